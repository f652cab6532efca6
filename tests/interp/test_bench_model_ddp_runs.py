"""`python -m bench.model_ddp` end to end on CPU, in a subprocess as a user runs it: two spawned ranks over gloo
train the tiny decoder stack under DDP, eager and kernels.patch, and the JSON says so; a variant that fails on every
rank is recorded while the run goes on (one rank under a torchrun-style environment); a bad --gpus is a usage error.

On CPU tensors without TRITON_INTERPRET, kernels computes with torch (its cpu fallback, counted in kernels.stats()):
these runs check the processes, the process group, the agreement between ranks and the records, not the kernels
(through the interpreter every rank would tune a dozen problems, minutes on 2 cores). The GPU run of the same command:
tests/gpu/test_multi_gpu.py."""
import json
import textwrap

import pytest
import torch

from bench.ddp_world import MULTICAST_OFF, free_port
from tests.helpers import run_module, run_python

TINY = ["--device", "cpu", "--hidden", "32", "--intermediate", "64", "--head-dim", "16", "--layers", "1",
        "--tokens", "8", "--dtype", "fp32", "--seconds", "0.05", "--rounds", "1"]
NO_INTERPRETER = {"TRITON_INTERPRET": None, "RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None}
FP32_TOL = 1e-5          # patch's products are torch's own here: equal up to a different summation order at most


def _read(path) -> tuple[dict, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "run"
    return lines[0], {r["variant"]: r for r in lines[1:]}


def test_two_cpu_ranks_train_eager_and_patch_under_ddp(tmp_path):
    path = tmp_path / "ddp.jsonl"
    proc = run_module("bench.model_ddp", TINY + ["--gpus", "2", "--json", str(path)], NO_INTERPRETER, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run, records = _read(path)
    assert (run["world_size"], run["backend"], run["launcher"], run["devices"]) == (2, "gloo", "spawn", ["cpu"] * 2)
    assert run["torch"] == torch.__version__ and run["global_tokens"] == 16
    assert run["multicast_env"] == MULTICAST_OFF
    assert set(records) == {"eager", "patch"}
    for r in records.values():
        assert r["status"] == "ok" and r["world_size"] == 2 and r["tokens"] == 8
        assert len(r["cold_s_by_rank"]) == 2 and r["cold_s"] == max(r["cold_s_by_rank"])
        assert len(r["rounds_ms"]) == 1 and r["loops_s"][0] >= 0.05
        assert r["tokens_per_s"] == pytest.approx(8 * 2 / (r["ms"] * 1e-3))
    eager, patch = records["eager"], records["patch"]
    assert eager["loss_by_rank"][0] != eager["loss_by_rank"][1]          # each rank its own input
    assert patch["loss_by_rank"] == pytest.approx(eager["loss_by_rank"], rel=FP32_TOL)
    assert patch["loss_err"] < FP32_TOL and patch["grad_err"] < FP32_TOL
    assert eager["cold_stats_by_rank"] == [{}, {}]
    # every rank's products went through kernels (torch's fallback on CPU tensors), none was tuned
    assert all(s.get("cpu_fallbacks", 0) > 0 and not s.get("tunes") for s in patch["cold_stats_by_rank"])
    assert patch["speedup"] == pytest.approx(eager["ms"] / patch["ms"])
    assert "tokens/s" in proc.stdout and "patch" in proc.stdout


BROKEN_PATCH = textwrap.dedent("""
    import sys
    import kernels
    from bench import model_ddp

    def broken(model):
        raise RuntimeError("patch is broken here")

    kernels.patch = broken
    sys.exit(model_ddp.main({argv!r}))
""")


def test_a_variant_failing_on_every_rank_is_recorded_and_the_run_goes_on(tmp_path):
    path = tmp_path / "ddp.jsonl"
    env = {**NO_INTERPRETER, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = run_python(BROKEN_PATCH.format(argv=TINY + ["--json", str(path)]), env, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    run, records = _read(path)
    assert (run["world_size"], run["launcher"]) == (1, "torchrun")
    assert records["eager"]["status"] == "ok" and len(records["eager"]["rounds_ms"]) == 1
    assert records["patch"]["status"] == "error" and records["patch"]["rounds_ms"] == []
    assert records["patch"]["message"] == "rank 0: RuntimeError: patch is broken here"


def test_bad_gpus_is_a_usage_error_naming_the_flag():
    """The exit code as a shell sees it (the other bad flags: tests/unit/test_bench_model_ddp.py, in process)."""
    proc = run_module("bench.model_ddp", ["--device", "cpu", "--gpus", "0"], NO_INTERPRETER, timeout=60)
    assert proc.returncode == 2
    assert "--gpus" in proc.stderr and "must be a positive integer" in proc.stderr
