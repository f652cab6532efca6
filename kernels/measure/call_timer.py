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
    known, each once; waiting() counts those still pending."""

    def start(self) -> object: ...

    def stop(self, token: object, tag: int) -> None: ...

    def done(self) -> list[tuple[int, float]]: ...

    def waiting(self) -> int: ...


class EventTimer:
    """CUDA events around a call on the current stream, read when complete; spent events are reused."""

    def __init__(self):
        self._pending: collections.deque = collections.deque()
        self._spare: list = []

    def _event(self):
        return self._spare.pop() if self._spare else torch.cuda.Event(enable_timing=True)

    def start(self) -> object:
        event = self._event()
        event.record()
        return event

    def stop(self, token: object, tag: int) -> None:
        end = self._event()
        end.record()
        self._pending.append((token, end, tag))

    def done(self) -> list[tuple[int, float]]:
        out = []
        # in order of recording: one stream completes them in that order (another stream's wait a little longer)
        while self._pending and self._pending[0][1].query():
            start, end, tag = self._pending.popleft()
            out.append((tag, start.elapsed_time(end)))
            self._spare += (start, end)
        return out

    def waiting(self) -> int:
        return len(self._pending)


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

    def waiting(self) -> int:
        return 0


def timer_for(device: str) -> CallTimer:
    return EventTimer() if device == "cuda" else HostTimer()
