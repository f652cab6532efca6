"""Suites and shapes files for bench.compare."""
import json

import pytest

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
