"""Issue 31: did tuning spread over several GPUs choose as well as tuning on one? Reads two copies of the selection
store (the `selections` folder after `kernels tune --gpus 0` and after `--gpus all`, each from an empty store) and
compares each problem's winner and the winner's final-round time (its recorded median, ms).

    python -m experiments.issue31_compare ONE_GPU_DIR ALL_GPUS_DIR [--json PATH]

A winner's time differs between runs by the clock and by which GPU timed it; where both runs chose the same kernel
the ratio is that noise alone, and where they differ it is the regret of one pick against the other as each run saw it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from kernels.core.selection import Selection
from kernels.tune.offline import label


def load(folder: Path) -> dict[str, Selection]:
    """key -> Selection of every readable entry in a selection store folder."""
    found = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            found[data["key"]] = Selection.from_dict(data["selection"], source=str(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"skipping {path}: {e}", file=sys.stderr)
    return found


def compare(one: dict[str, Selection], many: dict[str, Selection]) -> list[dict]:
    rows = []
    for key in sorted(set(one) & set(many), key=lambda k: label(one[k].problem)):
        a, b = one[key], many[key]
        ta, tb = a.timings.get(a.winner), b.timings.get(b.winner)
        ratio = tb / ta if isinstance(ta, float) and isinstance(tb, float) and ta > 0 else None
        rows.append({"problem": label(a.problem), "one_gpu": a.winner, "all_gpus": b.winner,
                     "same": a.winner == b.winner, "one_ms": ta, "all_ms": tb, "all_over_one": ratio})
    return rows


def summary(rows: list[dict]) -> dict:
    def geo(values):
        values = [v for v in values if v]
        return math.exp(sum(map(math.log, values)) / len(values)) if values else None

    same = [r for r in rows if r["same"]]
    return {"problems": len(rows), "same_winner": len(same),
            "geomean_all_over_one": geo(r["all_over_one"] for r in rows),
            "geomean_same_winner": geo(r["all_over_one"] for r in same),
            "worst_same_winner": max((r["all_over_one"] for r in same if r["all_over_one"]), default=None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("one", type=Path)
    parser.add_argument("many", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = compare(load(args.one), load(args.many))
    print("| problem | winner, 1 GPU | winner, all GPUs | ms, 1 GPU | ms, all | all/1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else "-"        # noqa: E731
        print(f"| {r['problem']} | {r['one_gpu']} | {'same' if r['same'] else r['all_gpus']} | {fmt(r['one_ms'])} | "
              f"{fmt(r['all_ms'])} | {fmt(r['all_over_one'])} |")
    total = summary(rows)
    print(json.dumps(total))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": total}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
