"""A CUTLASS toolchain without nvcc: a shell script that stands in for nvcc (the backend's real ninja path runs it),
a header tree that passes kernels.core.toolchain's checks, and a CUTLASS backend that serves CPU problems, for the
background-build and warmup tests. Only the compiler and the loading of its (fake) binaries are fake."""
import dataclasses
import os
import stat
from pathlib import Path

import torch

import backends
from backends.base import BuildOutcome, Runner
from backends.cutlass import CutlassBackend
from kernels.core.toolchain import CutlassDir, Toolchain

NVCC_VERSION = "12.4.99"
# stands in for nvcc: `--version`, or `... -o OUT ... SOURCE`: writes OUT (its niceness inside), unless SOURCE
# contains a line of the `fail` file beside it; each compile adds a line to `calls`
FAKE_NVCC = f"""#!/bin/sh
here=$(dirname "$0")
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 12.4, V{NVCC_VERSION}"; exit 0; fi
out=""; src=""
while [ $# -gt 0 ]; do
  case "$1" in -o) out="$2"; shift 2;; *) src="$1"; shift;; esac
done
echo "$src" >> "$here/calls"
members=$(grep '^#define kernels_cutlass_run ' "$src" | sed 's/.*_//')
if [ -n "$members" ]; then echo "$members" >> "$here/kernels"
else basename "$(dirname "$src")" | cut -c1-16 >> "$here/kernels"; fi
if [ -s "$here/fail" ] && grep -q -F -f "$here/fail" "$src"; then echo "error: fake nvcc refuses $src"; exit 1; fi
echo "fake kernel of $src; niceness $(nice)" > "$out"
"""


@dataclasses.dataclass
class FakeToolchain:
    folder: Path

    @property
    def nvcc(self) -> Path:
        return self.folder / "bin" / "nvcc"

    @property
    def cutlass_root(self) -> Path:
        return self.folder / "cutlass"

    @property
    def tools(self) -> Toolchain:
        return Toolchain(CutlassDir(self.cutlass_root, "CUTLASS_DIR", "0.0.0"), self.nvcc, NVCC_VERSION)

    def compiles(self) -> list[str]:
        """The kernels compiled so far, as the head of each one's artifact key (its folder's name): one per nvcc run
        of a kernel's own source, one per member of a translation unit of several (cutlass_render.batch_source,
        whose entry points carry that head as their suffix), as the fake nvcc saw them. A kernel compiled twice
        appears twice."""
        kernels = self.folder / "bin" / "kernels"
        return kernels.read_text().split() if kernels.exists() else []

    def fail_when_source_has(self, text: str) -> None:
        (self.folder / "bin" / "fail").write_text(text + "\n")

    def succeed(self) -> None:
        (self.folder / "bin" / "fail").write_text("")

    def environment(self) -> dict:
        """What a child process needs to find this toolchain itself (kernels.core.toolchain.resolve)."""
        return {"PATH": f"{self.nvcc.parent}{os.pathsep}{os.environ['PATH']}", "CUTLASS_DIR": str(self.cutlass_root)}


def make_toolchain(folder: Path) -> FakeToolchain:
    fake = FakeToolchain(folder)
    fake.nvcc.parent.mkdir(parents=True)
    fake.nvcc.write_text(FAKE_NVCC)
    fake.nvcc.chmod(fake.nvcc.stat().st_mode | stat.S_IXUSR)
    for sub in ("include/cutlass/cutlass.h", "include/cute/tensor.hpp", "tools/util/include/cutlass/util/x.h"):
        (fake.cutlass_root / sub).parent.mkdir(parents=True, exist_ok=True)
        (fake.cutlass_root / sub).write_text("")
    fake.succeed()
    return fake


def gpu_twin(problem):
    """The problem as an sm90 GPU would see it: what the CUTLASS heuristics and artifact keys are asked about."""
    return dataclasses.replace(problem, device="cuda", arch=90, device_name="sm90 (test)")


class CpuServedCutlass(CutlassBackend):
    """The CUTLASS backend (build modes, artifacts, markers, failure records: all real) for CPU problems: its choices
    and binaries are those of the problem's sm90 twin, and a built binary 'loads' as a runner that computes with
    torch.mm on the CPU (a fake binary cannot be dlopened)."""
    isolated = False
    epilogues = False        # its runner is a plain torch.mm: epilogue problems are left to the other backends

    def available(self, problem):
        return (True, "") if problem.device == "cpu" or problem.arch >= 80 else (False, "not sm80+")

    def choices(self, problem, space="default"):
        return super().choices(gpu_twin(problem), space)

    def artifact_paths(self, problem, choice):
        return super().artifact_paths(gpu_twin(problem), choice)

    def _load(self, problem, choice, paths, start, compiled):
        assert paths.binary.read_text().startswith("fake kernel of")
        return BuildOutcome(choice, Runner(choice, lambda a, b, out=None: torch.mm(a, b, out=out)), compiled=compiled)


def install(monkeypatch, backend: CutlassBackend) -> CutlassBackend:
    """`backend` is what get_backend('cutlass') returns for the rest of the test."""
    monkeypatch.setitem(backends._instances, "cutlass", backend)
    return backend
