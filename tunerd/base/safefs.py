"""Safe file handling in the daemon's runtime and state dirs.

tunerd runs as root on nodes that many users log into. Anything it creates,
chmods or reads in its dirs must not be redirectable by one of them, so:

* ``prepare_dir`` walks a dir's path from ``/`` with ``openat``-style calls and
  refuses it (one clear line) unless every directory on the way is owned by a
  trusted uid (root; also the daemon's own uid when it runs unprivileged) and
  writable by nobody else. A root-owned sticky world-writable dir such as
  ``/tmp`` is accepted as a parent only: the sticky bit keeps other users from
  renaming what root made in it. Missing dirs are created on the checked fd.
* ``write_atomic`` creates its temp file with ``O_EXCL | O_NOFOLLOW`` relative to
  the dir's fd, fsyncs it, renames it into place and fsyncs the dir; a failed
  write leaves no temp file behind and raises ``FileWriteError`` (a ``Failed``
  that is also an ``OSError``, naming the file and the errno).
* ``open_regular`` opens with ``O_NOFOLLOW | O_NONBLOCK`` and refuses anything but
  a regular file, so a FIFO cannot hang the daemon and a symlink cannot point
  it elsewhere.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Collection
from pathlib import Path

from tunerd.base.errors import Failed

__all__ = [
    "FileWriteError",
    "check_dir",
    "open_regular",
    "prepare_dir",
    "read_regular",
    "read_trusted",
    "trusted_uids",
    "write_atomic",
]

_MAX_SYMLINKS = 40  # as the kernel's path walk (MAXSYMLINKS)
_DIR_FLAGS = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class FileWriteError(Failed, OSError):
    """A state or runtime file could not be written; nothing was left half-written.

    Also an ``OSError`` (``errno``, ``strerror``, ``filename``) so that code which
    guards a write with ``except OSError`` keeps working.
    """

    def __init__(self, path: Path | str, err: OSError) -> None:
        reason = err.strerror or str(err)
        Failed.__init__(self, f"cannot write {path}: {reason} (errno {err.errno})",
                        file=str(path), errno=err.errno)
        self.errno = err.errno
        self.strerror = err.strerror
        self.filename = str(path)

    def __str__(self) -> str:
        return self.message


def trusted_uids() -> frozenset[int]:
    """Who may own the daemon's dirs: root, and the daemon's own uid when unprivileged."""
    return frozenset({0, os.geteuid()})


def file_kind(mode: int) -> str:
    """What ``mode`` (st_mode) is, for messages: "a FIFO", "a directory", ..."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _owner(uid: int) -> str:
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _who_trusted(trusted: Collection[int]) -> str:
    others = sorted(u for u in trusted if u != 0)
    return "root" + "".join(f" or {_owner(u)}" for u in others)


def _check(st: os.stat_result, shown: str, what: str, final: bool,
           trusted: Collection[int]) -> None:
    mode = st.st_mode
    if st.st_uid not in trusted:
        raise Failed(f"{what} {shown}: owned by {_owner(st.st_uid)}, not by "
                     f"{_who_trusted(trusted)}; refusing it (its owner could change what "
                     "tunerd reads or creates there)", path=shown)
    if not mode & (stat.S_IWGRP | stat.S_IWOTH):
        return
    if not final and st.st_uid == 0 and mode & stat.S_ISVTX:
        return  # /tmp-like: others cannot rename or remove what root made in it
    by = "group and others" if mode & stat.S_IWGRP and mode & stat.S_IWOTH else (
        "its group" if mode & stat.S_IWGRP else "others")
    raise Failed(f"{what} {shown}: writable by {by} (mode {stat.S_IMODE(mode):04o}); "
                 f"refusing it (run chmod go-w {shown})", path=shown)


def _walk(path: Path, what: str, create_mode: int | None,
          trusted: Collection[int]) -> tuple[int, bool]:
    """Open ``path`` as a directory, checking every dir on the way from ``/``.

    Symlinks are followed by hand (readlink + continue the walk), so each dir that
    is really traversed is checked, and a symlink in a sticky dir must belong to a
    trusted uid (its owner could re-point it). Returns (fd, created); the fd is
    opened O_RDONLY so the caller can fchmod it.
    """
    parts = list(Path(os.path.join(os.getcwd(), path)).parts[1:])
    stack: list[tuple[int, str, os.stat_result]] = []
    created = False

    def push_root() -> None:
        while stack:
            os.close(stack.pop()[0])
        fd = os.open("/", os.O_RDONLY | _DIR_FLAGS)
        st = os.fstat(fd)
        stack.append((fd, "/", st))
        _check(st, "/", what, not parts, trusted)

    try:
        push_root()
        hops = 0
        while parts:
            name = parts.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            dfd, dshown, dst = stack[-1]
            shown = os.path.join(dshown, name)
            made_here = False
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                if create_mode is None:
                    raise Failed(f"{what} {shown}: does not exist", path=shown) from None
                try:
                    os.mkdir(name, 0o700, dir_fd=dfd)  # set to its mode below, once opened
                except FileExistsError:
                    pass  # made by someone else meanwhile: checked like any other
                else:
                    made_here = True
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > _MAX_SYMLINKS:
                    raise Failed(f"{what} {path}: too many levels of symbolic links",
                                 path=str(path))
                if dst.st_mode & stat.S_ISVTX and st.st_uid not in trusted:
                    raise Failed(f"{what} {shown}: a symbolic link owned by "
                                 f"{_owner(st.st_uid)} in the sticky dir {dshown}; refusing "
                                 "to follow it", path=shown)
                target = os.readlink(name, dir_fd=dfd)
                tparts = list(Path(target).parts)
                if target.startswith("/"):
                    parts[:0] = tparts[1:]
                    push_root()
                else:
                    parts[:0] = tparts
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise Failed(f"{what} {shown}: {file_kind(st.st_mode)}, not a directory",
                             path=shown)
            fd = os.open(name, os.O_RDONLY | _DIR_FLAGS, dir_fd=dfd)
            fst = os.fstat(fd)
            stack.append((fd, shown, fst))
            if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                raise Failed(f"{what} {shown}: replaced while it was being checked",
                             path=shown)
            final = not parts
            if made_here:
                # exact modes, whatever the umask: parents must let others reach the socket
                os.fchmod(fd, create_mode if final and create_mode is not None else 0o755)
                fst = os.fstat(fd)
                created = final
            _check(fst, shown, what, final, trusted)
        fd = stack.pop()[0]
        return fd, created
    except OSError as err:
        raise Failed(f"{what} {path}: {err.strerror or err}", path=str(path),
                     errno=err.errno) from err
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def check_dir(path: Path, what: str = "directory",
              trusted: Collection[int] | None = None) -> None:
    """Raise ``Failed`` (one line) unless ``path`` and its parents are safe to use."""
    fd, _ = _walk(Path(path), what, None, trusted_uids() if trusted is None else trusted)
    os.close(fd)


def prepare_dir(path: Path, mode: int, what: str = "directory",
                trusted: Collection[int] | None = None) -> bool:
    """Create ``path`` (and missing parents) if needed, then check it like ``check_dir``.

    A dir it creates gets exactly ``mode``; an existing one keeps its mode (an
    operator's choice) as long as it passes the checks. Returns whether it was created.
    """
    fd, created = _walk(Path(path), what, mode, trusted_uids() if trusted is None else trusted)
    os.close(fd)
    return created


def open_regular(path: Path | str, flags: int = os.O_RDONLY) -> int:
    """Open a regular file without following a symlink or blocking on a FIFO.

    Returns the fd. A missing file raises ``FileNotFoundError``; a symlink, FIFO,
    device, socket or dir, or any other failure, raises ``Failed`` naming the path.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise Failed(f"{path}: a symbolic link; refusing to follow it", path=str(path),
                         errno=err.errno) from err
        if err.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO with no writer, a directory
            try:
                kind = file_kind(os.lstat(path).st_mode)
            except OSError:
                kind = err.strerror or "not a regular file"
            raise Failed(f"{path}: {kind}, not a regular file", path=str(path),
                         errno=err.errno) from err
        raise Failed(f"cannot open {path}: {err.strerror or err}", path=str(path),
                     errno=err.errno) from err
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Failed(f"{path}: {file_kind(st.st_mode)}, not a regular file", path=str(path))
    return fd


def read_trusted(path: Path | str, what: str, limit: int,
                 trusted: Collection[int] | None = None) -> bytes:
    """The content of ``path`` if it is trusted as sshd and sudo trust their files;
    ``Failed`` (one line naming the path and why) otherwise.

    Trusted: a regular file owned by root (or the daemon's own uid when it runs
    unprivileged, ``trusted_uids``) and writable by no one else, in directories that
    pass ``check_dir`` all the way from ``/``; a symlink is followed by hand, and its
    target must pass the same test (a kubelet ConfigMap's ``..data`` links do). Its
    size is checked on the opened file before anything is read: one larger than
    ``limit`` bytes is refused unread. A missing file raises ``FileNotFoundError``.
    """
    who = trusted_uids() if trusted is None else trusted
    shown = str(path)
    cur = Path(os.path.join(os.getcwd(), path))
    for _ in range(_MAX_SYMLINKS):
        dfd, _ = _walk(cur.parent, f"{what} {shown}: directory", None, who)
        try:
            try:
                st = os.stat(cur.name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise
            except OSError as err:
                raise Failed(f"{what} {shown}: {err.strerror or err}", path=shown,
                             errno=err.errno) from err
            if stat.S_ISLNK(st.st_mode):
                cur = cur.parent / os.readlink(cur.name, dir_fd=dfd)
                continue
            if not stat.S_ISREG(st.st_mode):
                raise Failed(f"{what} {shown}: not a regular file "
                             f"({file_kind(st.st_mode)})", path=shown)
            try:
                fd = os.open(cur.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=dfd)
            except OSError as err:
                raise Failed(f"{what} {shown}: cannot open: {err.strerror or err}",
                             path=shown, errno=err.errno) from err
        finally:
            os.close(dfd)
        try:
            fst = os.fstat(fd)
            real = str(cur) if str(cur) != os.path.join(os.getcwd(), path) else shown
            target = shown if real == shown else f"{shown} (-> {real})"
            if not stat.S_ISREG(fst.st_mode):
                raise Failed(f"{what} {target}: not a regular file "
                             f"({file_kind(fst.st_mode)})", path=shown)
            _check(fst, target, what, True, who)
            if fst.st_size > limit:
                raise Failed(f"{what} {target}: {fst.st_size} bytes, larger than the limit "
                             f"of {limit}; not read", path=shown)
            chunks: list[bytes] = []
            total = 0
            while total <= limit:  # a file growing meanwhile: still at most limit + 1
                chunk = os.read(fd, min(1 << 16, limit + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
            if total > limit:
                raise Failed(f"{what} {target}: larger than the limit of {limit} bytes",
                             path=shown)
            return b"".join(chunks)
        except OSError as err:
            raise Failed(f"cannot read {what} {shown}: {err.strerror or err}", path=shown,
                         errno=err.errno) from err
        finally:
            os.close(fd)
    raise Failed(f"{what} {shown}: more than {_MAX_SYMLINKS} symbolic links", path=shown)


def read_regular(path: Path | str, limit: int = 64 << 20) -> bytes:
    """The content of a regular file (``open_regular`` rules), at most ``limit`` bytes."""
    fd = open_regular(path)
    try:
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                raise Failed(f"{path}: larger than {limit} bytes", path=str(path))
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as err:
        raise Failed(f"cannot read {path}: {err.strerror or err}", path=str(path),
                     errno=err.errno) from err
    finally:
        os.close(fd)


def write_atomic(path: Path | str, payload: bytes, mode: int = 0o600, sync: bool = True) -> None:
    """Replace ``path`` with ``payload`` atomically: readers see the old or the new file.

    The temp file is made next to it with ``O_CREAT | O_EXCL | O_NOFOLLOW`` on the
    dir's fd (a planted symlink cannot redirect it). ``sync``: fsync the file before
    the rename and the dir after it (durable across power loss).
    On failure the temp file is removed and ``FileWriteError`` is raised.
    """
    path = Path(path)
    name = path.name
    tmp = f".{name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise FileWriteError(path, err) from err
    made = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode, dir_fd=dfd)
        made = True
        try:
            os.fchmod(fd, mode)
            view = memoryview(payload)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        made = False
        if sync:
            os.fsync(dfd)
    except OSError as err:
        raise FileWriteError(path, err) from err
    finally:
        if made:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
        os.close(dfd)
