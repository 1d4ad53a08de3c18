"""Re-bind a bound process when its cgroup cpuset changes (the kubelet's CPU manager).

When a Guaranteed pod arrives or leaves, the kubelet rewrites the shared pool's
cpusets; the kernel then narrows the affinity of every task in them (a shrink below
a task's mask leaves it the whole new set) and, on a grow, either restores the mask
the task asked for (kernels since 6.2 keep it as ``user_cpus_ptr``) or resets it to
the whole cpuset (RHEL 8/9, Ubuntu 20.04/22.04 kernels). Either way the placement
tunerd made is lost until something puts it back: this watcher does, within 1 s.

What is watched: only the cpuset cgroups that hold bound processes, and their
ancestors up to the hierarchy's root (the kubelet writes the QoS, pod and container
levels). Two triggers, both cheap:

- inotify ``IN_MODIFY`` on those directories: a write to any cpuset file in them
  (cgroupfs reports writes made through write(2), which is how the kubelet and runc
  change cpusets);
- a poll of the one effective file of each watched cgroup, for changes no write in a
  watched directory shows: the kernel does not notify a change of an effective file
  it makes itself (v1 ``cpuset.effective_cpus`` and v2 ``cpuset.cpus.effective``
  narrowed by a CPU going offline). With inotify working the poll is a backstop every
  ``SAFETY_POLL`` (CPU hotplug also wakes the watcher at once: :meth:`CpusetWatch.wake`,
  wired to the topology watch's udev events); without inotify it runs every
  ``POLL_INTERVAL``. (An idle daemon's 4 polls a second were ~0.3 ms/s of CPU.)
  The backstop runs on another thread's timer where one ticks often enough (``ticker``:
  the monitor's sampling thread, every second): :meth:`CpusetWatch.poll_elsewhere`
  reads the files there and wakes the event loop only when one differs from what the
  last round saw (the loop's own 1 s wake-up for it was ~0.3 ms/s of the loaded daemon).

On a change the placement is applied again inside the new set: the CPUs the job
was bound to that are still allowed, or, when none is, as many CPUs of the new set
as it had (the first ones: the kubelet gives a container's exclusive CPUs by core).
Nothing is ever written to the cgroup itself (see tunerd.adapters.cpuset on ``kubepods``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tunerd.adapters.cpuset import CpusetCgroup, find_cpuset
from tunerd.adapters.procfs import read_text
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.base.errors import TunerdError
from tunerd.base.jsontypes import JSONObject
from tunerd.jobs.ledger import Ledger, ProcKey, Slot

__all__ = ["FOLLOWED", "CpusetWatch", "Followed"]

log = logging.getLogger("tunerd.cpusetwatch")


class _Inotify(Protocol):
    """What the watcher uses of ``inotify_simple.INotify`` (an optional package)."""

    def fileno(self) -> int: ...
    def close(self) -> None: ...
    def read(self, timeout: int | None = None) -> object: ...
    def add_watch(self, path: str, mask: int) -> int: ...
    def rm_watch(self, wd: int) -> None: ...


POLL_INTERVAL = 0.25  # seconds, without inotify; the 1 s bound holds with a poll alone
SAFETY_POLL = 1.0  # seconds, with inotify (writes notify; hotplug wakes the watcher)
# lookup(pid) -> (start time, cpulist) of pid's binding where it is applied and has CPUs
Lookup = Callable[[int], "tuple[int, str] | None"]
# rebind(pid, cpus) re-applies inside the set (through tunerd.jobs.pipeline): the CPUs
# bound, as a cpulist (or a record with "cpus")
Rebind = Callable[[int, frozenset[int]], Awaitable[object]]


@dataclass(slots=True)
class Followed:
    """A bound process the watcher follows (its ``FOLLOWED`` slot in the ledger)."""

    wanted: frozenset[int]  # the CPUs asked for
    set_by_us: str | None  # the cpulist the last (re-)bind set, as recorded
    where: Path | None = None  # its cgroup dir, where that is watched


FOLLOWED = Slot[Followed]("cpuset")
_WATCH = "cpuset"  # the exit key: a followed process leaves its cgroup's count


@dataclass
class _Watched:
    cgroup: CpusetCgroup
    effective: frozenset[int]
    members: int = 0  # followed processes in it (each one's ``Followed.where``)
    # the effective file and its last text: a poll compares text, parses on a change
    file: Path | None = None
    text: str | None = None
    effective_now: frozenset[int] = frozenset()

    def read(self) -> frozenset[int]:
        """The cgroup's effective CPUs now (OSError: the cgroup is gone)."""
        if self.file is None:
            self.file = self.cgroup.effective_cpus_file()
        try:
            text = read_text(self.file)
        except OSError:
            self.file = None  # found again next time (v2: a controller enabled lower)
            raise
        if text != self.text:
            self.text, self.effective_now = text, parse_cpulist(text)
        return self.effective_now


class CpusetWatch:
    """A service: keeps bound processes' masks inside their (changing) cpusets."""

    name = "cpusetwatch"

    def __init__(self, lookup: Lookup, rebind: Rebind, *,
                 bound: Callable[[], Iterable[int]] = tuple, proc_root: Path = Path("/proc"),
                 sys_root: Path = Path("/sys"), poll_interval: float = POLL_INTERVAL,
                 on_change: Callable[[], None] | None = None, inotify: bool = True,
                 safety_poll: float = SAFETY_POLL, ticker: float | None = None,
                 ledger: Ledger | None = None) -> None:
        """``lookup``: a binding as it is now; ``bound``: the pids bound at start. After
        that the watcher looks only at pids it is told of (``changed``, wired to the
        registry's bind/unbind/exit events): a round costs nothing per binding.
        ``ticker``: seconds between calls of :meth:`poll_elsewhere` by another thread;
        at most ``safety_poll``, it runs the backstop poll instead of the loop.
        ``ledger``: the daemon's (a followed process is a slot of its record, and leaves
        its cgroup when it exits); a ledger of its own without one (tests)."""
        self._lookup = lookup
        self._bound = bound
        self._use_inotify = inotify  # False: the poll alone (cgroupfs without inotify)
        self._on_change = on_change  # the kubelet changed a cpuset (PodResources: List again)
        self._rebind = rebind
        self.proc = proc_root
        self.sys = sys_root
        self.poll_interval = poll_interval
        self.safety_poll = max(safety_poll, poll_interval)
        self.ticker = ticker
        # (effective file, its text) of each watched cgroup as the last round read it:
        # replaced whole on the loop, read by poll_elsewhere's thread
        self._expected: tuple[tuple[Path, str | None], ...] = ()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cgroups: dict[Path, _Watched] = {}  # cgroup dir -> what is in it
        self.ledger = ledger if ledger is not None else Ledger(str(proc_root))
        # events not yet looked at: pids whose binding was stored, replaced or removed
        # (a queue, emptied every round; what is kept of a process is in the ledger)
        self._changed: list[int] = []
        self._wds: dict[int, Path] = {}
        self._ino: _Inotify | None = None
        self._task: asyncio.Task[None] | None = None
        self._dirty = asyncio.Event()
        self.rebinds_total = 0
        self.last_rebind_ms: float | None = None
        self.errors_total = 0

    # -- service ---------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._changed.extend(self._bound())
        if self._changed:
            self._dirty.set()  # processes bound before a restart: track them at once
        if not self._use_inotify:
            self._task = asyncio.ensure_future(self._run())
            return
        try:
            from inotify_simple import INotify

            ino: _Inotify = INotify()
            self._ino = ino
            asyncio.get_running_loop().add_reader(ino.fileno(), self._on_inotify)
        except (ImportError, OSError) as err:  # the poll alone keeps the 1 s bound
            log.info("cpuset watch: no inotify (%s); polling every %.2f s", err,
                     self.poll_interval)
            self._ino = None
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        self._loop = None
        for key, f in self.ledger.each(FOLLOWED):  # its exit watches go (not the records)
            self._untrack(key.pid, f)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._ino is not None:
            asyncio.get_running_loop().remove_reader(self._ino.fileno())
            self._ino.close()
            self._ino = None

    def status(self) -> JSONObject:
        return {"summary": f"{len(self._cgroups)} cpuset cgroup(s) watched, "
                           f"{self.rebinds_total} re-bind(s) after a cpuset change",
                "cgroups": [*sorted(w.cgroup.path for w in self._cgroups.values())],
                "rebinds_total": self.rebinds_total, "last_rebind_ms": self.last_rebind_ms,
                "inotify": self._ino is not None}

    # -- events ----------------------------------------------------------------------
    def changed(self, pid: int) -> None:
        """``pid``'s binding was stored, replaced or removed: look at it now."""
        self._changed.append(pid)
        self._dirty.set()

    def wake(self, *_: object) -> None:
        """Look at the watched cgroups now (a CPU went on- or offline: the kernel changed
        effective cpusets without a write anyone is notified of)."""
        self._dirty.set()

    def _polled_elsewhere(self) -> bool:
        """The backstop poll runs on the ticker's thread (inotify works, and it ticks
        at least every ``safety_poll``)."""
        return (self._ino is not None and self.ticker is not None
                and self.ticker <= self.safety_poll)

    def poll_elsewhere(self) -> None:
        """The backstop poll, from the ticker's thread: read each watched effective file
        and wake the loop for a round if one differs from the last round's text (or is
        gone). Nothing here touches the watcher's state."""
        loop = self._loop
        if loop is None or not self._polled_elsewhere():
            return
        for path, text in self._expected:
            try:
                now: str | None = read_text(path)
            except OSError:
                now = None
            if now != text:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(self._dirty.set)
                return

    def _on_inotify(self) -> None:
        try:
            if self._ino is not None:  # the reader goes with it (``stop``)
                self._ino.read(timeout=0)
        except OSError:
            pass
        self._dirty.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # poll only while a cgroup is watched: an idle daemon sleeps until a bind.
            # A timer that sets the event, not wait_for (a task and a future each round)
            timer = None
            if self._cgroups and not self._dirty.is_set() and not self._polled_elsewhere():
                every = self.poll_interval if self._ino is None else self.safety_poll
                timer = loop.call_later(every, self._dirty.set)
            await self._dirty.wait()
            if timer is not None:
                timer.cancel()
            self._dirty.clear()
            try:
                await self.check()
            except Exception as err:  # one bad round must not end the watching
                self.errors_total += 1
                log.exception("cpuset watch round failed: %r", err)
            self._expected = tuple((w.file, w.text) for w in self._cgroups.values()
                                   if w.file is not None)

    async def check(self) -> None:
        """One round: follow the bound processes, re-bind where a cpuset changed."""
        t0 = time.perf_counter()
        for key, wanted, eff in self._track():
            # changed between the bind and this first look: no change is seen later
            if not wanted <= eff:
                await self._reapply(key, eff, t0)
        for w in list(self._cgroups.values()):
            try:
                eff = w.read()
            except OSError:
                continue  # the cgroup is gone: its processes' exits untrack it
            if eff == w.effective:
                continue
            t0 = time.perf_counter()
            log.info("cpuset %s changed: %s -> %s", w.cgroup.path,
                     format_cpulist(w.effective), format_cpulist(eff))
            w.effective = eff
            if self._on_change is not None:
                self._on_change()
            for key in self._members(w):
                await self._reapply(key, eff, t0)

    def _members(self, w: _Watched) -> list[ProcKey]:
        """The followed processes in ``w`` (a walk of the ledger: on a cpuset change)."""
        d = w.cgroup.dir
        return [key for key, f in self.ledger.each(FOLLOWED) if f.where == d]

    async def _reapply(self, key: ProcKey, eff: frozenset[int], t0: float) -> None:
        f = self.ledger.get(key.pid, FOLLOWED, start=key.start)
        wanted = f.wanted if f is not None else None
        if not wanted or not eff:
            return
        cpus = wanted & eff
        if not cpus:  # shrunk below the binding: as many CPUs, inside the new set
            cpus = frozenset(sorted(eff)[:len(wanted)])
        try:
            rec = await self._rebind(key[0], cpus)
        except TunerdError as err:
            self.errors_total += 1
            log.warning("re-binding pid %d inside its new cpuset %s failed: %s", key[0],
                        format_cpulist(eff), err.message)
            return
        got = rec.get("cpus") if isinstance(rec, dict) else rec
        f = self.ledger.get(key.pid, FOLLOWED, start=key.start)
        if f is not None:  # (it may have exited meanwhile)
            f.set_by_us = got if isinstance(got, str) else None
        self.rebinds_total += 1
        self.last_rebind_ms = round((time.perf_counter() - t0) * 1000, 3)
        log.info("pid %d re-bound to CPUs %s after its cpuset changed (%.1f ms)", key[0],
                 format_cpulist(cpus), self.last_rebind_ms)

    # -- which cgroups -----------------------------------------------------------------
    def _track(self) -> list[tuple[ProcKey, frozenset[int], frozenset[int]]]:
        """Follow the bound processes whose binding changed: cgroups found once per new
        process (not per round).

        Returns the processes seen for the first time, with the CPUs they asked for and
        their cgroup's CPUs now."""
        if not self._changed:
            return []
        pids, self._changed = sorted(set(self._changed)), []
        fresh: list[tuple[ProcKey, frozenset[int], frozenset[int]]] = []
        regroup = False
        for pid in pids:
            now = self._lookup(pid)
            f = self.ledger.get(pid, FOLLOWED)
            old = self.ledger.key(pid) if f is not None else None
            if f is not None and (now is None or old is None or now[0] != old.start):
                regroup |= self._untrack(pid, f)
                f = None
            if now is None:
                continue
            key, cpus = ProcKey(pid, now[0]), now[1]
            if f is not None:
                # a bind the user made since (not the one we made): what they want now
                if cpus != f.set_by_us and parse_cpulist(cpus) != f.wanted:
                    f.wanted, f.set_by_us = parse_cpulist(cpus), cpus
                continue
            f = self._follow(key, cpus)
            if f is None or f.where is None:
                continue
            regroup |= self._cgroups[f.where].members == 1
            fresh.append((key, f.wanted, self._cgroups[f.where].effective))
        if regroup:
            self._rewatch()
        return fresh

    def _follow(self, key: ProcKey, cpus: str) -> Followed | None:
        """Follow ``key`` (bound to ``cpus``) from now on: a slot of its record, which
        goes when it exits (None: it has exited already); its cgroup watched."""
        if not self.ledger.watch(key.pid, key.start, _WATCH, self._exited):
            return None  # gone: its exit is the registry's to tell
        f = Followed(parse_cpulist(cpus), cpus)
        self.ledger.put(key, FOLLOWED, f)
        try:
            cg = find_cpuset(key.pid, self.proc, self.sys)
        except OSError:
            return f
        if cg is None:
            return f
        if cg.dir not in self._cgroups:
            try:
                self._cgroups[cg.dir] = _Watched(cg, cg.effective_cpus())
            except OSError:
                return f
        self._cgroups[cg.dir].members += 1
        f.where = cg.dir
        return f

    def _untrack(self, pid: int, f: Followed) -> bool:
        """Stop following ``pid`` (unbound, or bound again as another process); True
        where its cgroup is no longer watched."""
        self.ledger.pop(pid, FOLLOWED)
        self.ledger.unwatch(pid, _WATCH)
        return self._leave(f)

    def _exited(self, pid: int) -> None:
        """A followed process exited (on the loop; its record, with ``FOLLOWED``, goes
        after this): it leaves its cgroup, whose watch goes with its last member."""
        f = self.ledger.get(pid, FOLLOWED)
        if f is not None and self._leave(f):
            self._rewatch()

    def _leave(self, f: Followed) -> bool:
        """``f`` leaves its cgroup; True where that was its last member (unwatched)."""
        d, f.where = f.where, None
        if d is None or d not in self._cgroups:
            return False
        self._cgroups[d].members -= 1
        if self._cgroups[d].members > 0:
            return False
        del self._cgroups[d]
        return True

    def _rewatch(self) -> None:
        """inotify watches on the watched cgroups and their ancestors, no others."""
        if self._ino is None:
            return
        from inotify_simple import flags

        want: set[Path] = set()
        for w in self._cgroups.values():
            d = w.cgroup.dir
            while True:
                want.add(d)
                if d == w.cgroup.mount or d == d.parent:
                    break
                d = d.parent
        have = {p: wd for wd, p in self._wds.items()}
        for p, wd in have.items():
            if p not in want:
                try:
                    self._ino.rm_watch(wd)
                except OSError:
                    pass  # the cgroup is gone, and its watch with it
                del self._wds[wd]
        for p in want - set(have):
            try:
                self._wds[self._ino.add_watch(str(p), flags.MODIFY)] = p
            except OSError:
                continue
