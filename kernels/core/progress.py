"""Progress on long work (a problem's tune: building, verifying and timing its candidates; CUTLASS builds): one
transient status line on stderr, through rich (the `progress` extra), shown only when stderr is a terminal; a
program whose stderr goes to a file or a pipe sees nothing."""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

_held = [0]       # > 0 while a caller (bench's bar over its shapes) owns the terminal's progress line


def _quiet(_what) -> None:
    pass


@contextlib.contextmanager
def held_by_caller() -> Iterator[None]:
    """A caller drawing its own progress (bench.compare's bar) keeps tuning's status line off the terminal meanwhile:
    two live displays on one line overwrite each other."""
    _held[0] += 1
    try:
        yield
    finally:
        _held[0] -= 1


def shown() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):       # replaced or closed stderr
        return False


@contextlib.contextmanager
def status(text: str) -> Iterator[Callable[[str], None]]:
    """A status line while the block runs; yields update(text). Quiet off a terminal or without rich."""
    if _held[0] or not shown():
        yield _quiet
        return
    try:
        from rich.console import Console
    except ImportError:
        yield _quiet
        return
    with Console(stderr=True).status(text) as line:
        yield lambda new: line.update(new)


@contextlib.contextmanager
def bar(total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A bar over `total` items of long work (`python -m kernels warmup`'s compiles) while the block runs; yields
    advance_to(done). On a terminal only: rich's bar, else a plain counter line; quiet elsewhere."""
    if not shown():
        yield _quiet
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield from _plain_bar(total, what)
        return
    with Progress(BarColumn(), MofNCompleteColumn(), TextColumn(what), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda done: progress.update(task, completed=done)


def _plain_bar(total: int, what: str) -> Iterator[Callable[[int], None]]:
    width = [0]

    def advance_to(done: int) -> None:
        line = f"{done}/{total} {what}"
        sys.stderr.write("\r" + line.ljust(width[0]))
        sys.stderr.flush()
        width[0] = max(width[0], len(line))

    try:
        yield advance_to
    finally:
        if width[0]:
            sys.stderr.write("\r" + " " * width[0] + "\r")
            sys.stderr.flush()
