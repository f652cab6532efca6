"""Device facts measured at the start of a run (peak FLOP/s, copy bandwidth) and the environment record."""
from __future__ import annotations

import datetime
import platform
import shutil
import subprocess
from collections.abc import Callable
from importlib import metadata

import torch

from bench.measure import FP8, FP8_LAYOUT, problem_for, user_calls
from bench.results import ENTRY_NAMES, DeviceFacts
from bench.shapes import Shape
from kernels.core.version import __version__
from kernels.measure.timing import measure
from kernels.measure.verify import make_inputs


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "absent"


def _run(cmd: list[str], timeout: float = 10.0) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable ({type(e).__name__})"
    return res.stdout.strip() if res.returncode == 0 else f"unavailable (exit {res.returncode})"


def _nvcc_version() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "absent"
    out = _run([nvcc, "--version"])
    lines = [ln for ln in out.splitlines() if "release" in ln]
    return lines[0].strip() if lines else out[:200]


def _gpu_clocks() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {}
    fields = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,driver_version"
    out = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"])
    if out.startswith("unavailable"):
        return {"nvidia_smi": out}
    first = out.splitlines()[0] if out else ""
    return dict(zip(fields.split(","), (v.strip() for v in first.split(","))))


def environment() -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "triton": _version("triton"), "kernels": __version__, "nvcc": _nvcc_version(),
           "cuda_runtime": torch.version.cuda or "none"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update({"gpu": props.name, "capability": f"{props.major}.{props.minor}",
                    "sm_count": props.multi_processor_count, "gpu_memory_gb": round(props.total_memory / 2**30, 1),
                    "l2_bytes": getattr(props, "L2_cache_size", None)})
        env.update(_gpu_clocks())
    else:
        env["gpu"] = "none"
    return env


# the layout torch's own call is fastest in, per dtype: B column-major for int8 (with a row-major B cuBLAS's int8 path
# ran ~7x slower on the H200 (4096^3: 1085 vs 160 us), which made every int8 kernel look faster than "peak") and the
# only one fp8 takes
PEAK_LAYOUT = {"int8": "nt", FP8: FP8_LAYOUT}


def _peak_call(dtype: str, size: int) -> tuple[Callable[[int], object], str]:
    """A large dense product of the dtype under test through torch's own function (cuBLAS's rate is our peak: what
    is achievable here), and what it is."""
    problem = problem_for(Shape(size, size, size), dtype, PEAK_LAYOUT.get(dtype, "nn"), "cuda")
    operands = make_inputs(problem, "cuda")
    fn = user_calls(problem).torch
    return (lambda i: fn(*operands)), f"{dtype} {size}^3 {ENTRY_NAMES[problem.op][1]}"


def measure_device(dtype: str, budget_ms: float = 200.0, size: int = 8192, copy_bytes: int = 1 << 30) -> DeviceFacts:
    """Peak FLOP/s (TOPS for int8) of `dtype` and device copy bandwidth, measured with kernels.timing."""
    if not torch.cuda.is_available():
        return DeviceFacts("cpu", platform.processor() or "cpu", note="no GPU: no peak or bandwidth measured")
    name = torch.cuda.get_device_name()
    call, peak_shape = _peak_call(dtype, size)
    t = measure(call, 1, "cuda", budget_ms)
    peak = 2 * size**3 / (t.median_ms * 1e-3) / 1e12
    del call
    torch.cuda.empty_cache()
    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    c = measure(lambda i: dst.copy_(src), 1, "cuda", budget_ms)
    bandwidth = 2 * copy_bytes / (c.median_ms * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return DeviceFacts("cuda", name, peak_tflops=peak, peak_shape=peak_shape,
                       bandwidth_gbs=bandwidth, copy_bytes=copy_bytes)
