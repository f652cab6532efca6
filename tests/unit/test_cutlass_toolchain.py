"""CUTLASS_DIR resolution (env -> third_party -> pip package -> none) and nvcc discovery, on temp trees."""
from pathlib import Path

import pytest

from kernels.core import toolchain
from tests.helpers import problem, run_python


def fake_cutlass(root: Path, version=(3, 9, 1)) -> Path:
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "include" / "cute").mkdir(parents=True)
    (root / "tools" / "util" / "include" / "cutlass" / "util").mkdir(parents=True)
    (root / "include" / "cutlass" / "cutlass.h").write_text("")
    (root / "include" / "cute" / "tensor.hpp").write_text("")
    major, minor, patch = version
    (root / "include" / "cutlass" / "version.h").write_text(
        f"#define CUTLASS_MAJOR {major}\n#define CUTLASS_MINOR {minor}\n#define CUTLASS_PATCH {patch}\n")
    return root


def test_env_var_wins(tmp_path):
    env_root = fake_cutlass(tmp_path / "checkout", (4, 1, 0))
    repo = tmp_path / "repo"
    fake_cutlass(repo / "third_party" / "cutlass")
    found, tried = toolchain.resolve_cutlass({"CUTLASS_DIR": str(env_root)}, repo, package_root=None)
    assert found.source == "CUTLASS_DIR" and found.root == env_root.resolve() and found.version == "4.1.0"
    assert found.include_dirs == (env_root.resolve() / "include", env_root.resolve() / "tools" / "util" / "include")
    assert tried == []


def test_bad_env_falls_back_to_third_party(tmp_path):
    bad = tmp_path / "bad"
    (bad / "include").mkdir(parents=True)
    repo = tmp_path / "repo"
    fake_cutlass(repo / "third_party" / "cutlass")
    found, tried = toolchain.resolve_cutlass({"CUTLASS_DIR": str(bad)}, repo, package_root=None)
    assert found.source == "third_party" and found.version == "3.9.1"
    assert len(tried) == 1 and "missing include/cutlass/cutlass.h" in tried[0] and str(bad) in tried[0]


def test_package_headers_last(tmp_path):
    pkg = fake_cutlass(tmp_path / "site" / "cutlass_library" / "source", (4, 2, 0))
    found, tried = toolchain.resolve_cutlass({}, tmp_path / "repo", package_root=pkg)
    assert found.source == "nvidia-cutlass" and found.root == pkg.resolve() and found.version == "4.2.0"
    assert [t.split(":")[0].split()[0] for t in tried] == ["CUTLASS_DIR", "third_party"]


def test_installed_wheel_is_found(tmp_path):
    pytest.importorskip("cutlass_library")
    found, _ = toolchain.resolve_cutlass({}, tmp_path / "repo")
    assert found is not None and found.source == "nvidia-cutlass"
    assert (found.root / "include" / "cute" / "tensor.hpp").is_file()


def test_nothing_found_lists_everything_tried(tmp_path):
    missing = tmp_path / "nope"
    tools_env = {"CUTLASS_DIR": str(missing), "PATH": str(tmp_path / "empty-bin"), "CUDA_HOME": str(tmp_path / "cuda")}
    found, tried = toolchain.resolve_cutlass(tools_env, tmp_path / "repo", package_root=None)
    assert found is None
    tc = toolchain.Toolchain(found, None, "", tuple(tried) + ("nvcc: not on PATH",))
    assert not tc.usable
    msg = tc.message
    assert msg.startswith("CUTLASS headers and nvcc not found")
    assert str(missing) in msg and "third_party" in msg and "nvidia-cutlass: package not installed" in msg


def test_nvcc_from_path_then_cuda_home(tmp_path):
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    on_path, _ = toolchain.find_nvcc({"PATH": str(bin_dir)})
    assert on_path == nvcc
    via_home, tried = toolchain.find_nvcc({"PATH": str(tmp_path / "empty"), "CUDA_HOME": str(tmp_path / "cuda")})
    assert via_home == nvcc and tried == ["nvcc: not on PATH"]
    assert toolchain.nvcc_version(nvcc) == "12.8.93"
    none, tried = toolchain.find_nvcc({"PATH": str(tmp_path / "empty"), "CUDA_HOME": str(tmp_path / "nocuda")})
    # /usr/local/cuda may exist on a dev box; only assert on what we control
    if none is None:
        assert any("CUDA_HOME" in t for t in tried)


def test_backend_reports_missing_toolchain(tmp_path):
    from backends.cutlass import CutlassBackend

    tc = toolchain.Toolchain(None, None, "", ("CUTLASS_DIR: not set", "nvcc: not on PATH"))
    ok, why = CutlassBackend(tc).available(problem())
    assert not ok and "CUTLASS headers and nvcc not found" in why and "CUTLASS_DIR: not set" in why
    ok, why = CutlassBackend(tc).available(problem(arch=0))
    assert not ok and "CUDA" in why


def test_kernels_info_runs():
    proc = run_python("from kernels.__main__ import main; main(['info'])", timeout=300)
    assert proc.returncode == 0, proc.stderr
    for field in ("torch:", "triton:", "nvcc:", "cutlass:", "cache dir:", "cutlass  "):
        assert field in proc.stdout
