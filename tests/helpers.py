"""What many test modules share and that is not a fixture: problems described without tensors, running code or a
module in a fresh interpreter, a lookup table file, the C++ table's hit count, and the split of a GPU grid into the
cases `pytest -m gpu` runs and the long sweep."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels.core.config import config
from kernels.core.problem import GemmProblem
from kernels.dispatch import api

REPO = Path(__file__).resolve().parent.parent


def eventually(condition, timeout: float = 30.0, every: float = 0.02) -> bool:
    """Whether `condition()` becomes true within `timeout` seconds, polled: for what another process or thread does
    in its own time (a fixed sleep before the assert is too short on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)
    return True


def strides(rows: int, cols: int, layout: str) -> tuple[int, int]:
    return (cols, 1) if layout == "row" else (1, rows)


def problem(m=4096, n=4096, k=4096, dtype="bf16", op=None, arch=90, la="row", lb="row", align_a=16, align_b=16,
            stride_a=None, stride_b=None) -> GemmProblem:
    """A problem on a test GPU of compute capability `arch` (CPU when 0), no tensors needed: int8 is int_mm unless
    `op` says otherwise, fp32 runs as tf32, operands row-major unless `la`/`lb` or explicit strides say otherwise."""
    op = op or ("int_mm" if dtype == "int8" else "mm")
    return GemmProblem(op=op, m=m, n=n, k=k, dtype=dtype, out_dtype="int32" if op == "int_mm" else dtype,
                       stride_a=stride_a or strides(m, k, la), stride_b=stride_b or strides(k, n, lb),
                       align_a=align_a, align_b=align_b, device="cuda" if arch else "cpu", arch=arch,
                       device_name="test", precision="tf32" if dtype == "fp32" else "")


def _child_env(env: dict | None) -> dict:
    """os.environ with the repo importable and `env` applied (entries set to None removed)."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    return full_env


def run_python(code: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter with the repo importable; env entries set to None are removed."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_child_env(env),
                          timeout=timeout, cwd=str(REPO))


def run_module(module: str, args: list[str], env: dict | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m module args...` in a fresh interpreter, as run_python."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env=_child_env(env), timeout=timeout, cwd=str(REPO))


def start_python(code: str, env: dict | None = None) -> subprocess.Popen:
    """run_python without waiting: several interpreters at once (proc.communicate(timeout=...) collects each)."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_child_env(env), cwd=str(REPO))


def gpu_grid(cases: list[tuple], representative: list[tuple]) -> list:
    """`cases` as pytest params: the `representative` ones marked `gpu` (what `pytest -m gpu` runs, one device call),
    the rest `gpu_sweep`. Every representative case must be in the grid, so the sweep is the grid's remainder."""
    missing = [c for c in representative if c not in cases]
    assert not missing, f"representative cases not in the grid: {missing}"
    return [pytest.param(*c, id="-".join(str(v).removeprefix("torch.") for v in c),
                         marks=pytest.mark.gpu if c in representative else pytest.mark.gpu_sweep) for c in cases]


def write_lut(folder: Path, entries: list[dict]) -> Path:
    """A lookup table of `entries` in `folder`, set as config.lut."""
    path = folder / "lut.json"
    path.write_text(json.dumps({"schema": "kernels-lut", "version": 1, "entries": entries}))
    config.lut = str(path)
    return path


def served(fn) -> int:
    """How many calls the C++ warm-call table served while fn ran."""
    before = api._fast.module.hits() if api._fast.module is not None else 0
    fn()
    return api._fast.module.hits() - before


def output_and_grads(fn, inputs, grad):
    """fn(*inputs) on fresh leaf copies of `inputs`, backward with `grad`: (output, [each input's grad])."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out, [t.grad for t in leaves]
