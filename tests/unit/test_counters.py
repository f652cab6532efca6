"""kernels.core.counters: the snapshot carries each reason beside its total, and reset clears both."""
from kernels.core import counters


def test_reasons_and_totals_are_snapshotted_and_reset(monkeypatch):
    monkeypatch.setattr(counters, "_stats", counters.Stats())
    monkeypatch.setattr(counters, "_reasons", {})
    monkeypatch.setattr(counters, "_declined", {})
    counters.passthrough("dtype=float64")
    counters.fused_declined("rmsnorm:differs")
    counters.fused_declined("rmsnorm:differs")
    counters.fused_declined("gated_mlp:failed:RuntimeError")
    counters.bump("fused_blocks", 3)
    snap = counters.snapshot()
    assert snap["passthroughs"] == 1 and snap["passthrough:dtype=float64"] == 1
    assert snap["fused_blocks"] == 3 and snap["fused_declined"] == 3
    assert snap["fused_declined:rmsnorm:differs"] == 2 and snap["fused_declined:gated_mlp:failed:RuntimeError"] == 1
    counters.reset()
    snap = counters.snapshot()
    assert snap["fused_declined"] == 0 and not any(k.startswith(("fused_declined:", "passthrough:")) for k in snap)
