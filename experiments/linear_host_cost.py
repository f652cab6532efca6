"""Host cost of a warm linear call (issue 28: a patched nn.Linear's warm host cost <= 1.5x F.linear's): per-call host
time of F.linear, nn.Linear, a kernels.patch-ed nn.Linear (when this checkout has kernels.patch) and kernels.linear,
served by the C++ table and, for comparison, by its Python path; with and without a bias; under torch.no_grad (a
layer's weight requires grad: with grad enabled the call belongs to autograd, not to the warm table).

    python -m experiments.linear_host_cost                        # CUDA: M=1, 4096x4096 (N x K), bf16
    python -m experiments.linear_host_cost --device cpu           # CPU: M=1, 64x64, bf16 (torch's products)
    python -m experiments.linear_host_cost --grad                 # a training step's layer: forward + backward
    python -m experiments.linear_host_cost --compiled             # under torch.compile: plain and patched layer

--grad times forward + backward (`y.sum().backward()`, x and the layer's parameters requiring grad) instead, and
adds kernels' autograd Function called directly: what every grad call ran before calls whose products all picked
aten were handed to torch's own autograd.

Timing: bursts of --burst calls, the host time of each burst (no sync inside it) with a sync between bursts (not
timed), the median over --bursts bursts. A burst is short enough that the launch queue never fills, so the GPU's time
does not show (nor the products' on CPU, where they run on the host: use a small problem there). The contenders are
interleaved burst by burst, so clock and load drift reach them alike. Not a test: numbers, for the closing note.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.core.config import config
from kernels.dispatch import api

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def patch_function():
    """kernels.patch when this checkout has it (another branch of issue 28 adds it), else None."""
    try:
        return kernels.patch
    except AttributeError:
        return None


def served_by_table(fn, calls: int = 10) -> float:
    """The share of `calls` calls of fn that the C++ table served (0 when it is not loaded)."""
    module = api._fast.module
    if module is None:
        return 0.0
    before = module.hits()
    for _ in range(calls):
        fn()
    return (module.hits() - before) / calls


def python_path(fn):
    """fn with the C++ table switched off for the call: kernels.linear's Python warm path."""

    def call():
        fast_call = api._fast_call
        api._fast_call = None
        try:
            return fn()
        finally:
            api._fast_call = fast_call

    return call


def contenders(x: torch.Tensor, layer: nn.Linear) -> dict[str, object]:
    w, b = layer.weight, layer.bias
    plain = nn.Linear(layer.in_features, layer.out_features, bias=False, device=w.device, dtype=w.dtype)
    plain.weight = layer.weight
    found = {
        "F.linear": lambda: F.linear(x, w, b),
        "nn.Linear": lambda: layer(x),
        "kernels.linear": lambda: kernels.linear(x, w, b),
        "F.linear, no bias": lambda: F.linear(x, w),
        "nn.Linear, no bias": lambda: plain(x),
        "kernels.linear, no bias": lambda: kernels.linear(x, w),
    }
    patch = patch_function()
    if patch is not None:
        patched, patched_plain = patch(copy.deepcopy(layer)), patch(copy.deepcopy(plain))
        found["kernels.patch(nn.Linear)"] = lambda: patched(x)
        found["kernels.patch(nn.Linear), no bias"] = lambda: patched_plain(x)
    found["kernels.linear, Python path"] = python_path(found["kernels.linear"])
    return found


def compiled_contenders(x: torch.Tensor, layer: nn.Linear) -> dict[str, object]:
    """Under torch.compile (Inductor, default mode): the graph's call into kernels::linear against Inductor's own
    product, with F.linear for scale. A patched layer's compiled call costs the op's dispatch on top of the graph's."""
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True)
    found = {"F.linear": lambda: F.linear(x, layer.weight, layer.bias), "compile(nn.Linear)": lambda: compiled(x)}
    patch = patch_function()
    if patch is not None:
        patched = torch.compile(patch(copy.deepcopy(layer)), fullgraph=True)
        found["compile(kernels.patch(nn.Linear))"] = lambda: patched(x)
    return found


def grad_contenders(x: torch.Tensor, layer: nn.Linear) -> dict[str, object]:
    """Forward + backward of one layer: the timed call is a training step's share of it (its sum's backward)."""
    w, b = layer.weight, layer.bias
    found = {
        "F.linear": lambda: F.linear(x, w, b).sum().backward(),
        "nn.Linear": lambda: layer(x).sum().backward(),
        "kernels.linear": lambda: kernels.linear(x, w, b).sum().backward(),
        "kernels' autograd Function": lambda: api._custom.eager_linear(x, w, b, None).sum().backward(),
    }
    patch = patch_function()
    if patch is not None:
        patched = patch(copy.deepcopy(layer))
        found["kernels.patch(nn.Linear)"] = lambda: patched(x).sum().backward()
    return found


def burst_us(fn, burst: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(burst):
        fn()
    host = time.perf_counter() - t0
    sync()
    return host / burst * 1e6


def measure(fns: dict[str, object], bursts: int, burst: int, sync) -> dict[str, float]:
    for fn in fns.values():             # cold calls (tunes) and warm-up
        for _ in range(3):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(bursts):
        for name, fn in fns.items():
            times[name].append(burst_us(fn, burst, sync))
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--m", type=int, default=1, help="tokens (rows of x)")
    ap.add_argument("--k", type=int, help="in_features (default 4096 on CUDA, 64 on CPU)")
    ap.add_argument("--n", type=int, help="out_features (default 4096 on CUDA, 64 on CPU)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--bursts", type=int, default=30)
    ap.add_argument("--burst", type=int, default=100, help="calls per timed burst")
    ap.add_argument("--backends", help="KERNELS_BACKENDS for this run (default: as configured)")
    ap.add_argument("--grad", action="store_true", help="time forward + backward with grad (a training step's layer)")
    ap.add_argument("--compiled", action="store_true",
                    help="time the layer under torch.compile, plain and patched (kernels::linear in the graph)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    k = args.k or (4096 if device == "cuda" else 64)
    n = args.n or (4096 if device == "cuda" else 64)
    if args.backends:
        config.backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    config.fastpath = "build"
    status = kernels.load_fastpath(wait=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    layer = nn.Linear(k, n, device=device, dtype=dtype)
    x = torch.randn(args.m, k, device=device, dtype=dtype, requires_grad=args.grad)
    if args.grad:
        fns = grad_contenders(x, layer)
        per_call = measure(fns, args.bursts, args.burst, sync)
        served = {}
    else:
        with torch.no_grad():
            fns = compiled_contenders(x, layer) if args.compiled else contenders(x, layer)
            per_call = measure(fns, args.bursts, args.burst, sync)
            served = {name: served_by_table(fn) for name, fn in fns.items() if "kernels" in name}
    with torch.no_grad():
        winner = kernels.explain(x, layer.weight, op="linear", bias=layer.bias).winner

    what = ("forward + backward, everything requiring grad" if args.grad else
            "per call under torch.compile, torch.no_grad" if args.compiled else "per call, torch.no_grad")
    print(f"warm host cost {what}, {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'host'}), "
          f"x {args.m}x{k}, weight {n}x{k}, {args.dtype}; median of {args.bursts} bursts of {args.burst} calls")
    print(f"fastpath: {status}; linear winner (with bias): {winner}; kernels.patch: "
          f"{'present' if patch_function() else 'not in this checkout'}")
    print(f"{'call':38s} {'us/call':>8s} {'x F.linear':>10s} {'C++ table':>9s}")
    for name, us in per_call.items():
        base = per_call["F.linear, no bias" if name.endswith("no bias") else "F.linear"]
        table = f"{served[name]:.0%}" if name in served else ""
        print(f"{name:38s} {us:8.2f} {us / base:10.2f} {table:>9s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "m": args.m, "k": k, "n": n, "dtype": args.dtype, "fastpath": status,
                       "winner": winner, "grad": args.grad, "compiled": args.compiled, "us_per_call": per_call,
                       "served_by_table": served}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
