"""Shape suites (the data: kernels.space.shapes) and shapes files (CSV or JSON of M,N,K) for the benchmarks."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from kernels.space.shapes import ALL_SUITES, CORE, SUITES, Shape


class ShapesError(ValueError):
    """A suite name or shapes file that cannot be used; the message names the file and row."""


# --dtype fp8's suites (K and N multiples of 16, torch._scaled_mm's rule; B column-major): issue 30's problems, and
# tiny ones for the Triton interpreter (K = 48 leaves a partial K tile: fp8 tiles are at least 32 deep)
FP8_SUITES: dict[str, tuple[Shape, ...]] = {
    "fp8": (Shape(16, 12288, 4096), Shape(64, 4096, 11008), Shape(512, 12288, 4096), Shape(4096, 4096, 4096),
            Shape(8192, 8192, 8192), Shape(8192, 14336, 4096)),
    "tiny-fp8": (Shape(64, 64, 64), Shape(17, 32, 48)),
}
_NAMED = {**SUITES, **FP8_SUITES}
SUITE_NAMES = tuple(_NAMED) + ("core", "all")


def suite(name: str, dtype: str = "bf16") -> list[Shape]:
    if name == "core":
        return list(CORE["int8" if dtype == "int8" else "float"])
    if name == "all":
        return _dedupe([s for n in ALL_SUITES for s in SUITES[n]])
    if name not in _NAMED:
        raise ShapesError(f"unknown suite {name!r}; suites: {', '.join(SUITE_NAMES)} (or a .csv/.json file)")
    return list(_NAMED[name])


def _dedupe(shapes: list[Shape]) -> list[Shape]:
    return list(dict.fromkeys(shapes))


def _to_shape(values, where: str) -> Shape:
    if len(values) != 3:
        raise ShapesError(f"{where}: expected 3 values M,N,K, got {len(values)}: {values!r}")
    dims = []
    for name, v in zip("MNK", values):
        try:
            if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                raise ValueError
            d = int(str(v).strip()) if not isinstance(v, (int, float)) else int(v)
        except (TypeError, ValueError) as e:
            raise ShapesError(f"{where}: {name}={v!r} is not an integer") from e
        if d < 1:
            raise ShapesError(f"{where}: {name}={d} must be positive")
        dims.append(d)
    return Shape(*dims)


def _read_csv(path: Path) -> list[Shape]:
    shapes = []
    with path.open(newline="") as f:
        for lineno, row in enumerate(csv.reader(f), start=1):
            cells = [c.strip() for c in row]
            if not any(cells) or cells[0].startswith("#"):
                continue
            if lineno == 1 and [c.upper() for c in cells] == ["M", "N", "K"]:
                continue   # header
            shapes.append(_to_shape(cells, f"{path}: row {lineno}"))
    return shapes


def _read_json(path: Path) -> list[Shape]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ShapesError(f"{path}: not valid JSON: {e}") from e
    if isinstance(data, dict) and "shapes" in data:
        data = data["shapes"]
    if not isinstance(data, list):
        raise ShapesError(f"{path}: expected a list of [M, N, K] or {{'M':..,'N':..,'K':..}} entries")
    shapes = []
    for i, row in enumerate(data):
        where = f"{path}: entry {i}"
        if isinstance(row, dict):
            low = {str(k).lower(): v for k, v in row.items()}
            missing = [d for d in "mnk" if d not in low]
            if missing:
                raise ShapesError(f"{where}: missing {', '.join(d.upper() for d in missing)} in {row!r}")
            row = [low["m"], low["n"], low["k"]]
        elif not isinstance(row, list):
            raise ShapesError(f"{where}: expected [M, N, K] or an object, got {row!r}")
        shapes.append(_to_shape(row, where))
    return shapes


def parse_shapes(spec: str, dtype: str = "bf16") -> list[Shape]:
    """A suite name, several joined by commas, or a path to a .csv / .json file of M,N,K."""
    path = Path(spec)
    if path.suffix.lower() in (".csv", ".json"):
        if not path.is_file():
            raise ShapesError(f"shapes file {spec} does not exist")
        shapes = _read_csv(path) if path.suffix.lower() == ".csv" else _read_json(path)
        if not shapes:
            raise ShapesError(f"{spec}: no shapes in file")
        return _dedupe(shapes)
    return _dedupe([s for name in spec.split(",") if name.strip() for s in suite(name.strip(), dtype)])
