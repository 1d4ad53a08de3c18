"""The node's ledger of processes: one tracked record per process, one pidfd each.

Every service of the bind domain that remembers something about a process (its
binding, the rule that bound it, why it was left alone, a GPU-use verdict, the cgroup
it was followed in) keeps it here, in a typed *slot* of that process's one record,
never in a map of its own. So a process is forgotten in one place when it exits, by
every service at once, and what tunerd knows of it can be read in one place (psutil's
``(pid, create_time)`` identity and nvitop's one object per live process are the
models).

``ProcKey(pid, start)`` is a process's identity: a PID alone may be reused, its start
time (field 22 of /proc/PID/stat, clock ticks since boot) tells the processes apart.

A record holds at most one pidfd: opened by ``watch`` (or handed over with ``adopt_fd``
by the exec watcher's thread, which pinned the process with it to bind it), readable on
the asyncio loop once the process exits. Then every exit callback registered for it
runs, reading the record's slots as they were, and the record goes. A record with no
pidfd (a cache of a look taken: an ancestry, a verdict) is checked by its start time
on every read and bounded in number (``UNWATCHED_MAX``, oldest first).

Thread safety: the exec watcher's thread reads and writes slots too; every access
takes one lock (a few hundred nanoseconds).
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar, cast

from tunerd.adapters import procfs
from tunerd.base.jsontypes import JSONObject

__all__ = ["UNWATCHED_MAX", "ExitCallback", "Ledger", "ProcKey", "Slot", "Tracked"]

log = logging.getLogger("tunerd.ledger")

T = TypeVar("T")
ExitCallback = Callable[[int], None]
UNWATCHED_MAX = 16_384  # records in all; past it those with no pidfd go, oldest first


class ProcKey(NamedTuple):
    """A process: its PID and its start time (clock ticks since boot)."""

    pid: int
    start: int


class Slot(Generic[T]):
    """A typed field of a tracked record, declared by the module that owns it
    (``RULE = Slot[RuleBound]("rule")``); the ledger never reads what is in it."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class Tracked:
    """One process in the ledger: its key, its one pidfd, who waits for its exit, and
    each service's slot."""

    __slots__ = ("exits", "key", "pidfd", "values")

    def __init__(self, key: ProcKey) -> None:
        self.key = key
        self.pidfd = -1  # -1: none held (a cache entry, or exited)
        self.exits: dict[str, ExitCallback] = {}
        self.values: dict[Slot[object], object] = {}

    def get(self, slot: Slot[T]) -> T | None:
        return cast("T | None", self.values.get(cast("Slot[object]", slot)))


class Ledger:
    """The only pid-keyed table of the bind domain (see the module docstring)."""

    def __init__(self, proc: str = procfs.PROC, unwatched_max: int = UNWATCHED_MAX) -> None:
        self.proc = proc
        self.unwatched_max = unwatched_max
        self._lock = threading.RLock()
        self._recs: dict[int, Tracked] = {}
        # each slot's records, by pid: ``each`` and ``count`` read only the slot's own
        self._index: dict[Slot[object], dict[int, Tracked]] = {}
        self._held = 0  # records holding a pidfd
        self._firing: Tracked | None = None  # whose exit callbacks run now (the loop's)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_tid = 0  # the loop's thread
        self.pidfds_opened = 0  # since start: status, and the one-pidfd-per-bind check

    def attach(self) -> None:
        """On the loop: the loop that watches the pidfds (and runs exit callbacks)."""
        self._loop = asyncio.get_running_loop()
        self._loop_tid = threading.get_ident()

    def _on_loop(self) -> bool:
        if self._loop is None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return False
            self.attach()
        return threading.get_ident() == self._loop_tid

    # -- identity --------------------------------------------------------------------
    def key_of(self, pid: int) -> ProcKey | None:
        """``pid``'s key as /proc shows it now (None: gone)."""
        start = procfs.read_start_time(pid, self.proc)
        return None if start is None else ProcKey(pid, start)

    def alive(self, pid: int, start_time: int | None) -> bool:
        st = procfs.read_start_time(pid, self.proc)
        return st is not None and (start_time is None or st == start_time)

    # -- slots -----------------------------------------------------------------------
    def _rec(self, pid: int) -> Tracked | None:
        firing = self._firing
        if firing is not None and firing.key.pid == pid \
                and threading.get_ident() == self._loop_tid:
            return firing  # an exit callback reads the record of the process that ended
        return self._recs.get(pid)

    def get(self, pid: int, slot: Slot[T], start: int | None = None) -> T | None:
        """What ``slot`` holds for ``pid`` (of the process started at ``start``)."""
        with self._lock:
            rec = self._rec(pid)
            if rec is None or (start is not None and rec.key.start != start):
                return None
            return rec.get(slot)

    def key(self, pid: int) -> ProcKey | None:
        """The key of the process the ledger holds under ``pid`` (None: none)."""
        with self._lock:
            rec = self._rec(pid)
            return None if rec is None else rec.key

    def has(self, pid: int, slot: Slot[T]) -> bool:
        return self.get(pid, slot) is not None

    def put(self, key: ProcKey, slot: Slot[T], value: T) -> None:
        """``slot`` of the process ``key`` holds ``value`` (a record of another process
        with the same PID is retired: that one has exited)."""
        s = cast("Slot[object]", slot)
        with self._lock:
            rec = self._record(key)
            if s not in rec.values:
                self._index.setdefault(s, {})[key.pid] = rec
            rec.values[s] = value

    def pop(self, pid: int, slot: Slot[T]) -> T | None:
        with self._lock:
            rec = self._rec(pid)
            if rec is None:
                return None
            s = cast("Slot[object]", slot)
            if s not in rec.values:
                return None
            out = rec.values.pop(s)
            if self._recs.get(rec.key.pid) is rec:
                del self._index[s][rec.key.pid]
            self._maybe_drop(rec)
            return cast("T | None", out)

    def each(self, slot: Slot[T]) -> list[tuple[ProcKey, T]]:
        """Every process whose ``slot`` holds something, by PID."""
        s = cast("Slot[object]", slot)
        with self._lock:
            members = self._index.get(s)
            if not members:
                return []
            return [(r.key, cast(T, r.values[s])) for _, r in sorted(members.items())]

    def count(self, slot: Slot[T]) -> int:
        """How many processes ``slot`` holds a value for (kept as they change: O(1))."""
        return len(self._index.get(cast("Slot[object]", slot), ()))

    def clear(self, slot: Slot[T]) -> None:
        """Empty ``slot`` in every record (a service's bounded cache, dropped whole)."""
        s = cast("Slot[object]", slot)
        with self._lock:
            members = self._index.pop(s, {})
            for rec in members.values():
                del rec.values[s]
                self._maybe_drop(rec)

    def status(self) -> JSONObject:
        """Counts only (no pid): records, pidfds held now and opened since start, and
        how many processes each slot holds something for."""
        with self._lock:
            slots: JSONObject = {s.name: len(m) for s, m in sorted(
                self._index.items(), key=lambda kv: kv[0].name) if m}
            return {"records": len(self._recs), "pidfds": self._held,
                    "pidfds_opened": self.pidfds_opened, "slots": slots}

    def __len__(self) -> int:
        return len(self._recs)

    # -- exits -----------------------------------------------------------------------
    def watch(self, pid: int, start_time: int | None, key: str,
              callback: ExitCallback) -> bool:
        """``callback(pid)`` once, when the process exits (its slots still readable
        then); False when it is gone already, or ``pid`` is another process now."""
        with self._lock:
            rec = self._recs.get(pid)
            if rec is None or rec.pidfd < 0 or (start_time is not None
                                                and rec.key.start != start_time):
                if not self._open(pid, start_time):
                    return False
                rec = self._recs[pid]
            rec.exits[key] = callback
            return True

    def adopt_fd(self, key: ProcKey, fd: int) -> bool:
        """Keep ``fd``, a pidfd on the process ``key`` opened by the caller, as its
        record's one pidfd (True: the ledger owns it now, the caller must not close
        it). A record with a pidfd keeps its own: False, ``fd`` stays the caller's."""
        with self._lock:
            rec = self._record(key)
            if rec.pidfd >= 0:
                return False
            self._hold(rec, fd)
            return True

    def release_idle(self, pid: int, fd: int) -> None:
        """Close ``fd``, the record's pidfd, if nobody waits for the exit and no slot
        holds anything (an adopted pidfd whose bind came to nothing); the record goes."""
        with self._lock:
            rec = self._recs.get(pid)
            if rec is None or rec.pidfd != fd or rec.exits or rec.values:
                return
            self._release(rec)
            self._maybe_drop(rec)

    def pidfd(self, pid: int) -> int:
        """The pidfd the ledger holds for ``pid`` (-1: none)."""
        with self._lock:
            rec = self._recs.get(pid)
            return -1 if rec is None else rec.pidfd

    def exited(self, pid: int) -> bool:
        """True when the process the ledger holds a pidfd of has exited (one poll(2),
        no read of /proc; any thread)."""
        with self._lock:
            rec = self._recs.get(pid)
            fd = -1 if rec is None else rec.pidfd
            if fd < 0:
                return False
            p = select.poll()
            p.register(fd, select.POLLIN)
            return bool(p.poll(0))

    def unwatch(self, pid: int, key: str) -> None:
        with self._lock:
            rec = self._recs.get(pid)
            if rec is None or rec.exits.pop(key, None) is None:
                return  # not watched by ``key``: a pidfd another holds stays
            if not rec.exits:
                self._release(rec)
            self._maybe_drop(rec)

    # -- internals -------------------------------------------------------------------
    def _record(self, key: ProcKey) -> Tracked:
        rec = self._recs.get(key.pid)
        if rec is not None and rec.key == key:
            return rec
        if rec is not None:  # that process exited and the PID is another's now
            self._retire(rec)
        if len(self._recs) >= self.unwatched_max:
            self._evict()
        rec = self._recs[key.pid] = Tracked(key)
        return rec

    def _open(self, pid: int, start_time: int | None) -> bool:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        self.pidfds_opened += 1
        st = procfs.read_start_time(pid, self.proc)  # after the pidfd: the one it holds
        if st is None or start_time not in (None, st):
            os.close(fd)
            return False
        rec = self._record(ProcKey(pid, st))
        if rec.pidfd >= 0:
            os.close(fd)
        else:
            self._hold(rec, fd)
        return True

    def _hold(self, rec: Tracked, fd: int) -> None:
        rec.pidfd = fd
        self._held += 1
        if self._on_loop():
            assert self._loop is not None
            self._loop.add_reader(fd, self._fired, rec)
        else:  # the exec watcher's thread: the loop registers it
            assert self._loop is not None, "Ledger.attach() on the loop first"
            self._loop.call_soon_threadsafe(self._add_reader, rec, fd)

    def _add_reader(self, rec: Tracked, fd: int) -> None:
        with self._lock:
            if rec.pidfd == fd:
                asyncio.get_running_loop().add_reader(fd, self._fired, rec)

    def _release(self, rec: Tracked) -> None:
        """Close the record's pidfd (it stays, unwatched, while a slot holds something)."""
        fd, rec.pidfd = rec.pidfd, -1
        if fd < 0:
            return
        self._held -= 1
        if self._loop is not None and self._on_loop():
            self._loop.remove_reader(fd)
            os.close(fd)
        elif self._loop is not None:
            self._loop.call_soon_threadsafe(self._close_later, fd)
        else:
            os.close(fd)

    @staticmethod
    def _close_later(fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def _maybe_drop(self, rec: Tracked) -> None:
        if rec.pidfd < 0 and not rec.values and not rec.exits \
                and self._recs.get(rec.key.pid) is rec:
            self._unlink(rec)

    def _unlink(self, rec: Tracked) -> None:
        """``rec`` leaves the table (its slots are still readable by whoever holds it)."""
        del self._recs[rec.key.pid]
        for s in rec.values:
            del self._index[s][rec.key.pid]

    def _evict(self) -> None:
        """Too many records: the oldest with no pidfd go (caches of looks, taken again
        when needed); a record with a pidfd is a live process and stays."""
        keep = self.unwatched_max * 3 // 4
        for rec in list(self._recs.values()):
            if len(self._recs) <= keep:
                break
            if rec.pidfd < 0 and not rec.exits:
                self._unlink(rec)

    def _retire(self, rec: Tracked) -> None:
        """``rec``'s process has exited (its PID is reused): its exit callbacks run on
        the loop, reading its slots, as if its pidfd had fired."""
        self._unlink(rec)
        if not rec.exits:
            self._release(rec)
        elif self._loop is not None:
            self._loop.call_soon_threadsafe(self._fired, rec)

    def _fired(self, rec: Tracked) -> None:
        """On the loop: ``rec``'s process exited. Its callbacks, then the record goes."""
        with self._lock:
            fd, rec.pidfd = rec.pidfd, -1
            if fd >= 0:
                self._held -= 1
                asyncio.get_running_loop().remove_reader(fd)
                os.close(fd)
            cbs = list(rec.exits.values())
            rec.exits.clear()
            if self._recs.get(rec.key.pid) is rec:
                self._unlink(rec)
            self._firing = rec
        try:
            for cb in cbs:
                try:
                    cb(rec.key.pid)
                except Exception:  # one failing callback must not starve the others
                    log.exception("exit handler for pid %d failed", rec.key.pid)
        finally:
            self._firing = None
