"""Generated Triton modules (<cache>/triton/src/<template>_<digest>.py) run only from bytes that match the digest in
their name: a .pyc planted in their __pycache__ is never run, an edited module is removed and rendered again (one
warning), and a malformed artifact record is a miss. Interpreter (CPU) tests: a tiny fp16 problem, one choice."""
import importlib.util
import hashlib
import json
import os
import py_compile
import re
import shutil
import warnings

import pytest
import torch

import kernels
from backends import triton_worker
from backends import triton as triton_backend
from backends.triton import TritonBackend, triton_version
from backends.triton_modules import GeneratedModuleWarning
from backends.triton_render import build_key, render
from backends.triton_templates import family
from kernels.core.choice import Choice
from kernels.core.config import interpret_mode
from kernels.core.problem import GemmProblem
from kernels.space.heuristics import GemmConfig
from tests.triton_helpers import assert_close

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")


def operands():
    torch.manual_seed(0)
    return torch.randn(9, 16).half(), torch.randn(16, 7).half()


def build_and_run(a, b):
    """Build the one triton_mm choice for (a, b) in the current cache and run it."""
    p = GemmProblem.from_tensors("mm", a, b)
    outcome = TritonBackend().build(p, [Choice("triton", "triton_mm", p.dtype, GemmConfig(16, 16, 16, 1, 1))])[0]
    assert outcome.runner is not None, outcome.error
    return outcome.runner.launch(a, b, None)


def rendered_module(cache) -> "os.PathLike":
    (module,) = (cache / "triton" / "src").glob("*.py")
    return module


@pytest.fixture
def second_cache(tmp_path, monkeypatch):
    """Switches to a fresh cache dir when called: modules already loaded in this process were loaded from the first
    one, so what is planted in this one is read from disk again."""
    def switch():
        cache = tmp_path / "second"
        monkeypatch.setenv("KERNELS_CACHE_DIR", str(cache))
        kernels.config.reset()
        return cache
    return switch


def planted(source: str, marker) -> str:
    """The module's own code plus a line that leaves `marker` behind when it runs."""
    return source + f"\nopen({str(marker)!r}, 'w').close()\n"


def test_planted_pyc_beside_a_generated_module_is_never_run(isolated_cache, second_cache, tmp_path):
    a, b = operands()
    build_and_run(a, b)
    genuine = rendered_module(isolated_cache)
    module = second_cache() / "triton" / "src" / genuine.name
    module.parent.mkdir(parents=True)
    shutil.copy(genuine, module)
    marker = tmp_path / "planted_pyc_ran"
    evil = tmp_path / "evil.py"
    evil.write_text(planted(genuine.read_text(), marker))
    # an unchecked hash-based .pyc is never compared with its source by the import system
    py_compile.compile(str(evil), cfile=importlib.util.cache_from_source(str(module)), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)

    with warnings.catch_warnings():
        warnings.simplefilter("error", GeneratedModuleWarning)      # the module itself is intact: no warning
        assert_close(build_and_run(a, b), a, b)
    assert not marker.exists(), "code from the planted .pyc ran"


def tampered_copy(a, b, first_cache, second_cache, marker):
    """Render a module in the first cache, then plant an edited copy (which would create `marker` if run) under the
    same name in a second cache: (the genuine module, the planted one, the marker path)."""
    build_and_run(a, b)
    genuine = rendered_module(first_cache)
    module = second_cache() / "triton" / "src" / genuine.name
    module.parent.mkdir(parents=True)
    module.write_text(planted(genuine.read_text(), marker))
    return genuine, module, marker


def test_edited_generated_module_is_removed_and_rendered_again_with_one_warning(isolated_cache, second_cache,
                                                                              tmp_path):
    a, b = operands()
    genuine, module, marker = tampered_copy(a, b, isolated_cache, second_cache, tmp_path / "edited_module_ran")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = build_and_run(a, b)
    assert_close(out, a, b)
    assert not marker.exists(), "the edited module ran"
    ours = [w for w in caught if issubclass(w.category, GeneratedModuleWarning)]
    assert len(ours) == 1 and genuine.name in str(ours[0].message), [str(w.message) for w in caught]
    assert module.read_bytes() == genuine.read_bytes()          # rendered again under the same name

    with warnings.catch_warnings():
        warnings.simplefilter("error", GeneratedModuleWarning)      # intact now: the next build says nothing
        assert_close(build_and_run(a, b), a, b)


def test_loader_runs_only_bytes_that_match_the_name(isolated_cache, second_cache, tmp_path):
    """The loader the compile workers and the interpreter path share reads, checks and runs the same bytes: a module
    swapped after it was rendered is removed with one warning, never run."""
    a, b = operands()
    genuine, module, marker = tampered_copy(a, b, isolated_cache, second_cache, tmp_path / "swapped_module_ran")
    kernel_name = re.search(r"^def (\w+)\(", genuine.read_text(), re.MULTILINE).group(1)

    with pytest.warns(GeneratedModuleWarning, match=genuine.name), pytest.raises(ValueError, match="content hash"):
        triton_worker.load_kernel(str(module), kernel_name)
    assert not marker.exists(), "the swapped module ran"
    assert not module.exists()


ARTIFACT = {"triton_hash": "ab" * 32, "cache_group": "GROUP0", "compile_seconds": 1.5}


def compiled_kernel(monkeypatch):
    """A Triton backend as on a GPU (records exist for compiled kernels) and one kernel's problem, choice, spec and
    build key, for tests that write its artifact record and Triton cache folder by hand."""
    monkeypatch.setattr(triton_backend, "interpret_mode", lambda: False)
    problem = GemmProblem(op="mm", m=64, n=64, k=64, dtype="fp16", out_dtype="fp16", stride_a=(64, 1),
                          stride_b=(64, 1), align_a=16, align_b=16, device="cuda", arch=90, device_name="test")
    choice = Choice("triton", "triton_mm", "fp16", GemmConfig(32, 32, 32, 2, 4))
    (spec,) = family("triton_mm").specs(problem, choice)
    return TritonBackend(), problem, choice, spec, build_key(render(spec), spec, "cuda:90", triton_version())


def recorded_folder(backend, spec, key):
    """A compiled kernel's Triton cache folder (GROUP0: metadata and a cubin) and our record of it, hashes and all:
    (the folder, the record's path)."""
    group = backend.triton_cache_dir / "GROUP0"
    group.mkdir(parents=True)
    (group / "kernel.json").write_text("{}")
    (group / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(64))
    record = backend.root / "artifacts" / f"{key}.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps(dict(ARTIFACT, kernel=spec.kernel_name, triton=triton_version(), arch=90,
                                      files=backend._group_hashes("GROUP0"))))
    return group, record


@pytest.mark.parametrize("bad", [
    {"cache_group": "../triton_cache/GROUP0"}, {"cache_group": 7}, {"cache_group": ""}, {"arch": "90"}, {"arch": 80},
    {"arch": True}, {"kernel": "other"}, {"triton": "0.0"}, {"triton_hash": None}, {"compile_seconds": "1"},
    {"compile_seconds": float("nan")}, {"files": {}}, {"files": {"../kernel.json": "00"}}, {"files": None},
    {"files": {"kernel.json": "00" * 32}},
])
def test_malformed_artifact_record_is_a_miss(isolated_cache, monkeypatch, bad):
    """A compiled kernel counts as built only when its artifact record is the one a compile of it would write."""
    backend, problem, choice, spec, key = compiled_kernel(monkeypatch)
    (backend.triton_cache_dir / "GROUP0").mkdir(parents=True)            # the compiled kernel's files
    (backend.triton_cache_dir / "GROUP0" / "kernel.json").write_text("{}")
    record = backend.root / "artifacts" / f"{key}.json"
    record.parent.mkdir(parents=True)
    good = dict(ARTIFACT, kernel=spec.kernel_name, triton=triton_version(), arch=90,
                files={"kernel.json": hashlib.sha256(b"{}").hexdigest()})
    record.write_text(json.dumps(good))
    assert backend.built(problem, [choice]) == {choice.name}
    record.write_text(json.dumps(dict(good, **bad), allow_nan=True))
    assert backend.built(problem, [choice]) == set()


def test_a_changed_binary_in_tritons_cache_is_a_miss(isolated_cache, monkeypatch):
    """Triton loads its cubin without a check: the files its cache folder holds must hash as they did when compiled
    (a truncated or swapped cubin is a miss, compiled again: the next test)."""
    backend, problem, choice, spec, key = compiled_kernel(monkeypatch)
    group, record = recorded_folder(backend, spec, key)
    assert backend.built(problem, [choice]) == {choice.name}
    (group / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(8))                 # truncated
    assert backend.built(problem, [choice]) == set()
    (group / "kernel.cubin").unlink()
    assert backend.built(problem, [choice]) == set()


def test_a_kernel_whose_folder_changed_is_compiled_again_not_handed_back(isolated_cache, monkeypatch):
    """Triton's own cache checks only that a folder's files exist: before the pool compiles a kernel whose recorded
    folder no longer hashes as recorded, that folder is removed, so the compile is a real one and the record is
    rewritten from its output, not from the changed files."""
    backend, problem, choice, spec, key = compiled_kernel(monkeypatch)
    group, record = recorded_folder(backend, spec, key)
    (group / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(8))                 # changed since it was recorded
    seen = []

    class Pool:       # the compile as Triton would run it: a real compile writes the folder afresh
        def map(self, jobs, timeout_s=600.0):
            seen.append(group.exists())
            group.mkdir(parents=True, exist_ok=True)
            (group / "kernel.json").write_text("{}")
            (group / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(64))
            return [{"id": j["id"], "ok": True, "hash": ARTIFACT["triton_hash"], "cache_group": "GROUP0"} for j in jobs]

    monkeypatch.setattr(backend, "_get_pool", lambda: Pool())
    path = backend.root / "src" / "module.py"
    backend._compiled(problem, {key: (spec, path, render(spec))})      # loading needs a GPU: only the build is checked
    assert seen == [False]                                             # the changed folder was gone before the compile
    assert backend.built(problem, [choice]) == {choice.name}
    assert json.loads(record.read_text())["files"] == backend._group_hashes("GROUP0")
    # a kernel never recorded, or recorded for another kernel: nothing removed
    other = backend.triton_cache_dir / "GROUP1"
    other.mkdir()
    record.write_text(json.dumps(dict(ARTIFACT, kernel="another", cache_group="GROUP1", triton=triton_version(),
                                      arch=90, files={})))
    backend._drop_changed_group(key, spec, 90)
    assert other.exists()


def test_a_recorded_kernel_in_a_folder_others_can_write_is_not_loaded(isolated_cache, monkeypatch):
    """Triton loads a kernel's cubin from its cache folder: below a root others may enter, a folder writable by group
    or others holds files anyone could have swapped together with our record's view of them, so the kernel is not
    loaded from it (a load failure: the candidate never wins)."""
    from kernels.core.cache_root import CacheWarning, ForeignWriterError, forget

    backend, problem, choice, spec, key = compiled_kernel(monkeypatch)
    group, record = recorded_folder(backend, spec, key)
    forget()
    os.chmod(isolated_cache, 0o755)
    os.chmod(group, 0o777)
    with pytest.warns(CacheWarning, match="not loading the Triton kernel file"), \
            pytest.raises(ForeignWriterError, match="writable by group or others"):
        backend._from_store(problem, spec, backend.root / "src" / "module.py", key)
