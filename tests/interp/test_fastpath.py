"""The C++ warm-call table (kernels/native/fastpath.py, kernels/native/csrc/fastpath.cpp) on CPU: built once for
the session, then each test copies it into its own cache dir (the `fast` fixture, tests/conftest.py). It must serve
exactly the calls the Python table would (same key), decline what it cannot serve (fp32, autograd, subclasses,
torch-function modes), and never take a call down. The library on disk is loaded only when its marker vouches for
it, and built once at a time by a builder process that outlives the process that started it."""
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import kernels
from kernels.core import fsutil
from kernels.core.config import interpret_mode
from kernels.dispatch import api
from kernels.native import fastpath, fastpath_build
from tests.helpers import run_python, served


def test_aten_winner_is_served_by_the_table_with_the_same_result(fast):
    a, b = torch.randn(8, 12).half(), torch.randn(12, 5).half()
    first = kernels.mm(a, b)
    assert api._fast_call is not None, api._fast.why_not
    assert served(lambda: kernels.mm(a, b)) == 1
    torch.testing.assert_close(kernels.mm(a, b), torch.mm(a, b), rtol=0, atol=0)
    torch.testing.assert_close(first, torch.mm(a, b), rtol=0, atol=0)
    hits = kernels.stats()["memory_hits"]
    kernels.mm(a, b)
    assert kernels.stats()["memory_hits"] == hits + 1


def test_int_mm_aten_winner(fast):
    a = torch.randint(-128, 128, (32, 16), dtype=torch.int8)
    b = torch.randint(-128, 128, (16, 8), dtype=torch.int8)
    kernels.int_mm(a, b)
    out = None

    def call():
        nonlocal out
        out = kernels.int_mm(a, b)

    assert served(call) == 1
    assert out.dtype == torch.int32 and torch.equal(out, torch.mm(a.int(), b.int()))


def test_grad_routes_to_torchs_autograd_are_served_by_the_table(fast):
    """aten won a layer's products: its grad calls after the first are the table's at::mm / at::linear under grad
    mode, recorded by torch's own autograd, per pattern of inputs needing grad; the grads are torch's."""
    torch.manual_seed(0)
    a, b = torch.randn(6, 16).half().requires_grad_(), torch.randn(16, 5).half()
    x, w = torch.randn(2, 3, 16).half().requires_grad_(), torch.randn(4, 16).half().requires_grad_()
    bias = torch.zeros(4).half().requires_grad_()
    kernels.mm(a, b), kernels.linear(x, w, bias, activation="silu")       # cold: tuned, routed
    out = []
    assert served(lambda: out.append(kernels.mm(a, b))) == 1 and type(out[-1].grad_fn).__name__ == "MmBackward0"
    assert served(lambda: out.append(kernels.linear(x, w, bias, activation="silu"))) == 1
    assert type(out[-1].grad_fn).__name__ == "SiluBackward0"
    out[-1].float().sum().backward()
    want_x, want_w = [t.detach().float().requires_grad_() for t in (x, w)]
    torch.nn.functional.silu(torch.nn.functional.linear(want_x, want_w)).sum().backward()
    torch.testing.assert_close(x.grad.float(), want_x.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.float(), want_w.grad, rtol=2e-2, atol=2e-2)
    w.requires_grad_(False)                 # another pattern: a route of its own, worked out on its first call
    assert served(lambda: kernels.linear(x, w, bias, activation="silu")) == 0
    assert served(lambda: kernels.linear(x, w, bias, activation="silu")) == 1
    with torch.no_grad():                   # the no-grad call is another key again
        assert served(lambda: kernels.mm(a, b)) == 0 and served(lambda: kernels.mm(a, b)) == 1


def test_the_table_refuses_a_grad_entry_that_is_not_torchs_own(fast):
    a, b = torch.randn(4, 8).half(), torch.randn(8, 2).half()
    kernels.mm(a, b)                                                      # loads the table
    module = api._fast.module
    grad_key = (api._fast_key("mm", a.requires_grad_(), b), True, False)
    with pytest.raises(ValueError, match="cannot compute"):
        module.add(grad_key, 2, lambda a, b: a @ b)                       # a Python launch under autograd: no
    with pytest.raises(ValueError, match="cannot compute"):
        module.add(api._fast_key("mm", a.detach(), b), 6, torch.mm)       # at::linear for a no-grad mm key: no
    assert module.add((api._fast_key("mm", a.detach(), b), False, False), 0, torch.mm) is False   # no input needs grad


def test_layout_and_alignment_are_part_of_the_key(fast):
    a, b = torch.randn(8, 12).half(), torch.randn(12, 6).half()
    kernels.mm(a, b)
    at = a.t().contiguous().t()                        # same shape, column-major: another problem
    assert served(lambda: kernels.mm(at, b)) == 0
    assert served(lambda: kernels.mm(at, b)) == 1
    storage = torch.randn(8 * 12 + 1).half()
    shifted = storage[1:].view(8, 12)                  # same shape and strides, 2-byte aligned
    assert served(lambda: kernels.mm(shifted, b)) == 0
    torch.testing.assert_close(kernels.mm(shifted, b), torch.mm(shifted, b), rtol=0, atol=0)


def test_declined_calls_take_the_python_path(fast):
    a16, b16 = torch.randn(4, 4).half(), torch.randn(4, 4).half()
    kernels.mm(a16, b16)
    module = api._fast.module
    assert module.add(api._fast_key("mm", torch.randn(2, 2), torch.randn(2, 2)), 0, torch.mm) is False   # fp32
    a32, b32 = torch.randn(4, 4), torch.randn(4, 4)
    kernels.mm(a32, b32)
    assert served(lambda: kernels.mm(a32, b32)) == 0 and kernels.mm(a32, b32).shape == (4, 4)

    g = torch.randn(4, 4).half().requires_grad_()
    kernels.mm(g.detach(), b16)                         # the same key without grad is registered
    result = None

    def grad_call():
        nonlocal result
        result = kernels.mm(g, b16)

    # declined (autograd needs it): aten won the product and its backward ones here, so the call is torch.mm itself
    # under torch's autograd (with another winner, kernels' autograd Function, whose product below autograd is the
    # table's: tests/interp/test_autograd.py)
    assert served(grad_call) == 0 and type(result.grad_fn).__name__ == "MmBackward0"
    kernels.config.backends = ("triton",)
    g2 = torch.randn(4, 8).half().requires_grad_()
    b2 = torch.randn(8, 4).half()
    kernels.mm(g2.detach(), b2)
    calls = []
    assert served(lambda: calls.append(kernels.mm(g2, b2))) == 1 and "EagerMm" in type(calls[-1].grad_fn).__name__
    kernels.config.backends = ("aten",)        # drops the process's selections: a16's is aten again, from the store

    class Sub(torch.Tensor):
        pass

    sub = a16.as_subclass(Sub)
    assert served(lambda: kernels.mm(sub, b16)) == 0

    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        assert served(lambda: kernels.mm(a16, b16)) == 0
    assert torch.mm in seen


def test_out_and_dynamic_calls_stay_in_python(fast):
    a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    kernels.mm(a, b)
    out = torch.empty(4, 4).half()
    assert served(lambda: kernels.mm(a, b, out=out)) == 0
    torch.testing.assert_close(out, torch.mm(a, b), rtol=0, atol=0)


def test_entries_made_before_the_load_are_registered_on_load(fast, monkeypatch):
    monkeypatch.setenv("KERNELS_FASTPATH", "off")
    a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    kernels.mm(a, b)
    assert api._fast_call is None and api._fast.why_not == "KERNELS_FASTPATH=off"
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    kernels.mm(torch.randn(3, 8).half(), b)             # a cold call loads the library
    assert api._fast.module.size() == 2
    assert served(lambda: kernels.mm(a, b)) == 1


def test_background_build_switches_warm_calls_over(fast, built_library, monkeypatch):
    fast.library.unlink()
    release = threading.Event()

    class GatedBuilder:                                 # stands in for the detached builder process
        def wait(self):
            assert release.wait(30)
            shutil.copy(built_library, fast.library)    # what the builder publishes
            shutil.copy(built_library.parent / fast.marker.name, fast.marker)
            return 0

    monkeypatch.setattr(fastpath, "start_builder", lambda job, wait: GatedBuilder())
    a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    kernels.mm(a, b)
    assert api._fast_call is None and api._fast.why_not == "building in the background"
    kernels.mm(a, b)                                    # warm, through the Python table meanwhile
    release.set()
    api._fast.wait(30)
    assert api._fast_call is not None
    assert served(lambda: kernels.mm(a, b)) == 1       # registered although no cold call happened since


def test_failed_build_is_recorded_and_calls_still_work(fast, monkeypatch):
    fast.library.unlink()
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("KERNELS_FASTPATH", "build")
    with pytest.raises(fastpath.FastpathBuildError, match="not found"):
        fastpath.build()
    where = fastpath.paths()                            # CXX is part of the build tag
    assert where.failed.exists() and "not found" in where.log.read_text()
    a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    torch.testing.assert_close(kernels.mm(a, b), torch.mm(a, b), rtol=0, atol=0)
    assert api._fast_call is None and "failed earlier" in api._fast.why_not
    with pytest.raises(fastpath.FastpathBuildError, match="an earlier build failed"):
        fastpath.build()                                # not retried at once...
    old = time.time() - fastpath_build.FAILED_RETRY_S - 60
    os.utime(where.failed, (old, old))
    with pytest.raises(fastpath.FastpathBuildError, match="not found"):
        fastpath.build()                                # ...but a day later: it ran (and failed) again
    assert time.time() - where.failed.stat().st_mtime < 60


def test_leftover_temp_files_are_not_loaded(fast):
    (fast.folder / f".{fastpath.MODULE_NAME}.1234.deadbeef.so").write_bytes(b"half-written")
    assert fastpath.build() == fast.library            # the published library is what loads


def test_clear_memory_cache_empties_the_table(fast):
    kernels.mm(torch.randn(4, 8).half(), torch.randn(8, 4).half())
    assert api._fast.module.size() == 1
    kernels.clear_memory_cache()
    assert api._fast.module.size() == 0


@pytest.mark.skipif(not interpret_mode(), reason="Triton winners on CPU need TRITON_INTERPRET=1")
def test_triton_winner_is_called_through_its_launcher(fast):
    kernels.config.backends = ("triton",)
    kernels.config.only = (r"^triton_mm_fp16_32x16x16_s1_",)
    a, b = torch.randn(17, 33).half(), torch.randn(33, 9).half()
    kernels.mm(a, b)
    assert kernels.explain(a, b).winner.startswith("triton_mm_")
    out = None

    def call():
        nonlocal out
        out = kernels.mm(a, b)

    assert served(call) == 1
    torch.testing.assert_close(out, torch.mm(a.float(), b.float()).half(), rtol=2e-3, atol=2e-3)


# -- the library on disk: verified before dlopen, built once at a time, by a builder that outlives its starter ------

def fake_compiler(folder, library, sleep_s=0.0, partial=False):
    """A stand-in for c++ (set as CXX, so also its own build tag): records each call in `calls`, sleeps, then writes
    `library` to the -o target (with `partial`, a first kilobyte of it, then sleeps a minute in a child process, as
    cc1plus would)."""
    calls = folder / "compiler_calls"
    script = folder / "fake-c++"
    tail = (f'head -c 1000 "{library}" > "$out"\nsleep 60\n' if partial else
            f'sleep {sleep_s}\ncp "{library}" "$out"\n')
    script.write_text('#!/bin/sh\nout=""; prev=""\nfor a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
                      f'echo "$$" >> "{calls}"\n' + tail)
    script.chmod(0o755)
    return script, calls


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain `text` (a cache path: builders and compilers name it)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def wait_until_gone(text: str, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def temporaries(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


LOAD_AND_CALL = """
import torch, kernels
status = kernels.load_fastpath(wait=True)
a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
assert torch.equal(kernels.mm(a, b), torch.mm(a, b))
print(status)
"""


@pytest.fixture
def rebuilding(built_library, tmp_path, monkeypatch, isolated_cache):
    """KERNELS_FASTPATH=auto with a compiler that 'builds' the good library at once: the paths of this cache's
    library, for a test to plant something there first."""
    cxx, _ = fake_compiler(tmp_path, built_library)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    monkeypatch.setenv("KERNELS_BACKENDS", "aten")
    where = fastpath.paths()
    where.folder.mkdir(parents=True)
    return where


@pytest.mark.parametrize("marker", ["none", "of the whole library"])
def test_truncated_library_never_reaches_dlopen_and_is_rebuilt(rebuilding, built_library, marker):
    """A truncated library (a copy cut short, or one corrupted after it was published) used to kill every process
    that loaded it (SIGBUS, exit 135)."""
    data = built_library.read_bytes()
    rebuilding.library.write_bytes(data[: len(data) // 2])
    if marker != "none":
        fsutil.publish_marker(built_library, rebuilding.marker, rebuilding.key, {})
    out = run_python(LOAD_AND_CALL, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert out.stdout.strip() == "loaded", out.stderr[-3000:]
    assert out.stderr.count("FastpathWarning") == 1, out.stderr[-3000:]
    assert rebuilding.library.read_bytes() == data
    assert fastpath.state(rebuilding) == "built"


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to make a foreign library")
@pytest.mark.parametrize("marker", ["none", "of another library"])
def test_foreign_library_is_never_loaded(rebuilding, built_library, tmp_path, marker):
    ran = tmp_path / "foreign_library_ran"
    source = tmp_path / "foreign.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                      f'{{ FILE *f = fopen("{ran}", "w"); if (f) fclose(f); }}\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(rebuilding.library), str(source)], check=True)
    if marker != "none":
        fsutil.publish_marker(built_library, rebuilding.marker, rebuilding.key, {})
    out = run_python(LOAD_AND_CALL, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert not ran.exists(), "the foreign library was loaded"
    assert out.stdout.strip() == "loaded" and out.stderr.count("FastpathWarning") == 1, out.stderr[-3000:]
    assert rebuilding.library.read_bytes() == built_library.read_bytes()


def test_state_names_an_unverified_library_and_removes_nothing(rebuilding, built_library):
    rebuilding.library.write_bytes(built_library.read_bytes()[:1000])
    assert fastpath.state(rebuilding) == "unverified"
    assert os.path.exists(rebuilding.library)           # reading the state removes nothing


@pytest.mark.slow
def test_eight_short_processes_build_once_and_leave_no_compiler_or_temporary(built_library, tmp_path, monkeypatch,
                                                                          isolated_cache):
    """Each process asks for the library and exits at once, while the (slow) compile still runs: the build used to
    die unpublished with the first process's thread, each process leaving an orphan compiler and a temporary."""
    cxx, calls = fake_compiler(tmp_path, built_library, sleep_s=4)
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    where = fastpath.paths()
    code = "import kernels; kernels.load_fastpath(wait=False)"
    for _ in range(8):          # each ~4 s (torch's import): the first ones overlap the compile, which takes as long
        out = run_python(code, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
    left = wait_until_gone(str(isolated_cache), 60)
    assert not left, left
    assert where.library.exists(), "the build never published the library"
    assert temporaries(where.folder) == []
    assert len(calls.read_text().split()) == 1        # one compile for the eight processes
    assert fastpath.state(where) == "built"


def test_interrupted_builder_takes_its_compiler_down_and_removes_its_temporary(built_library, tmp_path, monkeypatch,
                                                                              isolated_cache):
    cxx, _ = fake_compiler(tmp_path, built_library, partial=True)
    monkeypatch.setenv("CXX", str(cxx))
    where = fastpath.paths()
    where.folder.mkdir(parents=True)
    builder = fastpath.start_builder(fastpath.build_job(where), wait=False)
    deadline = time.monotonic() + 30
    while not temporaries(where.folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert temporaries(where.folder), "the compile never started"
    builder.terminate()
    assert builder.wait(30) != 0
    assert not wait_until_gone(str(isolated_cache), 10)
    assert temporaries(where.folder) == [] and not where.library.exists()


def test_build_removes_what_dead_builders_left(built_library, tmp_path, monkeypatch, isolated_cache):
    cxx, _ = fake_compiler(tmp_path, built_library)
    monkeypatch.setenv("CXX", str(cxx))
    where = fastpath.paths()
    where.folder.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    left_behind = [f".{fastpath.MODULE_NAME}.tmp.{dead.pid}.so", f".{fastpath.MODULE_NAME}.{dead.pid}.deadbeef.so",
                   f".{where.marker.name}.{dead.pid}.0123abcd.tmp"]
    for name in left_behind:
        (where.folder / name).write_bytes(b"half-written")
    live = f".{fastpath.MODULE_NAME}.tmp.{os.getpid()}.so"      # a live writer's: not for this build to remove
    (where.folder / live).write_bytes(b"being written")
    assert fastpath.build() == where.library
    assert temporaries(where.folder) == [live]
