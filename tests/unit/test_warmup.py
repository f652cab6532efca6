"""`python -m kernels warmup`: its arguments, bad input (an error naming the argument and what is allowed, exit 2,
no traceback), and the default CUTLASS set built with a fake nvcc (tests/fake_cutlass.py); `kernels info` says how
much of the set is built and where the background build stands."""
from pathlib import Path

import pytest

from backends.cutlass import CutlassBackend
from kernels.__main__ import main
from kernels.commands import info_lines
from kernels.core.config import config
from kernels.tune import warmup
from kernels.tune.autotune import candidates
from tests import fake_cutlass
from tests.helpers import run_python


@pytest.mark.parametrize("argv,message", [
    (["--dtypes", "fp8"], "argument --dtypes: unknown dtype 'fp8'; allowed: a comma list of bf16, fp16, int8"),
    (["--dtypes", "bf16,Int4"], "argument --dtypes: unknown dtype 'int4'; allowed: a comma list of bf16, fp16, int8"),
    (["--dtypes", ","], "argument --dtypes: no dtype given; allowed"),
    (["--backends", "cutlas"], "argument --backends: unknown backend 'cutlas'; allowed: a comma list of aten, "
                               "triton, cutlass, padded"),
    (["--jobs", "0"], "argument --jobs: '0' is not a positive integer"),
    (["--jobs", "two"], "argument --jobs: 'two' is not a positive integer"),
    # nvcc failed every kernel of the set on sm_999, each recorded as a build failure (a new user's probe)
    (["--arch", "999"], "argument --arch: '999' is not a compute capability (one of 80, 86"),
    (["--arch", "70"], "argument --arch: '70' is below 8.0: the CUTLASS templates here need 8.0 or newer"),
])
def test_bad_arguments_name_the_argument_and_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["warmup", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_arch_takes_a_compute_capability_as_the_help_writes_it():
    from kernels.__main__ import _arch

    assert [_arch(t) for t in ("90", "9.0", "sm_90", "sm90a", "8.6", "100", "9", "10")] == [90, 90, 90, 90, 86, 100,
                                                                                           90, 100]


def test_a_bad_max_jobs_is_a_usage_error_without_a_traceback():
    proc = run_python("import sys; from kernels.__main__ import main; sys.exit(main(['warmup']))", {"MAX_JOBS": "x"},
                      timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "MAX_JOBS='x' is not valid: allowed: a positive integer" in proc.stderr and "Traceback" not in proc.stderr


def test_backends_without_a_set_say_why_there_is_nothing_to_build(capsys):
    assert main(["warmup", "--backends", "triton,aten,padded"]) == 0
    out = capsys.readouterr().out
    assert "triton: nothing to build ahead: a Triton kernel compiles in about a second" in out
    assert "aten: " in out and "padded: " in out


@pytest.fixture
def fake(tmp_path, monkeypatch):
    tools = fake_cutlass.make_toolchain(tmp_path / "toolchain")
    fake_cutlass.install(monkeypatch, CutlassBackend(tools.tools))
    return tools


def test_warmup_builds_the_set_every_tune_of_it_finds_built_and_a_second_run_builds_nothing(fake, capsys):
    assert main(["warmup", "--dtypes", "int8", "--jobs", "3"]) == 0
    cset = warmup.default_set(90, "int8")
    out = capsys.readouterr().out
    assert f"building {len(cset.kernels)} with 3 parallel compiles" in out and config.max_jobs == 3
    assert f"int8 {len(cset.kernels)} kernels ({len(cset.kernels)} built)" in out
    assert len(fake.compiles()) == len(cset.kernels) > 0
    backend = CutlassBackend(fake.tools)
    config.cutlass_build = "off"                # a tune of a set problem: everything it asks for is built
    for problem in warmup.default_problems(90, "int8"):
        chosen = candidates(backend, problem).kept
        assert all(o.error is None or o.error.startswith("load failed") for o in backend.build(problem, chosen))
    assert main(["warmup", "--dtypes", "int8"]) == 0
    assert "building 0 with" in capsys.readouterr().out and len(fake.compiles()) == len(cset.kernels)


def test_failed_compiles_fail_the_warmup_are_recorded_and_retried_only_when_asked(fake, capsys):
    fake.fail_when_source_has("TileShape = Shape<_128, _128")
    assert main(["warmup", "--dtypes", "int8"]) == 1
    err = capsys.readouterr().err
    failed = warmup.default_set(90, "int8").states()["failed"]
    assert failed > 0 and f"{failed} failed (recorded: not retried until --retry-failed)" in err
    assert err.count("build.log") == failed
    compiles = len(fake.compiles())
    assert main(["warmup", "--dtypes", "int8"]) == 1 and len(fake.compiles()) == compiles
    fake.succeed()
    assert main(["warmup", "--dtypes", "int8", "--retry-failed"]) == 0
    assert len(fake.compiles()) == compiles + failed
    assert warmup.default_set(90, "int8").states()["failed"] == 0


def test_info_says_how_much_of_the_set_is_built_and_where_the_background_build_stands(fake, capsys):
    sizes = {d: len(warmup.default_set(90, d).kernels) for d in warmup.DTYPES}
    lines = [ln for ln in info_lines() if ln.startswith("cutlass set:")]
    assert lines == [f"cutlass set: sm90 (no GPU: compile-only): bf16 {sizes['bf16']} kernels (0 built), fp16 "
                     f"{sizes['fp16']} kernels (0 built), int8 {sizes['int8']} kernels (0 built); `python -m kernels "
                     f"warmup` builds it"]
    main(["warmup", "--dtypes", "int8"])
    text = "\n".join(info_lines())
    assert f"int8 {sizes['int8']} kernels ({sizes['int8']} built)" in text
    assert "KERNELS_CUTLASS_BUILD=background; background build: none has run" in text


def test_info_without_a_toolchain_says_there_is_no_set(tmp_path, monkeypatch):
    from kernels.core.toolchain import Toolchain

    fake_cutlass.install(monkeypatch, CutlassBackend(Toolchain(None, None, "", ("nvcc: not on PATH",))))
    [line] = [ln for ln in info_lines() if ln.startswith("cutlass set:")]
    assert line.startswith("cutlass set: none for sm90: CUTLASS headers and nvcc not found")


def test_units_of_several_kernels_give_each_its_own_binary_and_a_placing_failure_costs_a_compile(fake, monkeypatch):
    """13 int8 kernels on 3 compile slots: units of several kernels (fewer nvcc runs than kernels), each member
    published under its own key; a member whose binary cannot be placed is compiled again alone (not recorded as a
    failed compile, which the background build would never retry); the units' files are gone."""
    import backends.cutlass as cutlass_backend

    place = cutlass_backend._place_binary
    victim = []

    def flaky(unit, binary, unit_log, log):
        if not victim:
            victim.append(binary)
            raise OSError("no space left on device")
        place(unit, binary, unit_log, log)
    monkeypatch.setattr(cutlass_backend, "_place_binary", flaky)
    main(["warmup", "--dtypes", "int8", "--jobs", "3"])
    cset = warmup.default_set(90, "int8")
    calls = (fake.folder / "bin" / "calls").read_text().split()
    assert len(calls) < len(cset.kernels) == len(set(fake.compiles()))
    assert cset.states() == {"built": len(cset.kernels)} and victim[0].exists()
    assert calls[-1] == str(victim[0].with_name("kernel.cu"))           # the victim, compiled again on its own
    units = {Path(c).parent for c in calls if Path(c).parent.name == "units"}
    assert units and all(not list(u.iterdir()) for u in units)         # each unit's .so, source and log removed
