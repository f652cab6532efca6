"""bench.model_ddp without processes: its arguments (torchrun's environment included), NVLink multicast kept off,
the timing loop's agreement between ranks (a fake side channel plays the other ranks), and the records and table from
fake figures. Its runs end to end: tests/interp/test_bench_model_ddp_runs.py (CPU), tests/gpu/test_multi_gpu.py."""
import json
import os

import pytest
import torch

from bench import ddp_world as dw
from bench import model_ddp as md
from bench import model_ddp_rank as mr
from bench import model_ddp_report as rep


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch):
    for name in dw.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def _torchrun(monkeypatch, rank="0", size="2", local="0"):
    for name, value in zip(dw.TORCHRUN_VARS, (rank, size, local)):
        monkeypatch.setenv(name, value)


# -- arguments -------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the defaults without a GPU")
def test_defaults_without_a_gpu_are_two_cpu_ranks():
    args = md.resolve([])
    assert (args.device, args.gpus, args.world) == ("cpu", md.CPU_WORLD, None)
    cpu = md.CPU_DEFAULTS       # a small layer: the GPU's ran silently for minutes on gloo (a new user's probe)
    assert args.plan == mr.DdpPlan(device="cpu", hidden=cpu["hidden"], intermediate=cpu["intermediate"],
                                   head_dim=cpu["head_dim"], tokens=cpu["tokens"])
    assert (args.plan.hidden, args.plan.intermediate, args.plan.tokens, args.plan.dtype) == (256, 688, 64, "bf16")


def test_flags_reach_the_plan():
    args = md.resolve(["--device", "cpu", "--gpus", "3", "--hidden", "64", "--head-dim", "16", "--tokens", "8",
                       "--dtype", "fp32", "--seconds", "0.5", "--rounds", "4", "--seed", "7", "--timeout", "30"])
    assert args.gpus == 3
    assert args.plan == mr.DdpPlan(64, md.CPU_DEFAULTS["intermediate"], 1, 16, 8, "fp32", "cpu", 0.5, 4, 7, 30.0)


@pytest.mark.parametrize("argv, says", [
    (["--gpus", "0"], "argument --gpus: '0': must be a positive integer"),
    (["--gpus", "-1"], "argument --gpus: '-1': must be a positive integer"),
    (["--gpus", "two"], "argument --gpus: 'two': must be a positive integer"),
    (["--tokens", "0"], "argument --tokens"), (["--tokens", "1,16"], "argument --tokens"),
    (["--hidden", "100"], "--hidden 100 is not a multiple of --head-dim 64"),
    (["--rounds", "0"], "argument --rounds"), (["--seconds", "0"], "argument --seconds"),
    (["--timeout", "-5"], "argument --timeout"), (["--dtype", "int8"], "argument --dtype"),
    (["--device", "tpu"], "argument --device")])
def test_bad_flags_are_a_usage_error_naming_the_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        md.resolve(["--device", "cpu"] + argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-GPU case")
def test_cuda_without_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        md.resolve(["--device", "cuda", "--gpus", "2"])
    assert "--device cuda: torch sees no CUDA GPU here" in capsys.readouterr().err


def test_under_torchrun_this_process_is_one_rank(monkeypatch):
    _torchrun(monkeypatch, rank="1", size="2", local="1")
    args = md.resolve(["--device", "cpu"])
    assert args.world == dw.World(1, 2, 1, "cpu", "torchrun") and args.gpus == 2
    assert args.world.backend == "gloo" and args.world.torch_device == torch.device("cpu")
    assert md.resolve(["--device", "cpu", "--gpus", "2"]).gpus == 2


@pytest.mark.parametrize("env, argv, says", [
    ({"RANK": "0"}, [], "RANK set but not WORLD_SIZE, LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, [], "must be integers"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, [], "RANK=2, LOCAL_RANK=0 do not fit WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["--gpus", "4"], "--gpus 4: torchrun started WORLD_SIZE=2")])
def test_a_torchrun_environment_that_does_not_fit_is_a_usage_error(env, argv, says, monkeypatch, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        md.resolve(["--device", "cpu"] + argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_multicast_is_kept_off_unless_the_user_chose(monkeypatch):
    for name in dw.MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert dw.keep_multicast_off() == dw.MULTICAST_OFF
    assert all(os.environ[name] == value for name, value in dw.MULTICAST_OFF.items())
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "0")          # set by the user: theirs stands
    assert dw.keep_multicast_off()["NVSHMEM_DISABLE_NVLS"] == "0"


def test_free_port_is_a_port():
    assert 0 < dw.free_port() < 65536


# -- the timing loop's agreement ------------------------------------------------------------------------------------
class FakeComm:
    """Rank 0 of a world whose other ranks answer `others(value)` at each gather (their (elapsed, error))."""

    def __init__(self, others=lambda value: []):
        self.others, self.barriers, self.gathers = others, 0, 0

    def barrier(self):
        self.barriers += 1

    def gather(self, value):
        self.gathers += 1
        return [value] + self.others(value)


def test_the_loop_runs_at_least_the_seconds_in_chunks():
    calls = []
    comm = FakeComm()
    ms, length = mr.timed_loop(lambda: calls.append(1), 0.02, "cpu", comm)
    assert length >= 0.02 and ms == pytest.approx(length * 1e3 / len(calls))
    assert comm.barriers == 1 and comm.gathers >= 2          # a first chunk of one step, then the rest sized from it


def test_the_slowest_rank_sets_the_length_and_every_rank_runs_the_same_steps():
    calls = []
    comm = FakeComm(lambda value: [(value[0] + 10.0, "")])      # rank 1's clock is always 10 s further on
    ms, length = mr.timed_loop(lambda: calls.append(1), 5.0, "cpu", comm, hint_ms=1.0)
    assert len(calls) == 5000 and comm.gathers == 1             # the hint sized one chunk; rank 1 says it was enough
    assert length >= 10.0 and ms == pytest.approx(length * 1e3 / 5000)


def test_a_step_failing_on_any_rank_ends_the_loop_on_every_rank():
    with pytest.raises(mr.LoopError, match=r"^rank 1: RuntimeError: out of memory$"):
        mr.timed_loop(lambda: None, 5.0, "cpu", FakeComm(lambda v: [(v[0], "RuntimeError: out of memory")]))

    def fail():
        raise ValueError("bad step")
    with pytest.raises(mr.LoopError, match="rank 0: ValueError: bad step"):
        mr.timed_loop(fail, 5.0, "cpu", FakeComm())


def test_the_first_error_names_its_rank():
    assert mr._first_error(["", ""]) == ""
    assert mr._first_error(["", "E: x", "E: y"]) == "rank 1: E: x (and 1 more ranks)"


# -- records and table ----------------------------------------------------------------------------------------------
def _result(variant="patch", **kw) -> rep.DdpVariantResult:
    base = dict(cold_s=12.0, cold_s_by_rank=[12.0, 11.5], rounds_ms=[10.0, 8.0, 9.0], loss_by_rank=[1.0, 1.1],
                cold_stats_by_rank=[{"tunes": 12, "compiles": 40}, {"disk_hits": 12}], loss_err=1e-3, grad_err=2e-2,
                grad_err_param="layers.0.mlp.down.weight")
    return rep.DdpVariantResult(variant, "ok", 2, 4096, **{**base, **kw})


def test_figures_are_global_over_the_ranks():
    eager, patch = _result("eager", rounds_ms=[12.0]), _result()
    mr.attach_eager([eager, patch])
    d = patch.derived()
    assert d["ms"] == 9.0 and d["tokens_per_s"] == pytest.approx(4096 * 2 / 9e-3)
    assert d["speedup"] == pytest.approx(12.0 / 9.0) and d["first_step_tunes"] == 12
    assert rep.DdpVariantResult.from_json(json.loads(json.dumps(patch.to_json()))) == patch


def test_the_table_shows_each_ranks_first_step():
    assert rep.counters_cell(_result().cold_stats_by_rank) == \
        "r0: 12 tunes, 0 disk, 40 compiles; r1: 0 tunes, 12 disk, 0 compiles"
    assert rep.counters_cell([{}, {"memory_hits": 3}]) == "-"
    row = rep.table_row(_result())
    assert row[:4] == ["patch", "2", "12.00", "12.00 / 11.50"] and "12 tunes over all ranks" in row[-1]
    failed = rep.DdpVariantResult("patch", "error", 2, 8, message="rank 1: RuntimeError: boom")
    assert rep.table_row(failed)[-1] == "error: rank 1: RuntimeError: boom" and rep.table_row(failed)[5] == "-"


def test_the_table_prints_plain_and_reads_back(tmp_path):
    run = {"kind": "run", "world_size": 2, "devices": ["NVIDIA H100", "NVIDIA H100"], "backend": "nccl",
           "launcher": "spawn", "tokens": 4096, "dtype": "bf16"}
    results = [_result("eager"), _result()]
    text = rep.plain_table(results, rep.table_title(run))
    assert text.startswith("bench.model_ddp: 2 x NVIDIA H100 (nccl, spawn)") and "tokens/s (all ranks)" in text
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [run] + [r.to_json() for r in results]))
    assert rep.read_run(str(path)) == (run, results)
