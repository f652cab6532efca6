"""`kernels tune --gpus`'s real worker (`python -m kernels.dispatch.tune_worker`) through the interpreter: the parent
hands it problems as trace lines, it tunes them exactly as the one-process run does and answers with their
selections; what it stored is what the parent's next run finds (skipped as in the store)."""
import pytest

from kernels.core.config import config, interpret_mode
from kernels.dispatch import record
from kernels.tune import offline, on_gpus
from kernels.tune.problem_list import parse_csv, retarget

needs_interp = pytest.mark.skipif(not interpret_mode(), reason="exercised through the interpreter on CPU")


@needs_interp
def test_the_real_worker_tunes_what_it_is_handed_into_the_shared_store(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KERNELS_PRESET", "fast")          # the worker's benchmark space: a handful of candidates
    monkeypatch.setattr(config, "cache_dir", tmp_path / "cache")
    monkeypatch.setattr(config, "backends", ("aten", "triton"))
    items = retarget(parse_csv("M,N,K,dtype,layout,bias,activation\n24,16,40,fp16,nt,,\n8,8,16,fp32,nn,1,relu\n",
                               "p.csv"), *offline.target())
    report = on_gpus.run(items, [0], record.stored)
    assert [o.status for o in report.outcomes] == [offline.TUNED] * 2, offline.summary(report)
    for outcome, item in zip(report.outcomes, items):
        assert outcome.selection.problem == item.problem and outcome.selection.source == "GPU 0"
        assert outcome.selection.winner in outcome.selection.choices
    again = on_gpus.run(items, [0], record.stored)
    assert [o.status for o in again.outcomes] == [offline.IN_STORE] * 2
