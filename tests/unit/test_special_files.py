"""A FIFO, a device or a directory where a file is expected -- a user's table, trace, problem list or bundle, or a
file planted in the cache -- is refused at once with a message naming it (or, inside the cache, treated as a bad
entry), never waited on or read without end. Each case ran forever before its fix (a fault probe's findings), so
each runs here in a thread or a child process with a time limit: a regression fails instead of hanging the run."""
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import warnings

import pytest

from backends.triton import TritonBackend
from kernels import __main__ as cli
from kernels.core import fsutil
from kernels.core.cache_root import CacheWarning
from kernels.core.config import config
from kernels.core.errors import InputValueError
from kernels.dispatch import record
from kernels.native import fastpath, fastpath_build
from kernels.space import lut, perf_learned
from kernels.store import bundle
from kernels.tune import problem_list
from tests.helpers import problem

LIMIT_S = 30.0


def _unblock(fifo) -> None:
    """Open the other side of `fifo` and close it: an open() stuck on it returns (a reader then reads EOF)."""
    for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, flags))


def _within(fn, *fifos, limit_s: float = LIMIT_S):
    """fn()'s result, or its exception raised here. Still running after `limit_s`: a hang -- the FIFOs are opened
    from the other side so the stuck call ends, and the test fails."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        for fifo in fifos:
            _unblock(fifo)
        thread.join(5)
        pytest.fail(f"still running after {limit_s:.0f} s: blocked on {[str(f) for f in fifos]}")
    if "error" in out:
        raise out["error"]
    return out.get("value")


# a fresh interpreter whose address space is capped 2 GiB over what its imports took: a read of /dev/zero that is
# not refused ends in MemoryError (a failure here) instead of eating the machine's memory
_CAPPED = """
import resource, sys, warnings
{imports}
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
{body}
"""


def _capped(imports: str, body: str, env: dict | None = None) -> subprocess.CompletedProcess:
    code = _CAPPED.format(imports=imports, body=body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, cwd=os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture
def fifo(tmp_path):
    def make(name: str):
        path = tmp_path / name
        os.mkfifo(path)
        return path
    return make


# -- the primitives ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_read_regular_and_file_sha256_refuse_what_is_not_a_regular_file(kind, fifo, tmp_path):
    path = {"fifo": lambda: fifo("f"), "device": lambda: "/dev/zero", "directory": lambda: tmp_path}[kind]()
    says = "Is a directory" if kind == "directory" else "not a regular file"
    for read in (lambda: fsutil.read_regular(path, 1 << 20), lambda: fsutil.file_sha256(path)):
        with pytest.raises(OSError, match=says):
            _within(read, path)


def test_file_sha256_of_a_regular_file_is_its_sha256(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (3 << 20))
    assert fsutil.file_sha256(path) == hashlib.sha256(b"x" * (3 << 20)).hexdigest()


def test_a_fifo_under_a_marker_is_not_valid(fifo, tmp_path):
    binary = fifo("kernel.so")
    marker = tmp_path / "meta.json"     # claims the FIFO's size (0): only the hash can tell, and it must not block
    marker.write_text(json.dumps({"key": "k", "size": 0, "sha256": hashlib.sha256(b"").hexdigest()}))
    assert _within(lambda: fsutil.marker_valid(binary, marker, "k"), binary) is False


# -- 1. KERNELS_LUT ---------------------------------------------------------------------------------------------------
def test_a_lookup_table_that_is_a_fifo_is_a_warning_and_no_table(fifo, monkeypatch):
    path = fifo("lut.json")
    monkeypatch.setenv("KERNELS_LUT", str(path))
    config.reset()
    with pytest.warns(lut.LutWarning, match=rf"{path}: table: cannot be read .*not a regular file"):
        table, _ = _within(lut.active, path)         # what a call's candidate list reads
    assert table.entries == ()


def test_a_lookup_table_at_dev_zero_is_a_warning_and_no_table():
    done = _capped("from kernels.space import lut", """
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    table, _ = lut.active()
print(len(table.entries), *[str(w.message) for w in caught], sep="\\n")
""", env={"KERNELS_LUT": "/dev/zero"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("0\n") and "/dev/zero: table: cannot be read" in done.stdout
    assert "not a regular file" in done.stdout


# -- 2. KERNELS_RECORD ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_reader", [False, True])
def test_a_trace_that_is_a_fifo_is_refused_with_a_warning(with_reader, fifo, monkeypatch):
    path = fifo("trace.jsonl")
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if with_reader else None
    try:
        monkeypatch.setenv("KERNELS_RECORD", str(path))
        config.reset()
        with pytest.warns(CacheWarning, match=rf"cannot append to the problem trace {path} .*not a regular file"):
            _within(lambda: record.note(problem(m=8, n=8, k=8, dtype="fp16")), path)
        if reader is not None:
            assert os.read(reader, 4096) == b""       # nothing written into it: refused before the write
    finally:
        if reader is not None:
            os.close(reader)


def test_record_in_code_refuses_a_fifo(fifo):
    path = fifo("trace.jsonl")
    with pytest.raises(InputValueError, match="is not a regular file"):
        with record.record(path):
            pass


def test_a_regular_trace_is_still_appended(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("KERNELS_RECORD", str(path))
    config.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record.note(problem(m=8, n=8, k=8, dtype="fp16"))
    assert json.loads(path.read_text())["m"] == 8


# -- 3. problem lists -------------------------------------------------------------------------------------------------
def test_a_problem_list_that_is_a_fifo_is_one_line_and_exit_2(fifo, capsys):
    path = fifo("list.csv")
    with pytest.raises(problem_list.ProblemListError, match=rf"{path}: cannot be read: not a regular file"):
        _within(lambda: problem_list.read(path), path)
    assert _within(lambda: cli.main(["tune", str(path), "--dry-run"]), path) == 2
    err = capsys.readouterr().err
    assert err == f"python -m kernels tune: error: {path}: cannot be read: not a regular file\n"


def test_a_problem_list_that_is_a_directory_names_it(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(problem_list.ProblemListError, match=r"d.jsonl: cannot be read: Is a directory"):
        problem_list.read(tmp_path / "d.jsonl")


# -- 4. cache import --------------------------------------------------------------------------------------------------
def test_importing_a_fifo_is_refused_before_reading(fifo, capsys):
    path = fifo("bundle.tar.gz")
    assert _within(lambda: cli.main(["cache", "import", str(path)]), path) == 1
    err = capsys.readouterr().err
    assert err == (f"python -m kernels cache import: error: {path}: cannot be read: not a regular file; nothing "
                   "imported\n")


def test_importing_a_directory_is_refused(tmp_path):
    with pytest.raises(bundle.BundleError, match="Is a directory; nothing imported"):
        bundle.read_bundle(tmp_path)


def test_importing_dev_zero_is_refused_before_reading():
    done = _capped("from kernels.__main__ import main", 'sys.exit(main(["cache", "import", "/dev/zero"]))')
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr == ("python -m kernels cache import: error: /dev/zero: cannot be read: not a regular file; "
                           "nothing imported\n")


# -- 5. a failed fastpath build's log ---------------------------------------------------------------------------------
def test_a_failed_builds_log_that_is_a_fifo_is_left_out(tmp_path):
    where = fastpath_build.BuildPaths.under(tmp_path, "tag")
    where.failed.write_text("compile failed (exit 1)\n")
    os.mkfifo(where.log)
    job = fastpath_build.BuildJob(where, ("c++", fastpath_build.OUTPUT))
    with pytest.raises(fastpath_build.FastpathBuildError, match="an earlier build failed") as e:
        _within(lambda: fastpath_build.run(job), where.log)
    assert e.value.log == ""
    assert fastpath_build.read_note("/dev/zero") == "" and fastpath_build.read_note(tmp_path) == ""
    assert fastpath_build.read_note(where.failed) == "compile failed (exit 1)\n"


def test_fastpath_build_cli_with_a_fifo_log_fails_at_once(capsys):
    where = fastpath.paths()
    fsutil.make_private_dirs(where.folder)
    where.failed.write_text("compile failed (exit 1)\n")
    os.mkfifo(where.log)
    assert _within(lambda: cli.main(["fastpath", "build"]), where.log, limit_s=5) == 1
    assert "an earlier build failed" in capsys.readouterr().err


# -- 6. a FIFO planted in Triton's cache -----------------------------------------------------------------------------
def test_a_fifo_in_a_triton_cache_group_makes_it_not_intact(fifo, tmp_path):
    backend = TritonBackend()
    group = backend.triton_cache_dir / "g1"
    group.mkdir(parents=True)
    (group / "k.cubin").write_bytes(b"cubin")
    files = {"k.cubin": hashlib.sha256(b"cubin").hexdigest()}
    assert backend._group_intact("g1", files)
    os.mkfifo(group / "k.json")
    files["k.json"] = hashlib.sha256(b"").hexdigest()
    assert _within(lambda: backend._group_intact("g1", files), group / "k.json") is False


# -- the CLI's own reads ----------------------------------------------------------------------------------------------
def test_config_readme_that_is_a_fifo_is_one_line(fifo, capsys):
    path = fifo("README.md")
    assert _within(lambda: cli.main(["config", "--readme", str(path)]), path) == 2
    assert capsys.readouterr().err == f"python -m kernels config: error: --readme {path}: not a regular file\n"


def test_regular_files_still_read_as_text_mode_did(tmp_path):
    """The checked reads keep Path.read_text's newline translation: a list or table saved with CRLF (or CR) reads
    as before, line numbers included."""
    path = tmp_path / "p.json"
    path.write_bytes(b'[\r\n{"m": 8, "n": 8, "k": 8, "dtype": "fp16", "layout": "nn"},\r{"m": 16, "n": 8, "k": 8, '
                     b'"dtype": "fp16", "layout": "nn"}\r\n]\r\n')
    assert [item.where for item in problem_list.read(path)] == [f"{path}:2", f"{path}:3"]
    table = tmp_path / "lut.json"
    table.write_bytes(b'{"schema": "kernels-lut", "version": 1,\r\n "entries": []}\r\n')
    assert lut.load(table).entries == ()


# -- a learned performance model named by KERNELS_... / config.perf_model ---------------------------------------------
def test_a_performance_model_file_that_is_a_fifo_or_a_device_is_no_model(fifo):
    for path in (fifo("model.json"), "/dev/zero"):
        model, why = _within(lambda: perf_learned.load(path), *([path] if path != "/dev/zero" else []))
        assert model is None and ("not a regular file" in why or "larger than" in why), why



def test_a_logs_tail_is_read_without_reading_it_whole_and_never_from_a_fifo(fifo, tmp_path):
    log = tmp_path / "build.log"
    log.write_bytes(b"x" * (1 << 20) + b"error: the end")
    assert fsutil.read_tail(log, 14) == b"error: the end"
    assert fsutil.read_tail(log, 1 << 22).endswith(b"the end")
    with pytest.raises(OSError, match="not a regular file"):
        _within(lambda: fsutil.read_tail(fifo("log"), 10), tmp_path / "log")


def test_fastpath_state_says_an_old_failure_will_be_retried(tmp_path, monkeypatch):
    """A failure older than FAILED_RETRY_S is not 'failed' (the next build tries again, as fastpath_build does)."""
    import time

    from kernels.commands import _fastpath_line

    where = fastpath_build.BuildPaths.under(tmp_path, "tag")
    assert fastpath.state(where) == "absent"
    where.failed.write_text("compile failed (exit 1)\n")
    assert fastpath.state(where) == "failed"
    old = time.time() - fastpath_build.FAILED_RETRY_S - 60
    os.utime(where.failed, (old, old))
    assert fastpath.state(where) == "retry"
    assert fastpath_build.failed_lately(where) is False
    monkeypatch.setattr(fastpath, "paths", lambda: where)
    assert "the next build tries again" in _fastpath_line("auto")
