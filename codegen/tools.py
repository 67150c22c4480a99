"""External tools (the C++ compiler, LLVM's guarded compiler process) with a time limit.

A compiler that never returns must not hang the user's program. Every build fusec starts is
given `timeout()` seconds ($FUSEC_BUILD_TIMEOUT, default 300: gcc -O3 on fusec's largest kernels
takes a few seconds); past that it is killed and the build is a CompileError, which
fusec/runtime/build.py answers like any failed build: another backend builds the kernel, or its
ATen ops run eagerly.

Killing a compiler means killing everything it started: `g++` is a driver that runs `cc1plus`,
`as` and `collect2`/`ld` as its children, and a wrapper script (ccache, a distcc shell) may sit
in front of it. `run` starts the command in a process group of its own and kills the whole
group, so no grandchild keeps the output pipes open (`subprocess.run(..., timeout=)` kills only
the direct child, then waits for the pipes to close: with a grandchild still running, forever).
A tool that timed out GIVE_UP_AFTER times in a row is not run again in this process.
"""
from __future__ import annotations

import os
import signal
import subprocess

from fusec import env
from fusec.errors import CompileError

DEFAULT_TIMEOUT_S = 300


def timeout() -> int:
    """Seconds a build may take: $FUSEC_BUILD_TIMEOUT (a whole number of at least 1), else 300.
    A value that is not one is a FusecError naming the variable."""
    return env.integer("FUSEC_BUILD_TIMEOUT", DEFAULT_TIMEOUT_S, minimum=1)


def run(cmd: list[str], what: str, limit: float | None = None,
        counted: bool = True) -> subprocess.CompletedProcess:
    """Run `cmd` (text output captured) for at most `limit` seconds (default `timeout()`). Past
    that its whole process group is killed and a CompileError says that `what` timed out.
    A command that cannot start is a CompileError too. `counted=False`: a time-out of this
    (optional) work does not count towards giving up on the tool."""
    limit = timeout() if limit is None else limit
    tool = os.path.basename(cmd[0])
    if _TIMED_OUT.get(cmd[0], 0) >= GIVE_UP_AFTER:
        raise CompileError(f"fusec: {tool} ran past FUSEC_BUILD_TIMEOUT {GIVE_UP_AFTER} times in "
                           f"a row in this process; it is not run again here ({what})")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace",
                                start_new_session=True)
    except OSError as err:
        raise CompileError(f"fusec: could not run {cmd[0]} for {what}: {err}") from None
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()  # (the whole group is gone: the pipes are closed)
        if counted:
            _TIMED_OUT[cmd[0]] = _TIMED_OUT.get(cmd[0], 0) + 1
        raise CompileError(f"fusec: {tool} did not finish {what} within "
                           f"{limit:g} s (FUSEC_BUILD_TIMEOUT) and was killed"
                           + (f"; it printed:\n{err[-2000:]}" if err.strip() else "")) from None
    except BaseException:  # (KeyboardInterrupt: do not leave the compiler running)
        kill_group(proc)
        proc.wait()
        raise
    _TIMED_OUT.pop(cmd[0], None)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# A tool that hangs on every call would make each of a model's kernels wait out the limit: after
# GIVE_UP_AFTER time-outs in a row, its calls fail at once (the other backend builds instead).
GIVE_UP_AFTER = 3
_TIMED_OUT: dict[str, int] = {}  # tool path -> time-outs in a row


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s process group (it leads one: start_new_session), or `proc` alone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
