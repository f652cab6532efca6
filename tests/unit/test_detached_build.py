"""An interrupted build leaves nothing running (kernels.core.detached.run_in_group): ninja runs each command in a
process group of its own, so killing ninja's group alone left its compilers running under init."""
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kernels.core.detached import run_in_group
from tests.helpers import eventually

pytestmark = pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja not on PATH")


def _running(marker: str) -> bool:
    """Whether a live (not zombie) process has `marker` on its command line."""
    for proc in Path("/proc").iterdir():
        try:
            if marker.encode() in (proc / "cmdline").read_bytes() and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return True
        except (OSError, IndexError):
            continue
    return False


def test_an_interrupted_ninja_build_takes_its_compiles_down(tmp_path):
    marker = f"kernels-test-{uuid.uuid4().hex}"
    # two long "compiles", each started by ninja in its own process group, as nvcc is
    (tmp_path / "build.ninja").write_text(
        f"rule slow\n  command = {sys.executable} -c 'import time; time.sleep(600)' {marker} $out\n"
        "build a: slow\nbuild b: slow\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_in_group(["ninja", "-C", str(tmp_path), "-j2"], timeout_s=1.0)
    assert eventually(lambda: not _running(marker), timeout=10)

