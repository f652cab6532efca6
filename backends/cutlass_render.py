"""CUTLASS kernel specs, template rendering, compiler flags, artifact keys and the ninja file: all pure functions."""
from __future__ import annotations

import functools
import hashlib
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2

from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.space.families import TEMPLATES_ROOT
from kernels.space.heuristics_cutlass import FAMILY, CutlassConfig, kernel_operands

TEMPLATE_FILES = {"sm90": "cutlass/sm90_gemm.cu.jinja", "sm80": "cutlass/sm80_gemm.cu.jinja"}
CUTLASS_TYPES = {"fp16": "cutlass::half_t", "bf16": "cutlass::bfloat16_t", "int8": "int8_t", "int32": "int32_t",
                 "fp32": "float", "e4m3": "cutlass::float_e4m3_t", "e5m2": "cutlass::float_e5m2_t"}
LAYOUT_TAGS = {"row": "cutlass::layout::RowMajor", "col": "cutlass::layout::ColumnMajor"}
COMMON_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-shared")
# the epilogue contract's activations as CUTLASS functors (cutlass/epilogue/thread/activation.h), each applied to the
# fp32 value: GELU_taylor is the tanh approximation, SiLu x * sigmoid(x)
ACTIVATION_FUNCTORS = {"relu": "cutlass::epilogue::thread::ReLu", "gelu": "cutlass::epilogue::thread::GELU_taylor",
                       "silu": "cutlass::epilogue::thread::SiLu"}


@dataclass(frozen=True)
class CutlassKernelSpec:
    """Everything a binary depends on besides the toolchain; shape-agnostic (M, N, K, leading dims are run-time)."""
    family: str                 # "sm90" | "sm80"
    dtype: str
    out_dtype: str
    layout_a: str               # the kernel's operand layouts ("row" | "col"), after the optional swap
    layout_b: str
    layout_c: str
    config: CutlassConfig       # sm90: swizzle normalised to 1 (it is a run-time argument there)
    arch: int                   # device compute capability the binary is for
    bias: bool = False          # out = act(acc + bias), bias one value per output column (per kernel row if swapped)
    activation: str = ""        # "" or a key of ACTIVATION_FUNCTORS
    scaling: str = ""           # scaled_mm: "tensor" | "row" (out = acc * scale_a * scale_b [+ bias]); "" otherwise
    b_dtype: str = ""           # the problem's B dtype where it is not `dtype` (scaled_mm's e5m2 x e4m3)

    @property
    def kernel_dtypes(self) -> tuple[str, str]:
        """The kernel's A and B element dtypes: the problem's, exchanged when the kernel computes C^T."""
        a, b = self.dtype, self.b_dtype or self.dtype
        return (b, a) if self.config.swap else (a, b)

    @property
    def flags(self) -> tuple[str, ...]:
        if self.family == "sm90":
            # sm_90a: wgmma/TMA need the arch-specific target; NDEBUG keeps ptxas from serialising wgmma
            gencode = ("-gencode", "arch=compute_90a,code=sm_90a")
        else:
            gencode = ("-gencode", f"arch=compute_80,code=sm_{self.arch}")
        return (*gencode, *COMMON_FLAGS)


def spec_for(problem: GemmProblem, choice: Choice) -> CutlassKernelSpec:
    family = FAMILY[choice.template]
    cfg = CutlassConfig.from_params(choice.params)
    if cfg.epilogue != problem.epilogue:     # a kernel without the problem's epilogue would be silently wrong
        raise ValueError(f"{choice.name} fuses epilogue {cfg.epilogue or '(none)'}, the problem's is "
                         f"{problem.epilogue or '(none)'}")
    if problem.activation and problem.activation not in ACTIVATION_FUNCTORS:
        raise ValueError(f"no CUTLASS functor for activation {problem.activation!r}")
    ops = kernel_operands(problem, cfg.swap)
    if family == "sm90":
        cfg = replace(cfg, swizzle=1)
    if problem.scaling and family != "sm90":
        raise ValueError(f"{choice.name}: scaled fp8 products have sm90 kernels only")
    return CutlassKernelSpec(family, problem.dtype, problem.out_dtype, ops.layout_a, ops.layout_b, ops.layout_c,
                             cfg, problem.arch, problem.bias, problem.activation, problem.scaling,
                             "" if problem.b_dtype == problem.dtype else problem.b_dtype)


def _scaled_substitutions(spec: CutlassKernelSpec) -> dict:
    """scaled_mm's epilogue tree (templates/cutlass/sm90_gemm.cu.jinja): `scaling`, and which kernel axis each vector
    runs along ("Row": one value per kernel row, M; "Col": per kernel column, N). scale_a is one value per row of the
    problem's A and scale_b and the bias one per column of B: kernel rows and columns, exchanged when the kernel
    computes C^T. The entry points take scale_a, scale_b (then the bias) in that order whatever the swap."""
    swap = spec.config.swap
    formula = "(A @ B) * scale_a * scale_b" + (" + bias" if spec.bias else "")
    return {"scaling": spec.scaling, "bias": spec.bias, "activation_fn": "", "fusion_operation": "",
            "epilogue": f"{formula} ({'per-tensor' if spec.scaling == 'tensor' else 'row-wise'} scales)",
            "scale_a_along": "Col" if swap else "Row", "scale_b_along": "Row" if swap else "Col",
            "bias_along": "Row" if swap else "Col",
            "epilogue_pointers": ["scale_a", "scale_b"] + (["bias"] if spec.bias else [])}


def _epilogue_substitutions(spec: CutlassKernelSpec) -> dict:
    """`bias` (the entry points take a bias pointer after B), `activation_fn` ("" or its functor) and `epilogue` (the
    formula, for the source's comment). sm90 names its fusion operation (cutlass/epilogue/fusion/operations.hpp):
    the bias varies along the kernel's N (PerColBias) or, when the kernel computes C^T, along its M (PerRowBias);
    sm80 adds the bias as the C operand with leading dimension 0 (beta = 1), one vector read for every row (or
    column) of the output, and applies the activation with LinearCombinationGeneric."""
    if spec.scaling:
        return _scaled_substitutions(spec)
    act = spec.activation
    formula = "A @ B" + (" + bias" if spec.bias else "")
    subs = {"bias": spec.bias, "activation_fn": ACTIVATION_FUNCTORS[act] if act else "",
            "epilogue": f"{act}({formula})" if act else formula, "scaling": "",
            "epilogue_pointers": ["bias"] if spec.bias else []}
    if spec.family == "sm90":
        along = "Row" if spec.config.swap else "Col"
        subs["fusion_operation"] = ("" if not (spec.bias or act) else
                                    "LinComb" + (f"Per{along}Bias" if spec.bias else "") + ("EltAct" if act else ""))
    else:
        subs["activation_heavy"] = "false" if act in ("", "relu") else "true"    # the functor's kIsHeavy
    return subs


def _substitutions(spec: CutlassKernelSpec) -> dict:
    cfg = spec.config
    int8 = spec.dtype == "int8"
    kernel_a, kernel_b = spec.kernel_dtypes
    subs = {
        "element_ab": CUTLASS_TYPES[spec.dtype], "element_d": CUTLASS_TYPES[spec.out_dtype],
        "element_a": CUTLASS_TYPES[kernel_a], "element_b": CUTLASS_TYPES[kernel_b],
        "element_acc": "int32_t" if int8 else "float",
        "layout_a": LAYOUT_TAGS[spec.layout_a], "layout_b": LAYOUT_TAGS[spec.layout_b],
        "layout_c": LAYOUT_TAGS[spec.layout_c],
        "tile_m": cfg.tile_m, "tile_n": cfg.tile_n, "tile_k": cfg.tile_k, "align": cfg.align, "align_c": cfg.align_c,
        **_epilogue_substitutions(spec),
    }
    if spec.family == "sm90":
        coop = cfg.schedule == "coop"
        # fp8: the fast-accumulation mainloops (no promotion of the wgmma accumulators into separate fp32 registers)
        fast_accum = "FP8FastAccum" if spec.scaling else ""
        subs.update(
            cluster_m=cfg.cluster_m, cluster_n=cfg.cluster_n,
            kernel_schedule="cutlass::gemm::KernelTmaWarpSpecialized" + ("Cooperative" if coop else "Pingpong")
                            + fast_accum,
            epilogue_schedule="cutlass::epilogue::TmaWarpSpecialized" + ("Cooperative" if coop else ""),
            tile_scheduler="cutlass::gemm::StreamKScheduler" if cfg.stream_k else "cutlass::gemm::PersistentScheduler")
    else:
        subs.update(warp_m=cfg.tile_m // cfg.warps_m, warp_n=cfg.tile_n // cfg.warps_n,
                    instruction_k=32 if int8 else 16, stages=cfg.stages, swizzle=cfg.swizzle,
                    math_operator="cutlass::arch::OpMultiplyAddSaturate" if int8 else "cutlass::arch::OpMultiplyAdd")
    return subs


@functools.lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES_ROOT)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def render(spec: CutlassKernelSpec) -> str:
    return _environment().get_template(TEMPLATE_FILES[spec.family]).render(**_substitutions(spec))


def build_key(source: str, spec: CutlassKernelSpec, nvcc_version: str, cutlass_version: str) -> str:
    """Content address of a binary: source, compiler, flags, target arch and the CUTLASS headers' version."""
    h = hashlib.sha256()
    for part in (source, nvcc_version, " ".join(spec.flags), str(spec.arch), cutlass_version):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


# The entry points every rendered kernel defines; a batch renames them per member (`batch_source`)
ENTRY_POINTS = ("kernels_cutlass_workspace_size", "kernels_cutlass_run")


def symbol_suffix(key: str) -> str:
    """What a binary's entry points carry after their names when it was built in a batch: its artifact key's head
    (the loader tries the suffixed names, then the plain ones)."""
    return "_" + key[:16]


def batch_source(members: list[tuple[str, str]]) -> str:
    """One translation unit for several kernels: (rendered source, symbol suffix) each. The #include lines are
    hoisted (once each, in order); each body goes in its own namespace with its entry points renamed by the suffix,
    so one nvcc run parses the CUTLASS headers once for all of them (27 of a kernel's 85 s on a 2-core host; two
    kernels in one unit took 131 s against 170 s apart)."""
    includes: list[str] = []
    bodies: list[str] = []
    for i, (source, suffix) in enumerate(members):
        body = []
        for line in source.splitlines():
            if line.startswith("#include"):
                if line not in includes:
                    includes.append(line)
            else:
                body.append(line)
        renames = [f"#define {name} {name}{suffix}" for name in ENTRY_POINTS]
        undefs = [f"#undef {name}" for name in ENTRY_POINTS]
        bodies.append("\n".join([f"namespace kernels_batch_{i} {{", *renames, *body, *undefs,
                                 f"}}  // namespace kernels_batch_{i}"]))
    header = "// kernels: several CUTLASS kernels in one translation unit (backends.cutlass_render.batch_source)"
    return "\n".join([header, *includes, "", *bodies, ""])


@dataclass(frozen=True)
class BuildJob:
    """One nvcc invocation: `source` -> `output`, compiler output in `log`."""
    source: Path
    output: Path
    log: Path
    flags: tuple[str, ...]
    include_dirs: tuple[Path, ...]


def _ninja_escape(text: str) -> str:
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:").replace("\n", "$\n")


def _shell_quote(text: str) -> str:
    return shlex.quote(text)


def ninja_text(nvcc: str, jobs: list[BuildJob]) -> str:
    """build.ninja for a batch: one edge per job; each writes its own log and publishes its .so by rename, so a
    failed or interrupted compile never leaves a partial binary under the final name."""
    lines = ["ninja_required_version = 1.3", f"nvcc = {_shell_quote(nvcc)}", "",
             "rule nvcc_shared",
             # $$$$ is the shell's $$ (its pid): concurrent builds of one artifact never share a temp file
             "  command = $nvcc $flags -o $out.$$$$.tmp $in > $log 2>&1 && mv -f $out.$$$$.tmp $out",
             "  description = nvcc $out", ""]
    for job in sorted(jobs, key=lambda j: str(j.output)):
        flags = [*job.flags, *(f"-I{d}" for d in job.include_dirs)]
        lines.append(f"build {_ninja_escape(str(job.output))}: nvcc_shared {_ninja_escape(str(job.source))}")
        lines.append(f"  flags = {' '.join(_ninja_escape(_shell_quote(f)) for f in flags)}")
        lines.append(f"  log = {_ninja_escape(_shell_quote(str(job.log)))}")
        lines.append("")
    return "\n".join(lines)
