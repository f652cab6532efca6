"""The template registry: one record per template family holding everything about it. Adding a family means one
`TemplateFamily` here, its kernel code in templates/ and its implementation in the backend it names.

Every other table is derived from FAMILIES: which op a template implements, which config lists seed it, whether
its call is one native launch, how simple it is (ties go to the simpler), which module implements it and which
kernel files it renders. Choice names are unchanged by this registry: LUT files and the performance-model data key
on them.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TemplateFamily:
    name: str                          # template name: the first part of every choice name of the family
    backend: str                       # "aten" | "triton" | "cutlass" | "padded": the backend that builds it
    ops: tuple[str, ...]               # "mm" (fp16/bf16/fp32), "int_mm" (int8 -> int32), "scaled_mm" (fp8, scaled)
    complexity: int                    # lower is simpler: among candidates tied within noise the simplest wins
    what: str                          # one line for `kernels info` and the docs: what it is for
    config_lists: tuple[str, ...] = ()  # named lists in kernels/data/*.json seeding it, concatenated in order
    # one native launch per call: host cost per call is the same across such families, so on a short problem their
    # GPU times rank them as their calls rank (kmajor: transpose + mm; padded: pad + mm; decompose_k: bmm + reduce;
    # aten is a library call)
    one_launch: bool = False
    implementation: str = ""           # "module:attribute" of the object that builds it ("" for aten)
    kernel_files: tuple[str, ...] = ()  # files under templates/ it renders
    arch: str = ""                     # CUTLASS: "sm90" (3.x, TMA warp-specialized) or "sm80" (2.x multistage)


_TRITON = "backends.triton_templates"
_MM = ("triton/mm.py.jinja", "triton/_gemm.jinja")
_TMA = ("triton/tma_persistent.py.jinja", "triton/_gemm.jinja")

FAMILIES: tuple[TemplateFamily, ...] = (
    TemplateFamily("aten_mm", "aten", ("mm",), 0, "torch.mm (cuBLAS): always a candidate"),
    TemplateFamily("aten_int_mm", "aten", ("int_mm",), 0, "torch._int_mm (cuBLAS): always a candidate"),
    TemplateFamily("aten_scaled_mm", "aten", ("scaled_mm",), 0,
                   "torch._scaled_mm (cuBLASLt fp8, scales and bias in its epilogue): always a candidate"),
    TemplateFamily("aten_addmm", "aten", ("mm",), 0,
                   "torch.addmm (cuBLASLt bias epilogue) or torch.mm, then the activation: the baseline of products "
                   "with an epilogue (kernels.linear)"),
    TemplateFamily("triton_mm", "triton", ("mm",), 10, "one program per output tile, GROUP_M swizzle",
                   ("mm_configs",), True, f"{_TRITON}.mm:FAMILY", _MM),
    TemplateFamily("triton_int8_mm", "triton", ("int_mm",), 10, "the tiled kernel for int8",
                   ("int8_mm_configs", "int8_mm_extra_configs"), True, f"{_TRITON}.mm:FAMILY", _MM),
    TemplateFamily("triton_tma_mm", "triton", ("mm",), 11,
                   "persistent: min(SMs, tiles) programs, TMA descriptors made on the device (sm90+)",
                   ("persistent_mm_configs",), True, f"{_TRITON}.tma:FAMILY", _TMA),
    TemplateFamily("triton_tma_int8_mm", "triton", ("int_mm",), 11, "the persistent TMA kernel for int8",
                   ("persistent_mm_configs",), True, f"{_TRITON}.tma:FAMILY", _TMA),
    TemplateFamily("triton_scaled_mm", "triton", ("scaled_mm",), 10,
                   "the tiled kernel for fp8, the scales (per tensor or row-wise) and bias in its epilogue",
                   ("fp8_mm_configs",), True, f"{_TRITON}.mm:FAMILY", _MM),
    TemplateFamily("triton_tma_scaled_mm", "triton", ("scaled_mm",), 11,
                   "the persistent TMA kernel for fp8, the scales and bias in its epilogue (sm90+)",
                   ("scaled_persistent_mm_configs", "fp8_persistent_extra_configs"), True, f"{_TRITON}.tma:FAMILY",
                   _TMA),
    TemplateFamily("split_k", "triton", ("mm", "int_mm", "scaled_mm"), 12,
                   "K split over programs, atomics into a workspace, the last to arrive stores: one launch",
                   ("split_k_configs",), True, f"{_TRITON}.split_k:SPLIT_K",
                   ("triton/split_k.py.jinja", "triton/_gemm.jinja")),
    TemplateFamily("decompose_k", "triton", ("mm", "int_mm"), 14,
                   "K split into batched partial products, then a deterministic reduce launch",
                   (), False, f"{_TRITON}.split_k:DECOMPOSE_K",
                   ("triton/split_k.py.jinja", "triton/reduce.py.jinja", "triton/_gemm.jinja")),
    TemplateFamily("triton_kmajor_int8_mm", "triton", ("int_mm",), 13,
                   "int8 with B not K-major: one transpose launch, then the tiled kernel (Hopper int8 wgmma reads "
                   "K-major B only)", (), False, f"{_TRITON}.kmajor:FAMILY", ("triton/transpose_b.py.jinja", *_MM)),
    TemplateFamily("triton_padded_mm", "triton", ("mm",), 15,
                   "misaligned operands: one copy kernel pads both, then the tiled kernel writes the N columns",
                   (), False, f"{_TRITON}.padded:FAMILY", ("triton/pad2.py.jinja", *_MM)),
    TemplateFamily("triton_padded_int8_mm", "triton", ("int_mm",), 15, "the padded pair for int8 (B written K-major)",
                   (), False, f"{_TRITON}.padded:FAMILY", ("triton/pad2.py.jinja", *_MM)),
    TemplateFamily("triton_padded_tma_mm", "triton", ("mm",), 16, "the padded pair with the persistent TMA kernel",
                   (), False, f"{_TRITON}.padded:TMA_FAMILY", ("triton/pad2.py.jinja", *_TMA)),
    TemplateFamily("triton_padded_tma_int8_mm", "triton", ("int_mm",), 16, "the padded TMA pair for int8",
                   (), False, f"{_TRITON}.padded:TMA_FAMILY", ("triton/pad2.py.jinja", *_TMA)),
    TemplateFamily("padded_aten_mm", "padded", ("mm",), 15,
                   "misaligned operands: F.pad copies into aligned buffers, torch.mm on them, N columns kept",
                   implementation="backends.padded:PaddedBackend"),
    TemplateFamily("padded_triton_mm", "padded", ("mm",), 16, "F.pad copies, then an aligned Triton tile",
                   implementation="backends.padded:PaddedBackend", kernel_files=_MM),
    TemplateFamily("padded_triton_int8_mm", "padded", ("int_mm",), 16, "F.pad copies, then an aligned int8 tile",
                   implementation="backends.padded:PaddedBackend", kernel_files=_MM),
    TemplateFamily("cutlass3x_sm90_mm", "cutlass", ("mm",), 20, "CUTLASS 3.x TMA warp-specialized (Hopper)",
                   implementation="backends.cutlass:CutlassBackend", kernel_files=("cutlass/sm90_gemm.cu.jinja",),
                   arch="sm90"),
    TemplateFamily("cutlass3x_sm90_int8_mm", "cutlass", ("int_mm",), 20, "CUTLASS 3.x for int8 (Hopper)",
                   implementation="backends.cutlass:CutlassBackend", kernel_files=("cutlass/sm90_gemm.cu.jinja",),
                   arch="sm90"),
    TemplateFamily("cutlass3x_sm90_scaled_mm", "cutlass", ("scaled_mm",), 20,
                   "CUTLASS 3.x for fp8 (Hopper): FP8 fast-accumulation mainloops, the scales (per tensor or row-wise) "
                   "and bias in our epilogue visitor tree", implementation="backends.cutlass:CutlassBackend",
                   kernel_files=("cutlass/sm90_gemm.cu.jinja",), arch="sm90"),
    TemplateFamily("cutlass2x_sm80_mm", "cutlass", ("mm",), 20, "CUTLASS 2.x multistage (Ampere and later)",
                   implementation="backends.cutlass:CutlassBackend", kernel_files=("cutlass/sm80_gemm.cu.jinja",),
                   arch="sm80"),
    TemplateFamily("cutlass2x_sm80_int8_mm", "cutlass", ("int_mm",), 20, "CUTLASS 2.x multistage for int8",
                   implementation="backends.cutlass:CutlassBackend", kernel_files=("cutlass/sm80_gemm.cu.jinja",),
                   arch="sm80"),
)

BY_NAME: dict[str, TemplateFamily] = {f.name: f for f in FAMILIES}
UNKNOWN_COMPLEXITY = 100    # a template the registry does not know (a LUT naming a removed family) loses ties

# derived views, kept for the modules that ask one question of every family
TEMPLATE_OPS = {f.name: f.ops for f in FAMILIES}
TEMPLATE_CONFIG_LISTS = {f.name: f.config_lists for f in FAMILIES if f.config_lists}
SINGLE_LAUNCH_TEMPLATES = frozenset(f.name for f in FAMILIES if f.one_launch)


def backend_of(template: str) -> str:
    """The backend that builds a template (aten, triton, cutlass, padded); unknown names by their prefix."""
    family = BY_NAME.get(template)
    if family is not None:
        return family.backend
    return next((b for b in ("aten", "cutlass", "padded") if template.startswith(b)), "triton")


def families_of(backend: str, op: str | None = None) -> tuple[TemplateFamily, ...]:
    return tuple(f for f in FAMILIES if f.backend == backend and (op is None or op in f.ops))


def complexity(choice) -> int:
    family = BY_NAME.get(choice.template)
    return family.complexity if family is not None else UNKNOWN_COMPLEXITY


def one_launch(choice) -> bool:
    """Whether a choice's call is one kernel launch of ours (aten never: a library call)."""
    family = BY_NAME.get(choice.template)
    return choice.backend != "aten" and family is not None and family.one_launch


def templates_root() -> Path:
    """The checkout's top-level templates/ (source tree, editable install), else the copy a wheel installs as
    kernels/templates (pyproject's package-dir)."""
    package = Path(__file__).resolve().parents[1]
    for root in (package.parent / "templates", package / "templates"):
        if root.is_dir():
            return root
    return package.parent / "templates"


TEMPLATES_ROOT = templates_root()


def template_tree_hash() -> str:
    """Hash of every template file: part of the selection key, so editing a template re-tunes."""
    h = hashlib.sha256()
    for path in sorted(TEMPLATES_ROOT.rglob("*.jinja")):
        h.update(str(path.relative_to(TEMPLATES_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
