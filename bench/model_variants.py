"""The ways bench.model runs one model, each on its own deep copy of the same weights: torch eager, torch.compile
(default, max-autotune without CUDA graphs), `kernels.patch`, `kernels.patch` under torch.compile, and at small M
the CUDA-graph pair (max-autotune with CUDA graphs, a patched model captured in a torch.cuda.CUDAGraph). A variant is
a `step()` that runs one forward (no grad) or one forward+backward and returns the output; its weight grads stay on
its module until the next step. Also the numerical difference between two variants' outputs and grads."""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import kernels

VARIANTS = ("eager", "compile", "max-autotune", "patch", "patch+compile")
# kernels.patch(model, fuse=False): only the nn.Linear layers through kernels (what the fused blocks add is patch's
# time against this one's)
LINEAR_ONLY = "patch-linear"
# forward only, at M <= CUDAGRAPH_MAX_TOKENS, behind --cudagraphs: the launch cost is what they remove
# patch+compile+cudagraphs: torch.compile(mode="reduce-overhead") over the patched model (kernels' ops inside the
# CUDA-graph trees, Inductor's fusions around them)
CUDAGRAPH_VARIANTS = ("max-autotune+cudagraphs", "patch+cudagraph", "patch+compile+cudagraphs")
ALL_VARIANTS = VARIANTS + (LINEAR_ONLY,) + CUDAGRAPH_VARIANTS
CUDAGRAPH_MAX_TOKENS = 16
CUDAGRAPH_TREE_CALLS = 3      # warm-up, record, replay: max-autotune+cudagraphs' first call until it replays
MODES = ("fwd", "fwdbwd")


class VariantError(RuntimeError):
    """A variant that cannot run here (e.g. CUDA graphs without a GPU)."""


@dataclass
class Variant:
    """`module`: the copy whose parameters the step uses (grads are read here); `step`: one step, returns the output."""
    name: str
    module: nn.Module
    step: Callable[[], torch.Tensor]


def _forward(fn: Callable, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        with torch.no_grad():
            return fn(x)
    return step


def _forward_backward(module: nn.Module, fn: Callable, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Grads zeroed (set to None) before the forward, so after a step they hold that step's grads."""
    def step() -> torch.Tensor:
        module.zero_grad(set_to_none=True)
        out = fn(x)
        out.float().square().mean().backward()
        return out.detach()
    return step


def _marked(fn: Callable) -> Callable:
    """torch.compile's CUDA-graph trees: each call a new iteration, so replays may reuse the previous output's memory
    (the loop drops it; the first output is cloned by the caller before the next call)."""
    def call(x):
        torch.compiler.cudagraph_mark_step_begin()
        return fn(x)
    return call


def first_call_repeated(step: Callable[[], torch.Tensor], calls: int) -> Callable[[], torch.Tensor]:
    """The first call runs `step` `calls` times: torch.compile's CUDA-graph trees run a warm-up call and record on a
    later one, which belong to the cold time, not to the first timing loop."""
    done = False

    def run() -> torch.Tensor:
        nonlocal done
        if not done:
            for _ in range(calls - 1):
                step()
            done = True
        return step()
    return run


class CapturedForward:
    """`fn(x)` captured in a torch.cuda.CUDAGraph on its first call, replayed on every call after: the first call runs
    it eagerly (a patched model tunes there), warms it on a side stream, captures, then replays."""

    def __init__(self, fn: Callable, x: torch.Tensor, warm_calls: int = 2):
        self.fn, self.x, self.warm_calls = fn, x, warm_calls
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def _capture(self) -> None:
        if self.x.device.type != "cuda":
            raise VariantError("CUDA graphs need a CUDA device")
        with torch.no_grad():
            self.fn(self.x)
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warm_calls):
                    self.fn(self.x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = self.fn(self.x)
        self.graph = graph

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out


def applies(name: str, mode: str, tokens: int) -> bool:
    """Whether `name` is run at (mode, tokens): the CUDA-graph variants only forward at small M."""
    return name not in CUDAGRAPH_VARIANTS or (mode == "fwd" and tokens <= CUDAGRAPH_MAX_TOKENS)


def build_variant(name: str, base: nn.Module, x: torch.Tensor, mode: str) -> Variant:
    """`name` on a deep copy of `base`. Nothing runs here: compiling, tuning and capturing happen in the first step
    (the variant's cold time). Raises what the variant raises when it cannot be set up (kernels.patch missing, ...)."""
    if name not in ALL_VARIANTS:
        raise VariantError(f"unknown variant {name!r}")
    if mode not in MODES:
        raise VariantError(f"unknown mode {mode!r}")
    if name in CUDAGRAPH_VARIANTS:
        if mode != "fwd":
            raise VariantError(f"{name} runs forward only")
        if x.device.type != "cuda":
            raise VariantError(f"{name} needs a CUDA device")
    module = copy.deepcopy(base)
    if name.startswith("patch"):
        module = kernels.patch(module, fuse=name != LINEAR_ONLY)
    fn: Callable = module
    if name in ("compile", "patch+compile"):
        fn = torch.compile(module)
    elif name == "max-autotune":
        fn = torch.compile(module, mode="max-autotune-no-cudagraphs")
    elif name == "max-autotune+cudagraphs":
        fn = _marked(torch.compile(module, mode="max-autotune"))
    elif name == "patch+compile+cudagraphs":
        fn = _marked(torch.compile(module, mode="reduce-overhead"))
    if name == "patch+cudagraph":
        return Variant(name, module, CapturedForward(fn, x))
    step = _forward(fn, x) if mode == "fwd" else _forward_backward(module, fn, x)
    if name in ("max-autotune+cudagraphs", "patch+compile+cudagraphs"):
        step = first_call_repeated(step, CUDAGRAPH_TREE_CALLS)
    return Variant(name, module, step)


# -- numerical difference from eager ------------------------------------------------------------------------------
def max_rel_err(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max|value - reference| / max|reference|, in fp32: one number per tensor that does not blow up where the
    reference crosses zero (an elementwise relative error would)."""
    if value.shape != reference.shape:
        raise ValueError(f"shapes differ: {tuple(value.shape)} vs {tuple(reference.shape)}")
    diff = (value.float() - reference.float()).abs().max().item()
    scale = reference.float().abs().max().item()
    return diff / scale if scale > 0 else diff


def weight_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's grad, cloned (the next step sets them to None), by parameter name."""
    return {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}


def worst_grad_err(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(the largest max_rel_err over the parameters, its name, "" when that is 0); a parameter with a grad on one
    side only is an error, not a difference."""
    if set(grads) != set(reference):
        missing = sorted(set(reference) ^ set(grads))
        raise ValueError(f"grads present on one side only: {', '.join(missing[:4])}")
    errs = {name: max_rel_err(g, reference[name]) for name, g in grads.items()}
    if not errs:
        raise ValueError("no weight grads")
    worst = max(errs, key=errs.get)
    return errs[worst], worst if errs[worst] > 0 else ""       # no name when every grad matches exactly
