"""RUNTIME_DIR/tunerd.pid: how scripts without systemd find the daemon."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from tunerd.safefs import write_atomic

__all__ = ["read_pidfile", "remove_pidfile", "write_pidfile"]


def write_pidfile(path: Path) -> None:
    """RUNTIME_DIR/tunerd.pid: the pid and a newline, replaced atomically, never followed.

    FileWriteError (an OSError) when it cannot be written; no temp file is left.
    The runtime dir is a tmpfs: no fsync.
    """
    write_atomic(path, f"{os.getpid()}\n".encode(), mode=0o644, sync=False)


def read_pidfile(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).decode(errors="replace").strip()
    finally:
        os.close(fd)
    return int(text) if text.isdigit() else None


def remove_pidfile(path: Path) -> None:
    """Remove the pidfile if it is still ours (a new daemon may have replaced it)."""
    if read_pidfile(path) == os.getpid():
        with contextlib.suppress(OSError):
            path.unlink()
