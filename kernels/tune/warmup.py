"""The default CUTLASS set: the kernels tune() would build for bench.compare's default shapes and for a llama-7B
layer's products (kernels.space.shapes), per dtype. `python -m kernels warmup` builds it ahead of time; the
background build (kernels.tune.background_build) builds a dtype's set after the first tune that needed CUTLASS
kernels of that dtype; `python -m kernels info` says how much of it is built.

The set is planned with the tuner's own narrowing (kernels.tune.autotune.candidates: the backend's choices, the
lookup table, KERNELS_ONLY / KERNELS_SKIP, the benchmark space), so a tune of one of these problems finds every
binary it asks for. Planning needs no GPU: the problems are described, not allocated (device "cuda", the target arch).
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from backends import get_backend
from kernels.core.choice import Choice
from kernels.core.config import WARMUP_DTYPES
from kernels.core.problem import GemmProblem
from kernels.space.shapes import COMPARE_LAYOUT, COMPARE_SUITE, LLAMA7B_LAYOUT, SUITES, llama7b_layers, problem_of
from kernels.tune.autotune import candidates

DTYPES = WARMUP_DTYPES
# fp8 (kernels.scaled_mm) has no default set: its binaries differ by scaling (per tensor / row-wise), bias and output
# dtype with no one combination the common case, and its operands have one layout of their own (B column-major). A
# scaled problem's CUTLASS kernels are built when it is first tuned (inline, or by the background build)
NO_DEFAULT_SET = {d: "no default CUTLASS set for fp8: a scaled_mm problem's kernels are built when it is first tuned "
                     "(they differ by scaling, bias and output dtype)" for d in ("e4m3", "e5m2")}
# the arch a machine without a GPU builds for (compile-only, as `kernels info` and bench.compare do)
DEFAULT_ARCH = 90
# why the other backends have nothing to build ahead
NOTHING_TO_BUILD = {
    "aten": "calls torch.mm / torch._int_mm: nothing to build",
    "triton": "nothing to build ahead: a Triton kernel compiles in about a second (in worker processes, in parallel) "
              "when a problem is first tuned, and is cached from then on",
    "padded": "runs aten or Triton on padded copies: nothing of its own to build",
}


def default_problems(arch: int, dtype: str, device_name: str = "") -> list[GemmProblem]:
    """bench.compare's default shapes in its default layout, then a llama-7B layer's products (B column-major, as
    nn.Linear weights give it) at a few token counts."""
    name = device_name or f"sm{arch}"
    problems = [problem_of(s, dtype, COMPARE_LAYOUT, "cuda", arch, name) for s in SUITES[COMPARE_SUITE]]
    problems += [problem_of(s, dtype, LLAMA7B_LAYOUT, "cuda", arch, name) for s in llama7b_layers()]
    return list(dict.fromkeys(problems))


@dataclass(frozen=True)
class Kernel:
    """One binary of the set, and a (problem, choice) that asks for it (swizzle twins share a binary)."""
    problem: GemmProblem
    choice: Choice


@dataclass
class CutlassSet:
    arch: int
    dtype: str
    work: list[tuple[GemmProblem, list[Choice]]]          # what tune() builds per problem
    kernels: dict[str, Kernel] = field(default_factory=dict)   # artifact key -> one that asks for it
    why_not: str = ""                                     # why CUTLASS builds nothing for this arch ('' when it does)

    def states(self) -> Counter:
        """built / failed / missing, per distinct binary (no binary is read: markers and sizes only)."""
        backend = get_backend("cutlass")
        return Counter(backend.state(k.problem, k.choice) for k in self.kernels.values())


def default_set(arch: int, dtype: str, device_name: str = "") -> CutlassSet:
    """The default set of one dtype for an arch (never raises for a problem CUTLASS cannot serve: it adds nothing)."""
    if dtype in NO_DEFAULT_SET:
        return CutlassSet(arch, dtype, [], why_not=NO_DEFAULT_SET[dtype])
    backend = get_backend("cutlass")
    problems = default_problems(arch, dtype, device_name)
    ok, why = backend.available(problems[0])
    if not ok:
        return CutlassSet(arch, dtype, [], why_not=why)
    cset = CutlassSet(arch, dtype, [])
    for problem in problems:
        if not backend.available(problem)[0]:
            continue
        chosen = candidates(backend, problem).kept
        cset.work.append((problem, chosen))
        for choice in chosen:
            try:
                key = backend.artifact_paths(problem, choice)[0]
            except Exception:  # noqa: BLE001 - a config that does not render is no kernel of the set
                continue
            cset.kernels.setdefault(key, Kernel(problem, choice))
    return cset


@dataclass
class WarmupResult:
    sets: list[CutlassSet]
    compiled: int
    seconds: float
    states: Counter                         # over all sets, after the build
    failed_logs: list[str]


def warmup(sets: list[CutlassSet], jobs: int, retry_failed: bool, on_progress=None) -> WarmupResult:
    """Build what the sets lack in one ninja batch with `jobs` parallel compiles; `on_progress(done, total)` as each
    compile ends. A binary whose compile failed before is retried only with `retry_failed`."""
    start = time.perf_counter()
    work = [w for s in sets for w in s.work]
    compiled = get_backend("cutlass").prebuild(work, jobs, on_progress, retry_failed) if work else 0
    states, logs = Counter(), []
    backend = get_backend("cutlass")
    for s in sets:
        for k in s.kernels.values():
            state = backend.state(k.problem, k.choice)
            states[state] += 1
            if state == "failed":
                logs.append(str(backend.artifact_paths(k.problem, k.choice)[1].log))
    return WarmupResult(sets, compiled, time.perf_counter() - start, states, logs)


def to_build(sets: list[CutlassSet], retry_failed: bool) -> int:
    """How many distinct binaries a warmup of these sets compiles."""
    counts = Counter()
    for s in sets:
        counts.update(s.states())
    return counts["missing"] + (counts["failed"] if retry_failed else 0)


def summary(sets: list[CutlassSet]) -> str:
    """'bf16 30 kernels (12 built), fp16 ...' for `kernels info` and `kernels warmup`."""
    parts = []
    for s in sets:
        states = s.states()
        failed = f", {states['failed']} failed" if states["failed"] else ""
        parts.append(f"{s.dtype} {len(s.kernels)} kernels ({states['built']} built{failed})")
    return ", ".join(parts)
