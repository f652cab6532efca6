"""On the GPU: a cold problem met inside a CUDA-graph capture is served by aten (nothing tunes or verifies there),
and is tuned on the next call outside the capture."""
import pytest
import torch

import kernels


@pytest.mark.gpu
def test_a_cold_call_under_graph_capture_is_served_by_aten_then_tuned_outside():
    kernels.config.backends = ("aten", "triton")
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(256, 384, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, b, out=out)                              # cuBLAS initialised outside the capture
    graph = torch.cuda.CUDAGraph()
    tunes = kernels.stats()["tunes"]
    with torch.cuda.graph(graph):
        kernels.mm(a, b, out=out)
    assert kernels.stats()["tunes"] == tunes
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-1)
    kernels.mm(a, b)
    assert kernels.stats()["tunes"] == tunes + 1
