"""Suite-wide CUTLASS builds (`Backend.prebuild`, `kernels.autotune.prebuild`): one batch for several problems, and
the per-problem builds that follow compile nothing. ninja is faked here (the real path is test_cutlass_compile)."""
import shutil

import pytest

from backends.cutlass import CutlassBackend
from kernels.core.toolchain import resolve
from tests.helpers import problem

TOOLS = resolve()
pytestmark = pytest.mark.skipif(not TOOLS.usable or shutil.which("ninja") is None,
                                reason=f"nvcc/CUTLASS/ninja missing: {TOOLS.message or 'ninja not on PATH'}")


@pytest.fixture
def batches(monkeypatch):
    """Record each ninja batch (binary paths) and stand in for nvcc by writing the binaries."""
    seen = []

    def fake_compile(self, todo, max_jobs=None, on_progress=None):
        seen.append([p.paths.binary for p in todo])
        for p in todo:
            p.paths.binary.parent.mkdir(parents=True, exist_ok=True)
            p.paths.binary.write_bytes(b"not a real library")

    monkeypatch.setattr(CutlassBackend, "_compile", fake_compile)
    return seen


def test_prebuild_builds_a_suite_in_one_batch_and_the_builds_after_compile_nothing(batches):
    backend = CutlassBackend(TOOLS)
    work = [(p, backend.choices(p)[0][:4]) for p in (problem(), problem(16, 4096, 11008), problem(2048, 8192, 1024))]
    binaries = {backend.artifact_paths(p, c)[1].binary for p, cs in work for c in cs}
    assert backend.prebuild(work) == len(binaries) and len(batches) == 1
    assert set(batches[0]) == binaries and len(batches[0]) == len(binaries)     # shared binaries built once
    for p, cs in work:
        outcomes = backend.compile_only(p, cs)
        assert all(o.error is None and not o.compiled for o in outcomes), outcomes
    assert len(batches) == 1 and backend.prebuild(work) == 0


def test_autotune_prebuild_uses_the_tuners_choices(batches, monkeypatch):
    from backends import get_backend
    from kernels.tune.autotune import prebuild

    monkeypatch.setattr(get_backend("cutlass"), "max_configs", 2)
    problems = [problem(), problem(64, 4096, 4096)]
    assert prebuild(problems, ("cutlass", "aten")) == {"cutlass": len(batches[0]), "aten": 0}
    backend = CutlassBackend(TOOLS, max_configs=2)
    expected = {backend.artifact_paths(p, c)[1].binary for p in problems for c in backend.choices(p)[0]}
    assert set(batches[0]) == expected and len(batches) == 1
    assert prebuild([problem(arch=70)], ("cutlass",)) == {"cutlass": 0}     # unavailable there: nothing to do


def test_a_built_set_hashes_each_binary_once_and_rebuilds_a_corrupt_one(batches, monkeypatch):
    """With everything built, the batch check hashes each distinct binary once, however many candidates (of however
    many problems) stand behind it; a binary changed behind its marker's back (same size) is compiled again by the
    batch itself, so the background builder repairs it too."""
    import kernels.core.fsutil as fsutil

    backend = CutlassBackend(TOOLS)
    problems = [problem(16, 4096, 11008), problem(32, 4096, 11008)]
    work = [(p, backend.choices(p)[0][:3]) for p in problems]
    binaries = {backend.artifact_paths(p, c)[1].binary for p, cs in work for c in cs}
    assert backend.prebuild(work) == len(binaries) and sum(len(cs) for _, cs in work) > len(binaries)
    hashed = []
    real = fsutil.file_sha256
    monkeypatch.setattr(fsutil, "file_sha256", lambda path: hashed.append(path) or real(path))
    assert backend.prebuild(work) == 0
    assert sorted(hashed) == sorted(binaries)                          # once each
    _, paths, _ = backend.artifact_paths(problems[0], work[0][1][0])
    paths.binary.write_bytes(b"X" * paths.binary.stat().st_size)          # same size: the marker still claims it
    assert backend.prebuild(work) == 1 and batches[-1] == [paths.binary]
