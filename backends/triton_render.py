"""Kernel specs and template rendering for the Triton backend. Pure: no GPU, no compiler, no torch.

A TritonKernelSpec is everything one compiled binary depends on (template file, render variables, argument types,
divisibility facts, launch options). Template families (backends/triton_templates/) build specs from a problem and
a choice; shapes whose specs are equal share the binary.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass

import jinja2

from kernels.core.problem import ACTIVATIONS, SCALINGS, GemmProblem
from kernels.space.families import TEMPLATES_ROOT

TEMPLATE_DIR = TEMPLATES_ROOT / "triton"
TRITON_TYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "int8": "i8", "int32": "i32", "e4m3": "fp8e4nv",
                "e5m2": "fp8e5"}


@dataclass(frozen=True)
class Arg:
    name: str
    type: str          # Triton signature type: "*bf16", "i32", ...
    div16: bool        # value known to be a multiple of 16 (pointers: 16-byte aligned)


@dataclass(frozen=True)
class TritonKernelSpec:
    template_file: str
    kernel_name: str
    args: tuple[Arg, ...]
    num_warps: int
    num_stages: int
    render_vars: tuple[tuple[str, object], ...]    # sorted (name, value) pairs handed to the template

    @property
    def signature(self) -> dict[str, str]:
        return {a.name: a.type for a in self.args}

    @property
    def div16(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.args) if a.div16)

    @property
    def options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}

    def var(self, name: str):
        return dict(self.render_vars)[name]


def make_spec(template_file: str, kernel_name: str, args: list[Arg], num_warps: int, num_stages: int,
              **render_vars) -> TritonKernelSpec:
    """The kernel's spec. Its name, the choice's name, is rendered into Python source as the kernel's: anything but
    a plain identifier is refused, whatever a choice read from a file held (the other values come from the problem
    and the config, checked where they are made)."""
    if not (kernel_name.isascii() and kernel_name.isidentifier()):
        raise ValueError(f"kernel name {kernel_name!r} is not a plain identifier")
    return TritonKernelSpec(template_file, kernel_name, tuple(args), num_warps, num_stages,
                            tuple(sorted(render_vars.items())))


def ptr(name: str, dtype: str, aligned: bool = True) -> Arg:
    return Arg(name, "*" + TRITON_TYPES[dtype], aligned)


def int_arg(problem: GemmProblem, name: str, value: int, dims: str = "") -> Arg:
    """An i32 argument; `dims` names the problem dims its value follows, so a dynamic dim is never specialised on."""
    return Arg(name, "i32", value % 16 == 0 and not any(d in problem.dynamic for d in dims))


def epilogue_args(problem: GemmProblem) -> list[Arg]:
    """The epilogue's tensors, passed right after c_ptr in the order launches take them: scaled_mm's fp32 scales
    (scale_a_ptr, scale_b_ptr: one element each, or (M, 1) and (1, N) contiguous), then bias_ptr (the (N,) vector in
    the output dtype). Their addresses are not part of the problem, so no alignment is assumed (each is read once
    per output tile)."""
    scales = [ptr("scale_a_ptr", "fp32", False), ptr("scale_b_ptr", "fp32", False)] if problem.scaling else []
    return scales + ([ptr("bias_ptr", problem.out_dtype, False)] if problem.bias else [])


def gemm_args(problem: GemmProblem, out_cols: int | None = None) -> list[Arg]:
    """a, b, c, [bias,] M, N, K and the six strides: the argument list every GEMM template starts with. The output
    is ours (or checked at launch): row-major with row stride `out_cols` (default N)."""
    sa, sb = problem.stride_a, problem.stride_b
    return [ptr("a_ptr", problem.dtype, problem.align_a >= 16), ptr("b_ptr", problem.b_dtype, problem.align_b >= 16),
            ptr("c_ptr", problem.out_dtype), *epilogue_args(problem),
            int_arg(problem, "M", problem.m, "m"), int_arg(problem, "N", problem.n, "n"),
            int_arg(problem, "K", problem.k, "k"),
            int_arg(problem, "stride_am", sa[0]), int_arg(problem, "stride_ak", sa[1]),
            int_arg(problem, "stride_bk", sb[0]), int_arg(problem, "stride_bn", sb[1]),
            int_arg(problem, "stride_cm", problem.n if out_cols is None else out_cols, "n"),
            Arg("stride_cn", "i32", False)]


def ldc_multiple(spec: TritonKernelSpec, row_bytes_multiple: int = 1, out_bytes: int = 1) -> int:
    """What a caller's `out` row stride must be a multiple of for this binary: 16 when it was compiled assuming
    stride_cm % 16 == 0, and (for TMA) whatever keeps rows `row_bytes_multiple`-byte aligned."""
    assumed = 16 if any(a.name == "stride_cm" and a.div16 for a in spec.args) else 1
    need = max(1, row_bytes_multiple // out_bytes)
    return math.lcm(assumed, need)


def layout_vars(problem: GemmProblem) -> dict:
    """Unit strides render as the literal 1 so loads along them vectorize."""
    la, lb = problem.layout_a, problem.layout_b
    return dict(a_layout=la, b_layout=lb,
                s_am="1" if la == "col" else "stride_am", s_ak="1" if la == "row" else "stride_ak",
                s_bk="1" if lb == "col" else "stride_bk", s_bn="1" if lb == "row" else "stride_bn",
                s_cm="stride_cm", s_cn="1")


def dot_vars(problem: GemmProblem) -> dict:
    if problem.op == "scaled_mm":
        return dict(acc_type="tl.float32", dot_args="")
    if problem.dtype == "int8":
        return dict(acc_type="tl.int32", dot_args=", out_dtype=tl.int32")
    return dict(acc_type="tl.float32", dot_args=f', input_precision="{problem.precision}"' if problem.precision else "")


def epilogue_vars(problem: GemmProblem) -> dict:
    """The fused epilogue as render variables (templates/triton/_gemm.jinja's `epilogue` macro): `scaling` ("",
    "tensor" or "row": multiply the fp32 accumulator by scale_a * scale_b), `bias` (add bias[n]) and `activation`
    ("" or its name), all in fp32 before the one cast."""
    if problem.activation and problem.activation not in ACTIVATIONS:
        raise ValueError(f"activation {problem.activation!r} is not one of {ACTIVATIONS}")
    if problem.scaling and problem.scaling not in SCALINGS:
        raise ValueError(f"scaling {problem.scaling!r} is not one of {SCALINGS}")
    return dict(scaling=problem.scaling, bias=problem.bias, activation=problem.activation)


def even_k(problem: GemmProblem, block_k: int) -> bool:
    return problem.k % block_k == 0 and "k" not in problem.dynamic


@functools.lru_cache(maxsize=None)
def _template(name: str) -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    return env.get_template(name)


def render(spec: TritonKernelSpec) -> str:
    return render_file(spec.template_file, spec.kernel_name, **dict(spec.render_vars))


def render_file(template_file: str, kernel_name: str, **render_vars) -> str:
    """The module source of one template under templates/triton (a GEMM family's or a fused block's)."""
    return _template(template_file).render(kernel_name=kernel_name, **render_vars)


def build_key(source: str, spec: TritonKernelSpec, target: str, triton_version: str) -> str:
    payload = json.dumps({"source": source, "spec": asdict(spec), "target": target, "triton": triton_version},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
