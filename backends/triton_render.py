"""Turn (problem, choice) into a TritonKernelSpec and render its template. Pure: no GPU, no compiler, no torch."""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
import jinja2

from kernels.choice import Choice
from kernels.problem import GemmProblem
from kernels.templates_info import TEMPLATES_ROOT

TEMPLATE_DIR = TEMPLATES_ROOT / "triton"
TEMPLATE_FILES = {"triton_mm": "mm.py.jinja", "triton_int8_mm": "mm.py.jinja"}
TRITON_TYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "int8": "i8", "int32": "i32"}
ARG_NAMES = ("a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn",
             "stride_cm", "stride_cn")


@dataclass(frozen=True)
class TritonKernelSpec:
    """Everything the compiled binary depends on; shapes that share it share the binary."""
    template: str
    kernel_name: str
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int
    dtype: str
    out_dtype: str
    a_layout: str
    b_layout: str
    even_k: bool
    precision: str            # "" (fp16/bf16/int8), "ieee" or "tf32"
    div16: tuple[int, ...]    # argument indices known to be multiples of 16 (pointers: 16-byte aligned)

    @property
    def signature(self) -> dict[str, str]:
        ptr = "*" + TRITON_TYPES[self.dtype]
        sig = {"a_ptr": ptr, "b_ptr": ptr, "c_ptr": "*" + TRITON_TYPES[self.out_dtype]}
        sig.update({name: "i32" for name in ARG_NAMES[3:]})
        return sig

    @property
    def options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def spec_for(problem: GemmProblem, choice: Choice) -> TritonKernelSpec:
    cfg = choice.config
    ints = (problem.m, problem.n, problem.k, *problem.stride_a, *problem.stride_b)
    div16 = [i for i, ok in enumerate((problem.align_a >= 16, problem.align_b >= 16, True)) if ok]
    div16 += [3 + i for i, v in enumerate(ints) if v % 16 == 0 and not (i < 3 and "mnk"[i] in problem.dynamic)]
    # the output is ours (or checked at launch): row-major, 16-byte aligned; its row stride is N
    if problem.n % 16 == 0 and "n" not in problem.dynamic:
        div16.append(10)
    return TritonKernelSpec(
        template=choice.template, kernel_name=choice.name, block_m=cfg.block_m, block_n=cfg.block_n,
        block_k=cfg.block_k, group_m=cfg.group_m, num_stages=cfg.num_stages, num_warps=cfg.num_warps,
        dtype=problem.dtype, out_dtype=problem.out_dtype, a_layout=problem.layout_a, b_layout=problem.layout_b,
        even_k=problem.k % cfg.block_k == 0 and "k" not in problem.dynamic, precision=problem.precision, div16=tuple(sorted(set(div16))))


@functools.lru_cache(maxsize=None)
def _template(name: str) -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    return env.get_template(name)


def _dot_args(spec: TritonKernelSpec) -> str:
    if spec.dtype == "int8":
        return ", out_dtype=tl.int32"
    if spec.precision:
        return f', input_precision="{spec.precision}"'
    return ""


def render(spec: TritonKernelSpec) -> str:
    return _template(TEMPLATE_FILES[spec.template]).render(
        kernel_name=spec.kernel_name, block_m=spec.block_m, block_n=spec.block_n, block_k=spec.block_k,
        group_m=spec.group_m, even_k=spec.even_k, a_layout=spec.a_layout, b_layout=spec.b_layout,
        s_am="1" if spec.a_layout == "col" else "stride_am", s_ak="1" if spec.a_layout == "row" else "stride_ak",
        s_bk="1" if spec.b_layout == "col" else "stride_bk", s_bn="1" if spec.b_layout == "row" else "stride_bn",
        s_cm="stride_cm", s_cn="1",
        acc_type="tl.int32" if spec.dtype == "int8" else "tl.float32", dot_args=_dot_args(spec))


def build_key(source: str, spec: TritonKernelSpec, target: str, triton_version: str) -> str:
    payload = json.dumps({"source": source, "spec": asdict(spec), "target": target, "triton": triton_version},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
