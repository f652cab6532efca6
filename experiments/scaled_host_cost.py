"""Host cost of a warm kernels.scaled_mm call beside torch._scaled_mm's (issue 30: dispatched like mm): per-call
host time for each scaling, with the tuned winner and with each backend forced (aten only: the dispatch overhead
alone; Triton only: our launch path), in bursts that never fill the launch queue (experiments.linear_host_cost's
method: contenders interleaved burst by burst, the median over the bursts). Not a test: numbers for the notes.

    python -m experiments.scaled_host_cost                     # CUDA: M=16, N=K=4096, e4m3, bf16 out
"""
from __future__ import annotations

import argparse
import json

import torch

import kernels
from experiments.linear_host_cost import measure
from kernels.core.config import config

E4M3 = torch.float8_e4m3fn


def operands(m: int, n: int, k: int, scaling: str):
    a = torch.randn(m, k, device="cuda").to(E4M3)
    b = torch.randn(n, k, device="cuda").to(E4M3).t()
    if scaling == "tensor":
        return a, b, torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    return a, b, torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5


def winner_under(backends: tuple[str, ...], ops) -> str:
    """Tune the problem with only these backends (a fresh memory state), and name the winner."""
    config.backends = backends
    kernels.clear_memory_cache()
    return kernels.explain(*ops[:2], op="scaled_mm", scale_a=ops[2], scale_b=ops[3]).winner


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--bursts", type=int, default=30)
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    torch.manual_seed(0)
    results = {}
    for scaling in ("tensor", "row"):
        ops = operands(args.m, args.n, args.k, scaling)
        row = {}
        for label, backends in (("aten only", ("aten",)), ("triton only", ("triton",)),
                                ("aten+triton", ("aten", "triton"))):
            winner = winner_under(backends, ops)
            per_call = measure({"torch._scaled_mm": lambda: torch._scaled_mm(*ops, out_dtype=torch.bfloat16),
                                "kernels.scaled_mm": lambda: kernels.scaled_mm(*ops)},
                               args.bursts, args.burst, torch.cuda.synchronize)
            row[label] = {"winner": winner, **per_call}
            print(f"{scaling:6s} {label:12s} winner {winner:48s} torch._scaled_mm {per_call['torch._scaled_mm']:6.2f} "
                  f"us  kernels.scaled_mm {per_call['kernels.scaled_mm']:6.2f} us", flush=True)
        results[scaling] = row
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"m": args.m, "n": args.n, "k": args.k, "gpu": torch.cuda.get_device_name(),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
