"""Binds made in the exec watcher's thread that the loop has not recorded yet.

A rule's match is bound in the watcher's thread first and recorded (with its originals,
in the runtime state) by the loop a moment later (``tunerd.jobs.autobind``). A daemon
killed in between (SIGKILL, the OOM killer, a crash) would leave that process bound
with nothing to put it back by, and its next start would take the narrowed mask for the
process's own choice ("set its own affinity: left as it is"). So the thread appends one
line per bind to ``RUNTIME_DIR/binds-in-flight`` right after setting the CPUs (one
write(2) on tmpfs, after the bind: it never delays one), and the loop empties the file
whenever nothing is in flight. At start the daemon reads what is left: a process still
running with the same start time and the mask tunerd gave it gets its mask back, so that
the rescan that follows binds it afresh, recorded.

A line: ``PID START_TIME CPUS_BEFORE CPUS_SET`` (cpulists, e.g. ``0-3,8``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NamedTuple

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.jobs.actuate import set_threads

log = logging.getLogger("tunerd.autobind")

NAME = "binds-in-flight"
MAX_READ = 1 << 20  # more than this at start is no journal of ours: ignored


class InFlight(NamedTuple):
    pid: int
    start_time: int
    before: frozenset[int]
    set_to: frozenset[int]


class BindJournal:
    """The file (None: no runtime dir, nothing kept). Writes never raise: a journal
    that cannot be written is logged once and the binds go on without it."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd = -1
        self._failed = False

    def open(self) -> list[InFlight]:
        """What a daemon before this one left (read once), then the file, emptied."""
        if self.path is None:
            return []
        left = _read(self.path)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
                               | os.O_NOFOLLOW, 0o600)
            os.ftruncate(self._fd, 0)
        except OSError as err:
            self._write_failed(err)
        return left

    def add(self, pid: int, start_time: int, before: frozenset[int],
            set_to: frozenset[int]) -> None:
        if self._fd < 0:
            return
        line = f"{pid} {start_time} {format_cpulist(before)} {format_cpulist(set_to)}\n"
        try:
            os.write(self._fd, line.encode())
        except OSError as err:
            self._write_failed(err)

    def clear(self) -> None:
        if self._fd >= 0:
            try:
                os.ftruncate(self._fd, 0)
            except OSError as err:
                self._write_failed(err)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _write_failed(self, err: OSError) -> None:
        if not self._failed:
            self._failed = True
            log.warning("%s: %s; binds in flight are not journaled", self.path, err.strerror)


def _read(path: Path) -> list[InFlight]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            raw = os.read(fd, MAX_READ + 1)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return []
    except OSError as err:
        log.warning("%s: cannot read: %s", path, err.strerror)
        return []
    if len(raw) > MAX_READ:
        log.warning("%s: over %d bytes: ignored", path, MAX_READ)
        return []
    out: list[InFlight] = []
    for line in raw.decode("ascii", "replace").splitlines():
        parts = line.split()
        try:
            out.append(InFlight(int(parts[0]), int(parts[1]), parse_cpulist(parts[2]),
                                parse_cpulist(parts[3])))
        except (IndexError, ValueError):
            continue  # a line cut by the crash
    return out


def put_back(entry: InFlight, proc: str = procfs.PROC) -> int:
    """Give every thread of ``entry``'s process that still has the mask tunerd set its
    mask from before; the number of threads put back (0: gone, or changed since).
    Pinned by a pidfd and its start time (tunerd.jobs.actuate)."""
    got = set_threads(entry.pid, every=(entry.set_to, entry.before),
                      start_time=entry.start_time, proc=proc)
    return len(got.done)
