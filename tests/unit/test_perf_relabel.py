"""GPU-time labels (kernels.perf_relabel, kernels.perf_data.gpu_labelled): what training and scoring rank a short
problem's candidates by, and the dataset's backward-compatible `gpu_ms` column (the relabel run through the
interpreter: tests/interp/test_perf_collect.py)."""
import csv

from kernels.core.choice import Choice
from kernels.space.heuristics import GemmConfig
from tools.perf_model.data import COLUMNS, LAUNCH_GAP_MS, Row, append_rows, gpu_labelled, read_dataset
from tools.perf_model.relabel import plan
from kernels.core.problem import GemmProblem

GPU = "NVIDIA H100 80GB HBM3"


def _problem(m, n, k):
    return GemmProblem(op="mm", m=m, n=n, k=k, dtype="bf16", out_dtype="bf16", stride_a=(k, 1), stride_b=(n, 1),
                       align_a=16, align_b=16, device="cuda", arch=90, device_name=GPU)


def _row(p, bm, ms, gpu_ms=None, backend="triton"):
    choice = (Choice("aten", "aten_mm", "bf16") if backend == "aten"
              else Choice("triton", "triton_mm", "bf16", GemmConfig(bm, 64, 64, 3, 4)))
    return Row(p, choice, ms, "ok", GPU, "3.6.0", "2026-11-23", gpu_ms)


def test_gpu_labels_replace_call_times_only_in_relabelled_problems():
    short, long = _problem(24, 6144, 1536), _problem(4096, 4096, 4096)
    rows = [_row(short, 32, 0.0101), _row(short, 64, 0.0100), _row(short, 128, 0.0130),     # the collected file
            _row(short, 32, 0.0101, 0.0087), _row(short, 64, 0.0100, 0.0095),               # the relabel file
            _row(short, 0, 0.0500, None, "aten"), _row(short, 0, 0.0400, 0.0050, "aten"),
            _row(long, 128, 0.5), _row(long, 64, 0.7)]
    train = gpu_labelled(rows, keep_unlabelled=False)
    by = {(r.problem.m, r.choice.config.block_m if r.choice.config else 0): r.ms for r in train}
    # the short problem's one-launch candidates rank by GPU time + the launch gap (32 beats 64, the reverse of their
    # call times); 128 has no GPU time: not trained on. aten (a library call) keeps its fastest call time.
    assert by == {(24, 32): 0.0087 + LAUNCH_GAP_MS, (24, 64): 0.0095 + LAUNCH_GAP_MS, (24, 0): 0.04,
                  (4096, 128): 0.5, (4096, 64): 0.7}
    assert len(train) == 5
    scored = {(r.problem.m, r.choice.config.block_m if r.choice.config else 0): r.ms
              for r in gpu_labelled(rows, keep_unlabelled=True)}
    # scoring keeps 128 at its call time: about an upper bound
    assert scored[(24, 128)] == 0.0130 and scored[(24, 32)] == 0.0087 + LAUNCH_GAP_MS


def test_multi_launch_templates_keep_their_call_times():
    """A kmajor candidate's GPU time leaves out the host cost of its second launch: its call time labels it."""
    p = GemmProblem(op="int_mm", m=768, n=768, k=768, dtype="int8", out_dtype="int32", stride_a=(768, 1),
                    stride_b=(768, 1), align_a=16, align_b=16, device="cuda", arch=90, device_name=GPU)
    cfg = GemmConfig(64, 64, 128, 3, 4)
    kmajor = Row(p, Choice("triton", "triton_kmajor_int8_mm", "int8", cfg), 0.0150, "ok", GPU, "", "", 0.0060)
    one = Row(p, Choice("triton", "triton_int8_mm", "int8", cfg), 0.0099, "ok", GPU, "", "", 0.0082)
    got = {r.choice.template: r.ms for r in gpu_labelled([kmajor, one], keep_unlabelled=False)}
    assert got == {"triton_kmajor_int8_mm": 0.0150, "triton_int8_mm": 0.0082 + LAUNCH_GAP_MS}


def test_plan_picks_short_problems_fastest_first_with_aten():
    short, shorter, long = _problem(64, 64, 4096), _problem(16, 16, 16), _problem(4096, 4096, 4096)
    rows = [_row(short, 32, 0.020), _row(short, 64, 0.018), _row(short, 16, 0.030), _row(short, 0, 0.05, None, "aten"),
            _row(shorter, 32, 0.009), _row(long, 128, 0.5), _row(short, 64, 0.017)]
    todo = plan(rows, GPU, 0.025, top=2)
    assert [key[3:6] for key, _ in todo] == [(16, 16, 16), (64, 64, 4096)]
    names = [r.choice.name for r in todo[1][1]]
    assert names == [_row(short, 64, 0).choice.name, _row(short, 32, 0).choice.name, "aten_mm"]
    assert todo[1][1][0].ms == 0.017                # a candidate timed twice: its fastest call
    assert plan(rows, "another GPU", 0.025, None) == []


def test_append_keeps_an_older_files_columns(tmp_path):
    """A file written before `gpu_ms` existed gets rows in its own columns, and reads back."""
    old = tmp_path / "old.csv"
    cols = [c for c in COLUMNS if c != "gpu_ms"]
    with open(old, "w", newline="") as f:
        csv.writer(f).writerow(cols)
    p = _problem(16, 16, 16)
    row = {c: "" for c in COLUMNS} | dict(gpu=GPU, arch=90, device="cuda", op="mm", dtype="bf16", out_dtype="bf16",
                                           m=16, n=16, k=16, stride_a="16:1", stride_b="16:1", backend="aten",
                                           choice='{"backend":"aten","template":"aten_mm","dtype":"bf16"}',
                                           ms="0.01", status="ok", gpu_ms="0.005")
    append_rows(old, [row])
    rows, bad = read_dataset([old])
    assert not bad and len(rows) == 1 and rows[0].ms == 0.01 and rows[0].gpu_ms is None
    assert rows[0].problem.m == p.m


def test_cli_labels_only_the_chosen_gpus_rows(tmp_path):
    """`model train/eval --gpu X` on data from two GPUs: another GPU's GPU times never label X's problems."""
    import json

    from tools.perf_model.__main__ import _load_rows

    path = tmp_path / "two_gpus.csv"
    cfg = GemmConfig(32, 64, 64, 3, 4)
    choice = Choice("triton", "triton_mm", "bf16", cfg)

    def rec(gpu, ms, gpu_ms=""):
        return {c: "" for c in COLUMNS} | dict(gpu=gpu, arch=90, device="cuda", op="mm", dtype="bf16",
                                               out_dtype="bf16", m=24, n=64, k=64, stride_a="64:1",
                                               stride_b="64:1", backend="triton", template="triton_mm",
                                               name=choice.name, choice=json.dumps(choice.as_dict()), ms=str(ms),
                                               status="ok", gpu_ms=str(gpu_ms))
    append_rows(path, [rec(GPU, 0.010), rec("NVIDIA H200", 0.011, 0.004)])
    rows, gpu = _load_rows([str(path)], GPU, for_training=True)
    assert gpu == GPU and [(r.gpu, r.ms) for r in rows] == [(GPU, 0.010)]


def test_relabel_times_with_the_gpu_timer_by_default_on_a_gpu(tmp_path, monkeypatch):
    """Without a `gpu_time` argument, a machine with CUDA relabels with kernels.measure.timing.device_time_ms (an
    import moved out of the function once left it None, and every problem failed with a TypeError)."""
    import types

    from tools.perf_model import relabel as relabel_mod

    seen = []
    monkeypatch.setattr(relabel_mod.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(relabel_mod.torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(relabel_mod, "device_time_ms", lambda call, n_sets: seen.append(n_sets) or 0.001)
    monkeypatch.setattr(relabel_mod, "relabel_problem", lambda rows, gpu_time, device: [gpu_time(None, 1)] and [])
    monkeypatch.setattr(relabel_mod, "read_dataset", lambda paths: ([], []))
    key, group = ("int_mm", "int8", "int32", 64, 64, 256), [types.SimpleNamespace(ms=0.01)]
    monkeypatch.setattr(relabel_mod, "plan", lambda rows, gpu, below_ms, top: [(key, group)])
    relabel_mod.relabel([str(tmp_path / "d.csv")], str(tmp_path / "g.csv"), progress=lambda s: None)
    assert seen == [1]
