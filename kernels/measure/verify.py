"""Fresh random inputs shaped like the user's (same strides and alignment), a high-precision reference, and the
check every candidate must pass before it may win."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.core.problem import DTYPES_BY_NAME, GemmProblem
from kernels.measure.timing import rotation_sets

# However a tune's final round goes, the first pass's fastest this many are verified (the fastest before the regime is
# chosen from it; kernels.tune.final_round.OnDemandCheck, and the isolated child likewise for its own): the dynamic
# shapes' pool (DYNAMIC_POOL names a hint), `lut export --top-k` and a duel whose challenger crashed read further
# down a Selection's ranking than its finalists. Each costs about one call and one pass over the output.
VERIFIED_TOP = 3

# relative Frobenius error allowed, by (dtype, precision)
TOLERANCE = {("fp32", "ieee"): 1e-5, ("fp32", "tf32"): 2e-3, ("fp16", ""): 1e-2, ("bf16", ""): 1e-2,
             ("int8", ""): 0.0, ("e4m3", ""): 1e-2, ("e5m2", ""): 1e-2}


@dataclass
class CheckResult:
    ok: bool
    rel_error: float
    message: str = ""


def _storage_elems(shape: tuple[int, int], stride: tuple[int, int]) -> int:
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)


def make_operand(shape: tuple[int, int], stride: tuple[int, int], align: int, dtype: str, device: str,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """A random tensor with exactly this shape, stride and data-pointer alignment (never zeros)."""
    tdtype = DTYPES_BY_NAME[dtype]
    elem = tdtype.itemsize
    # offset the view so its address has the same alignment as the user's (16-byte aligned base + offset)
    offset = 0 if align >= 16 else max(align // elem, 1) if align >= elem else 1
    n = _storage_elems(shape, stride) + offset
    if dtype == "int8":
        flat = torch.randint(-128, 128, (n,), dtype=torch.int8, device=device, generator=generator)
    elif elem == 1:      # fp8: randn spans e4m3's and e5m2's fine range; a zero element is as likely as in fp16
        flat = torch.randn(n, dtype=torch.float32, device=device, generator=generator).to(tdtype)
    else:
        flat = torch.randn(n, dtype=torch.float32, device=device, generator=generator).to(tdtype)
    return torch.as_strided(flat, shape, stride, storage_offset=offset)


def make_inputs(problem: GemmProblem, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The problem's operands, as every launch takes them before `out`: (a, b), then for scaled_mm its two fp32
    scales (per-tensor: shape (); row-wise: (M, 1) and (1, N), contiguous, positive), then a contiguous (N,) bias of
    the output dtype when the problem has one."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    a = make_operand((problem.m, problem.k), problem.stride_a, problem.align_a, problem.dtype, device, gen)
    b = make_operand((problem.k, problem.n), problem.stride_b, problem.align_b, problem.b_dtype, device, gen)
    operands: tuple[torch.Tensor, ...] = (a, b)
    if problem.scaling:
        shapes = ((), ()) if problem.scaling == "tensor" else ((problem.m, 1), (1, problem.n))
        operands += tuple(0.125 + 0.875 * torch.rand(shape, dtype=torch.float32, device=device, generator=gen)
                          for shape in shapes)
    if problem.bias:
        operands += (make_operand((1, problem.n), (problem.n, 1), 16, problem.out_dtype, device, gen)[0],)
    return operands


def timing_sets(problem: GemmProblem, device: str, first: tuple[torch.Tensor, ...],
                seed: int) -> list[tuple[torch.Tensor, ...]]:
    """The input sets a timing loop rotates through (kernels.timing.rotation_sets of them, so small problems are not
    timed out of a warm L2): `first`, then fresh ones from seeds seed, seed + 1, ..."""
    n_sets = rotation_sets((problem.m * problem.k + problem.k * problem.n) * problem.elem_bytes, device)
    return [first] + [make_inputs(problem, device, seed=seed + s) for s in range(n_sets - 1)]


def fresh_timing_sets(problem: GemmProblem, device: str, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """timing_sets whose first set is fresh too (from `seed`, the rest from seed + 1, ...): inputs shared with
    nothing else. Tuning times candidates before it verifies them, and one that wrote out of bounds onto its inputs
    must not fail the correct ones' checks (checked_inputs)."""
    return timing_sets(problem, device, make_inputs(problem, device, seed=seed), seed=seed + 1)


def _activation64(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return torch.relu(x)
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "silu":
        return x * torch.sigmoid(x)
    return x


def reference(problem: GemmProblem, a: torch.Tensor, b: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """float64 result, scales and epilogue included (the product is exact for int8 at any K we allow: |sum| <
    2**53). `rest`: scaled_mm's scales, then the bias when the problem has one."""
    out = torch.mm(a.to(torch.float64), b.to(torch.float64))
    if problem.scaling:
        scale_a, scale_b, *rest = rest
        out = out * scale_a.to(torch.float64) * scale_b.to(torch.float64)
    bias = rest[0] if rest else None
    if bias is not None:
        out += bias.to(torch.float64)
    return _activation64(problem.activation, out)


def poisoned_output(problem: GemmProblem, device: str) -> torch.Tensor:
    """An output filled with values no correct kernel leaves behind."""
    dtype = DTYPES_BY_NAME[problem.out_dtype]
    if dtype.is_floating_point:
        return torch.full((problem.m, problem.n), float("nan"), dtype=dtype, device=device)
    return torch.full((problem.m, problem.n), torch.iinfo(dtype).min, dtype=dtype, device=device)


@dataclass(frozen=True)
class Reference:
    """The exact result in the form a check compares with: float32 for float outputs (its rounding, 6e-8 relative,
    is far below the tightest tolerance, fp32's 1e-5), int32 for int outputs (exact), or the float64 result itself
    where an int result does not fit int32 (no int32 output can then match it); and its float64 Frobenius norm.
    Made once per tune: a check then reads the output and this once (on bf16 8192x14336 output the float64 check
    moved 60 bytes per element and synchronized three times, about as long as the kernel it checked)."""
    values: torch.Tensor
    norm: float


def prepare_reference(problem: GemmProblem, ref: torch.Tensor) -> Reference:
    """`ref` (reference()'s float64 result) in the form `check` compares with."""
    if ref.dtype != torch.float64:
        raise TypeError(f"prepare_reference takes reference()'s float64 result, got {ref.dtype}")
    norm = float(torch.linalg.vector_norm(ref))
    out_dtype = DTYPES_BY_NAME[problem.out_dtype]
    if out_dtype.is_floating_point:
        return Reference(ref.to(torch.float32), norm)
    limits = torch.iinfo(torch.int32)
    fits = ref.numel() == 0 or (float(ref.min()) >= limits.min and float(ref.max()) <= limits.max)
    return Reference(ref.to(torch.int32) if fits else ref, norm)


def checked_inputs(problem: GemmProblem, device: str, seed: int) -> tuple[tuple[torch.Tensor, ...], Reference]:
    """The operands a tune's checks run candidates on (make_inputs from `seed`) and their Reference."""
    operands = make_inputs(problem, device, seed=seed)
    return operands, prepare_reference(problem, reference(problem, *operands))


def check(problem: GemmProblem, out: torch.Tensor, ref: torch.Tensor | Reference) -> CheckResult:
    """Whether `out` is the problem's result: ints exactly, floats within TOLERANCE in relative Frobenius error.
    `ref`: a Reference (prepare_reference), or reference()'s float64 result."""
    if tuple(out.shape) != (problem.m, problem.n):
        return CheckResult(False, float("inf"), f"wrong output shape {tuple(out.shape)}")
    if out.dtype != DTYPES_BY_NAME[problem.out_dtype]:
        return CheckResult(False, float("inf"), f"wrong output dtype {out.dtype}")
    if not isinstance(ref, Reference):
        ref = prepare_reference(problem, ref)
    if not out.dtype.is_floating_point:
        ok = bool(torch.equal(out, ref.values)) if ref.values.dtype == out.dtype else False
        if ok:
            return CheckResult(True, 0.0)
        err = float(torch.linalg.vector_norm(out.to(torch.float64) - ref.values.to(torch.float64)))
        rel = err / max(ref.norm, 1e-30)
        return CheckResult(False, rel, f"not the exact integer product (relative error {rel:.3g})")
    # a NaN or inf anywhere (an unwritten element of the poisoned output, an overflow) makes the norm NaN or inf
    err = float(torch.linalg.vector_norm(torch.sub(ref.values, out))) / max(ref.norm, 1e-30)
    if not math.isfinite(err):
        if bool(torch.isfinite(out).all()):     # finite values so far off that the float32 norm overflowed
            return CheckResult(False, float("inf"), "relative error beyond float32's range (wrong values)")
        return CheckResult(False, float("inf"), "output has NaN/inf (unwritten or overflowed elements)")
    tol = TOLERANCE[(problem.dtype, problem.precision)]
    ok = err <= tol
    return CheckResult(ok, err, "" if ok else f"relative error {err:.3g} > {tol:g}")


def verify_launch(launch, problem: GemmProblem, operands: tuple[torch.Tensor, ...],
                  ref: torch.Tensor | Reference) -> str | None:
    """None when every way the warm path can call `launch` writes the reference result into a poisoned output:
    launch(*operands, out), and its native launch (`launch.native(*operands, out)`, the C++ table's path) when it
    has one.
    Else why not; a crash is a result here, never an exception."""
    device = "cuda" if problem.device == "cuda" else "cpu"
    if not isinstance(ref, Reference):
        ref = prepare_reference(problem, ref)
    paths = [("", launch)]
    native = getattr(launch, "native", None)
    if native is not None:
        paths.append(("native launch: ", native))
    for label, call in paths:
        out = poisoned_output(problem, device)
        try:
            call(*operands, out)
            if device == "cuda":
                # this stream only: under DDP a device-wide sync would also wait on a pending all-reduce whose peer
                # rank waits for this tune (through the selection lock): a deadlock
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001
            return f"{label}crashed: {type(e).__name__}: {str(e)[:300]}"
        result = check(problem, out, ref)
        if not result.ok:
            return f"{label}wrong result: {result.message}"
    return None
