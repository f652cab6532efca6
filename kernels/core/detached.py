"""Builder processes that outlive the process that starts them, and the compilers they run: what the C++ warm-call
table's builder (kernels.native.fastpath_build) and the background CUTLASS builder (kernels.tune.background_build)
share.

A builder runs as `python -m <module> <argument>` in its own session (a Ctrl-C meant for its parent does not reach
it, and it publishes or records its failure even when the parent has exited); the compiler it runs gets its own
process group, killed as a whole when the build is interrupted, so no nvcc or cc1plus is left running.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

# the folder that holds the `kernels` package: builder processes import their module from there
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def start(module: str, argument: str, wait: bool) -> subprocess.Popen:
    """Start `python -m module argument` in its own session; `wait`: its stderr is piped for the caller to read."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([sys.executable, "-m", module, argument], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if wait else subprocess.DEVNULL,
                            text=True, start_new_session=True, env=env,
                            cwd=str(PACKAGE_ROOT))   # never the cache: `-m` puts cwd on sys.path


def run_in_group(command: list[str], timeout_s: float | None = None, on_line=None) -> tuple[int, str]:
    """Run a compiler (or ninja) in its own process group and return (exit status, output). An interrupted run
    (timeout, signal, exception) takes the whole group (driver, cc1plus, nvcc, linker) down with it rather than
    leaving it running. `on_line(line)` sees each output line as it comes (a progress display); the timeout then
    counts from when the output ends."""
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)    # its own group: killpg reaches the compiler
    try:
        if on_line is None:
            output, _ = proc.communicate(timeout=timeout_s)
        else:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                on_line(line)
            proc.wait(timeout=timeout_s)
            output = "".join(lines)
    except BaseException:
        _end_group(proc)
        raise
    return proc.returncode, output


# how long an interrupted build's group has to stop on SIGTERM before SIGKILL
STOP_GRACE_S = 5.0


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the group first: ninja runs each compile in a process group of its own and, on SIGTERM, ends those
    groups itself; SIGKILL would leave its nvcc and cicc running, re-parented to init. Then SIGKILL what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    finally:                  # a second ^C during the grace still ends the group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True         # someone else's process
    return True


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)      # unwinds the build: the compiler group is killed, temporaries removed


def exit_on_signals() -> None:
    """In a builder: SIGTERM, SIGHUP and SIGINT unwind the build like an exception (see run_in_group)."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, _exit_on_signal)
