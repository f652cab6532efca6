"""Progress on long work (a problem's tune: building, verifying and timing its candidates; CUTLASS builds): one
transient status line on stderr, through rich (the `progress` extra), shown only when stderr is a terminal; a
program whose stderr goes to a file or a pipe sees nothing."""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


def _quiet(_text: str) -> None:
    pass


def shown() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):       # replaced or closed stderr
        return False


@contextlib.contextmanager
def status(text: str) -> Iterator[Callable[[str], None]]:
    """A status line while the block runs; yields update(text). Quiet off a terminal or without rich."""
    if not shown():
        yield _quiet
        return
    try:
        from rich.console import Console
    except ImportError:
        yield _quiet
        return
    with Console(stderr=True).status(text) as line:
        yield lambda new: line.update(new)
