"""Progress of a bench run on stderr: a bar over the shapes with the current step (rich's when rich is installed,
`pip install "kernels[progress]"`; a one-line counter otherwise), shown only when stderr is a terminal. Notes (device
facts, builds, errors, files written) are lines that stay, printed whether or not stderr is a terminal."""
from __future__ import annotations

import sys
import time
from typing import TextIO

from kernels.core.progress import held_by_caller


class RunProgress:
    """Use as a context manager around the per-shape loop: `step(text)` says what runs now, `advance()` ends a
    shape, `note(text)` prints a line above the bar. `quiet` silences everything."""

    def __init__(self, total: int, quiet: bool = False, stream: TextIO | None = None, bar: bool | None = None):
        self.total = total
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.bar = (not quiet and self.stream.isatty()) if bar is None else (bar and not quiet)
        self.start = time.perf_counter()
        self.done = 0
        self._rich = None          # (Progress, task id) while a rich bar is live
        self._plain_width = 0      # characters of the plain counter line now on screen
        self._hold = None          # while the bar is shown, tuning's own status line stays off the terminal

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __enter__(self) -> "RunProgress":
        if self.bar:
            self._hold = held_by_caller()
            self._hold.__enter__()
            self._rich = _rich_bar(self.stream, self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self._hold is not None:
            self._hold.__exit__(*exc)
            self._hold = None
        if self._rich is not None:
            self._rich[0].stop()
            self._rich = None
        elif self._plain_width:
            self.stream.write("\r" + " " * self._plain_width + "\r")
            self.stream.flush()
            self._plain_width = 0

    def step(self, text: str) -> None:
        if not self.bar:
            return
        if self._rich is not None:
            progress, task = self._rich
            progress.update(task, description=text)
        else:
            self._plain(text)

    def advance(self) -> None:
        self.done += 1
        if self._rich is not None:
            progress, task = self._rich
            progress.update(task, completed=self.done)
        elif self.bar:
            self._plain("")

    def note(self, text: str) -> None:
        if self.quiet:
            return
        line = f"[{self.elapsed:7.1f}s] {text}"
        if self._rich is not None:
            self._rich[0].console.print(line, markup=False, highlight=False, soft_wrap=True)
            return
        if self._plain_width:
            self.stream.write("\r" + " " * self._plain_width + "\r")
            self._plain_width = 0
        print(line, file=self.stream, flush=True)

    def _plain(self, text: str) -> None:
        line = f"{self.done}/{self.total} shapes  {self.elapsed:5.0f} s  {text}"
        self.stream.write("\r" + line.ljust(self._plain_width))
        self.stream.flush()
        self._plain_width = max(self._plain_width, len(line))


def _rich_bar(stream: TextIO, total: int):
    """A started rich Progress on `stream` and its task, or None when rich is not installed (the plain counter)."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    progress = Progress(BarColumn(), MofNCompleteColumn(), TextColumn("shapes"), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=Console(file=stream), transient=True)
    task = progress.add_task("", total=total)
    progress.start()
    return progress, task
