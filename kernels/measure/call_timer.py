"""Timing single calls made by the caller's own code (the duel on calls, kernels.dispatch.call_duel): a timer
brackets one call and later hands back its milliseconds, without ever waiting on the GPU.

On the GPU two CUDA events bracket the call on the current stream; they are read once they have completed (asked on
later calls), so the caller's host never waits for them. Off the GPU (the interpreter, CPU tensors) the host clock
brackets the call, which is synchronous there.
"""
from __future__ import annotations

import collections
import time
from typing import Protocol

import torch


class CallTimer(Protocol):
    """start() before the call, stop(token, tag) after it; done() hands back (tag, ms) of the calls whose times are
    known, each once."""

    def start(self) -> object: ...

    def stop(self, token: object, tag: int) -> None: ...

    def done(self) -> list[tuple[int, float]]: ...


class EventTimer:
    """CUDA events around a call on the current stream of device `index` (the launcher's: a warm call does not make
    its tensors' device current, so the current device's stream may be another GPU's), read when complete; spent
    events are reused (they belong to that device)."""

    def __init__(self, index: int):
        self.index = index
        self._pending: collections.deque = collections.deque()
        self._spare: list = []

    def _event(self):
        try:
            return self._spare.pop()        # atomic: two threads never get one event (the loser makes a new one)
        except IndexError:
            return torch.cuda.Event(enable_timing=True)

    def start(self) -> object:
        event = self._event()
        event.record(torch.cuda.current_stream(self.index))
        return event

    def stop(self, token: object, tag: int) -> None:
        end = self._event()
        end.record(torch.cuda.current_stream(self.index))
        self._pending.append((token, end, tag))

    def done(self) -> list[tuple[int, float]]:
        out = []
        # in order of recording: one stream completes them in that order (another stream's wait a little longer)
        while self._pending and self._pending[0][1].query():
            start, end, tag = self._pending.popleft()
            out.append((tag, start.elapsed_time(end)))
            self._spare.extend((start, end))
        return out


class HostTimer:
    """The host clock around a synchronous call (off the GPU)."""

    def __init__(self):
        self._done: list[tuple[int, float]] = []

    def start(self) -> object:
        return time.perf_counter()

    def stop(self, token: object, tag: int) -> None:
        self._done.append((tag, (time.perf_counter() - token) * 1e3))

    def done(self) -> list[tuple[int, float]]:
        out, self._done = self._done, []
        return out


def timer_for(device: str, index: int | None = None) -> CallTimer:
    """The timer for calls on `device` ("cuda" with its device index, else the host clock)."""
    return EventTimer(torch.cuda.current_device() if index is None else index) if device == "cuda" else HostTimer()


def capturing_on(index: int) -> bool:
    """Whether device `index`'s current stream is capturing a CUDA graph (the current device's, cheaply)."""
    if torch.cuda.current_device() == index:
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(index):
        return torch.cuda.is_current_stream_capturing()
