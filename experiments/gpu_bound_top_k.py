"""Whether a learned model's top k of the default Triton list holds that list's fastest first pass on GPU-bound
problems, from the timed perf-model data (no GPU needed).

    python -m experiments.gpu_bound_top_k --model kernels/data/perf_model_nvidia_h100_80gb_hbm3.json \
        tools/perf_model/data/h100_heldout_full_bf16.csv.gz tools/perf_model/data/h100_train_bf16.csv

For every problem of the files (once: from the file that timed most of it) whose fastest prediction over the whole
default list is 0.1 ms or more (STEADY_MIN_MS: its final round is the duel of aten and the first pass's fastest
challenger), it prints the fastest measured time of the model's top k of that list over the fastest of the list's
timed members (1.000: the top k held it), for several k; `?` where a pick was never timed. The model is loaded from
its file, not checked for freshness (this runs off the GPU it was trained on); problems the model was trained on
flatter it, so each row names its file.

Twenty-sixth session: on the H100 data the top 4 already held the fastest of the list's timed members on the 4 GPU-bound
held-out problems, and on the 13 of 15 trained-on ones where every pick was timed. Building and timing only the top 8
for GPU-bound problems was tried on a llama-7B layer (H100) and reverted: with the shorter first pass the duel's 300 ms
windows fell elsewhere on the card's power oscillation, read the same Triton tiles at 0.97-1.02x aten instead of
1.09-1.19x, ran two rounds instead of stopping at the first window, and the layer's tune took as long (docs/journal,
twenty-sixth session).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from backends import get_backend
from kernels.core.problem import GemmProblem
from kernels.measure.steady import STEADY_MIN_MS
from kernels.space import perf_learned
from kernels.space.ranking import top_k
from tools.perf_model.data import problem_of as problem_identity
from tools.perf_model.data import read_dataset


def measured_problems(paths: list[Path]) -> dict[tuple, tuple[str, GemmProblem, dict[str, float]]]:
    """One entry per problem of the files (tools.perf_model.data's identity): the file that timed the most of it,
    its problem, and choice name -> measured ms."""
    found: dict[tuple, tuple[str, GemmProblem, dict[str, float]]] = {}
    for path in paths:
        rows, _ = read_dataset([path])
        here: dict[tuple, tuple[GemmProblem, dict[str, float]]] = {}
        for row in rows:
            if row.ms is not None:
                here.setdefault(problem_identity(row), (row.problem, {}))[1][row.choice.name] = row.ms
        for key, (problem, measured) in here.items():
            if key not in found or len(measured) > len(found[key][2]):
                found[key] = (path.name, problem, measured)
    return found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a learned model file (kernels/data/perf_model_*.json)")
    ap.add_argument("--ks", default="4,6,8,12")
    ap.add_argument("data", nargs="+", type=Path)
    args = ap.parse_args(argv)
    model, why = perf_learned.load(args.model)
    if model is None:
        raise SystemExit(f"{args.model}: {why}")
    ks = [int(k) for k in args.ks.split(",")]
    triton = get_backend("triton")
    worst: dict[int, float] = {k: 1.0 for k in ks}
    judged = {k: 0 for k in ks}
    count = 0
    for _, (source, p, measured) in sorted(measured_problems(args.data).items()):
        default = triton.choices(p, "default")[0]
        if not default or not all(model.knows(c) for c in default):
            continue
        pred = model.predict(p, default)        # the whole default list, as tuning would rank it
        known = [x for x in pred if x is not None]
        if not known or min(known) < STEADY_MIN_MS:
            continue
        timed = [c.name for c in default if c.name in measured]
        if not timed:
            continue
        best = min(measured[n] for n in timed)
        cells = []
        for k in ks:
            picked = [default[i].name for i in top_k(model, p, default, k, pred=pred)]
            if not all(n in measured for n in picked):     # a pick never timed: this k cannot be judged here
                cells.append(f"top{k} ?")
                continue
            got = min(measured[n] for n in picked) / best
            worst[k] = max(worst[k], got)
            judged[k] += 1
            cells.append(f"top{k} {got:.3f}")
        count += 1
        aten = measured.get("aten_mm", measured.get("aten_int_mm"))
        print(f"{source}  {p.short()}  default list {len(default)}, {len(timed)} timed  predicted {min(known):.3f} ms  "
              f"aten/best {'-' if aten is None else f'{aten / best:.3f}'}  " + "  ".join(cells))
    print(f"{count} GPU-bound problems (best of the list's timed members); worst, over the problems where every pick "
          "was timed: " + "  ".join(f"top{k} {w:.3f} ({judged[k]})" for k, w in worst.items()))


if __name__ == "__main__":
    main()
