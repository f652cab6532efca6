"""--backends parsing, --only/--skip, and picking each column's best candidate from a Selection's timings."""
import pytest

from bench.columns import Column, ColumnError, NameFilter, parse_columns, pick_best, tuned_backends
from bench.compare import build_parser, resolve_defaults
from kernels.core.choice import Choice


def test_parser_defaults_and_choices():
    args = resolve_defaults(build_parser().parse_args([]), no_gpu=False)
    assert (args.backends, args.shapes, args.dtype, args.layout, args.keep_going) == ("aten,triton", "square",
                                                                                      "bf16", "nn", False)
    # without a GPU the interpreter checks tiny shapes in fp16 (its bf16 dot is wrong); given values are kept
    assert (resolve_defaults(build_parser().parse_args([]), no_gpu=True).shapes, "fp16") == ("tiny", "fp16")
    given = resolve_defaults(build_parser().parse_args(["--shapes", "odd", "--dtype", "bf16"]), no_gpu=True)
    assert (given.shapes, given.dtype) == ("odd", "bf16")
    args = build_parser().parse_args(["--dtype", "int8", "--only", "a", "--only", "b", "--skip", "c", "--keep-going",
                                      "--layout", "tn", "--json", "x.json", "--csv", "x.csv", "--plot", "x.png"])
    assert args.only == ["a", "b"] and args.skip == ["c"] and args.keep_going and args.layout == "tn"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--dtype", "fp4"])


def test_fp8_defaults_its_shapes_layout_and_scaling():
    gpu = resolve_defaults(build_parser().parse_args(["--dtype", "fp8"]), no_gpu=False)
    assert (gpu.shapes, gpu.layout, gpu.scaling) == ("fp8", "nt", "tensor")
    cpu = resolve_defaults(build_parser().parse_args(["--dtype", "fp8", "--scaling", "row"]), no_gpu=True)
    assert (cpu.shapes, cpu.layout, cpu.scaling) == ("tiny-fp8", "nt", "row")
    given = resolve_defaults(build_parser().parse_args(["--dtype", "fp8", "--layout", "nt", "--shapes", "square"]),
                             no_gpu=False)
    assert (given.shapes, given.layout) == ("square", "nt")
    assert resolve_defaults(build_parser().parse_args(["--dtype", "int8"]), no_gpu=False).scaling == ""


@pytest.mark.parametrize("argv, says", [
    (["--dtype", "fp8", "--layout", "nn"], "--layout nn: fp8 takes A row-major and B column-major only (layout nt"),
    (["--dtype", "fp8", "--layout", "tt"], "--layout tt:"),
    (["--dtype", "bf16", "--scaling", "row"], "--scaling row: scales are for --dtype fp8 only, not bf16"),
    (["--dtype", "int8", "--scaling", "tensor"], "not int8")])
def test_what_fp8_does_not_take_is_a_usage_error_naming_the_option(argv, says, capsys):
    from bench.compare import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "No GPU" not in err            # refused before anything runs


def test_aten_always_first_and_backends_deduped():
    cols = parse_columns("triton,cutlass,inductor,triton_tma,padded_tma,cutlass3x,triton")
    assert [c.name for c in cols] == ["aten", "triton", "cutlass", "inductor", "triton_tma", "padded_tma",
                                      "cutlass3x"]
    assert [c.kind for c in cols] == ["backend", "backend", "backend", "inductor", "template", "template",
                                      "template"]
    assert tuned_backends(cols) == ["aten", "triton", "cutlass", "padded"]
    assert tuned_backends(parse_columns("decompose_k,split_k")) == ["aten", "triton"]


def test_unknown_backend_is_rejected():
    with pytest.raises(ColumnError, match="unknown backend or template 'cublas'"):
        parse_columns("aten,cublas")
    with pytest.raises(ColumnError, match="empty"):
        parse_columns(" , ")


def test_bad_regex_is_rejected():
    with pytest.raises(ColumnError, match="bad --only/--skip pattern"):
        NameFilter.compile(["("], None)


def _choices():
    return {c.name: c for c in (Choice("aten", "aten_mm", "bf16"), Choice("triton", "triton_mm", "bf16", None,
                                                                           (("v", 1),)),
                                Choice("triton", "triton_tma", "bf16", None, (("v", 2),)),
                                Choice("triton", "split_k", "bf16", None, (("s", 4),)))}


def test_pick_best_per_backend_and_template_group():
    choices = _choices()
    timings = {"aten_mm": 1.0, "triton_mm_bf16_v1": 0.9, "triton_tma_bf16_v2": 0.7,
               "split_k_bf16_s4": "wrong result: relative error 1 > 0.01",
               "triton_mm_bf16_huge": "unsupported: shared memory 300000 > 232448"}
    flt = NameFilter()
    whole = pick_best(timings, choices, Column("triton", "backend", "triton"), flt)
    assert (whole.name, whole.median_ms, whole.candidates, whole.failed) == ("triton_tma_bf16_v2", 0.7, 4, 2)
    mm = pick_best(timings, choices, Column("triton_mm", "template", "triton"), flt)
    assert (mm.name, mm.candidates) == ("triton_mm_bf16_v1", 2)
    sk = pick_best(timings, choices, Column("split_k", "template", "triton"), flt)
    assert sk.name is None and sk.failure.startswith("wrong result")
    none = pick_best(timings, choices, Column("decompose_k", "template", "triton"), flt)
    assert none.name is None and none.candidates == 0 and none.failure == "no candidates"


def test_only_and_skip_filter_candidates_but_never_aten():
    choices, timings = _choices(), {"aten_mm": 1.0, "triton_mm_bf16_v1": 0.9, "triton_tma_bf16_v2": 0.7}
    col = Column("triton", "backend", "triton")
    assert pick_best(timings, choices, col, NameFilter.compile(None, ["tma"])).name == "triton_mm_bf16_v1"
    assert pick_best(timings, choices, col, NameFilter.compile(["^cublas"], None)).failure.endswith("--only/--skip")
    aten = pick_best(timings, choices, Column("aten", "backend", "aten"), NameFilter.compile(["nothing"], ["aten"]))
    assert aten.name == "aten_mm"


def test_a_column_whose_candidates_are_all_unsupported_is_unavailable_not_failed():
    """split_k on a problem whose tiles already fill the GPU offers no candidate: nothing was built to fail, so the
    cell says unavailable, as other columns do then (it said failed, and the summary counted it; a new user's
    probe). A column with a built candidate that failed still says failed."""
    from bench.measure import TuneOutcome, tuned_cell
    from tests.helpers import problem

    choices = _choices()
    unsupported = {"aten_mm": 1.0, "split_k_bf16_s4": "unsupported: output tiles already fill the GPU"}
    del choices["split_k_bf16_s4"]
    outcome = TuneOutcome(("aten", "triton"), None, unsupported, choices, [], 0.1)
    cell = tuned_cell(Column("split_k", "template", "triton"), outcome, problem(), None, NameFilter(), True)
    assert (cell.status, cell.unsupported, cell.candidates) == ("unavailable", 1, 1)
    assert "output tiles already fill the GPU" in cell.message
    broken = TuneOutcome(("aten", "triton"), None, {"aten_mm": 1.0, "split_k_bf16_s4": "wrong result: error 1"},
                         _choices(), [], 0.1)
    assert tuned_cell(Column("split_k", "template", "triton"), broken, problem(), None, NameFilter(), True).status \
        == "failed"
