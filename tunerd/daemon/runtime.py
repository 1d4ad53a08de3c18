"""RUNTIME_DIR/tunerd.pid: how scripts without systemd find the daemon, and its lock.

One daemon per runtime dir: the daemon takes an flock on ``tunerd.pid.lock`` (0600:
no one else can open it, so no one else can lock it) before it touches anything
else there (state, socket) and holds it while it runs. A second one (say ``tunerd
--dry-run`` run by hand with the default dirs) finds it locked and exits 1 with one
line naming the running pid, without touching the socket.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from tunerd.adapters.procfs import lock_holders, read_comm, read_uid
from tunerd.base.errors import Failed
from tunerd.base.safefs import check_dir, file_kind, write_atomic

__all__ = ["NodeClaim", "PidLock", "read_pidfile", "remove_pidfile", "write_pidfile"]

log = logging.getLogger("tunerd")


class PidLock:
    """One daemon per runtime dir: an flock on ``tunerd.pid.lock`` beside the pidfile,
    a file as the node lock's (0600, ours alone: see ``_take``), so that no user can
    hold it (the pidfile itself is 0644 for scripts to read, and flock needs only a
    read-only fd); the pid is written to ``tunerd.pid`` once the lock is held."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, path: Path) -> PidLock:
        """Lock the runtime dir and write our pid in ``path``; Failed (exit 1) naming the
        pid of the daemon that holds it (the kernel's lock table first)."""
        def held(lock: Path, st: os.stat_result, fd: int) -> str:
            pids = sorted({p for k, p in lock_holders(st.st_dev, st.st_ino) if k == "FLOCK"})
            who = (f"pid {pids[0]}" if pids and pids[0] > 0
                   else f"pid {read_pidfile(path) or 'unknown'}")
            return (f"another tunerd ({who}) is running with runtime dir {path.parent}; stop "
                    "it first, or give this one its own --runtime-dir (and --state-dir)")

        fd = _take(path.with_name(path.name + ".lock"), held, "runtime dir lock")
        try:
            write_pidfile(path)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Remove the pidfile (if it is still ours) and let go of the lock."""
        if self._fd is None:
            return
        remove_pidfile(self.path)
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

    No other user can create, hold, replace or link it: it lives in a dir only root
    writes (default ``/run``; a sticky world-writable one such as ``/run/lock`` is
    refused), it is mode 0600 (flock needs only an open fd, so a file others could open
    read-only is one they could lock), and a file that is not exactly ours (another
    owner, a second hard link, group or other bits) is replaced by a fresh one while we
    hold its lock. Who holds it is read from the kernel's lock table (/proc/locks), not
    only from what the file says.
    """

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd  # None: looked, not held (unprivileged)

    @classmethod
    def acquire(cls, path: Path, runtime_dir: Path) -> NodeClaim:
        """Lock ``path``; Failed (exit 1) naming the daemon (the pid the kernel says)
        that holds it.

        An unprivileged daemon in a dir it does not own (the default /run) only looks:
        it refuses to start if a daemon holds the claim (from /proc/locks: the file is
        root's 0600), but neither creates nor holds it."""
        check_dir(path.parent, "node lock dir")  # only root (or we) may write there
        owner = os.stat(path.parent).st_uid
        if os.geteuid() != 0 and owner != os.geteuid():
            _look(path)
            return cls(path, None)
        fd = _take(path, _held_message)
        try:
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


_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _take(path: Path, held: Callable[[Path, os.stat_result, int], str],
          what: str = "node lock") -> int:
    """An fd of ``path`` that we hold the flock of, the file ours alone (0600, one link,
    owned by us): a file that is not is replaced while we hold its lock, so a daemon
    waiting on the old one finds it gone and looks again."""
    for _ in range(8):
        try:
            fd = os.open(path, _OPEN | os.O_CREAT, 0o600)
        except OSError as err:  # a symlink (ELOOP), a dir: only root can make one there
            raise Failed(f"cannot open the {what} {path}: {err.strerror or err} "
                         "(remove it)", path=str(path), errno=err.errno) from err
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Failed(f"{what} {path} is {file_kind(st.st_mode)}; refusing to "
                             "use it (remove it)", path=str(path))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise Failed(held(path, st, fd), path=str(path)) from None
            if not _names(path, st):
                os.close(fd)  # replaced while we waited: the new file is the lock
                continue
            why = _not_ours(st)
            if why is None:
                return fd
            fresh = _replace_or_keep(path, fd, why)
            if fresh == fd:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return fresh
    raise Failed(f"{what} {path} kept changing under us; refusing to start",
                 path=str(path))


def _not_ours(st: os.stat_result) -> str | None:
    """Why a lock file is not ours alone (None: it is)."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_nlink != 1:
        return f"{st.st_nlink} hard links"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"mode {stat.S_IMODE(st.st_mode):04o}"
    return None


def _names(path: Path, st: os.stat_result) -> bool:
    """Whether ``path`` still names the file ``st`` describes."""
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def _replace_or_keep(path: Path, fd: int, why: str) -> int:
    """``_replace``; a file that cannot be renamed over (a Kubernetes hostPath file is a
    mount point: EBUSY) is kept, made ours alone (0600, root's) and warned of."""
    try:
        return _replace(path, why)
    except OSError as err:
        if err.errno not in (errno.EBUSY, errno.EXDEV):
            raise Failed(f"cannot replace the lock file {path} ({why}): "
                         f"{err.strerror or err}", path=str(path), errno=err.errno) from err
    os.fchown(fd, os.geteuid(), os.getegid())
    os.fchmod(fd, 0o600)
    log.warning("lock file %s was not tunerd's alone (%s) and cannot be replaced (a mount "
                "point): made it 0600, ours", path, why)
    return fd


def _replace(path: Path, why: str) -> int:
    """A fresh lock file renamed over ``path`` (whose lock the caller holds), locked."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    fd = os.open(tmp, _OPEN | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        os.close(fd)
        raise
    log.warning("lock file %s was not tunerd's alone (%s): replaced it with a new file",
                path, why)
    return fd


def _look(path: Path) -> None:
    """Refuse (Failed) when a daemon holds the claim; the file need not be readable."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return  # nobody ever claimed this node
    if lock_holders(st.st_dev, st.st_ino):
        raise Failed(_held_message(path, st, None), path=str(path))


def _held_message(path: Path, st: os.stat_result, fd: int | None = None) -> str:
    return (f"another tunerd ({_holder(st, fd)}) binds processes on this node (node lock "
            f"{path}); stop it first, or run this one --dry-run or --scope-pid PID")


def _holder(st: os.stat_result, fd: int | None) -> str:
    """``pid N, runtime dir D``: the pid from the kernel's lock table, the runtime dir
    from the file's text (what its holder wrote), and a word when they disagree."""
    pids = sorted({p for kind, p in lock_holders(st.st_dev, st.st_ino) if kind == "FLOCK"})
    text = ""
    if fd is not None:
        with contextlib.suppress(OSError):
            text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    parts = text.split(" ")
    named = int(parts[0]) if len(parts) >= 3 and parts[0].isdigit() else None
    run = " ".join(parts[1:-1]) if named is not None else None
    if not pids or pids[0] <= 0:
        where = "a process outside this PID namespace" if pids else "pid unknown"
        return where + (f"; the file names pid {named}, runtime dir {run}" if named else "")
    pid = pids[0]
    if pid == named:
        return f"pid {pid}, runtime dir {run}"
    comm = read_comm(pid) or "?"
    uid = read_uid(pid)
    stale = f"; the file names pid {named}, stale" if named is not None else ""
    return f"pid {pid} ({comm}, uid {uid}){stale}"
