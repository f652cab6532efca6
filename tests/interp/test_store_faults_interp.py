"""A dynamic-bucket decision file whose entry has fields of the wrong types (a fault probe's plant) is a miss on a real
benchmark-mode call through the Triton interpreter: the bucket is benchmarked again and the file rewritten, never an
AttributeError in every process that reads it."""
import errno
import json
import warnings

import pytest
import torch

import backends.triton as triton_backend
import kernels
from kernels.core.config import interpret_mode
from kernels.store.buckets import entry_problem

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")

DYNAMIC = kernels.Dynamic("m", hints=(16, 32), mode="benchmark")


def _call() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(24, 40), torch.randn(40, 8)
    assert torch.allclose(kernels.mm(a, b, dynamic=DYNAMIC), a @ b, atol=1e-4)


@pytest.mark.parametrize("field,value", [("timings", []), ("edge_timings", 3), ("worst_ratio", "x"),
                                         ("measured_at", 24), ("seconds", [1])])
def test_a_bucket_decision_with_a_field_of_the_wrong_type_is_benchmarked_again(isolated_cache, field, value):
    _call()
    files = sorted((isolated_cache / "selections" / "dynamic").glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    (bucket,) = data["buckets"]
    data["buckets"][bucket][field] = value
    files[0].write_text(json.dumps(data))
    kernels.clear_memory_cache()
    before = kernels.stats()["bucket_benchmarks"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _call()
    assert kernels.stats()["bucket_benchmarks"] == before + 1
    assert entry_problem(json.loads(files[0].read_text())["buckets"][bucket]) is None      # rewritten whole


def test_a_tune_whose_candidates_failed_on_the_cache_is_not_kept_for_good(monkeypatch):
    """Triton's modules could not be written (a full disk): the tune goes on with aten, records Triton as
    unavailable, and the next cold lookup tunes again -- once the disk has room, with Triton. Before, the aten pick
    was stored and served for good."""
    kernels.config.backends = ("aten", "triton")
    kernels.config.benchmark_space = 1
    a, b = torch.randn(24, 40).half(), torch.randn(40, 16).half()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(triton_backend, "publish_module", full_disk)
        kernels.mm(a, b)
    sel = kernels.explain(a, b)
    assert sel.unavailable == ["triton"] and sel.winner == "aten_mm"
    assert any("failed on the cache" in n for n in sel.notes)
    kernels.clear_memory_cache()
    tunes = kernels.stats()["tunes"]
    kernels.mm(a, b)                                  # a new process's cold lookup: the entry is stale, tuned again
    assert kernels.stats()["tunes"] == tunes + 1
    sel = kernels.explain(a, b)
    assert sel.unavailable == [] and any(isinstance(t, float) for n, t in sel.timings.items() if n != "aten_mm")
