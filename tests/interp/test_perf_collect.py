"""Performance-model data through the interpreter (int8 is exact there): `collect` writes rows and resumes, and
`relabel` with a stand-in GPU timer writes the GPU-time labels (tests/unit/test_perf_model.py and
test_perf_relabel.py have the pure parts)."""
from backends import get_backend
from kernels.core.config import config
from kernels.space.families import SINGLE_LAUNCH_TEMPLATES
from tools.perf_model.data import LAUNCH_GAP_MS, collect, gpu_labelled, read_dataset
from tools.perf_model.relabel import relabel


def test_collect_on_cpu_writes_rows_and_resumes(tmp_path):
    """The collection command through the interpreter (int8 is exact there); times are CPU times."""
    out = tmp_path / "d.csv"
    lines = []
    n = collect([(16, 16, 32)], ["int8"], out, max_configs=1, bench_ms=1.0, progress=lines.append)
    rows, bad = read_dataset([out])
    assert n == len(rows) > 1 and not bad
    assert any(r.choice.backend == "triton" and r.ms for r in rows)
    assert any("[1/1] int8 16x16x32" in line for line in lines)
    assert config.search_space == "default" and config.benchmark_space == "all"    # settings restored
    assert collect([(16, 16, 32)], ["int8"], out, max_configs=1, bench_ms=1.0, resume=True,
                   progress=lines.append) == 0
    assert get_backend("triton") is not None
    explored = tmp_path / "e.csv"
    assert collect([(16, 16, 32)], ["int8"], explored, max_configs=2, bench_ms=1.0, explore=True,
                   progress=lines.append) > 1
    assert config.benchmark_space == "all"


def test_relabel_on_cpu_writes_gpu_times_and_resumes(tmp_path):
    """Through the interpreter (int8 is exact there), with a stand-in timer: the rows it writes carry `gpu_ms`, read
    back as the labels of that problem."""
    data, out = tmp_path / "d.csv", tmp_path / "g.csv"
    assert collect([(16, 16, 32)], ["int8"], data, max_configs=2, bench_ms=1.0, progress=lambda s: None) > 1
    calls = []

    def timer(call, n_sets):
        call(0)
        calls.append(n_sets)
        return 0.001 * len(calls)

    lines = []
    n = relabel([str(data)], str(out), below_ms=1e9, gpu_time=timer, progress=lines.append)
    rows, bad = read_dataset([out])
    assert n == len(rows) > 1 and not bad and calls
    timed = [r for r in rows if r.gpu_ms is not None]
    assert {r.choice.backend for r in timed} >= {"triton", "aten"} and len(timed) == len(calls)
    assert all(r.ms is not None for r in timed)          # the collected call time stays beside the GPU time
    assert any("GPU-timed" in line for line in lines)
    source, _ = read_dataset([data])
    merged = {r.choice.name: r.ms for r in gpu_labelled(source + rows, keep_unlabelled=False)}
    for r in timed:
        one_launch = r.choice.template in SINGLE_LAUNCH_TEMPLATES
        assert merged[r.choice.name] == (r.gpu_ms + LAUNCH_GAP_MS if one_launch else min(
            s.ms for s in source + rows if s.choice.name == r.choice.name and s.ms is not None))
    assert relabel([str(data)], str(out), below_ms=1e9, gpu_time=timer, progress=lines.append) == 0
