"""How `python -m kernels tune --gpus` starts its workers (`python -m kernels.dispatch.tune_worker`, one per GPU): their
argv, environment and logs; and starting them before this process has imported torch.

A worker takes seconds to come up (Python, torch, its CUDA context, its isolated child), and so does the command
itself (torch, the problem lists, the store). The CLI starts the workers first, from what it knows without torch (the
--gpus list, counted against the GPUs the driver lists, and the run's settings), so both start-ups overlap; once torch
is up the run adopts them only if torch numbers the same devices, and otherwise ends them and starts its own. This
module must stay free of torch: it runs before torch is imported.
"""
from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path

from kernels.core.cache_root import cache_root
from kernels.core.config import config
from kernels.core.fsutil import make_private_dirs
from kernels.core.helper_env import child_environment
from kernels.core.toolchain import REPO_ROOT
from kernels.tune import gpu_pool

WORKER = [sys.executable, "-m", "kernels.dispatch.tune_worker"]
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")      # one folder per GPU the NVIDIA driver gives this container


def worker_env(device: int, devices: int) -> dict[str, str]:
    """A worker's environment: its one GPU, this run's settings (the CLI may have changed them in this process),
    its share of the compile cores, and NVLink multicast off."""
    env = child_environment()
    env.update(gpu_pool.MULTICAST_OFF)
    env.update({"CUDA_VISIBLE_DEVICES": gpu_pool.physical_device(device, os.environ.get("CUDA_VISIBLE_DEVICES")),
                "KERNELS_BACKENDS": ",".join(config.backends), "KERNELS_CUTLASS_BUILD": config.cutlass_build,
                "KERNELS_RECORD": "", "MAX_JOBS": str(max(1, config.max_jobs // devices))})
    return env


class Launcher:
    """Starts one worker on a device: `launcher(device, events)` -> gpu_pool.Worker (the pool's `start`). Each start
    gets its own log (cache/logs/tune-gpu<device>-<run>-<n>.log, 0600): a restarted worker's death quotes its own."""

    def __init__(self, devices: list[int], argv: list[str] | None = None):
        self.devices, self.argv = devices, argv or WORKER
        self.events: queue.Queue[tuple] = queue.Queue()      # the pool reads every worker's events from it
        self.logs = cache_root() / "logs"
        make_private_dirs(self.logs)
        self.run_id = f"{os.getpid()}-{int(time.time())}"
        self.starts = 0

    def __call__(self, device: int, events: queue.Queue) -> gpu_pool.Worker:
        self.starts += 1
        return gpu_pool.Worker(device, self.argv, worker_env(device, len(self.devices)),
                               self.logs / f"tune-gpu{device}-{self.run_id}-{self.starts}.log", events,
                               cwd=str(REPO_ROOT))


def visible_count(environ: dict[str, str] | None = None, driver_gpus: Path | None = None) -> int | None:
    """How many GPUs torch will number, told without CUDA: CUDA_VISIBLE_DEVICES's entries up to the first that is
    not an index or a GPU/MIG UUID (as CUDA reads it), else the driver's GPU list; None when neither tells."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not (entry.isascii() and entry.isdigit()) and not entry.startswith(("GPU-", "MIG-")):
                break
            count += 1
        return count
    try:
        return sum(1 for p in (driver_gpus or DRIVER_GPUS).iterdir() if p.is_dir())
    except OSError:
        return None


class EarlyWorkers:
    """Workers started for a --gpus list before torch was imported, and the launcher that started them."""

    def __init__(self, devices: list[int], argv: list[str] | None = None):
        self.devices = devices
        self.launcher = Launcher(devices, argv)
        self.workers: dict[int, gpu_pool.Worker] = {}
        try:
            for device in devices:
                self.workers[device] = self.launcher(device, self.launcher.events)
        except BaseException:
            self.close()                      # the ones started before the failure (or the ^C)
            raise

    def adopt(self, devices: list[int]) -> dict[int, gpu_pool.Worker]:
        """The workers, handed to the run when torch numbers the same devices; otherwise they are ended and {}."""
        if devices != self.devices:
            self.close()
            return {}
        workers, self.workers = self.workers, {}
        return workers

    def close(self) -> None:
        """End every worker not adopted (their process groups: an isolated child too)."""
        workers, self.workers = list(self.workers.values()), {}
        gpu_pool.stop_workers(workers)
        for worker in workers:
            worker.drop_log()                  # ended unused


def start_early(gpus: str, argv: list[str] | None = None) -> EarlyWorkers | None:
    """Workers for `--gpus gpus` now, or None when what torch will see cannot be told without it (no driver list,
    no GPU), the list is bad, or a worker cannot be started (the run starts its own and names what fails)."""
    count = visible_count()
    if not count:
        return None
    try:
        return EarlyWorkers(gpu_pool.parse_gpus(gpus, count), argv)
    except (gpu_pool.GpuListError, OSError):
        return None
