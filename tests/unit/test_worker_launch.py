"""`python -m kernels tune --gpus` starts its workers before it imports torch (kernels.tune.worker_launch): the GPU
count it can tell without CUDA, the run adopting those workers when torch numbers the same devices, ending them
otherwise, and the CLI leaving none behind when the run stops early. Fake workers (tests/fake_tune_worker.py)."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kernels.__main__ import main
from kernels.core.config import config
from kernels.tune import offline, on_gpus, worker_launch
from tests.helpers import REPO
from tests.unit.test_tune_gpus import FAKE, alive, jobs_run, listed


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(config, "cache_dir", tmp_path / "cache")
    monkeypatch.setattr(config, "backends", ("aten", "triton"))        # no CUTLASS batch before the workers


def driver_list(tmp_path, gpus: int):
    folder = tmp_path / "driver_gpus"
    for i in range(gpus):
        (folder / f"0000:{i:02x}:00.0").mkdir(parents=True)
    (folder / "not-a-gpu-folder.txt").parent.mkdir(parents=True, exist_ok=True)
    (folder / "not-a-gpu-folder.txt").write_text("")
    return folder


@pytest.mark.parametrize("visible, count", [("0,1,2", 3), ("2", 1), ("", 0), ("1,-1,2", 1), ("GPU-aa,GPU-bb", 2),
                                            ("MIG-x", 1), (" 3 , 5 ", 2), ("0,abc,1", 1)])
def test_the_gpu_count_is_read_from_cuda_visible_devices_as_cuda_reads_it(visible, count, tmp_path):
    assert worker_launch.visible_count({"CUDA_VISIBLE_DEVICES": visible}, tmp_path / "none") == count


def test_without_cuda_visible_devices_the_drivers_gpu_list_is_counted(tmp_path):
    assert worker_launch.visible_count({}, driver_list(tmp_path, 3)) == 3
    assert worker_launch.visible_count({}, tmp_path / "no-driver") is None


def test_no_workers_start_early_when_the_count_or_the_list_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(worker_launch, "DRIVER_GPUS", tmp_path / "no-driver")
    assert worker_launch.start_early("all", FAKE + [str(tmp_path)]) is None
    monkeypatch.setattr(worker_launch, "DRIVER_GPUS", driver_list(tmp_path, 2))
    assert worker_launch.start_early("0,7", FAKE + [str(tmp_path)]) is None     # the run names the bad index


def test_the_run_adopts_the_workers_started_early(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(worker_launch, "DRIVER_GPUS", driver_list(tmp_path, 2))
    (tmp_path / "slow").write_text("0.5")
    early = worker_launch.start_early("all", FAKE + [str(tmp_path)])
    assert early is not None and early.devices == [0, 1]
    pids = {w.proc.pid for w in early.workers.values()}
    report = on_gpus.run(listed(6), [0, 1], lambda problem: None, early=early)
    assert report.count(offline.TUNED) == 6 and not report.stopped
    assert early.launcher.starts == 2                         # no worker started after torch
    assert {v for v, _ in jobs_run(tmp_path)} == {"0", "1"}
    assert not any("started again" in n for n in report.notes)
    assert not any(alive(pid) for pid in pids)


def test_workers_started_for_other_devices_are_ended_and_the_run_starts_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(worker_launch, "DRIVER_GPUS", driver_list(tmp_path, 3))
    (tmp_path / "slow").write_text("0.5")
    early = worker_launch.start_early("all", FAKE + [str(tmp_path)])
    early_pids = [w.proc.pid for w in early.workers.values()]
    report = on_gpus.run(listed(4), [0, 1], lambda problem: None, argv=FAKE + [str(tmp_path)], early=early)
    assert report.count(offline.TUNED) == 4
    assert any("for GPUs [0, 1, 2], torch numbers [0, 1]: started again" in n for n in report.notes)
    assert not any(alive(pid) for pid in early_pids)
    assert {v for v, _ in jobs_run(tmp_path)} == {"0", "1"}


def test_workers_are_ended_when_nothing_is_left_to_tune(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(worker_launch, "DRIVER_GPUS", driver_list(tmp_path, 2))
    early = worker_launch.start_early("all", FAKE + [str(tmp_path)])
    pids = [w.proc.pid for w in early.workers.values()]
    stored = SimpleNamespace(pending=[])
    report = on_gpus.run(listed(2), [0, 1], lambda problem: stored, early=early)    # the store has them all
    assert report.count(offline.IN_STORE) == 2
    assert not any(alive(pid) for pid in pids)
    assert not list((tmp_path / "cache" / "logs").glob("tune-gpu*.log"))


@pytest.fixture
def spied_cli(tmp_path, monkeypatch):
    """The CLI's early start with fake workers on a fake two-GPU driver list; yields the pids it started."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(worker_launch, "DRIVER_GPUS", driver_list(tmp_path, 2))
    monkeypatch.setattr(worker_launch, "WORKER", FAKE + [str(tmp_path)])
    started: list[int] = []
    real = worker_launch.EarlyWorkers.__init__

    def spy(self, devices, argv=None):
        real(self, devices, argv)
        started.extend(w.proc.pid for w in self.workers.values())
    monkeypatch.setattr(worker_launch.EarlyWorkers, "__init__", spy)
    return started


def test_the_cli_ends_its_early_workers_when_the_list_is_empty(tmp_path, spied_cli, capsys):
    path = tmp_path / "p.csv"
    path.write_text("M,N,K,dtype,layout\n")
    assert main(["tune", str(path), "--gpus", "all"]) == 2
    assert "no problems listed" in capsys.readouterr().err
    assert len(spied_cli) == 2 and not any(alive(pid) for pid in spied_cli)
    assert not list((tmp_path / "cache" / "logs").glob("tune-gpu*.log"))


def test_the_cli_ends_its_early_workers_when_there_is_no_gpu(tmp_path, spied_cli, monkeypatch, capsys):
    """On CPU the command stops at "no GPU"; the workers it started before torch must not outlive it."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = tmp_path / "p.csv"
    path.write_text("M,N,K,dtype,layout\n64,48,32,fp16,nt\n")
    assert main(["tune", str(path), "--gpus", "all"]) == 2
    assert "no GPU here" in capsys.readouterr().err
    assert len(spied_cli) == 2 and not any(alive(pid) for pid in spied_cli)


@pytest.mark.parametrize("argv", [["tune", "missing.csv", "--gpus", "all"],
                                  ["tune", "{p}", "--gpus", "all", "--dry-run"],
                                  ["tune", "{p}", "--gpus", "all", "--time-limit", "0"], ["tune", "{p}", "--dry-run"]])
def test_no_workers_start_early_for_a_run_that_cannot_use_them(argv, tmp_path, spied_cli, capsys):
    path = tmp_path / "p.csv"
    path.write_text("M,N,K,dtype,layout\n64,48,32,fp16,nt\n")
    main([a.replace("{p}", str(path)) for a in argv])
    assert spied_cli == []


EARLY = """
import sys
from pathlib import Path
from kernels import __main__ as cli
from kernels.tune import worker_launch
base = Path(sys.argv[1])
worker_launch.DRIVER_GPUS = base / "driver_gpus"
worker_launch.WORKER = [sys.executable, sys.argv[2], str(base)]
real = worker_launch.EarlyWorkers.__init__
def spy(self, devices, argv=None):
    print("torch loaded when the workers started:", "torch" in sys.modules, flush=True)
    real(self, devices, argv)
worker_launch.EarlyWorkers.__init__ = spy
sys.exit(cli.main(["tune", str(base / "p.csv"), "--gpus", "all", "--backends", "aten,triton"]))
"""


def test_the_cli_starts_the_workers_before_it_loads_torch(tmp_path):
    driver_list(tmp_path, 2)
    (tmp_path / "p.csv").write_text("M,N,K,dtype,layout\n64,48,32,fp16,nt\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["KERNELS_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", EARLY, str(tmp_path), FAKE[1]], capture_output=True, text=True,
                         timeout=300, cwd=str(REPO), env=env)
    assert "torch loaded when the workers started: False" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("module", ["kernels.__main__", "kernels.tune.worker_launch", "kernels.dispatch.tune_worker",
                                    "backends.child_handle"])
def test_what_starts_workers_and_children_before_torch_is_free_of_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
