"""Child processes for tests that signal them or wait on them.

- :func:`popen` starts a child with SIGINT at its default action. A suite started as a background
  job (``make test &`` from a script) runs with SIGINT ignored, every child inherits that, and a
  Python child then never turns SIGINT into KeyboardInterrupt: a test must not depend on how the
  suite was started.
- :func:`wait_for` and :func:`communicate` wait with a deadline that tells a slow, loaded machine
  from a hang: they give up when the child (with its descendants) has used no CPU time for
  ``quiet_s`` seconds, or at ``limit_s`` seconds in all, and the failure says which.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

QUIET_S = 90.0  # no CPU used by the child for this long: it is hung, not slow
LIMIT_S = 900.0  # a ceiling for a child that keeps computing but never gets there


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen(cmd: Sequence[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, ...)`` with SIGINT at its default action in the child (POSIX)."""
    if sys.platform != "win32":
        kwargs.setdefault("preexec_fn", _default_sigint)
    return subprocess.Popen(list(cmd), **kwargs)


def _stat_fields(pid_dir: Path) -> list[str] | None:
    try:
        text = (pid_dir / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from the state on (the name may hold spaces)


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) used so far by ``pid`` and its live descendants; None where the
    system does not say (no /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parent, used = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields is None:
            continue
        # after the name: state ppid ... utime (14th field) stime (15th), counted from pid = 1
        parent[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / ticks
    if pid not in used:
        return 0.0
    family, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, pp in parent.items() if pp in frontier and p not in family]
        family.update(children)
        frontier = children
    return sum(used[p] for p in family)


class _Watch:
    """Progress of a child: hung when its CPU time stands still for ``quiet_s``."""

    def __init__(self, proc: subprocess.Popen, what: str, quiet_s: float, limit_s: float) -> None:
        self.proc, self.what, self.quiet_s = proc, what, quiet_s
        self.start = time.monotonic()
        self.limit = self.start + limit_s
        self.cpu = cpu_seconds(proc.pid)
        self.moved = self.start

    def check(self) -> None:
        now = time.monotonic()
        cpu = cpu_seconds(self.proc.pid)
        if cpu is None or self.cpu is None or cpu > self.cpu + 0.01:
            self.cpu, self.moved = cpu, now
        if now - self.moved > self.quiet_s:
            self._fail(f"hung: no CPU time used for {now - self.moved:.0f} s")
        if now > self.limit:
            self._fail(f"still running after {now - self.start:.0f} s (and still computing)")

    def _fail(self, why: str) -> None:
        self.proc.kill()
        out, err = self.proc.communicate()
        raise AssertionError(f"{self.what}: {why}\nstdout: {out!r}\nstderr: {err!r}")


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, what: str, *,
             quiet_s: float = QUIET_S, limit_s: float = LIMIT_S, poll_s: float = 0.1) -> None:
    """Wait until ``condition()`` holds; fail (killing ``proc``) if ``proc`` exits first, hangs or
    runs past ``limit_s``."""
    watch = _Watch(proc, f"waiting for {what}", quiet_s, limit_s)
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}\n"
                                 f"stdout: {out!r}\nstderr: {err!r}")
        watch.check()
        time.sleep(poll_s)


def communicate(proc: subprocess.Popen, what: str = "the process to exit", *,
                quiet_s: float = QUIET_S, limit_s: float = LIMIT_S) -> tuple[str, str]:
    """``proc.communicate()`` that fails (killing ``proc``) when it hangs or runs past
    ``limit_s``."""
    watch = _Watch(proc, f"waiting for {what}", quiet_s, limit_s)
    while True:
        try:
            return proc.communicate(timeout=1.0)
        except subprocess.TimeoutExpired:
            watch.check()
