"""`python -m bench.model` end to end on CPU with a tiny model (hidden 64, intermediate 128, 4 tokens, fp32): every
(variant, M, mode) gets a JSON record, eager is the reference, and `kernels.patch`'s products reach our kernels through
the interpreter (its first call tunes them) and match eager. Its GPU numbers: issue 28's closing note."""
import json

import pytest

import kernels
from bench import model as bm
from kernels.core.config import interpret_mode

TINY = ["--hidden", "64", "--intermediate", "128", "--head-dim", "16", "--tokens", "4", "--dtype", "fp32",
        "--seconds", "0.05", "--heat", "0", "--quiet"]
FP32_TOL = 1e-4          # max|x - eager's| / max|eager's| in fp32: a different summation order, not a different answer


def _records(path) -> tuple[dict, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "run" and lines[0]["hidden"] == 64 and lines[0]["device"] == "cpu"
    return lines[0], {(r["variant"], r["tokens"], r["mode"]): r for r in lines[1:]}


@pytest.mark.skipif(not interpret_mode(), reason="runs the interpreter on CPU tensors")
def test_eager_and_patch_forward_and_backward(tmp_path, capsys):
    kernels.config.backends = ("aten", "triton")
    kernels.config.benchmark_space = 1          # the performance model's top pick per backend: 12 tunes in seconds
    path = tmp_path / "model.jsonl"
    rc = bm.main(TINY + ["--variants", "eager,patch", "--mode", "fwd,fwdbwd", "--json", str(path)])
    _, records = _records(path)
    assert set(records) == {(v, 4, m) for v in ("eager", "patch") for m in ("fwd", "fwdbwd")}
    for mode in ("fwd", "fwdbwd"):
        eager = records[("eager", 4, mode)]
        assert eager["status"] == "ok" and eager["speedup"] == 1.0 and len(eager["rounds_ms"]) == 2
        assert eager["tokens_per_s"] == pytest.approx(4 / (eager["ms"] * 1e-3))
    assert records[("eager", 4, "fwdbwd")]["grad_err"] == 0.0
    out = capsys.readouterr().out
    assert "patch" in out and "vs eager" in out
    if not hasattr(kernels, "patch"):                       # kernels.patch not on this branch yet: an error record
        assert rc == 1
        assert all("patch" in records[("patch", 4, m)]["message"] for m in ("fwd", "fwdbwd"))
        return
    assert rc == 0
    fwd, train = records[("patch", 4, "fwd")], records[("patch", 4, "fwdbwd")]
    assert fwd["status"] == train["status"] == "ok"
    assert fwd["cold_stats"].get("tunes", 0) >= 4            # qkv, o, gate/up, down: through the interpreter
    assert not fwd["loop_stats"].get("tunes") and not train["loop_stats"].get("tunes")    # warm: no tune in the loop
    assert fwd["out_err"] < FP32_TOL and train["out_err"] < FP32_TOL and train["grad_err"] < FP32_TOL
    assert train["speedup"] > 0


@pytest.mark.skipif(not interpret_mode(), reason="runs the interpreter on CPU tensors")
def test_torch_compile_beside_eager(tmp_path):
    """torch.compile's CPU backend (~27 s on 2 cores with an empty inductor cache, 5 s warm): its records and its own
    difference from eager, the yardstick for kernels'."""
    path = tmp_path / "model.jsonl"
    assert bm.main(TINY + ["--variants", "compile", "--mode", "fwd,fwdbwd", "--json", str(path)]) == 0
    _, records = _records(path)
    for mode in ("fwd", "fwdbwd"):
        comp = records[("compile", 4, mode)]
        assert comp["status"] == "ok" and comp["cold_s"] > 0 and comp["out_err"] < FP32_TOL
        assert comp["speedup"] == pytest.approx(records[("eager", 4, mode)]["ms"] / comp["ms"])
    assert records[("compile", 4, "fwdbwd")]["grad_err"] < FP32_TOL
