"""The fused blocks of kernels.patch (kernels.dispatch.fused) against eager, one block at a time on the GPU: llama's
RMSNorm on (M, hidden) and the gated MLP's silu(g) * u on (M, intermediate), forward and forward + backward, each in
a back-to-back loop of --seconds (bench.sustained's loop: ms per call from CUDA events over its timed tail), eager
and fused alternated for --rounds; and the largest difference of the fused result (and grads) from eager's, relative
to eager's largest.

    python -m experiments.fused_blocks                    # M 2048, 4096, 8192; hidden 4096, intermediate 11008, bf16
    python -m experiments.fused_blocks --m 4096 --json out.jsonl

Not a test: numbers for the closing note.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from bench.sustained import alternate
from kernels.dispatch.fused import eager_rms_norm, rms_norm, silu_mul

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def eager_silu_mul(g, u):
    return F.silu(g) * u


def _rel(value, reference) -> float:
    return ((value.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-30)).item()


def _cases(m: int, hidden: int, intermediate: int, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, hidden, device="cuda", dtype=dtype, generator=gen)
    weight = (1.0 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).to(dtype)
    g = torch.randn(m, intermediate, device="cuda", dtype=dtype, generator=gen)
    u = torch.randn(m, intermediate, device="cuda", dtype=dtype, generator=gen)
    return {"rmsnorm": ((x, weight), lambda a, b: eager_rms_norm(a, b, 1e-6), lambda a, b: rms_norm(a, b, 1e-6)),
            "silu_mul": ((g, u), eager_silu_mul, silu_mul)}


def _step(fn, inputs, backward: bool):
    if not backward:
        return lambda: fn(*inputs)
    leaves = [t.detach().requires_grad_() for t in inputs]
    grad = torch.randn_like(fn(*inputs))

    def step():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(grad)
    return step


def _difference(eager, fused, inputs) -> dict:
    leaves_e = [t.detach().clone().requires_grad_() for t in inputs]
    leaves_f = [t.detach().clone().requires_grad_() for t in inputs]
    out_e, out_f = eager(*leaves_e), fused(*leaves_f)
    grad = torch.randn_like(out_e)
    out_e.backward(grad)
    out_f.backward(grad)
    return {"output": _rel(out_f, out_e), "grads": [_rel(f.grad, e.grad) for f, e in zip(leaves_f, leaves_e)]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="2048,4096,8192", help="comma list of token counts M")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="append one JSON line per (block, M, mode) here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    print(f"{'block':9} {'M':>6} {'mode':7} {'eager ms':>9} {'fused ms':>9} {'speedup':>8}  difference")
    for m in (int(v) for v in args.m.split(",")):
        for block, (inputs, eager, fused) in _cases(m, args.hidden, args.intermediate, DTYPES[args.dtype]).items():
            diff = _difference(eager, fused, inputs)
            for mode in ("fwd", "fwdbwd"):
                steps = {name: _step(fn, inputs, mode == "fwdbwd") for name, fn in (("eager", eager),
                                                                                     ("fused", fused))}
                times = alternate({name: (lambda _, step=step: step()) for name, step in steps.items()}, 1,
                                  args.rounds, args.seconds)
                best = {name: min(ts) for name, ts in times.items()}
                row = {"block": block, "m": m, "mode": mode, "eager_ms": best["eager"], "fused_ms": best["fused"],
                       "speedup": best["eager"] / best["fused"], "rounds": times, "difference": diff,
                       "device": torch.cuda.get_device_name(), "dtype": args.dtype}
                print(f"{block:9} {m:>6} {mode:7} {best['eager']:9.4f} {best['fused']:9.4f} "
                      f"{row['speedup']:7.3f}x  out {diff['output']:.1e} grads "
                      + " ".join(f"{g:.1e}" for g in diff["grads"]))
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
