"""Where a run's tunes spent their time, and what their first pass said against their final round: one JSON line per
selection in the store (KERNELS_CACHE_DIR), oldest first: the problem, winner, regime, tune seconds and stages, the
gap since the previous tune ended (time the run spent outside tunes), the baseline's (aten's) first pass against the
fastest other candidate's, and the final round's ratio when a duel ran. Issue 28's layer tune (<= 15 s cold) is
read from it. `python -m experiments.selection_stages [--json PATH]` (no GPU needed: it reads the store).
"""
from __future__ import annotations

import argparse
import json

from kernels.store.cache_admin import entries


def summary(selection, previous_end: float | None) -> dict:
    firsts = selection.first_pass()
    verified = sorted((t, n) for n, t in selection.timings.items() if isinstance(t, float))
    baseline = next((n for _, n in verified if n.startswith("aten")), None)
    first = {n: firsts.get(n, t) for t, n in verified}
    # the duel's challenger is the fastest verified other (those never verified could not be finalists)
    others = sorted((t, n) for n, t in first.items() if n != baseline and isinstance(t, float))
    row = {"problem": selection.problem.short(), "winner": selection.winner, "regime": selection.regime,
           "tune_s": round(selection.tune_seconds, 3), "stages": selection.stage_seconds,
           "candidates": len(selection.choices), "timed": len(firsts), "verified": len(verified)}
    start = selection.created - selection.tune_seconds
    if previous_end is not None:
        row["gap_before_s"] = round(start - previous_end, 3)
    if baseline is not None and isinstance(first.get(baseline), float) and others:
        row["baseline_first_ms"] = round(first[baseline], 5)
        row["challenger"] = others[0][1]
        row["challenger_first_ratio"] = round(others[0][0] / first[baseline], 4)
        detail = selection.details.get(others[0][1], {})
        if detail.get("final_ratio") is not None:
            row["challenger_final_ratio"] = detail["final_ratio"]
            row["first_window_stop"] = bool(detail.get("first_window_stop"))  # then: to aten's first window alone
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="also write the lines here")
    args = p.parse_args(argv)
    good, bad = entries()
    lines, end = [], None
    for entry in good:
        lines.append(json.dumps(summary(entry.selection, end)))
        end = entry.selection.created
    total = sum(e.selection.tune_seconds for e in good)
    lines.append(json.dumps({"selections": len(good), "bad_files": len(bad), "tune_s_total": round(total, 3),
                             "first_to_last_s": round(good[-1].selection.created - good[0].selection.created
                                                      + good[0].selection.tune_seconds, 3) if good else 0.0}))
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
