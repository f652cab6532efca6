"""CUTLASS configs: the candidate pool per template, the one `supports_cutlass()` check, and the ranking that decides
which `backends.cutlass.CUTLASS_MAX_CONFIGS` of them get built.

Layouts: a CUTLASS kernel is compiled for fixed operand layouts. The problem's row/col layouts map onto the kernel's
directly (16-bit kernels take either layout for A and B; output is row-major). `swap=True` computes C^T = B^T A^T
instead: the kernel's A is B^T, its B is A^T and its output is column-major, which is the same memory as our
row-major C. That is exact (a relabelling, no data moves) and lets a small-M problem use the kernel's large M tile.
The swap never changes which operand is K-contiguous, so it cannot rescue int8 layouts other than A row x B col.

fp8 (scaled_mm) is sm90 only (cutlass3x_sm90_scaled_mm): Hopper's fp8 wgmma reads A and B K-major only, as int8's
does. Its epilogue is the scales (problem.scaling) then the optional bias; the scales and out dtype come from the
problem (as mm's out dtype does), so a config's tag carries only the bias, like mm's.

Epilogues (problem.bias / problem.activation): a problem with one gets the same configs, each carrying the epilogue
(`CutlassConfig.epilogue`, the tag's last part): it is a different binary and a different kernel name. The bias is one
value per output column, so per kernel column, or per kernel row when the kernel computes C^T (swap).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from kernels.core.problem import ACTIVATIONS, SCALED_OUT_DTYPES, SCALINGS, GemmProblem
from kernels.space.families import families_of
from kernels.space.heuristics import shared_memory_limit

# op -> template, per CUTLASS generation, and template -> generation (kernels/space/families.py is the one list); an op
# a generation has no template for is missing from its dict (scaled_mm has no sm80 kernels)
SM90_TEMPLATES = {f.ops[0]: f.name for f in families_of("cutlass") if f.arch == "sm90"}
SM80_TEMPLATES = {f.ops[0]: f.name for f in families_of("cutlass") if f.arch == "sm80"}
FAMILY = {f.name: f.arch for f in families_of("cutlass")}
TEMPLATE_OP = {f.name: f.ops[0] for f in families_of("cutlass")}
CUTLASS_DTYPES = {"mm": ("fp16", "bf16"), "int_mm": ("int8",), "scaled_mm": ("e4m3", "e5m2")}
# the ops whose tensor cores read 8-bit operands, K-major only (A row-major, B column-major)
EIGHT_BIT_OPS = ("int_mm", "scaled_mm")
INT32_MAX = 2**31 - 1
SM90_EPILOGUE_SMEM = 32_768          # upper bound of the TMA epilogue's shared storage; the rest feeds the mainloop
ASSUMED_SMS = 132                    # H100/H200 SXM; only used to rank, never to decide correctness
# every GemmProblem.epilogue but the plain one: "bias", "relu", "bias+relu", ...
EPILOGUES = tuple(e for bias in ("", "bias") for act in ("", *ACTIVATIONS)
                  if (e := "+".join(part for part in (bias, act) if part)))
_TAG_RE = re.compile(r"(\d+)x(\d+)x(\d+)_c(\d+)x(\d+)_(coop|pingpong|s\d+w\d+x\d+)(_sk)?(_swap)?_a(\d+)c(\d+)_sw(\d+)"
                     r"(?:_(" + "|".join(re.escape(e) for e in EPILOGUES) + r"))?")


@dataclass(frozen=True)
class CutlassConfig:
    tile_m: int
    tile_n: int
    tile_k: int
    cluster_m: int = 1
    cluster_n: int = 1
    schedule: str = "coop"       # sm90: "coop" | "pingpong"; sm80: "" (multistage)
    stream_k: bool = False       # sm90 coop only
    stages: int = 0              # sm80 pipeline depth; sm90 derives it from shared memory (0 = auto)
    warps_m: int = 0             # sm80 warp grid: warp tile = tile / warps
    warps_n: int = 0
    align: int = 8               # elements per access of A and B
    align_c: int = 8             # elements per access of the output
    swap: bool = False           # compute C^T = B^T A^T (see module doc)
    swizzle: int = 1             # sm90: runtime max swizzle of the tile scheduler; sm80: threadblock swizzle
    epilogue: str = ""           # the problem's fused epilogue (GemmProblem.epilogue): "" or one of EPILOGUES

    def tag(self) -> str:
        sched = self.schedule or f"s{self.stages}w{self.warps_m}x{self.warps_n}"
        return (f"{self.tile_m}x{self.tile_n}x{self.tile_k}_c{self.cluster_m}x{self.cluster_n}_{sched}"
                f"{'_sk' if self.stream_k else ''}{'_swap' if self.swap else ''}_a{self.align}c{self.align_c}"
                f"_sw{self.swizzle}{'_' + self.epilogue if self.epilogue else ''}")

    @classmethod
    def from_tag(cls, tag: str) -> "CutlassConfig":
        m = _TAG_RE.fullmatch(tag)      # the whole tag: a "$" would let a trailing newline through
        if m is None:
            raise ValueError(f"not a CUTLASS config tag: {tag!r}")
        tm, tn, tk, cm, cn, sched, sk, swap, al, alc, sw, epilogue = m.groups()
        stages = warps_m = warps_n = 0
        if sched.startswith("s"):
            stages, warps_m, warps_n = (int(x) for x in re.findall(r"\d+", sched))
            sched = ""
        return cls(int(tm), int(tn), int(tk), int(cm), int(cn), sched, bool(sk), stages, warps_m, warps_n,
                   int(al), int(alc), bool(swap), int(sw), epilogue or "")

    def params(self) -> tuple[tuple[str, str], ...]:
        """What goes into Choice.params: the name then reads `<template>_<dtype>_<tag>`."""
        return (("", self.tag()),)

    @classmethod
    def from_params(cls, params) -> "CutlassConfig":
        return cls.from_tag(dict((k, v) for k, v in params)[""])


# -- the pools ----------------------------------------------------------------------------------------------------
def _sm90_pool(eight_bit: bool) -> list[CutlassConfig]:
    k = 128 if eight_bit else 64     # 128 bytes of K per stage either way
    coop = [(128, 256, 2, 1), (128, 256, 1, 2), (256, 128, 1, 2), (256, 128, 2, 1), (128, 128, 2, 1),
            (128, 128, 1, 2), (128, 128, 1, 1), (128, 64, 1, 1)]
    pool = [CutlassConfig(tm, tn, k, cm, cn, "coop") for tm, tn, cm, cn in coop]
    pool += [CutlassConfig(128, 256, k, 2, 1, "coop", stream_k=True),
             CutlassConfig(128, 128, k, 1, 1, "coop", stream_k=True)]
    pool += [CutlassConfig(tm, tn, k, cm, cn, "pingpong") for tm, tn, cm, cn in
             [(64, 256, 1, 1), (64, 128, 1, 1), (64, 128, 2, 1), (128, 128, 1, 1), (64, 64, 1, 1)]]
    return pool


def _sm80_pool(int8: bool) -> list[CutlassConfig]:
    k = 128 if int8 else 64
    rows = [(128, 256, k, 3, 2, 4), (256, 128, k, 3, 4, 2), (128, 128, k, 4, 2, 2), (128, 64, k, 4, 2, 2),
            (64, 128, k, 4, 2, 2), (64, 64, k, 5 if not int8 else 4, 2, 2)]
    if not int8:
        rows.append((128, 128, 32, 5, 2, 2))
    return [CutlassConfig(tm, tn, tk, 1, 1, "", False, st, wm, wn) for tm, tn, tk, st, wm, wn in rows]


def templates_for(op: str) -> tuple[str, ...]:
    """The CUTLASS templates that implement `op`, sm90 first (scaled_mm has no sm80 one)."""
    return tuple(t for t in (SM90_TEMPLATES.get(op), SM80_TEMPLATES.get(op)) if t is not None)


# On an sm90 card, CUTLASS 2.x (sm80: no TMA, no warpgroup MMA) kernels ran 1.80-2.77x the best candidate's time on
# every problem of the default bf16 set on the H200 (experiments/cutlass_ranks.py, twenty-first session: 13 problems,
# M 1024 to 8192); they stay candidates only where no sm90 kernel serves the problem.
SM80_ON_SM90 = ("left out: an sm90 kernel serves this problem, and sm80 kernels ran 1.8-2.8x the best candidate's time "
                "on sm90 (H200, experiments/cutlass_ranks.py)")


def superseded(problem: GemmProblem, template: str, ranked: dict[str, list[CutlassConfig]]) -> str:
    """Why `template` is left out for `problem` given the other templates' supported configs (`ranked`), or ''."""
    if FAMILY[template] == "sm80" and problem.arch >= 90 and any(
            cfgs for t, cfgs in ranked.items() if FAMILY[t] == "sm90"):
        return SM80_ON_SM90
    return ""


def config_pool(template: str) -> list[CutlassConfig]:
    """Every config the template is offered with, before alignment is fitted to a problem. 8-bit operands (int8,
    fp8) take the same tiles with K doubled: 128 bytes of K per stage."""
    eight_bit = TEMPLATE_OP[template] in EIGHT_BIT_OPS
    base = _sm90_pool(eight_bit) if FAMILY[template] == "sm90" else _sm80_pool(eight_bit)
    swapped = [replace(c, swap=True) for c in base if c.tile_n <= 128]
    return base + swapped


def _offered(problem: GemmProblem, cfg: CutlassConfig) -> bool:
    """Swapped twins only where they can pay: M small against N (they re-tile the short side as N)."""
    return not cfg.swap or (problem.m < problem.n and problem.m <= 256)


# -- what a config needs from a problem ----------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelOperands:
    """The problem as the kernel sees it (after the optional swap): its M/N, operand layouts and which problem
    operand feeds the kernel's A and B."""
    m: int
    n: int
    layout_a: str
    layout_b: str
    layout_c: str
    a_is: str          # "a" or "b": which problem operand is the kernel's A
    b_is: str


def _flip(layout: str) -> str:
    return {"row": "col", "col": "row"}.get(layout, layout)


def kernel_operands(problem: GemmProblem, swap: bool) -> KernelOperands:
    if not swap:
        return KernelOperands(problem.m, problem.n, problem.layout_a, problem.layout_b, "row", "a", "b")
    # C^T (n x m) = B^T (n x k) @ A^T (k x m); transposing flips row/col
    return KernelOperands(problem.n, problem.m, _flip(problem.layout_b), _flip(problem.layout_a), "col", "b", "a")


def _contiguous_extent(problem: GemmProblem, which: str) -> int:
    """Extent of the operand's unit-stride dimension: CUTLASS accesses it in whole vectors of `align` elements."""
    layout = problem.layout_a if which == "a" else problem.layout_b
    if which == "a":
        return problem.k if layout == "row" else problem.m
    return problem.n if layout == "row" else problem.k


def _operand_reason(problem: GemmProblem, which: str, align: int) -> str:
    elem = problem.elem_bytes
    need = align * elem
    ptr_align = problem.align_a if which == "a" else problem.align_b
    if ptr_align < need:
        return f"{which.upper()} pointer is {ptr_align}-byte aligned, the kernel loads {need} bytes at a time"
    if not problem.leading_dim_aligned(which, need):
        return f"{which.upper()} leading dimension is not a multiple of {align} elements"
    extent = _contiguous_extent(problem, which)
    if extent % align:
        return f"{which.upper()}'s contiguous extent {extent} is not a multiple of {align} elements"
    return ""


def _smem_reason(problem: GemmProblem, template: str, cfg: CutlassConfig) -> str:
    per_stage = (cfg.tile_m + cfg.tile_n) * cfg.tile_k * problem.elem_bytes
    limit = shared_memory_limit(problem.arch or 90)
    if FAMILY[template] == "sm90":
        need = 2 * per_stage + SM90_EPILOGUE_SMEM      # the builder picks as many stages as fit; two at least
    else:
        need = cfg.stages * per_stage
    return f"shared memory {need} B > {limit} B" if need > limit else ""


def _epilogue_reason(problem: GemmProblem, template: str) -> str:
    """mm fuses any epilogue; scaled_mm needs its scaling and takes a bias but no activation; int_mm fuses none."""
    if problem.op == "scaled_mm":
        if problem.scaling not in SCALINGS:
            return f"{template} needs the scales per tensor or row-wise ({'/'.join(SCALINGS)}), not {problem.scaling!r}"
        if problem.out_dtype not in SCALED_OUT_DTYPES:
            return f"{template} writes {'/'.join(SCALED_OUT_DTYPES)}, not {problem.out_dtype}"
        if problem.activation:
            return f"{template} fuses the scales and a bias, no activation ({problem.activation})"
        return ""
    if problem.scaling:
        return f"{template} fuses no scales into {problem.op}"
    if problem.epilogue and problem.op != "mm":
        return f"{template} fuses no epilogue ({problem.epilogue}) into {problem.op}"
    return ""


def supports_cutlass(problem: GemmProblem, template: str, cfg: CutlassConfig | None) -> tuple[bool, str]:
    """Can CUTLASS `template` with `cfg` run `problem`? The reason names the first rule that fails."""
    family = FAMILY.get(template)
    if family is None:
        return False, f"unknown CUTLASS template {template}"
    if template not in templates_for(problem.op):
        return False, f"{template} does not implement {problem.op}"
    if problem.dtype not in CUTLASS_DTYPES[problem.op]:
        return False, f"{template} takes {'/'.join(CUTLASS_DTYPES[problem.op])}, not {problem.dtype}"
    if problem.device != "cuda":
        return False, "CUTLASS kernels need CUDA tensors"
    if family == "sm90" and problem.arch != 90:
        return False, f"sm_90a kernels need compute capability 9.0, device has {problem.arch / 10:.1f}"
    if family == "sm80" and problem.arch < 80:
        return False, f"sm80 kernels need compute capability >= 8.0, device has {problem.arch / 10:.1f}"
    for which, layout in (("a", problem.layout_a), ("b", problem.layout_b)):
        if layout == "strided":
            return False, f"{which.upper()} has no unit-stride dimension"
    if problem.op in EIGHT_BIT_OPS and (problem.layout_a, problem.layout_b) != ("row", "col"):
        return False, (f"{problem.dtype} CUTLASS kernels need A row-major and B column-major (K contiguous in both), "
                       f"got A {problem.layout_a} x B {problem.layout_b}; swapping operands keeps K's layout, so no")
    if max(problem.m, problem.n, problem.k) > INT32_MAX:
        return False, "a dimension exceeds 32-bit int"
    if problem.activation not in ("", *ACTIVATIONS):
        return False, f"unknown activation {problem.activation!r}"
    why = _epilogue_reason(problem, template)
    if why:
        return False, why
    if cfg is None:
        return True, ""
    if cfg.epilogue != problem.epilogue:
        return False, (f"config built for epilogue {cfg.epilogue or '(none)'}, the problem's is "
                       f"{problem.epilogue or '(none)'}")
    elem, out = problem.elem_bytes, problem.out_bytes
    if family == "sm90":
        if cfg.align * elem != 16 or cfg.align_c * out != 16:
            return False, "TMA kernels need 16-byte accesses on every operand"
        if cfg.schedule not in ("coop", "pingpong"):
            return False, f"unknown sm90 schedule {cfg.schedule!r}"
        if cfg.schedule == "coop" and cfg.tile_m < 128:
            return False, "the cooperative schedule splits tile M over two warp groups: needs tile_m >= 128"
        if cfg.stream_k and cfg.schedule != "coop":
            return False, "stream-K needs the cooperative schedule"
    else:
        if cfg.align * elem not in (4, 8, 16):
            return False, f"cp.async copies 4, 8 or 16 bytes, not {cfg.align * elem}"
        if cfg.stream_k or cfg.cluster_m * cfg.cluster_n != 1:
            return False, "sm80 kernels have no clusters or stream-K"
        if not cfg.warps_m or cfg.tile_m % cfg.warps_m or cfg.tile_n % cfg.warps_n:
            return False, "tile does not divide over the warp grid"
    for which in ("a", "b"):
        why = _operand_reason(problem, which, cfg.align)
        if why:
            return False, why
        if family == "sm90" and problem.rows_overlap(which):
            return False, f"{which.upper()}'s rows overlap (a broadcast or overlapping view): TMA may not describe it"
    if problem.n % cfg.align_c:
        return False, f"N={problem.n} is not a multiple of the output access of {cfg.align_c} elements"
    if cfg.align_c * out > 16:
        return False, f"output access of {cfg.align_c * out} bytes > 16"
    why = _smem_reason(problem, template, cfg)
    if why:
        return False, why
    return True, ""


# -- fitting and ranking --------------------------------------------------------------------------------------------
def fit_alignment(problem: GemmProblem, template: str, cfg: CutlassConfig) -> CutlassConfig:
    """The config fitted to this problem: the widest accesses it allows (sm90: only 16 bytes), and its epilogue."""
    cfg = replace(cfg, epilogue=problem.epilogue)
    elem, out = problem.elem_bytes, problem.out_bytes
    if FAMILY[template] == "sm90":
        return replace(cfg, align=16 // elem, align_c=16 // out)
    aligns = [a for a in (16 // elem, 8 // elem, 4 // elem) if a >= 1]
    if problem.dtype == "int8":
        aligns = [16]    # int8 tensor-op tiles are laid out for 16-byte accesses
    align = next((a for a in aligns if not _operand_reason(problem, "a", a) and not _operand_reason(problem, "b", a)),
                 aligns[0])
    align_c = next((c for c in (16 // out, 8 // out, 4 // out, 2 // out, 1) if c >= 1 and problem.n % c == 0), 1)
    return replace(cfg, align=align, align_c=align_c)


def score(problem: GemmProblem, template: str, cfg: CutlassConfig) -> float:
    """Rough relative throughput: tile efficiency x padding waste x wave quantisation (higher is better)."""
    ops = kernel_operands(problem, cfg.swap)
    tiles_m, tiles_n = math.ceil(ops.m / cfg.tile_m), math.ceil(ops.n / cfg.tile_n)
    tiles = tiles_m * tiles_n
    padding = (ops.m * ops.n) / (tiles_m * cfg.tile_m * tiles_n * cfg.tile_n)
    waves = tiles / ASSUMED_SMS
    wave_eff = waves / math.ceil(waves)
    if cfg.stream_k:   # stream-K splits K across the last wave: good when there is K to split, some fixup cost
        wave_eff = max(wave_eff, 0.93 if problem.k >= 1024 else 0.5) * 0.97
    intensity = (cfg.tile_m * cfg.tile_n / (cfg.tile_m + cfg.tile_n)) / (128 * 256 / 384)
    s = math.sqrt(intensity) * padding * wave_eff
    big = tiles >= 2 * ASSUMED_SMS
    if FAMILY[template] == "sm80":
        s *= 0.8 if problem.arch >= 90 else 1.0    # no TMA / wgmma
    else:
        clustered = cfg.cluster_m * cfg.cluster_n > 1
        s *= (1.03 if clustered else 1.0) if big else (0.98 if clustered else 1.0)   # multicast pays on big grids
        s *= 1.0 if cfg.schedule == "coop" else 0.97
        if cfg.swizzle > 1:
            s *= 1.02 if big else 0.99
    if cfg.align * problem.elem_bytes < 16:
        s *= 0.7
    return s


def _with_swizzle(problem: GemmProblem, template: str, pool: list[CutlassConfig]) -> list[CutlassConfig]:
    """sm90's swizzle is a runtime argument: add swizzle-8 twins (no extra build) of configs on big grids."""
    if FAMILY[template] != "sm90":
        return [replace(c, swizzle=1) for c in pool]
    out = []
    for c in pool:
        out.append(c)
        ops = kernel_operands(problem, c.swap)
        if math.ceil(ops.m / c.tile_m) * math.ceil(ops.n / c.tile_n) >= 2 * ASSUMED_SMS:
            out.append(replace(c, swizzle=8))
    return out


def ranked_configs(problem: GemmProblem, template: str) -> tuple[list[CutlassConfig], dict[str, str]]:
    """Supported configs best-first (by `score`, ties keep pool order) and the left-out ones with reasons (by tag)."""
    ok, why = supports_cutlass(problem, template, None)
    if not ok:
        return [], {"*": why}
    supported: list[CutlassConfig] = []
    rejected: dict[str, str] = {}
    seen = set()
    pool = [c for c in config_pool(template) if _offered(problem, c)]
    for cfg in _with_swizzle(problem, template, pool):
        cfg = fit_alignment(problem, template, cfg)
        if cfg in seen:
            continue
        seen.add(cfg)
        good, reason = supports_cutlass(problem, template, cfg)
        if good:
            supported.append(cfg)
        else:
            rejected[cfg.tag()] = reason
    order = {c: i for i, c in enumerate(supported)}
    supported.sort(key=lambda c: (-score(problem, template, c), order[c]))
    return supported, rejected


def select(problem: GemmProblem, ranked: dict[str, list[CutlassConfig]], limit: int) -> list[tuple[str, CutlassConfig]]:
    """The best (template, config) pairs over all templates, at most `limit` distinct binaries: first the best of
    each kernel shape (tile, schedule, stream-K, swap), so the budget is not spent on cluster twins of one tile; then
    the rest by score. sm90 swizzle twins share a binary, so they come along free."""
    scored = sorted(((score(problem, t, c), -i, t, c) for t, cfgs in ranked.items() for i, c in enumerate(cfgs)),
                    key=lambda x: (-x[0], -x[1]))
    firsts, rest, shapes = [], [], set()
    for _, _, t, c in scored:
        shape = (t, c.tile_m, c.tile_n, c.tile_k, c.schedule, c.stream_k, c.swap)
        (rest if shape in shapes else firsts).append((t, c))
        shapes.add(shape)
    chosen, binaries = [], set()
    for t, c in firsts + rest:
        binary = (t, replace(c, swizzle=1) if FAMILY[t] == "sm90" else c)
        if binary not in binaries and len(binaries) >= limit:
            continue
        binaries.add(binary)
        chosen.append((t, c))
    return chosen
