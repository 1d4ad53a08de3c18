"""The one spelling of a /proc/PID file's path for the layers below adapters/procfs.py
(the CLI may not import adapters); everything that reads a process's files goes through
tunerd.adapters.procfs, which takes an injectable proc root."""

from __future__ import annotations

__all__ = ["PROC", "pid_path"]

PROC = "/proc"


def pid_path(pid: int | str, name: str, proc: str = PROC) -> str:
    """``proc``/PID/``name``, e.g. pid_path(42, "comm") -> "/proc/42/comm"."""
    return f"{proc}/{pid}/{name}"
