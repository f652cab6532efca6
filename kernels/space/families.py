"""Which op each template implements and which config list seeds it: data shared by heuristics and backends."""
import hashlib
from pathlib import Path


def _templates_root() -> Path:
    """The checkout's top-level templates/ (source tree, editable install), else the copy a wheel installs as
    kernels/templates (pyproject's package-dir)."""
    package = Path(__file__).resolve().parents[1]
    for root in (package.parent / "templates", package / "templates"):
        if root.is_dir():
            return root
    return package.parent / "templates"


TEMPLATES_ROOT = _templates_root()

TEMPLATE_OPS = {
    "aten_mm": ("mm",),
    "aten_int_mm": ("int_mm",),
    "triton_mm": ("mm",),
    "triton_int8_mm": ("int_mm",),
    "triton_tma_mm": ("mm",),
    "triton_tma_int8_mm": ("int_mm",),
    "split_k": ("mm", "int_mm"),
    "decompose_k": ("mm", "int_mm"),
    "triton_padded_mm": ("mm",),
    "triton_padded_int8_mm": ("int_mm",),
    "triton_padded_tma_mm": ("mm",),
    "triton_padded_tma_int8_mm": ("int_mm",),
    "triton_kmajor_int8_mm": ("int_mm",),
    "padded_aten_mm": ("mm",),
    "padded_triton_mm": ("mm",),
    "padded_triton_int8_mm": ("int_mm",),
    "cutlass3x_sm90_mm": ("mm",),
    "cutlass3x_sm90_int8_mm": ("int_mm",),
    "cutlass2x_sm80_mm": ("mm",),
    "cutlass2x_sm80_int8_mm": ("int_mm",),
}

# template -> the named config list(s) seeding it (kernels/data/*.json), concatenated in order
TEMPLATE_CONFIG_LISTS = {
    "triton_mm": "mm_configs",
    "triton_int8_mm": ("int8_mm_configs", "int8_mm_extra_configs"),
    "split_k": "split_k_configs",
    "triton_tma_mm": "persistent_mm_configs",
    "triton_tma_int8_mm": "persistent_mm_configs",
}

# templates whose call is one kernel launch: their host cost per call is the same, so on a short problem their GPU
# times rank them as their calls rank when the GPU is the bottleneck (kernels.perf_data.gpu_labelled). The others
# launch more (kmajor: transpose + mm; padded: pad + mm; decompose_k: bmm + reduce) or are a library (aten).
SINGLE_LAUNCH_TEMPLATES = frozenset({"triton_mm", "triton_int8_mm", "triton_tma_mm", "triton_tma_int8_mm", "split_k"})


def one_launch(choice) -> bool:
    """Whether a choice's call is one kernel launch of ours (SINGLE_LAUNCH_TEMPLATES; aten never: a library call)."""
    return choice.backend != "aten" and choice.template in SINGLE_LAUNCH_TEMPLATES

# lower is simpler: among candidates whose times tie within noise, the simplest wins
TEMPLATE_COMPLEXITY = {
    "aten_mm": 0,
    "aten_int_mm": 0,
    "triton_mm": 10,
    "triton_int8_mm": 10,
    "triton_tma_mm": 11,
    "triton_tma_int8_mm": 11,
    "split_k": 12,
    "decompose_k": 14,
    "triton_padded_mm": 15,
    "triton_padded_int8_mm": 15,
    "triton_padded_tma_mm": 16,
    "triton_padded_tma_int8_mm": 16,
    "triton_kmajor_int8_mm": 13,
    "padded_aten_mm": 15,
    "padded_triton_mm": 16,
    "padded_triton_int8_mm": 16,
    "cutlass3x_sm90_mm": 20,
    "cutlass3x_sm90_int8_mm": 20,
    "cutlass2x_sm80_mm": 20,
    "cutlass2x_sm80_int8_mm": 20,
}


def template_tree_hash() -> str:
    """Hash of every template file: part of the selection key, so editing a template re-tunes."""
    h = hashlib.sha256()
    for path in sorted(TEMPLATES_ROOT.rglob("*.jinja")):
        h.update(str(path.relative_to(TEMPLATES_ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
