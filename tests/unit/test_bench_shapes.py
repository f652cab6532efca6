"""Suites and shapes files for bench.compare."""
import json

import pytest
import torch

import kernels

from bench.shapes import CORE, SUITES, Shape, ShapesError, parse_shapes, suite


def test_suites_match_the_issue():
    assert suite("square") == [Shape(1024, 1024, 1024), Shape(4096, 4096, 4096), Shape(8192, 8192, 8192)]
    llama = suite("llama")
    assert len(llama) == 10 and {s.m for s in llama} == {16, 64}
    assert Shape(16, 12288, 4096) in llama and Shape(64, 65536, 4096) in llama and Shape(64, 4096, 11008) in llama
    assert suite("splitk") == [Shape(32, 32, k) for k in (4096, 16384, 32768)]
    assert suite("training") == [Shape(8192, 14336, 4096), Shape(4096, 4096, 14336)]
    assert suite("odd") == [Shape(3000, 2000, 1000), Shape(2047, 2047, 2047)]
    assert Shape(17, 33, 65) in suite("tiny")


def test_core_depends_on_dtype_and_all_has_no_tiny():
    assert suite("core", "int8") == list(CORE["int8"])
    assert Shape(256, 12288, 4096) in suite("core", "int8")
    assert Shape(64, 22016, 4096) in suite("core", "bf16") and len(suite("core", "bf16")) == 7
    everything = suite("all")
    assert len(everything) == len(set(everything)) == sum(len(SUITES[n]) for n in
                                                          ("square", "llama", "splitk", "training", "odd"))
    assert not set(SUITES["tiny"]) & set(everything)


def test_comma_joined_suites_dedupe():
    assert parse_shapes("square,square") == suite("square")
    assert parse_shapes("tiny,odd") == suite("tiny") + suite("odd")


def test_unknown_suite_lists_the_known_ones():
    with pytest.raises(ShapesError, match="unknown suite 'nope'.*llama"):
        parse_shapes("nope")


def test_csv_file_with_header_comments_and_blank_lines(tmp_path):
    f = tmp_path / "s.csv"
    f.write_text("M,N,K\n# a comment\n128, 256, 64\n\n3000,2000,1000\n")
    assert parse_shapes(str(f)) == [Shape(128, 256, 64), Shape(3000, 2000, 1000)]


@pytest.mark.parametrize("row,msg", [("128,256", "row 3: expected 3 values"), ("128,x,64", "row 3: N='x'"),
                                     ("128,0,64", "row 3: N=0 must be positive"), ("1.5,2,3", "row 3: M='1.5'")])
def test_csv_bad_row_is_named(tmp_path, row, msg):
    f = tmp_path / "bad.csv"
    f.write_text(f"M,N,K\n64,64,64\n{row}\n")
    with pytest.raises(ShapesError, match=msg) as e:
        parse_shapes(str(f))
    assert str(f) in str(e.value)


def test_json_lists_and_objects(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"shapes": [[16, 32, 64], {"M": 8, "n": 9, "K": 10}]}))
    assert parse_shapes(str(f)) == [Shape(16, 32, 64), Shape(8, 9, 10)]


@pytest.mark.parametrize("data,msg", [([[1, 2, 3], {"M": 1, "N": 2}], "entry 1: missing K"),
                                      ([[1, 2, 3], "1,2,3"], "entry 1: expected"),
                                      ([[1, 2, 3.5]], "entry 0: K=3.5"), ({"x": 1}, "expected a list")])
def test_json_bad_entry_is_named(tmp_path, data, msg):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(data))
    with pytest.raises(ShapesError, match=msg):
        parse_shapes(str(f))


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ShapesError, match="does not exist"):
        parse_shapes(str(tmp_path / "none.csv"))
    bad = tmp_path / "broken.json"
    bad.write_text("[1, 2")
    with pytest.raises(ShapesError, match="not valid JSON"):
        parse_shapes(str(bad))
    empty = tmp_path / "empty.csv"
    empty.write_text("M,N,K\n")
    with pytest.raises(ShapesError, match="no shapes"):
        parse_shapes(str(empty))


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "int8"])
def test_a_shapes_problem_without_tensors_is_the_problem_of_real_tensors(dtype, layout):
    """kernels.space.shapes.problem_of (what the default CUTLASS set is planned from, no GPU needed) describes the
    tensors bench.compare makes."""
    from bench.measure import problem_for
    from kernels.space.shapes import problem_of

    for shape in (Shape(64, 48, 32), Shape(1, 48, 32)):
        assert problem_of(shape, dtype, layout, "cpu", 0, "cpu") == problem_for(shape, dtype, layout, "cpu")


def test_fp8_suites_are_issue30s_problems_and_tiny_ones_torch_scaled_mm_takes():
    from bench.shapes import FP8_SUITES

    assert suite("fp8") == [Shape(16, 12288, 4096), Shape(64, 4096, 11008), Shape(512, 12288, 4096),
                            Shape(4096, 4096, 4096), Shape(8192, 8192, 8192), Shape(8192, 14336, 4096)]
    assert all(s.k % 16 == 0 and s.n % 16 == 0 for name in FP8_SUITES for s in suite(name))
    assert max(s.macs for s in suite("tiny-fp8")) <= 1 << 21          # bench.compare's interpreter limit
    assert not set(suite("tiny-fp8")) & set(suite("all"))     # "all" stays the performance suites it was
    assert parse_shapes("tiny-fp8") == suite("tiny-fp8")


def test_fp8_problems_are_scaled_mm_in_the_nt_layout():
    from bench.measure import layout_error, op_for, problem_for, shape_error, user_calls

    assert [op_for(d) for d in ("bf16", "fp32", "int8", "fp8", "e4m3")] == ["mm", "mm", "int_mm", "scaled_mm",
                                                                           "scaled_mm"]
    tensor = problem_for(Shape(17, 32, 48), "fp8", "nt", "cpu")
    assert (tensor.op, tensor.dtype, tensor.out_dtype, tensor.scaling, tensor.bias) == ("scaled_mm", "e4m3", "bf16",
                                                                                        "tensor", False)
    assert (tensor.layout_a, tensor.layout_b, tensor.epilogue_operands) == ("row", "col", 2)
    assert problem_for(Shape(17, 32, 48), "e4m3", "nt", "cpu", "row").scaling == "row"
    assert problem_for(Shape(17, 32, 48), "bf16", "nn", "cpu", "row").scaling == ""      # other dtypes: no scales
    assert layout_error("fp8", "nt") == "" and "layout nt" in layout_error("fp8", "nn")
    assert layout_error("int8", "tt") == "" and shape_error(Shape(8, 8, 8), "bf16") == ""
    assert shape_error(Shape(8, 8, 8), "fp8") == "8x8x8: fp8 needs K and N multiples of 16 (torch._scaled_mm's rule)"
    for args, says in (((Shape(16, 32, 48), "fp8", "tn", "cpu"), "not tn"), ((Shape(16, 8, 48), "fp8", "nt", "cpu"),
                       "multiples of 16"), ((Shape(16, 32, 48), "fp8", "nt", "cpu", "col"), "scaling must be")):
        with pytest.raises(ValueError, match=says):
            problem_for(*args)
    calls = user_calls(tensor)      # torch._scaled_mm(a, b, sa, sb, out_dtype=bf16), and kernels.scaled_mm alike
    assert calls.torch.func is torch._scaled_mm and calls.torch.keywords == {"out_dtype": torch.bfloat16}
    assert calls.kernels.func is kernels.scaled_mm and calls.kernels.keywords == {"out_dtype": torch.bfloat16}


def test_compare_refuses_shapes_fp8_cannot_run_naming_them(tmp_path):
    from bench import compare
    from bench.progress import RunProgress

    args = compare.resolve_defaults(compare.build_parser().parse_args(["--dtype", "fp8", "--shapes", "tiny"]), True)
    with pytest.raises(ShapesError, match="--shapes tiny: 17x33x65: fp8 needs K and N multiples of 16"):
        compare.run(args, no_gpu=True, progress=RunProgress(0, quiet=True))
