"""RUNTIME_DIR/tunerd.pid: how scripts without systemd find the daemon, and its lock.

One daemon per runtime dir: the daemon takes an flock on the pidfile before it
touches anything else there (state, socket) and holds it while it runs. A second
one (say ``tunerd --dry-run`` run by hand with the default dirs) finds it locked and
exits 1 with one line naming the running pid, without touching the socket.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

from tunerd.errors import Failed
from tunerd.safefs import write_atomic

__all__ = ["PidLock", "read_pidfile", "remove_pidfile", "write_pidfile"]


class PidLock:
    """The pidfile, flock'ed by the running daemon, its pid written in place (a rename
    would give a second daemon an unlocked file to lock)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd
        st = os.fstat(fd)
        self._inode = (st.st_dev, st.st_ino)

    @classmethod
    def acquire(cls, path: Path) -> PidLock:
        """Lock ``path`` and write our pid in it; Failed (exit 1) naming the pid of the
        daemon that holds it. Never follows a symlink, opens nothing but a regular file."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise Failed(f"cannot open {path}: {err.strerror or err}", path=str(path)) from err
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Failed(f"{path} is not a regular file; refusing to use it",
                             path=str(path))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 64, 0).decode(errors="replace").strip()
                who = f"pid {text}" if text.isdigit() else "pid unknown"
                raise Failed(f"another tunerd ({who}) is running with runtime dir "
                             f"{path.parent}; stop it first, or give this one its own "
                             "--runtime-dir (and --state-dir)", path=str(path)) from None
            os.fchmod(fd, 0o644)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Remove the pidfile (if it is still this one) and let go of the lock."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                self.path.unlink()
        os.close(self._fd)
        self._fd = None


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
