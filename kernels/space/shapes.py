"""Named matrix-product shapes: the benchmark suites (bench.compare reads them from here) and the problems the
default CUTLASS set is built for (kernels.tune.warmup). Data, and the tensor-free GemmProblem of a shape."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.core.problem import GemmProblem, op_of, precision_of


@dataclass(frozen=True)
class Shape:
    m: int
    n: int
    k: int

    @property
    def macs(self) -> int:
        return self.m * self.n * self.k

    def label(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


def _cube(s: int) -> Shape:
    return Shape(s, s, s)


# Llama projections as (K, N): qkv, down, gate+up, o, lm head
_LLAMA_KN = ((4096, 12288), (11008, 4096), (4096, 22016), (4096, 4096), (4096, 65536))

SUITES: dict[str, tuple[Shape, ...]] = {
    "tiny": (Shape(64, 64, 64), Shape(17, 33, 65)),
    "square": (_cube(1024), _cube(4096), _cube(8192)),
    "llama": tuple(Shape(m, n, k) for m in (16, 64) for k, n in _LLAMA_KN),
    "splitk": tuple(Shape(32, 32, k) for k in (4096, 16384, 32768)),
    "training": (Shape(8192, 14336, 4096), Shape(4096, 4096, 14336)),
    "odd": (Shape(3000, 2000, 1000), _cube(2047)),
}

# the core issue's reference set; int8 has its own shapes
CORE = {
    "float": (_cube(1024), _cube(4096), _cube(8192), Shape(16, 12288, 4096), Shape(64, 4096, 11008),
              Shape(64, 22016, 4096), Shape(3000, 2000, 1000)),
    "int8": (Shape(256, 12288, 4096), Shape(1024, 22016, 4096), _cube(4096)),
}

# "all" is every performance suite (not tiny: that one exists for machines without a GPU)
ALL_SUITES = ("square", "llama", "splitk", "training", "odd")

# what `python -m bench.compare` runs on a GPU when --shapes and --layout are not given
COMPARE_SUITE = "square"
COMPARE_LAYOUT = "nn"

# A llama-7B decoder layer's products as (N, K), B column-major (an nn.Linear weight is (out, in), used transposed):
# fused qkv (3 x hidden), o, gate and up (intermediate; fused 2 x intermediate), down
LLAMA7B_HIDDEN, LLAMA7B_INTERMEDIATE = 4096, 11008
LLAMA7B_LAYER_NK = ((3 * LLAMA7B_HIDDEN, LLAMA7B_HIDDEN), (LLAMA7B_HIDDEN, LLAMA7B_HIDDEN),
                    (LLAMA7B_INTERMEDIATE, LLAMA7B_HIDDEN), (2 * LLAMA7B_INTERMEDIATE, LLAMA7B_HIDDEN),
                    (LLAMA7B_HIDDEN, LLAMA7B_INTERMEDIATE))
# token counts (M) the default CUTLASS set covers: prefill and training batches, where CUTLASS's wins are. Decode-
# sized M (16-256) adds 11-12 more kernels per dtype (swapped tiles) for problems aten and Triton serve well; a
# problem outside the set is built in the background when it is first tuned
LLAMA7B_TOKENS = (1024, 4096)
LLAMA7B_LAYOUT = "nt"


def llama7b_layers() -> tuple[Shape, ...]:
    return tuple(Shape(m, n, k) for m in LLAMA7B_TOKENS for n, k in LLAMA7B_LAYER_NK)


def _strides(rows: int, cols: int, transposed: bool) -> tuple[int, int]:
    return (1, rows) if transposed else (cols, 1)


def problem_of(shape: Shape, dtype: str, layout: str, device: str = "cuda", arch: int = 90,
               device_name: str = "", scaling: str = "tensor", out_dtype: str = "bf16") -> GemmProblem:
    """The problem of freshly allocated operands of this shape (16-byte aligned, dense) without making them: layout
    'n' is row-major, 't' column-major (A then B); int8 is int_mm (int32 out); fp8 (e4m3, e5m2) is scaled_mm with
    `scaling` and `out_dtype` (ignored for the other ops)."""
    if len(layout) != 2 or set(layout) - {"n", "t"}:
        raise ValueError(f"layout must be one of nn, nt, tn, tt, got {layout!r}")
    op = op_of(dtype)
    scaled = op == "scaled_mm"
    return GemmProblem(op=op, m=shape.m, n=shape.n, k=shape.k, dtype=dtype,
                       out_dtype=out_dtype if scaled else "int32" if op == "int_mm" else dtype,
                       stride_a=_strides(shape.m, shape.k, layout[0] == "t"),
                       stride_b=_strides(shape.k, shape.n, layout[1] == "t"), align_a=16, align_b=16, device=device,
                       arch=arch, device_name=device_name, precision=precision_of(dtype),
                       scaling=scaling if scaled else "")
