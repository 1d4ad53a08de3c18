"""A launcher above a test's ranks: a process named like torchrun that starts its command
as a child and waits for it, as a real launcher's agent does (the intake counts a rank
identity only under a launcher or a scheduler step)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.helpers import wait_for

__all__ = ["launcher", "rank_pid", "spawn_rank"]

_SCRIPT = """#!{python}
import signal, subprocess, sys
child = subprocess.Popen(sys.argv[1:])
signal.signal(signal.SIGTERM, lambda *_: (child.kill(), sys.exit(143)))
sys.exit(child.wait())
"""
_dirs: dict[str, Path] = {}


def launcher(name: str = "torchrun") -> Path:
    """An executable named ``name`` (its /proc comm too) that runs its arguments."""
    if name not in _dirs:
        d = Path(tempfile.mkdtemp(prefix="tunerd-launcher-"))
        os.chmod(d, 0o755)
        path = d / name
        path.write_text(_SCRIPT.format(python=sys.executable))
        path.chmod(0o755)
        _dirs[name] = d
    return _dirs[name] / name


def rank_pid(launcher_pid: int, timeout: float = 10) -> int:
    """The one child a launcher started."""
    path = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children")
    kids = wait_for(lambda: path.read_text().split(), timeout, "the launcher's child")
    return int(kids[0])


def spawn_rank(argv: list[str], env: dict[str, str], *, name: str = "torchrun",
               **kw: object) -> tuple[subprocess.Popen[str], int]:
    """``argv`` started under a launcher: (the launcher, the rank's pid)."""
    p: subprocess.Popen[str] = subprocess.Popen(  # type: ignore[call-overload]
        [str(launcher(name)), *argv], env={**os.environ, **env}, text=True, **kw)
    return p, rank_pid(p.pid)
