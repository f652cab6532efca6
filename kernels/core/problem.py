"""GemmProblem: everything about a matrix product that decides which kernel can run it and how fast."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "int8",
               torch.int32: "int32", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "int8": 1, "int32": 4, "e4m3": 1, "e5m2": 1}
# scaled_mm's dtype names A's type: "e4m3" is e4m3 x e4m3, "e5m2" is e5m2 x e4m3 (the one mixed pair cuBLAS runs)
OPS = {"mm": ("fp16", "bf16", "fp32"), "int_mm": ("int8",), "scaled_mm": ("e4m3", "e5m2")}
# sizes and strides a problem read back from a file may hold (a stored selection, a problem list): below 2**31
MAX_DIM = 1 << 31
SCALED_OUT_DTYPES = ("bf16", "fp16", "fp32")
# scaled_mm's K and N are multiples of this: torch._scaled_mm's own shape rule (cuBLASLt's fp8 alignment), which
# kernels.scaled_mm and problem lists enforce alike
SCALED_MULTIPLE = 16


def op_of(dtype: str) -> str:
    """mm, int_mm or scaled_mm: the op whose inputs have this dtype name (OPS)."""
    return next(op for op, dtypes in OPS.items() if dtype in dtypes)
# scaled_mm's scales: "tensor" (one fp32 each) or "row" (scale_a (M, 1) per row of A, scale_b (1, N) per column of B)
SCALINGS = ("tensor", "row")
# epilogue activations (kernels.linear): applied in fp32 to acc + bias, before the one cast to the output dtype.
# gelu is the tanh approximation (F.gelu(approximate="tanh")).
ACTIVATIONS = ("relu", "gelu", "silu")
# fields whose default is left out of key(): stored keys of plain products stay what they were before epilogues
_KEY_DEFAULTS = {"bias": False, "activation": "", "scaling": ""}


def pointer_alignment(ptr: int) -> int:
    """Largest power of two (capped at 16 bytes) that divides the address."""
    for align in (16, 8, 4, 2):
        if ptr % align == 0:
            return align
    return 1


def layout_of(shape: tuple[int, int], stride: tuple[int, int]) -> str:
    """'row' when the last dim is unit-stride, 'col' when the first is, else 'strided' (size-1 dims match any)."""
    if stride[1] == 1 or shape[1] == 1:
        return "row"
    if stride[0] == 1 or shape[0] == 1:
        return "col"
    return "strided"


def precision_of(dtype: str) -> str:
    """How an fp32 product runs under torch's current setting ("ieee" or "tf32"); "" for other dtypes."""
    if dtype != "fp32":
        return ""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


@dataclass(frozen=True)
class GemmProblem:
    op: str                      # "mm" or "int_mm"
    m: int
    n: int
    k: int
    dtype: str                   # input dtype name, both operands
    out_dtype: str
    stride_a: tuple[int, int]
    stride_b: tuple[int, int]
    align_a: int                 # byte alignment of the data pointers (<= 16)
    align_b: int
    device: str                  # "cuda" or "cpu"
    arch: int                    # compute capability as 90, 80; 0 on cpu
    device_name: str
    precision: str = ""          # "ieee" or "tf32" for fp32 inputs, "" otherwise
    # dims ("m", "n", "k") declared dynamic: kernels must not specialise on their values, so one binary serves all
    dynamic: tuple[str, ...] = ()
    # epilogue (mm; scaled_mm takes the bias only): out = activation(a @ b + bias), bias a (N,) vector of the output
    # dtype
    bias: bool = False
    activation: str = ""         # "" or one of ACTIVATIONS
    # scaled_mm only: out = (a @ b) * scale_a * scale_b (+ bias), the scales applied once per output element
    scaling: str = ""            # "" or one of SCALINGS

    @property
    def b_dtype(self) -> str:
        """B's dtype name (scaled_mm's e5m2 problems take an e4m3 B)."""
        return "e4m3" if self.op == "scaled_mm" else self.dtype

    @property
    def epilogue(self) -> str:
        """'' for a plain product, else 'bias', 'gelu', 'bias+gelu', ...: names and explain() use it."""
        return "+".join(p for p in ("bias" if self.bias else "", self.activation) if p)

    @property
    def epilogue_operands(self) -> int:
        """How many tensors every launch takes between b and out: scaled_mm's two scales, then the bias."""
        return (2 if self.scaling else 0) + (1 if self.bias else 0)

    @property
    def layout_a(self) -> str:
        return layout_of((self.m, self.k), self.stride_a)

    @property
    def layout_b(self) -> str:
        return layout_of((self.k, self.n), self.stride_b)

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def out_bytes(self) -> int:
        return DTYPE_BYTES[self.out_dtype]

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def min_bytes(self) -> int:
        """Fewest bytes a kernel must move: each operand read once, the result written once."""
        return ((self.m * self.k + self.k * self.n) * self.elem_bytes + self.m * self.n * self.out_bytes
                + (self.n * self.out_bytes if self.bias else 0))

    def leading_dim(self, which: str) -> int | None:
        """The operand's non-unit stride (row-major: the row stride; column-major: the column stride); None when
        neither dimension has a unit stride."""
        stride, layout = (self.stride_a, self.layout_a) if which == "a" else (self.stride_b, self.layout_b)
        return stride[0] if layout == "row" else stride[1] if layout == "col" else None

    def leading_dim_aligned(self, which: str, bytes_: int = 16) -> bool:
        """True when the non-unit stride of the operand keeps every row/column start `bytes_`-aligned."""
        lead = self.leading_dim(which)
        if lead is None:
            return False
        return (lead * self.elem_bytes) % bytes_ == 0

    def rows_overlap(self, which: str) -> bool:
        """True when the operand's rows (row-major; columns, column-major) overlap in memory: more than one, and a
        leading stride below the contiguous extent -- a broadcast view (`expand`: stride 0) or an overlapping
        `as_strided` one. Plain loads read such views correctly; a TMA descriptor may not describe them."""
        lead = self.leading_dim(which)
        if lead is None:
            return False
        rows, cols = (self.m, self.k) if which == "a" else (self.k, self.n)
        count, extent = (rows, cols) if (self.layout_a if which == "a" else self.layout_b) == "row" else (cols, rows)
        return count > 1 and lead < extent

    def key(self) -> str:
        """Stable text identity of the problem, used in the persistent selection store."""
        data = asdict(self)
        for name, default in _KEY_DEFAULTS.items():
            if data[name] == default:
                del data[name]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    def short(self) -> str:
        parts = [self.op, f"{self.m}x{self.n}x{self.k}", self.dtype, f"A:{self.layout_a}{list(self.stride_a)}",
                 f"B:{self.layout_b}{list(self.stride_b)}", self.precision,
                 f"{self.scaling}-scaled->{self.out_dtype}" if self.scaling else "", self.epilogue]
        return " ".join(p for p in parts if p)

    def digest(self) -> str:
        return hashlib.sha256(self.key().encode()).hexdigest()[:24]

    @classmethod
    def from_dict(cls, data: dict) -> "GemmProblem":
        data = dict(data)
        data["stride_a"] = tuple(data["stride_a"])
        data["stride_b"] = tuple(data["stride_b"])
        data["dynamic"] = tuple(data.get("dynamic", ()))
        return cls(**data)

    @classmethod
    def from_tensors(cls, op: str, a: torch.Tensor, b: torch.Tensor, bias: bool = False,
                     activation: str = "", scaling: str = "", out_dtype: str = "") -> "GemmProblem":
        """Assumes inputs were validated (2-D, same supported dtype, same device)."""
        return cls.from_layout(op, a.dtype, a.device, (a.shape[0], b.shape[1], a.shape[1]), tuple(a.stride()),
                               tuple(b.stride()), pointer_alignment(a.data_ptr()), pointer_alignment(b.data_ptr()),
                               bias=bias, activation=activation, scaling=scaling, out_dtype=out_dtype)

    @classmethod
    def from_layout(cls, op: str, dtype: torch.dtype, device: torch.device, mnk: tuple[int, int, int],
                    stride_a: tuple[int, int], stride_b: tuple[int, int], align_a: int, align_b: int,
                    bias: bool = False, activation: str = "", scaling: str = "", out_dtype: str = "") -> "GemmProblem":
        """The problem operands of this layout would make, without the operands (a product met ahead of its call)."""
        name = DTYPE_NAMES[dtype]
        arch, device_name = gpu_of(device) if device.type == "cuda" else (0, "cpu")
        m, n, k = mnk
        return cls(op=op, m=m, n=n, k=k, dtype=name, out_dtype=out_dtype or ("int32" if op == "int_mm" else name),
                   stride_a=stride_a, stride_b=stride_b, align_a=align_a, align_b=align_b, device=device.type,
                   arch=arch, device_name=device_name, precision=precision_of(name), bias=bias,
                   activation=activation, scaling=scaling)


def gpu_of(device) -> tuple[int, str]:
    """(arch as 90 for sm_90, name) of a CUDA device (a torch.device or an index): what a problem records of its GPU."""
    cap = torch.cuda.get_device_capability(device)
    return cap[0] * 10 + cap[1], torch.cuda.get_device_name(device)


def probe_problem(arch: int, device_name: str) -> GemmProblem:
    """A plain aligned bf16 problem on the first device (the CPU when arch is 0): what a backend's `available()` is
    asked about when no real problem is at hand yet."""
    return GemmProblem(op="mm", m=1024, n=1024, k=1024, dtype="bf16", out_dtype="bf16", stride_a=(1024, 1),
                       stride_b=(1024, 1), align_a=16, align_b=16, device="cuda" if arch else "cpu", arch=arch,
                       device_name=device_name)
