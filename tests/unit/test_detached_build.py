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


def test_a_command_stopped_by_a_signal_says_so_in_one_line(monkeypatch, capsys):
    """SIGTERM / SIGHUP reach a command as ^C (so what it started is ended on the way out) and end it with one line,
    exit status 130, no traceback."""
    import signal

    import kernels.commands as commands
    from kernels import __main__ as cli

    def stopped(args, early=None):
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(commands, "run", stopped)
    assert cli.main(["cache", "list"]) == 130
    assert capsys.readouterr().err == ("python -m kernels cache: interrupted (SIGTERM); nothing it started is left "
                                       "running\n")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL        # the handler is put back
