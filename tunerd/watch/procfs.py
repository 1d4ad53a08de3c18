"""Small, cheap readers of /proc/PID files used by the exec watcher and leases.

Every reader takes the proc root as an argument (tests may point it at a
recorded tree) and returns ``None`` when the process is gone or unreadable:
a process that exits between an event and the read is the normal case for
short-lived commands, not an error.
"""

from __future__ import annotations

import os

__all__ = [
    "PROC",
    "children_map",
    "descendants",
    "list_pids",
    "list_tids",
    "read_cmdline",
    "read_environ",
    "read_ppid",
    "read_start_time",
    "read_uid",
]

PROC = "/proc"
_MAX_READ = 1 << 20  # cmdline/environ larger than 1 MiB are truncated (globs see the start)


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks = []
        total = 0
        while total < _MAX_READ:
            b = os.read(fd, 65536)
            if not b:
                break
            chunks.append(b)
            total += len(b)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_cmdline(pid: int, proc: str = PROC) -> str | None:
    """The command line with NUL separators turned into spaces (as ``ps`` shows it).

    On the exec-event path for every exec on the host: one open/read/close
    when the command line fits in 4 KiB (nearly always).
    """
    path = f"{proc}/{pid}/cmdline"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) == 4096:
        full = _read(path)
        if full is None:
            return None
        raw = full
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def read_environ(pid: int, proc: str = PROC) -> dict[str, str] | None:
    """The environment the process was exec'd with (/proc/PID/environ)."""
    raw = _read(f"{proc}/{pid}/environ")
    if raw is None:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep and k:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _stat_fields(pid: int, proc: str) -> list[str] | None:
    raw = _read(f"{proc}/{pid}/stat")
    if raw is None:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'
    tail = raw[raw.rfind(b")") + 2:].split()
    return [f.decode() for f in tail]


def read_start_time(pid: int, proc: str = PROC) -> int | None:
    """Start time in clock ticks since boot (stat field 22): with the PID, a unique id."""
    f = _stat_fields(pid, proc)
    return int(f[19]) if f and len(f) > 19 else None


def read_ppid(pid: int, proc: str = PROC) -> int | None:
    f = _stat_fields(pid, proc)
    return int(f[1]) if f and len(f) > 1 else None


def read_uid(pid: int, proc: str = PROC) -> int | None:
    """Real uid of the process (owner of /proc/PID, which follows the real uid)."""
    try:
        return os.stat(f"{proc}/{pid}").st_uid
    except OSError:
        return None


def list_pids(proc: str = PROC) -> list[int]:
    try:
        return [int(n) for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return []


def list_tids(pid: int, proc: str = PROC) -> list[int]:
    try:
        return [int(n) for n in os.listdir(f"{proc}/{pid}/task") if n.isdigit()]
    except OSError:
        return []


def children_map(proc: str = PROC) -> dict[int, list[int]]:
    """ppid -> [pid, ...] for every process on the host (one stat read per process)."""
    out: dict[int, list[int]] = {}
    for pid in list_pids(proc):
        ppid = read_ppid(pid, proc)
        if ppid is not None:
            out.setdefault(ppid, []).append(pid)
    return out


def descendants(root: int, proc: str = PROC, include_root: bool = True) -> list[int]:
    """``root`` and every process below it, breadth first."""
    kids = children_map(proc)
    out = [root] if include_root else []
    todo = [root]
    while todo:
        p = todo.pop()
        for c in kids.get(p, ()):
            out.append(c)
            todo.append(c)
    return out
