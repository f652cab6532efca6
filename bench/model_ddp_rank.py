"""What each rank of bench.model_ddp measures: the decoder stack (bench/model_def.py) under DistributedDataParallel,
plain (`eager`) and through kernels.patch (`patch`), each on its own copy of the same seeded weights and this rank's
own input. Per variant: the first step timed (patch tunes every forward and backward problem in it; ranks meeting
the same new problem tune it once, the others wait and load the selection), its kernels.stats() delta, and its loss
and all-reduced grads against eager's; then the variants' timing loops alternated for --rounds rounds.

The ranks run the same steps in the same order (every step all-reduces gradients, so a rank that stopped early would
leave the others waiting in a collective): a loop runs steps in chunks, and after each chunk the ranks agree through
the CPU side channel on the time so far, the slowest rank's, and on whether anyone failed. A failure every rank sees
at the same point (a variant that cannot run here) is recorded and the run goes on; one rank failing alone leaves the
others in a gradient all-reduce, which the process group's timeout ends."""
from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kernels
from bench.ddp_world import Comm, World
from bench.model import stats_delta
from bench.model_ddp_report import DdpVariantResult
from bench.model_report import attach_eager
from bench.model_def import build_model, model_input
from bench.model_variants import max_rel_err, weight_grads, worst_grad_err

VARIANTS = ("eager", "patch")


@dataclass(frozen=True)
class DdpPlan:
    """The command line as every rank needs it (picklable: spawned processes receive it)."""
    hidden: int = 4096
    intermediate: int = 11008
    layers: int = 1
    head_dim: int = 128
    tokens: int = 4096
    dtype: str = "bf16"
    device: str = "cuda"
    seconds: float = 1.0
    rounds: int = 2
    seed: int = 0
    timeout_s: float = 600.0
    stat: str = "median"


@dataclass
class _Variant:
    name: str
    module: nn.Module                      # the model inside DDP: its parameters carry the all-reduced grads
    step: Callable[[], torch.Tensor]       # one forward+backward, returns the loss


@dataclass
class _FirstStep:
    """This rank's first step of a variant: the variant the loops run, and what the ranks gather (_Summary)."""
    variant: _Variant
    cold_s: float
    stats: dict
    loss: float
    grads: dict[str, torch.Tensor]


@dataclass(frozen=True)
class _Summary:
    """One rank's first step as gathered: its wall time, counters, loss, and difference from eager's on that rank."""
    cold_s: float
    stats: dict
    loss: float
    loss_err: float | None
    grad_err: float | None
    grad_err_param: str


class LoopError(RuntimeError):
    """A timing loop some rank could not finish; the message names the rank and its error."""


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:400]}"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_variant(name: str, base: nn.Module, x: torch.Tensor, world: World) -> _Variant:
    """`name` on a deep copy of `base`, wrapped in DDP (a collective: every rank builds the same variants in the same
    order). Step: grads set to None, forward, loss = out.float().square().mean(), backward (DDP all-reduces)."""
    module = copy.deepcopy(base)
    if name == "patch":
        module = kernels.patch(module)
    ddp = DistributedDataParallel(module, device_ids=[world.local_rank] if world.device == "cuda" else None)

    def step() -> torch.Tensor:
        ddp.zero_grad(set_to_none=True)
        loss = ddp(x).float().square().mean()
        loss.backward()
        return loss.detach()
    return _Variant(name, module, step)


def _first_step(name: str, base: nn.Module, x: torch.Tensor, world: World) -> _FirstStep:
    variant = build_variant(name, base, x, world)
    _sync(world.device)
    before = kernels.stats()
    start = time.perf_counter()
    loss = variant.step()
    _sync(world.device)
    cold_s = time.perf_counter() - start
    return _FirstStep(variant, cold_s, stats_delta(before, kernels.stats()), float(loss), weight_grads(variant.module))


def _first_error(errors: list[str]) -> str:
    """The first failed rank's error, naming the rank (and how many others failed), or "" when every rank ran."""
    failed = [(rank, e) for rank, e in enumerate(errors) if e]
    if not failed:
        return ""
    rank, error = failed[0]
    return f"rank {rank}: {error}" + (f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else "")


def timed_loop(step: Callable[[], torch.Tensor], seconds: float, device: str, comm: Comm,
               hint_ms: float | None = None) -> tuple[float, float]:
    """(ms per step, loop length in s): steps back to back for at least `seconds` of the slowest rank's clock, every
    rank the same number of steps. Starts with every GPU idle and every rank at a barrier; runs chunks sized from
    `hint_ms` (one step when None), each ended by a sync and the ranks' agreement. Raises LoopError on every rank
    when any rank's step raised."""
    _sync(device)
    comm.barrier()
    start, steps = time.perf_counter(), 0
    chunk = 1 if not hint_ms else max(1, math.ceil(seconds * 1e3 / hint_ms))
    while True:
        error = ""
        try:
            for _ in range(chunk):
                step()
            _sync(device)
        except Exception as e:  # noqa: BLE001 - agreed below, so every rank leaves the loop together
            error = _failure(e)
        steps += chunk
        everyone = comm.gather((time.perf_counter() - start, error))
        why = _first_error([e for _, e in everyone])
        if why:
            raise LoopError(why)
        elapsed = max(t for t, _ in everyone)
        if elapsed >= seconds:
            return elapsed * 1e3 / steps, elapsed
        chunk = max(1, math.ceil((seconds - elapsed) / (elapsed / steps)))


@dataclass
class _Reference:
    loss: float | None = None
    grads: dict | None = None


def _differences(first: _FirstStep, ref: _Reference) -> tuple[float | None, float | None, str]:
    """(loss err, grad err, its parameter) of this rank's first step against eager's on the same rank."""
    if first.variant.name == "eager":
        return 0.0, 0.0, ""
    if ref.loss is None:
        return None, None, ""
    loss_err = max_rel_err(torch.tensor(first.loss), torch.tensor(ref.loss))
    grad_err, param = worst_grad_err(first.grads, ref.grads)
    return loss_err, grad_err, param


def _record_first(result: DdpVariantResult, summaries: list[_Summary]) -> None:
    """The ranks' first steps into the variant's record: per rank, and the worst rank's figures."""
    result.cold_s_by_rank = [s.cold_s for s in summaries]
    result.cold_s = max(result.cold_s_by_rank)
    result.cold_stats_by_rank = [s.stats for s in summaries]
    result.loss_by_rank = [s.loss for s in summaries]
    losses = [s.loss_err for s in summaries if s.loss_err is not None]
    result.loss_err = max(losses) if losses else None
    grads = [(s.grad_err, s.grad_err_param) for s in summaries if s.grad_err is not None]
    if grads:
        result.grad_err, result.grad_err_param = max(grads, key=lambda g: g[0])


def measure(world: World, comm: Comm, plan: DdpPlan) -> list[DdpVariantResult]:
    """Both variants' first steps, then their loops alternated; the same records on every rank."""
    device = str(world.torch_device)
    base = build_model(plan.hidden, plan.intermediate, plan.layers, plan.head_dim, plan.dtype, device, plan.seed)
    # seed + 1 + rank: rank 0's input is bench.model's, and no input shares the weights' random stream
    x = model_input(plan.tokens, plan.hidden, plan.dtype, device, plan.seed + 1 + world.rank)
    results = {n: DdpVariantResult(n, "ok", world.size, plan.tokens, stat=plan.stat) for n in VARIANTS}
    ready: dict[str, _Variant] = {}
    ref = _Reference()
    for name in VARIANTS:
        comm.barrier()
        first, summary, error = None, None, ""
        try:
            first = _first_step(name, base, x, world)
            summary = _Summary(first.cold_s, first.stats, first.loss, *_differences(first, ref))
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is recorded; the other still runs
            error = _failure(e)
            with contextlib.suppress(Exception):
                _sync(world.device)
        everyone = comm.gather((summary, error))
        why = _first_error([e for _, e in everyone])
        if why:
            results[name].status, results[name].message = "error", why
            continue
        _record_first(results[name], [s for s, _ in everyone])
        if name == "eager":
            ref = _Reference(first.loss, first.grads)
        ready[name] = first.variant
        del first
    del ref
    _loops(ready, results, plan, world.device, comm)
    out = list(results.values())
    attach_eager(out)
    return out


def _loops(ready: dict[str, _Variant], results: dict[str, DdpVariantResult], plan: DdpPlan, device: str,
           comm: Comm) -> None:
    """The variants' loops alternated, A B A B ..., plan.rounds rounds; each round's chunk sized from the last."""
    last_ms: dict[str, float | None] = {name: None for name in ready}
    for _ in range(plan.rounds):
        for name, variant in list(ready.items()):
            try:
                ms, length = timed_loop(variant.step, plan.seconds, device, comm, last_ms[name])
            except LoopError as e:
                results[name].status, results[name].message = "error", f"in the timing loop: {e}"
                del ready[name]
                continue
            last_ms[name] = ms
            results[name].rounds_ms.append(ms)
            results[name].loops_s.append(length)
