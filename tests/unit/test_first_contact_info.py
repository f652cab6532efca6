"""`python -m kernels info` says why each backend is or is not available in words true on this machine: padded is
asked about the unaligned problems it exists for, CUTLASS without a GPU says whether it can still compile."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.commands import _backend_status, info_lines
from kernels.core.problem import probe_problem
from kernels.core.config import interpret_mode
from kernels.core.toolchain import resolve
from tests.helpers import REPO

no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU wording")


def _backend_lines() -> dict[str, str]:
    return {ln.split()[0]: ln.split(None, 1)[1] for ln in info_lines() if ln.startswith("  ") and ln.split()}


def test_padded_is_described_by_what_it_is_for_not_by_the_aligned_probe():
    line = _backend_lines()["padded"]
    assert line.startswith("available: pads operands whose rows are not 16-byte aligned")
    assert "already" not in line


@no_gpu_only
def test_cutlass_without_a_gpu_says_whether_it_can_compile():
    tools = resolve()
    line = _backend_lines()["cutlass"]
    assert "needs CUDA tensors" not in line and "need CUDA tensors" not in line
    if tools.usable and shutil.which("ninja"):
        assert line == "no GPU: compile-only (nvcc and CUTLASS headers found; builds for sm90, runs nothing)"
    else:
        assert line.startswith("unavailable: no GPU, and cannot compile for one either: ")


@no_gpu_only
def test_cutlass_without_a_gpu_or_a_toolchain_gives_the_toolchain_reason():
    class NoToolchain:
        name = "cutlass"

        def available(self, problem):
            assert problem.device == "cuda" and problem.arch == 90      # asked about what a GPU would build
            return False, "nvcc not found (set CUDA_HOME or put nvcc on PATH)"

    status = _backend_status(NoToolchain(), probe_problem(0, "cpu"))
    assert status == "unavailable: no GPU, and cannot compile for one either: nvcc not found (set CUDA_HOME or " \
                     "put nvcc on PATH)"


@no_gpu_only
def test_triton_without_a_gpu_names_the_interpreter():
    line = _backend_lines()["triton"]
    if interpret_mode():
        assert line.startswith("available through the Triton interpreter (TRITON_INTERPRET=1)") and "bf16" in line
    else:
        assert line.startswith("no GPU: Triton runs only through its interpreter")


@no_gpu_only
def test_info_command_without_the_interpreter_set():
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    res = subprocess.run([sys.executable, "-m", "kernels", "info"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln.startswith("  ") and ln.split()}
    assert "TRITON_INTERPRET=1 turns on" in lines["triton"]
    assert lines["aten"].split() == ["aten", "available"]
