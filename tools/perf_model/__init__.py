"""Performance-model tooling: `python -m tools.perf_model collect | relabel | train | eval | cv`.

data/ holds the measured training and held-out datasets (one CSV row per timed or failed candidate, with GPU and
versions) the shipped models in kernels/data/perf_model_*.json were trained on; `collect` and `relabel` regenerate
them on a GPU machine (see tools/perf_model/data/README.md)."""
