"""What the bench commands share: argparse types (positive, non-negative, positive integer, an output file), table
cells, rich tables with a plain-text fallback, and reading a saved JSON-lines run back (`--table-from`)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable


def number_cell(x: float | None, fmt: str) -> str:
    """A table cell: the number in `fmt`, or '-' when it was not measured."""
    return "-" if x is None else format(x, fmt)


def rate_cell(x: float | None) -> str:
    """A rate (tokens/s) as 1.23M / 456.7k / 89."""
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


class RunFileError(ValueError):
    """A --table-from file that is not a run of the command reading it."""


def _number(text: str, zero_ok: bool) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x) or x < 0 or (x == 0 and not zero_ok):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a {'non-negative' if zero_ok else 'positive'} number")
    return x


def positive(text: str) -> float:
    return _number(text, zero_ok=False)


def non_negative(text: str) -> float:
    return _number(text, zero_ok=True)


def output_file(text: str) -> str:
    """A file an output flag will write at the end of a run, checked before the run spends any time: not a folder,
    in a folder that exists and can be written."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file to write")
    if os.path.exists(text) and os.access(text, os.W_OK):
        return text                 # a file, or /dev/stdout, /dev/fd/N: writable as it is
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: its folder {folder} cannot be written")
    return text


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return int(text)


def print_tables(title: str, sections: list[tuple[list[str], list[list[str]]]], plain: Callable[[], str],
                 file=None) -> None:
    """Rich tables (one per (headers, rows) section with rows) under `title` when rich is importable, else `plain()`."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(plain(), file=file)
        return
    out = file if file is not None else sys.stdout
    console = Console(file=out, width=None if out.isatty() else 220)
    console.print(Text(title))
    for headers, rows in sections:
        if not rows:
            continue
        table = Table()
        for h in headers:
            table.add_column(h, overflow="fold")
        for row in rows:
            table.add_row(*(Text(v) for v in row))
        console.print(table)


def read_run(path: str, command: str, kind: str, from_json: Callable[[dict], object]) -> tuple[dict, list]:
    """A saved run's header line ("kind": "run") and its records of `kind`, each through `from_json`."""
    run, results = {}, []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                if data.get("kind") == "run":
                    run = data
                elif data.get("kind") == kind:
                    results.append(from_json(data))
            except (json.JSONDecodeError, TypeError, AttributeError) as e:
                raise RunFileError(f"{path}: line {lineno} is not a {command} record: {e}") from e
    if not run and not results:
        raise RunFileError(f"{path}: no {command} records in it")
    return run, results
