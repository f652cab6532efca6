"""The process group of a data-parallel bench run: which rank this process is (torchrun's environment, or one of the
processes this command spawns), the process group and a CPU side channel, and NVLink multicast kept off.

Why multicast off: NCCL's NVLS (NVLink SHARP) and torch's symmetric-memory multicast can take the host's GPUs out of
service on the lent multi-GPU machines, so every process that may start NCCL gets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (setdefault: a value the user exported wins) before
the process group exists; spawned processes inherit them, and set them again themselves.

Why a CPU side channel: barriers around timing windows, and the ranks' agreement on how long a loop ran or whether a
step failed, go through a gloo group of their own, never through the NCCL stream that carries the gradients (a
control message would queue behind the step's all-reduces, and a mismatched one would pair with a gradient's)."""
from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class WorldError(ValueError):
    """An environment that names no consistent rank (a torchrun variable missing or out of range)."""


def keep_multicast_off() -> dict[str, str]:
    """Set the three variables unless already set; returns their values now (for the run header)."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in MULTICAST_OFF}


@dataclass(frozen=True)
class World:
    """One rank's place: its global rank, the world size, its GPU index on this host, and how it was started."""
    rank: int
    size: int
    local_rank: int
    device: str                  # "cuda" | "cpu"
    launcher: str                # "torchrun" | "spawn"

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.device == "cuda" else torch.device("cpu")


def torchrun_world(device: str) -> World | None:
    """This process's rank when torchrun (or any launcher setting RANK, WORLD_SIZE and LOCAL_RANK) started it, else
    None; WorldError when only some of the three are set or they do not fit together."""
    present = [name for name in TORCHRUN_VARS if name in os.environ]
    if not present:
        return None
    if len(present) != len(TORCHRUN_VARS):
        missing = [name for name in TORCHRUN_VARS if name not in os.environ]
        raise WorldError(f"{', '.join(present)} set but not {', '.join(missing)}: run under torchrun, or unset them")
    try:
        rank, size, local = (int(os.environ[name]) for name in TORCHRUN_VARS)
    except ValueError:
        raise WorldError(f"RANK, WORLD_SIZE, LOCAL_RANK must be integers, got "
                         f"{[os.environ[n] for n in TORCHRUN_VARS]}") from None
    if not (size >= 1 and 0 <= rank < size and 0 <= local < size):
        raise WorldError(f"RANK={rank}, LOCAL_RANK={local} do not fit WORLD_SIZE={size}")
    return World(rank, size, local, device, "torchrun")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick; taken back at once, so another process could take it first:
    rank 0's store then fails to bind, which is an error, not a hang)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(entry: Callable, size: int, args: tuple) -> None:
    """`entry(index, *args)` in `size` new processes on this host, rendezvous on 127.0.0.1 at a free port; returns
    when every one has ended. One that raises or dies ends the others (torch.multiprocessing's join terminates them)
    and raises here."""
    keep_multicast_off()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    mp.spawn(entry, args=args, nprocs=size, join=True)     # children inherit os.environ as it is now


@dataclass
class Comm:
    """The ranks' side channel (a gloo group): barriers and agreement, never on a GPU stream."""
    group: object
    size: int

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def gather(self, value) -> list:
        """Every rank's `value` (picklable), in rank order, on every rank."""
        out: list = [None] * self.size
        dist.all_gather_object(out, value, group=self.group)
        return out


def init(world: World, timeout: datetime.timedelta) -> Comm:
    """The default process group (NCCL on CUDA, gloo on CPU) and the side channel, both failing after `timeout` at
    a collective some rank never reaches (a rank that raised): the run ends rather than hangs."""
    keep_multicast_off()
    if world.device == "cuda":
        torch.cuda.set_device(world.local_rank)          # before NCCL starts: each rank's communicator on its GPU
    dist.init_process_group(world.backend, rank=world.rank, world_size=world.size, timeout=timeout)
    group = dist.new_group(backend="gloo", timeout=timeout) if world.backend != "gloo" else dist.group.WORLD
    return Comm(group, world.size)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
