"""Learn when a process exits, from a pidfd on the asyncio loop.

A pidfd refers to one process, never to a later process that reuses its PID;
the start time read *after* opening the pidfd confirms it is the process we
were told about (not one that already replaced it).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from tunerd.adapters import procfs

__all__ = ["PidWatch"]

log = logging.getLogger("tunerd.pidwatch")


class PidWatch:
    """``watch(pid, start_time, key, callback)``: ``callback(pid)`` once, when pid exits."""

    def __init__(self, proc: str = procfs.PROC) -> None:
        self.proc = proc
        self._fds: dict[int, int] = {}
        self._starts: dict[int, int] = {}  # start time of the process each pidfd is
        self._callbacks: dict[int, dict[str, Callable[[int], None]]] = {}

    def alive(self, pid: int, start_time: int | None) -> bool:
        st = procfs.read_start_time(pid, self.proc)
        return st is not None and (start_time is None or st == start_time)

    def watch(self, pid: int, start_time: int | None, key: str,
              callback: Callable[[int], None]) -> bool:
        """Start watching; False when the process is already gone (or the PID was reused)."""
        if pid not in self._fds:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                return False
            st = procfs.read_start_time(pid, self.proc)
            if st is None or start_time not in (None, st):
                os.close(fd)
                return False
            self._fds[pid] = fd
            self._starts[pid] = st
            asyncio.get_running_loop().add_reader(fd, self._fired, pid)
        elif start_time not in (None, self._starts[pid]) and not self.alive(pid, start_time):
            return False
        # (the pidfd open for this very process needs no new read of /proc: had it
        # exited, _fired is on its way and calls this callback too)
        self._callbacks.setdefault(pid, {})[key] = callback
        return True

    def unwatch(self, pid: int, key: str) -> None:
        cbs = self._callbacks.get(pid)
        if cbs is None:
            return
        cbs.pop(key, None)
        if not cbs:
            self._close(pid)

    def _close(self, pid: int) -> None:
        self._callbacks.pop(pid, None)
        self._starts.pop(pid, None)
        fd = self._fds.pop(pid, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _fired(self, pid: int) -> None:
        cbs = list(self._callbacks.get(pid, {}).values())
        self._close(pid)
        for cb in cbs:
            try:
                cb(pid)
            except Exception:  # one failing callback must not starve the others
                log.exception("exit handler for pid %d failed", pid)
