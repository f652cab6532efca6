"""Trust nothing on disk (issue 26): the cache root is checked before use, writes never follow links and degrade on a
full or read-only disk, stored selections are checked against a schema and their winners re-verified, stale entries
re-tuned, the warm tables bounded. Faults are injected (CI runs as root: chmod cannot make them)."""
import errno
import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernels
from kernels.core import cache_root as cache_root_mod
from kernels.core import fsutil
from kernels.core.cache_root import CacheWarning, cache_root
from kernels.dispatch import api, selected
from kernels.store import entries
from kernels.store.selections import SelectionStore


pytestmark = pytest.mark.usefixtures("fresh_cache_checks")       # conftest.py: the cache's checks made anew


def _mm_ok() -> None:
    a, b = torch.randn(24, 40), torch.randn(40, 8)
    assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-5)


def _ours(w) -> list:
    return [x for x in w if issubclass(x.category, CacheWarning)]


def test_a_private_root_is_used_and_new_folders_are_0700(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(tmp_path / "a" / "b"))
    old = os.umask(0o000)                       # the most permissive umask: our modes must not depend on it
    try:
        assert cache_root() == tmp_path / "a" / "b"
        fsutil.atomic_write_text(tmp_path / "a" / "b" / "x" / "f.json", "{}")
    finally:
        os.umask(old)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "x"):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b" / "x" / "f.json").st_mode) == 0o600


@pytest.mark.parametrize("fault", ["world-writable", "another owner", "a regular file", "a symlink"])
def test_an_unsafe_root_warns_once_and_a_private_cache_serves(tmp_path, monkeypatch, fault):
    root = tmp_path / "cache"
    if fault == "a regular file":
        root.write_text("not a directory")
    elif fault == "a symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
    else:
        root.mkdir(mode=0o700)
        real = os.lstat

        def fake_lstat(path):
            st_ = real(path)
            if Path(path) != root:
                return st_
            fields = list(st_)
            if fault == "world-writable":
                fields[stat.ST_MODE] = st_.st_mode | 0o777
            else:
                fields[stat.ST_UID] = st_.st_uid + 1
            return os.stat_result(fields)

        monkeypatch.setattr(cache_root_mod, "_lstat", fake_lstat)
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(root))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _mm_ok()
        _mm_ok()
        used = cache_root()
    assert len(_ours(caught)) == 1, [str(w.message) for w in caught]
    assert used != root and str(used).startswith(os.path.realpath(os.path.dirname(used)))
    assert list(used.glob("selections/*.json")), "the private cache stores the selection"
    if fault == "a symlink":
        assert not list((tmp_path / "elsewhere").iterdir()), "nothing written through the link"


def test_lock_files_never_follow_a_planted_link(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("precious")
    lock = tmp_path / "locks" / "k.lock"
    lock.parent.mkdir()
    lock.symlink_to(target)
    with fsutil.file_lock(lock, 5):
        pass
    assert target.read_text() == "precious" and not lock.is_symlink()


def test_writes_replace_a_planted_link_instead_of_writing_through_it(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("precious")
    (tmp_path / "entry.json").symlink_to(target)
    fsutil.atomic_write_text(tmp_path / "entry.json", "{}")
    assert target.read_text() == "precious" and (tmp_path / "entry.json").read_text() == "{}"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_a_failed_write_warns_once_and_the_result_serves_from_memory(monkeypatch, code):
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fsutil, "atomic_write_text", refuse)
    monkeypatch.setattr(entries, "atomic_write_text", refuse)
    monkeypatch.setattr(entries, "file_lock", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (24, 25, 26):
            a, b = torch.randn(m, 40), torch.randn(40, 8)
            assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-5)
    assert len(_ours(caught)) == 1 and os.strerror(code) in str(_ours(caught)[0].message)
    assert kernels.stats()["tunes"] >= 3


def _stored_entry(cache: Path) -> Path:
    files = sorted((cache / "selections").glob("*.json"))
    assert len(files) == 1
    return files[0]


def test_a_winner_that_fails_verification_when_loaded_is_retuned(isolated_cache, monkeypatch):
    a, b = torch.randn(24, 40), torch.randn(40, 8)
    kernels.mm(a, b)
    kernels.clear_memory_cache()
    real = selected.get_backend

    class WrongBackend:                             # what a tampered entry's winner computes: NaN
        def __init__(self, backend):
            self.backend = backend

        def build(self, problem, choices):
            outcomes = self.backend.build(problem, choices)
            for o in outcomes:
                o.runner.launch = lambda a, b, out=None: torch.full((a.shape[0], b.shape[1]), float("nan"))
            return outcomes

    monkeypatch.setattr(selected, "get_backend", lambda name: WrongBackend(real(name)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tunes = kernels.stats()["tunes"]
        out = kernels.mm(a, b)
    assert any("failed verification" in str(w.message) for w in caught)
    assert kernels.stats()["tunes"] == tunes + 1 and not torch.isnan(out).any()


def test_a_selection_tuned_without_a_backend_is_retuned_once_it_can_serve(isolated_cache, monkeypatch):
    a, b = torch.randn(24, 40), torch.randn(40, 8)
    kernels.config.backends = ("aten", "triton")
    triton = selected.get_backend("triton")
    monkeypatch.setattr(type(triton), "available", lambda self, p: (False, "numpy is missing"))
    kernels.mm(a, b)
    assert json.loads(_stored_entry(isolated_cache).read_text())["selection"]["unavailable"] == ["triton"]
    kernels.clear_memory_cache()
    monkeypatch.undo()
    kernels.config.backends = ("aten", "triton")
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(isolated_cache))
    tunes = kernels.stats()["tunes"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels.mm(a, b)
    assert kernels.stats()["tunes"] == tunes + 1
    assert any("could not serve" in str(w.message) for w in caught)


good = {"schema": 1, "winner": "aten_mm", "choices": {"aten_mm": {"backend": "aten", "template": "aten_mm",
        "dtype": "fp32", "config": None, "params": []}}, "timings": {"aten_mm": 0.01}}
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
                           | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(["schema", "winner", "choices", "timings", "problem", "details", "notes",
                              "stage_seconds", "unavailable", "tune_seconds", "created", "fingerprint",
                              "pending"]),
       value=json_values)
def test_any_json_in_a_selection_file_is_ignored_or_used_never_an_error(isolated_cache, field, value):
    a, b = torch.randn(24, 40), torch.randn(40, 8)
    kernels.clear_memory_cache()
    kernels.mm(a, b)
    path = _stored_entry(isolated_cache)
    data = json.loads(path.read_text())
    data["selection"][field] = value
    path.write_text(json.dumps(data))
    kernels.clear_memory_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-5)
        store = SelectionStore()
        store.get(data["key"])          # never raises, whatever the file holds


def test_the_warm_tables_stay_bounded(monkeypatch):
    kernels.config.max_problems = 16
    b = torch.randn(8, 4)
    for m in range(1, 200):
        a = torch.randn(m, 8)
        assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-5)
    assert len(api._dispatch) <= 16 and len(selected._launchers) <= 16 and len(selected._selections) <= 16


@pytest.mark.parametrize("text", ["[" * 100000, "\x00\xff garbage", "", "[1, 2]", '{"key": 1}', "1e999999"])
def test_any_bytes_in_a_selection_file_are_a_miss_never_an_error(isolated_cache, text):
    a, b = torch.randn(24, 40), torch.randn(40, 8)
    kernels.mm(a, b)
    _stored_entry(isolated_cache).write_text(text, errors="surrogateescape")
    kernels.clear_memory_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-5)


def test_explain_of_a_dynamic_own_tune_survives_a_shrink(monkeypatch):
    """A dynamic shape no hint winner can run is tuned on its own; the warm tables shrinking under other problems
    must not leave explain() without its Selection."""
    from kernels.dispatch import dynamic

    monkeypatch.setattr(dynamic.Family, "can_run", staticmethod(lambda runtime, c: "cannot (forced)"))
    kernels.config.max_problems = 8
    a, b = torch.randn(24, 40), torch.randn(40, 8)
    kernels.mm(a, b, dynamic="m")
    before = kernels.explain(a, b, dynamic="m")
    for m in range(1, 12):
        kernels.mm(torch.randn(m, 8), torch.randn(8, 4))
    after = kernels.explain(a, b, dynamic="m")
    assert before.winner and (after.winner, after.problem) == (before.winner, before.problem)


def test_a_relative_cache_dir_is_made_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KERNELS_CACHE_DIR", "kc")
    assert kernels.config.cache_dir == str(tmp_path / "kc")


def test_no_background_fastpath_build_into_a_temporary_cache(tmp_path, monkeypatch):
    from kernels.native import fastpath

    root = tmp_path / "not-a-dir"
    root.write_text("")
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(root))
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    monkeypatch.setattr(fastpath, "start_builder", lambda *a, **k: pytest.fail("started a builder"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        state = fastpath.Fastpath()
        state.try_load(lambda module: None)
    assert state.module is None and "temporary cache" in state.why_not


@pytest.mark.parametrize("plant", ["fifo", "device", "directory", "oversize", "deep"])
def test_a_json_file_that_is_no_plain_small_file_is_a_miss_at_once(tmp_path, monkeypatch, plant):
    """A FIFO (which would block an open for reading), a link to /dev/zero, a directory, a file past the size limit
    or JSON nested past the parser's recursion where a selection, marker or record belongs: read_json returns None
    without hanging or reading it whole."""
    path = tmp_path / "entry.json"
    if plant == "fifo":
        os.mkfifo(path)
    elif plant == "device":
        path.symlink_to("/dev/zero")
    elif plant == "directory":
        path.mkdir()
    elif plant == "oversize":
        path.write_text(json.dumps({"pad": "x" * 100}))
        monkeypatch.setattr(fsutil, "MAX_JSON_BYTES", 64)
    else:
        path.write_text("[" * 100000 + "]" * 100000)
    assert fsutil.read_json(path) is None
    path2 = tmp_path / "ok.json"
    path2.write_text('{"a": 1}')
    assert fsutil.read_json(path2) == {"a": 1}


@pytest.mark.parametrize("plant", ["fifo", "directory"])
def test_a_generated_module_planted_as_a_fifo_or_a_folder_is_replaced(tmp_path, plant):
    """Where a rendered Triton module belongs, a FIFO or a directory is removed and the module written again (the
    reader neither blocks on the FIFO nor fails every candidate on the directory)."""
    from backends import triton_modules

    source = "X = 1\n"
    path = tmp_path / triton_modules.module_file_name("mm", source)
    if plant == "fifo":
        os.mkfifo(path)
    else:
        (path / "inner").mkdir(parents=True)
    with pytest.warns(triton_modules.GeneratedModuleWarning):
        triton_modules.publish(path, source, lambda p, text: fsutil.atomic_write_text(p, text))
    assert path.read_text() == source
    assert triton_modules.load(path, "m").X == 1


def test_code_in_a_folder_others_can_write_or_reach_through_a_link_is_not_loaded(tmp_path, monkeypatch):
    """A binary and its marker sit side by side, so whoever can write their folder can swap both: below a root others
    may enter (0755), a folder writable by group or others, or a link, keeps anything in it from being loaded (one
    warning); a folder of ours others cannot enter (0700, as new ones are made) closes everything below it."""
    from backends import cutlass
    from kernels.native import fastpath

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(root))
    loose = root / "fastpath" / "tag"
    loose.mkdir(parents=True)
    os.chmod(root / "fastpath", 0o777)
    library = loose / "_kernels_fastpath.so"
    library.write_bytes(b"\x7fELF planted")
    assert cache_root_mod.foreign_writer(library) is None         # the root is 0700: no one else gets in
    os.chmod(root, 0o755)
    assert "writable by group or others (mode 777)" in cache_root_mod.foreign_writer(library)
    with pytest.warns(CacheWarning, match="not loading the fastpath library"), \
            pytest.raises(cache_root_mod.ForeignWriterError):
        fastpath.load_library(library)
    with pytest.raises(cache_root_mod.ForeignWriterError, match="the CUTLASS kernel"):
        cutlass.load_library(library)
    os.chmod(root / "fastpath", 0o700)
    assert cache_root_mod.foreign_writer(library) is None
    os.chmod(root / "fastpath", 0o755)
    (root / "linked").symlink_to(loose)
    assert "is a symbolic link" in cache_root_mod.foreign_writer(root / "linked" / "_kernels_fastpath.so")
    assert cache_root_mod.foreign_writer(root / "absent" / "x.so") is None     # nothing there to load
    os.chmod(root, 0o700)                  # a closed root: a link below it still leads out, to a folder others write
    world = tmp_path / "world"
    world.mkdir(mode=0o777)
    os.chmod(world, 0o777)
    (world / "k.so").write_bytes(b"\x7fELF planted")
    (root / "fastpath" / "out").symlink_to(world)
    assert "is a symbolic link" in cache_root_mod.foreign_writer(root / "fastpath" / "out" / "k.so")
    (loose / "k.so").symlink_to(world / "k.so")
    assert "is a symbolic link" in cache_root_mod.foreign_writer(loose / "k.so")
    os.chmod(root, 0o755)
    elsewhere = tmp_path / "elsewhere"                 # built outside the cache: its folder and it are checked
    elsewhere.mkdir(mode=0o700)
    (elsewhere / "k.so").write_bytes(b"")
    assert cache_root_mod.foreign_writer(elsewhere / "k.so") is None
    os.chmod(elsewhere, 0o777)
    assert "writable by group or others" in cache_root_mod.foreign_writer(elsewhere / "k.so")


def test_a_compile_worker_never_imports_a_module_planted_in_the_callers_working_directory(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on the path: the Triton compile workers run from the package's
    root, so a json.py where the user happens to run from is never executed by them (an attacker's probe)."""
    from backends.worker_pool import _Worker, worker_env

    marker = tmp_path / "ran"
    (tmp_path / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit(7)\n")
    monkeypatch.chdir(tmp_path)
    worker = _Worker("backends.triton_worker", worker_env({}))
    worker.proc.stdin.close()           # the worker reads to the end of its input and exits
    assert worker.proc.wait(timeout=120) == 0 and not marker.exists()
