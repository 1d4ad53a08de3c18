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
import time
from pathlib import Path

from tunerd.base.errors import Failed
from tunerd.base.safefs import write_atomic

__all__ = ["NodeClaim", "PidLock", "read_pidfile", "remove_pidfile", "write_pidfile"]


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


# -- the node-wide claim ---------------------------------------------------------------


class NodeClaim:
    """One daemon binds processes on a node: an flock on a file at a fixed path (not
    under the runtime dir), holding ``pid runtime-dir start-time`` of its holder.

    Taken by every unscoped, non-dry-run daemon before it touches its runtime dir's
    state; a second one, whatever its runtime dir, finds it locked and exits 1 naming
    the first. The kernel drops the lock when the holder dies (SIGKILL included), so
    the file itself is never removed (unlinking a lock file races a new holder).
    """

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd  # None: looked, not held (unprivileged)

    @classmethod
    def acquire(cls, path: Path, runtime_dir: Path) -> NodeClaim:
        """Lock ``path`` (created 0644 if missing, never through a symlink, nothing but
        a regular file owned by us or root, in a dir only root writes or a sticky one
        such as /run/lock); Failed (exit 1) naming the daemon that holds it.

        An unprivileged daemon in a dir it does not own (the default /run/lock) only
        looks: it refuses to start if a daemon holds the claim, but neither creates
        nor holds it, so no user can keep root's daemon from starting."""
        owner = _check_lock_dir(path.parent)
        hold = os.geteuid() == 0 or owner == os.geteuid()
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, (os.O_RDWR | os.O_CREAT | flags) if hold
                         else (os.O_RDONLY | flags), 0o644)
        except FileNotFoundError:
            if hold:
                raise Failed(f"cannot create the node lock {path}", path=str(path)) from None
            return cls(path, None)  # nobody ever claimed this node
        except OSError as err:
            raise Failed(f"cannot open the node lock {path}: {err.strerror or err}",
                         path=str(path)) from err
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Failed(f"node lock {path} is not a regular file; refusing to use it",
                             path=str(path))
            if hold and st.st_uid not in (0, os.geteuid()):
                raise Failed(f"node lock {path} is owned by uid {st.st_uid}, not root; "
                             "refusing to use it (remove it)", path=str(path))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Failed(f"another tunerd ({_holder(fd)}) binds processes on this "
                             f"node (node lock {path}); stop it first, or run this one "
                             "--dry-run or --scope-pid PID", path=str(path)) from None
            if not hold:
                os.close(fd)
                return cls(path, None)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {runtime_dir} {int(time.time())}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Let go of the lock (the file stays: see the class)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _holder(fd: int) -> str:
    """``pid N, runtime dir D`` from the lock file's text (what its holder wrote)."""
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    parts = text.split(" ")
    if len(parts) >= 3 and parts[0].isdigit():
        return f"pid {parts[0]}, runtime dir {' '.join(parts[1:-1])}"
    return "pid unknown"


def _check_lock_dir(d: Path) -> int:
    """The node lock's dir: a real dir owned by root (or us), writable by no one else
    unless sticky (as /run/lock is: no one may replace another's file there). Its
    owner's uid."""
    try:
        st = os.lstat(d)
    except OSError as err:
        raise Failed(f"node lock dir {d}: {err.strerror or err}", path=str(d)) from err
    if not stat.S_ISDIR(st.st_mode):
        raise Failed(f"node lock dir {d} is not a directory; refusing it", path=str(d))
    if st.st_uid not in (0, os.geteuid()):
        raise Failed(f"node lock dir {d} is owned by uid {st.st_uid}; refusing it",
                     path=str(d))
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise Failed(f"node lock dir {d} is writable by others and not sticky; "
                     "refusing it", path=str(d))
    return st.st_uid
