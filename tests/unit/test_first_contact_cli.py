"""First contact, the parts that run nothing: every bench option has help, the progress line is quiet off a
terminal and shows the step and the count on one, and a cell's spread comes only from its median's own samples."""
import argparse
import importlib
import io
import sys

import pytest

from bench import compare, dynamic
from bench.progress import RunProgress


def test_spread_is_kept_only_from_the_medians_own_samples():
    from bench.measure import spread_of

    first_pass = {"median_ms": 6.18, "p20_ms": 1.34, "p80_ms": 6.53}
    assert spread_of(first_pass, 6.18) == (1.34, 6.53)
    # a finalist: its time is the final round's median, its details still the first pass's percentiles
    assert spread_of({**first_pass, "first_pass_ms": 6.18, "final_ms": 2.36}, 2.36) == (None, None)


@pytest.mark.parametrize("parser", [compare.build_parser(), dynamic.build_parser()], ids=["compare", "dynamic"])
def test_every_option_has_help(parser):
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.strip() and action.help != argparse.SUPPRESS, action.option_strings


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_quiet_when_stderr_is_not_a_terminal():
    stream = io.StringIO()
    with RunProgress(2, stream=stream) as progress:
        progress.step("64x64x64 fp16 nn: tuning aten+triton")
        progress.advance()
        progress.note("built 3 kernels")
    assert stream.getvalue().endswith("] built 3 kernels\n") and "tuning" not in stream.getvalue()


@pytest.mark.parametrize("rich", [True, False], ids=["rich", "plain"])
def test_progress_on_a_terminal_shows_the_step_and_the_count(rich, monkeypatch):
    if rich:
        pytest.importorskip("rich")
    else:
        monkeypatch.setitem(sys.modules, "rich.progress", None)
    stream = _Terminal()
    with RunProgress(2, stream=stream) as progress:
        progress.step("64x64x64 fp16 nn: tuning aten+triton")
        progress.advance()
        progress.note("built 3 kernels")
        progress.step("17x33x65 fp16 nn: tuning aten+triton")
        progress.advance()
    out = stream.getvalue()
    assert "built 3 kernels" in out and "tuning aten+triton" in out and "2/2" in out
    with RunProgress(2, stream=_Terminal(), quiet=True) as progress:
        progress.step("x")
        assert progress.stream.getvalue() == ""


@pytest.mark.parametrize("module", ["kernels.__main__", "tools.perf_model.__main__"])
def test_every_option_of_the_other_clis_has_help(module):
    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif not action.help and action.dest != "help":
                missing.append(" ".join([*path, *(action.option_strings or [action.dest])]))

    walk(importlib.import_module(module).build_parser(), [])
    assert not missing, f"{module}: options without help: {missing}"


@pytest.mark.parametrize("argv, message", [
    (["--json", "/"], "argument --json: '/' is a directory, not a file to write"),
    (["--csv", "/no/such/folder/x.csv"], "argument --csv: '/no/such/folder/x.csv': its folder /no/such/folder does"),
    (["--time-limit", "-1"], "argument --time-limit: '-1': must be a non-negative number"),
    (["--bench-ms", "0"], "argument --bench-ms: '0': must be a positive number")])
def test_compare_refuses_bad_output_paths_and_numbers_before_it_measures(argv, message, capsys):
    """The files are written at the end of the run: a path that cannot be written is an error at the start."""
    with pytest.raises(SystemExit) as e:
        compare.build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_existing_writable_file_is_a_good_output_even_in_a_folder_that_is_not(tmp_path):
    """/dev/stdout or /dev/fd/N sit in a folder users cannot write: the file itself is what is written."""
    from bench.cli_common import output_file

    path = tmp_path / "out.json"
    path.write_text("")
    assert output_file(str(path)) == str(path)
    assert output_file(str(tmp_path / "new.json")) == str(tmp_path / "new.json")


def test_the_cli_names_a_bad_setting_in_one_line_for_every_command(monkeypatch, capsys, tmp_path):
    from kernels.__main__ import main

    monkeypatch.setenv("KERNELS_BACKENDS", "foo")
    assert main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m kernels info: error: KERNELS_BACKENDS='foo' is not valid")
    assert "Traceback" not in err
    monkeypatch.delenv("KERNELS_BACKENDS")
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    for argv, message in ([["lut", "export", "--store", str(tmp_path / "none")], "--store"],
                          [["lut", "export", "-o", str(tmp_path)], "cannot write"]):
        assert main(argv) == 2
        assert "python -m kernels lut export: error: " in (err := capsys.readouterr().err) and message in err
    with pytest.raises(SystemExit):
        main(["lut", "export", "--top-k", "0"])
    assert "'0' is not a positive integer" in capsys.readouterr().err
