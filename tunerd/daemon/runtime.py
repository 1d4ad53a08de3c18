"""RUNTIME_DIR/tunerd.pid: how scripts without systemd find the daemon."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["read_pidfile", "remove_pidfile", "write_pidfile"]


def write_pidfile(path: Path) -> None:
    """RUNTIME_DIR/tunerd.pid: the pid and a newline, replaced atomically, never followed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


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
