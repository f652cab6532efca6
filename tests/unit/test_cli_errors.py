"""The CLI's own bad input ends in one line naming the file or what is missing, exit status 2, no traceback (a new
user's probe found tracebacks for these)."""
import pytest

from kernels import __main__ as cli


@pytest.mark.parametrize("argv, says", [
    (["config", "--readme", "{tmp}/missing.md"], "--readme {tmp}/missing.md: No such file or directory"),
    (["config", "--readme", "{tmp}"], "--readme {tmp}: Is a directory"),
    (["config", "--readme", "{tmp}/plain.md"], "no <!-- settings:begin --> ... <!-- settings:end --> section"),
    (["lut", "check", "{tmp}/missing.json"], "lut check: error: {tmp}/missing.json: No such file or directory"),
    (["lut", "check", "{tmp}/broken.json"], "lut check: error: {tmp}/broken.json: not valid JSON"),
    (["lut", "check", "{tmp}/fifo.json"], "lut check: error: {tmp}/fifo.json: not a regular file"),
])
def test_a_bad_file_is_one_line_naming_it(argv, says, tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "fifo.json")               # read without blocking: refused, never waited on
    (tmp_path / "plain.md").write_text("# a README without the settings markers\n")
    (tmp_path / "broken.json").write_text("{not json")
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert says.format(tmp=tmp_path) in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("command, choices", [("fastpath", "build"), ("lut", "export|check"),
                                              ("cache", "list|show|export|import|verify|prune|clear")])
def test_a_missing_subcommand_names_the_choices(command, choices, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command])
    assert e.value.code == 2 and f"the following arguments are required: {choices}" in capsys.readouterr().err


def test_info_names_a_bad_setting_and_fails(monkeypatch, capsys):
    monkeypatch.setenv("MAX_JOBS", "-2")              # info itself reads no MAX_JOBS: it passed unnoticed
    assert cli.main(["info"]) == 2
    out, err = capsys.readouterr()
    assert err == "python -m kernels info: error: MAX_JOBS='-2' is not valid: allowed: a positive integer below 2147483648\n"
    assert out.startswith("gpu:") and "nvcc:" in out  # what does not need the settings is still shown


def test_tune_refuses_a_lookup_table_that_is_not_there(monkeypatch, tmp_path, capsys):
    """A call goes on without an unreadable table, with a warning; a tune run would store every selection without
    the table it was asked to use."""
    listed = tmp_path / "one.csv"
    listed.write_text("m,n,k,dtype,layout\n32,48,64,fp16,nn\n")
    monkeypatch.setenv("KERNELS_LUT", str(tmp_path / "missing.json"))
    assert cli.main(["tune", str(listed), "--dry-run"]) == 2
    assert f"KERNELS_LUT={tmp_path / 'missing.json'}: No such file or directory" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("{not json")
    monkeypatch.setenv("KERNELS_LUT", str(tmp_path / "broken.json"))
    assert cli.main(["tune", str(listed), "--dry-run"]) == 2
    assert f"KERNELS_LUT={tmp_path / 'broken.json'}: not valid JSON" in capsys.readouterr().err


def test_a_command_stopped_by_a_signal_says_so_in_one_line(monkeypatch, capsys):
    """SIGTERM / SIGHUP reach a command as ^C (so what it started is ended on the way out) and end it with one line,
    exit status 130, no traceback; the handlers before are put back."""
    import signal

    import kernels.commands as commands

    def stopped(args, early=None):
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(commands, "run", stopped)
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    assert cli.main(["cache", "list"]) == 130
    assert capsys.readouterr().err == "python -m kernels cache: interrupted (SIGTERM)\n"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before


def test_a_command_under_nohup_keeps_ignoring_sighup(monkeypatch):
    """nohup leaves SIGHUP ignored: a closed terminal must not stop the run."""
    import signal

    import kernels.commands as commands

    seen = []

    def runs(args, early=None):
        signal.raise_signal(signal.SIGHUP)            # ignored: the command goes on
        seen.append(signal.getsignal(signal.SIGHUP))
        return 0

    monkeypatch.setattr(commands, "run", runs)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert cli.main(["cache", "list"]) == 0 and seen == [signal.SIG_IGN]
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_tune_on_cpu_says_up_front_that_the_interpreter_is_slow(monkeypatch, tmp_path, capsys):
    """Nothing else is printed until a problem ends, and a large one takes minutes through the interpreter."""
    import kernels.commands as commands

    listed = tmp_path / "one.csv"
    listed.write_text("m,n,k,dtype,layout\n32,48,64,fp16,nn\n")
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(commands.offline, "target", lambda: ("cpu", 0, "cpu"))
    monkeypatch.setattr(commands.offline, "run", lambda *a, **k: commands.offline.Report([]))
    assert cli.main(["tune", str(listed)]) == 0
    assert capsys.readouterr().err.startswith("python -m kernels tune: no GPU: tuning through the Triton interpreter")
