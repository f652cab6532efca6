"""The fused blocks' kernels compiled for sm90 without a GPU, through backends.fused_triton.binary (the path their
GPU launches compile by), in a child process: this one runs the Triton interpreter, whose kernels do not compile."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CHILD = r"""
import json, re
import torch
from triton.backends.compiler import GPUTarget
from backends import fused_triton as ft

target = GPUTarget("cuda", 90, 32)
bf16 = torch.bfloat16
base = torch.randn(64, 4096 + 16, dtype=bf16)
w = torch.ones(4096, dtype=bf16)


def norm_args(x):
    return (x, w, torch.empty(64, 4096, dtype=bf16), torch.empty(64), x.stride(0), 4096, 4096, 1e-6)


g = torch.randn(8, 1024, dtype=bf16)
cases = {
    "rmsnorm_forward": (ft.RMSNORM_FORWARD, norm_args(base[:, :4096]), (4096, True), 8),
    "rmsnorm_forward_misaligned": (ft.RMSNORM_FORWARD, norm_args(base[:, 1:4097]), (4096, False), 8),
    "rmsnorm_backward": (ft.RMSNORM_BACKWARD, (base[:, :4096], base[:, :4096], w, torch.empty(64),
                                               torch.empty(64, 4096, dtype=bf16), torch.zeros(4, 4096),
                                               4096 + 16, 4096 + 16, 4096, 64, 4096, 16), (4096,), 8),
    "swiglu_forward": (ft.SWIGLU_FORWARD, (g, g, torch.empty_like(g), g.numel()), (1024,), 4),
    "swiglu_backward": (ft.SWIGLU_BACKWARD, (g, g, g, torch.empty_like(g), torch.empty_like(g), g.numel()), (1024,), 4),
}
found = {}
for name, (kernel, args, consts, warps) in cases.items():
    compiled = ft.binary(kernel, args, consts, warps, target)
    ptx = compiled.asm["ptx"]
    found[name] = {"warps": compiled.metadata.num_warps, "cubin": len(compiled.asm["cubin"]),
                   "scalar_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.b16", ptx)),
                   "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v\d", ptx))}
print(json.dumps(found))
"""


def test_fused_kernels_compile_for_sm90_and_vectorise_only_what_is_aligned(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["KERNELS_CACHE_DIR"] = str(tmp_path / "kernels")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(found) == {"rmsnorm_forward", "rmsnorm_forward_misaligned", "rmsnorm_backward", "swiglu_forward",
                          "swiglu_backward"}
    assert all(f["cubin"] > 0 for f in found.values())
    assert found["rmsnorm_forward"]["warps"] == 8 and found["swiglu_forward"]["warps"] == 4
    # x's rows 16-byte aligned: read in vectors; 2 bytes off: element by element
    assert found["rmsnorm_forward"]["scalar_loads"] == 0
    assert found["rmsnorm_forward_misaligned"]["scalar_loads"] > 0
    assert found["swiglu_forward"]["vector_loads"] > 0
