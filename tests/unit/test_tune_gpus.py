"""`python -m kernels tune --gpus`: the scheduler (kernels.tune.gpu_pool) and the run around it (kernels.tune.on_gpus)
with fake workers (tests/fake_tune_worker.py: real processes that speak the worker's protocol without a GPU), so the
distribution, a dead worker's re-queue, the shared artifact builds and a clean ^C are checked on any machine."""
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from kernels.__main__ import main
from kernels.core.config import config
from kernels.tune import gpu_pool, offline, on_gpus, worker_launch
from kernels.tune.problem_list import from_line, line_of, parse_csv, parse_jsonl
from tests.helpers import eventually

FAKE = [sys.executable, str(Path(__file__).resolve().parents[1] / "fake_tune_worker.py")]


def listed(count: int):
    rows = "\n".join(f"{16 * (i + 1)},64,32,fp16,nt" for i in range(count))
    return parse_csv("M,N,K,dtype,layout\n" + rows + "\n", "p.csv")


def tune(tmp_path, items, devices, monkeypatch, time_limit=None):
    monkeypatch.setattr(config, "backends", ("aten", "triton"))        # no CUTLASS batch before the workers
    return on_gpus.run(items, devices, lambda problem: None, time_limit, argv=FAKE + [str(tmp_path)])


def jobs_run(tmp_path) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in (tmp_path / "jobs").read_text().splitlines()]


def alive(pid: int) -> bool:
    """Running, not a zombie left for a PID 1 that does not reap (containers)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(config, "cache_dir", tmp_path / "cache")


def test_problems_spread_over_every_device_each_worker_seeing_only_its_own(tmp_path, monkeypatch):
    (tmp_path / "slow").write_text("0.2")
    report = tune(tmp_path, listed(8), [0, 1], monkeypatch)
    assert report.count(offline.TUNED) == 8 and not report.stopped
    seen = jobs_run(tmp_path)
    assert sorted(where for _, where in seen) == sorted(i.where for i in listed(8))    # each problem once
    assert {visible for visible, _ in seen} == {"0", "1"}                               # pulled by both
    assert [o.item.where for o in report.outcomes] == [i.where for i in listed(8)]     # the list's order
    assert any(line.startswith("GPU 0: ") for line in report.notes)
    assert any(line.startswith("GPU 1: ") for line in report.notes)


def test_the_run_ends_with_its_last_answer_not_with_the_workers_teardown(tmp_path, monkeypatch):
    (tmp_path / "slow-exit").write_text("60")
    start = time.monotonic()
    report = tune(tmp_path, listed(4), [0, 1], monkeypatch)
    assert report.count(offline.TUNED) == 4 and not report.stopped
    assert time.monotonic() - start < 30                    # the 60 s teardowns were ended, not waited for
    assert not list((tmp_path / "cache" / "logs").glob("tune-gpu*.log"))     # clean runs keep no log


def test_a_dead_workers_problem_goes_to_the_others_and_the_device_gets_a_fresh_worker(tmp_path, monkeypatch):
    items = listed(4)
    (tmp_path / f"die-on-{items[1].where.replace(':', '_')}").write_text("once")
    report = tune(tmp_path, items, [0, 1], monkeypatch)
    assert report.count(offline.TUNED) == 4
    assert [where for _, where in jobs_run(tmp_path)].count(items[1].where) == 2     # died once, then tuned
    assert any("died (killed by SIGKILL) while tuning problem #1: handed back" in n for n in report.notes)
    assert any("1 worker(s) died" in n for n in report.notes)


def test_a_problem_that_kills_every_worker_it_meets_fails_and_the_rest_are_tuned(tmp_path, monkeypatch):
    items = listed(3)
    (tmp_path / f"die-on-{items[0].where.replace(':', '_')}").write_text("always")
    report = tune(tmp_path, items, [0, 1], monkeypatch)
    failed = [o for o in report.outcomes if o.status == offline.FAILED]
    assert [o.item.where for o in failed] == [items[0].where]
    assert f"{gpu_pool.MAX_ATTEMPTS} workers died on it" in failed[0].reason
    assert report.count(offline.TUNED) == 2


def test_one_device_whose_workers_keep_dying_leaves_the_rest_to_report(tmp_path, monkeypatch):
    items = listed(1)
    (tmp_path / f"die-on-{items[0].where.replace(':', '_')}").write_text("always")
    report = tune(tmp_path, items, [0], monkeypatch)
    assert report.count(offline.FAILED) == 1


def test_an_artifact_two_workers_need_at_once_is_built_once(tmp_path, monkeypatch):
    (tmp_path / "artifacts").write_text("k1 k2 k3")
    report = tune(tmp_path, listed(2), [0, 1], monkeypatch)
    assert report.count(offline.TUNED) == 2
    assert {v for v, _ in jobs_run(tmp_path)} == {"0", "1"}
    assert sorted((tmp_path / "builds").read_text().split()) == ["k1", "k2", "k3"]


def test_ctrl_c_stops_every_worker_and_its_children_and_reports_what_was_left(tmp_path, monkeypatch):
    (tmp_path / "slow").write_text("0.5")
    (tmp_path / "grandchild").write_text("")
    started: list[gpu_pool.Worker] = []
    monkeypatch.setattr(config, "backends", ("aten", "triton"))

    def start(device, events):
        worker = gpu_pool.Worker(device, FAKE + [str(tmp_path)], worker_launch.worker_env(device, 2),
                                 tmp_path / f"w{device}.log", events)
        started.append(worker)
        return worker

    answers = []

    def interrupt(result):
        answers.append(result)
        if len(answers) == 1:
            raise KeyboardInterrupt             # ^C arrives with the first answer

    pool = gpu_pool.Pool([0, 1], start, on_result=interrupt)
    items = listed(6)
    out = pool.run({i: {"line": line_of(item), "where": item.where} for i, item in enumerate(items)})
    assert pool.stopped == "interrupted"
    assert sum(1 for r in out.values() if r.left == "interrupted") >= 4
    assert eventually(lambda: all(w.proc.poll() is not None for w in started))
    for pid in map(int, (tmp_path / "grandchildren").read_text().split()):
        assert eventually(lambda: not alive(pid))     # the worker's own children went with its process group


def test_workers_that_cannot_start_blame_their_device_not_the_problems(tmp_path, monkeypatch):
    (tmp_path / "no-start").write_text("")
    report = tune(tmp_path, listed(3), [0, 1], monkeypatch)
    assert report.count(offline.LEFT) == 3 and report.count(offline.FAILED) == 0
    assert report.stopped == "every worker died"
    assert any("before it was ready" in n for n in report.notes)


def test_a_worker_never_ready_is_killed_as_hung(tmp_path, monkeypatch):
    (tmp_path / "no-ready").write_text("")
    monkeypatch.setattr(gpu_pool, "READY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(gpu_pool, "RESTARTS", 0)
    start = time.perf_counter()
    report = tune(tmp_path, listed(2), [0], monkeypatch)
    assert time.perf_counter() - start < 30
    assert report.count(offline.LEFT) == 2
    assert any("not ready after 1 s: killed" in n for n in report.notes)
    assert len(list((tmp_path / "cache" / "logs").glob("tune-gpu0-*.log"))) == 1    # why it never came up


def test_a_worker_hung_on_a_problem_is_killed_and_the_problem_handed_back(tmp_path, monkeypatch):
    items = listed(3)
    (tmp_path / f"hang-on-{items[0].where.replace(':', '_')}").write_text("")
    monkeypatch.setattr(gpu_pool, "JOB_TIMEOUT_S", 1.0)
    report = tune(tmp_path, items, [0, 1], monkeypatch)
    assert report.count(offline.TUNED) == 3
    assert any("no answer after 1 s on one problem: killed" in n for n in report.notes)
    assert any("handed back to the queue" in n for n in report.notes)


def test_an_error_in_the_caller_stops_every_worker_and_propagates(tmp_path, monkeypatch):
    (tmp_path / "slow").write_text("0.3")
    started: list[gpu_pool.Worker] = []

    def start(device, events):
        started.append(gpu_pool.Worker(device, FAKE + [str(tmp_path)], worker_launch.worker_env(device, 2),
                                       tmp_path / f"w{device}.log", events))
        return started[-1]

    def broken(result):
        raise RuntimeError("the report cannot be written")

    items = listed(4)
    with pytest.raises(RuntimeError, match="cannot be written"):
        gpu_pool.Pool([0, 1], start, on_result=broken).run(
            {i: {"line": line_of(item), "where": item.where} for i, item in enumerate(items)})
    assert eventually(lambda: all(w.proc.poll() is not None for w in started))


def test_time_limit_hands_out_nothing_new_and_leaves_the_rest(tmp_path, monkeypatch):
    # the limit counts from the run's start, the worker's too: 2 s leaves a loaded machine time to start it, and six
    # problems of 1.5 s each cannot all start within it
    (tmp_path / "slow").write_text("1.5")
    report = tune(tmp_path, listed(6), [0], monkeypatch, time_limit=2.0)
    assert 1 <= report.count(offline.TUNED) < 6
    assert report.count(offline.LEFT) == 6 - report.count(offline.TUNED)
    assert report.stopped == "--time-limit 2 s reached"


def test_the_worker_environment_pins_one_device_and_turns_multicast_off(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc,5")
    monkeypatch.setattr(config, "max_jobs", 16)
    env = worker_launch.worker_env(1, 2)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-abc"
    assert env["MAX_JOBS"] == "8"
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == \
        ("0", "1", "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert worker_launch.worker_env(1, 2)["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("text,count,message", [
    ("\u00b2", 2, "is not a device index"),
    ("all", 0, "no GPU visible"),
    ("0,2", 2, "device 2 does not exist; this host has 2 visible GPU(s): 0..1"),
    ("0,0", 2, "device 0 is listed twice"),
    ("x", 2, "'x' is not a device index"),
    ("", 2, "'' is not a device index"),
])
def test_bad_gpu_lists_are_named(text, count, message):
    with pytest.raises(gpu_pool.GpuListError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gpu_pool.parse_gpus(text, count)


def test_gpu_lists():
    assert gpu_pool.parse_gpus("all", 4) == [0, 1, 2, 3]
    assert gpu_pool.parse_gpus("2, 0", 4) == [2, 0]


def test_a_host_mixing_gpu_models_is_refused():
    models = {0: (90, "NVIDIA H100"), 1: (80, "NVIDIA A100")}
    with pytest.raises(gpu_pool.GpuListError, match="different models"):
        on_gpus.same_model([0, 1], models.get)
    assert on_gpus.same_model([0], models.get) == ("cuda", 90, "NVIDIA H100")


def test_a_problem_travels_to_a_worker_as_one_trace_line_unchanged():
    item = parse_csv("M,N,K,dtype,layout,bias,activation\n64,48,32,fp16,nt,1,gelu\n", "p.csv")[0]
    assert from_line(line_of(item), item.where) == item
    dyn = parse_jsonl(line_of(item), "t.jsonl")[0]
    assert dyn.problem == item.problem


def test_the_cli_refuses_gpus_without_a_gpu(tmp_path, capsys, monkeypatch):
    path = tmp_path / "p.csv"
    path.write_text("M,N,K,dtype,layout\n64,48,32,fp16,nt\n")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)          # no worker started before torch either
    monkeypatch.setattr(worker_launch, "DRIVER_GPUS", tmp_path / "no-driver")
    monkeypatch.setenv("TRITON_INTERPRET", "1")          # the CPU target: tune would run, but --gpus finds none
    code = main(["tune", str(path), "--gpus", "0"])
    assert code == 2 and "--gpus 0: no GPU visible" in capsys.readouterr().err


SIGTERMED = """
import json, sys
from pathlib import Path
from kernels.tune import gpu_pool, worker_launch
from kernels.tune.problem_list import line_of, parse_csv
from tests.unit.test_tune_gpus import FAKE
base = Path(sys.argv[1])
rows = "\\n".join(f"{16 * (i + 1)},64,32,fp16,nt" for i in range(6))
items = parse_csv("M,N,K,dtype,layout\\n" + rows + "\\n", "p.csv")
def start(device, events):
    env = worker_launch.worker_env(device, 2)
    w = gpu_pool.Worker(device, FAKE + [str(base)], env, base / f"w{device}.log", events)
    with open(base / "workers", "a") as f:
        f.write(f"{w.proc.pid}\\n")
    return w
pool = gpu_pool.Pool([0, 1], start)
with gpu_pool.terminations_as_interrupt():
    out = pool.run({i: {"line": line_of(it), "where": it.where} for i, it in enumerate(items)})
print(json.dumps({"stopped": pool.stopped, "left": sum(1 for r in out.values() if r.left)}))
"""


def test_sigterm_to_the_run_ends_every_worker_like_ctrl_c(tmp_path):
    import subprocess
    (tmp_path / "slow").write_text("2")
    proc = subprocess.Popen([sys.executable, "-c", SIGTERMED, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=str(Path(__file__).resolve().parents[2]))
    eventually(lambda: (tmp_path / "jobs").exists(), timeout=60, every=0.1)
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert '"stopped": "interrupted"' in out
    for pid in map(int, (tmp_path / "workers").read_text().split()):
        assert eventually(lambda: not alive(pid))
