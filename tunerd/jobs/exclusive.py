"""Exclusive jobs: move the other processes of a scope off the job's CPUs, and back.

A scope names the processes that must make room:

* ``pid:N``         -- process N and all its descendants;
* ``cgroup:/path``  -- the processes of that cgroup (v2 unified tree, else the
  v1 cpuset hierarchy).

Each thread's affinity becomes ``original - job CPUs``; a thread that would be
left with no CPU at all is left alone (and reported). The original masks are
saved in the runtime state (section ``leases``, key ``moved``) *before* any change,
so a crash or ``kill -9`` of the daemon still lets the next start put them
back. A thread is restored only if it is the same thread (start time) and its
mask is still the one we set: a mask someone changed since is theirs.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.base.errors import PermissionDenied, UsageError
from tunerd.jobs.actuate import set_threads

__all__ = ["ExclusiveMover", "MoveReport", "MovedEntry", "MovedThread", "parse_scope"]

log = logging.getLogger("tunerd.exclusive")

CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/cpuset")
_SCOPE_RE = re.compile(r"^(pid:(?P<pid>\d+)|cgroup:(?P<cg>/[^\0]*))$")
_NAME_MAX = 255  # bytes in one path component (NAME_MAX)
_PATH_MAX = 4096 - len("/sys/fs/cgroup/unified/cgroup.procs")  # PATH_MAX, roots included


class MovedThread(TypedDict):
    """One moved thread, as the runtime state keeps it (``leases.moved[KEY].threads``)."""

    pid: int
    start_time: int
    orig: str  # its mask before (a cpulist)
    set: str  # the mask tunerd set


class MovedEntry(TypedDict):
    """What one exclusive holder moved (``leases.moved[KEY]``)."""

    scope: str
    cpus: str  # the holder's CPUs
    threads: dict[str, MovedThread]  # str(tid) -> the thread


@dataclass(frozen=True)
class MoveReport:
    """What ``move_off`` did."""

    scope: str
    moved: int = 0  # threads moved
    notes: list[str] = field(default_factory=list)


def parse_scope(scope: str) -> tuple[str, str]:
    """``("pid", "123")`` or ``("cgroup", "/path")``; UsageError for anything else."""
    m = _SCOPE_RE.match(scope.strip())
    if not m:
        raise UsageError(f"exclusive scope {scope!r}: expected 'pid:N' or 'cgroup:/path'")
    if m.group("pid"):
        return "pid", m.group("pid")
    path = m.group("cg")
    if ".." in Path(path).parts:
        raise UsageError(f"exclusive scope {scope!r}: '..' is not allowed in a cgroup path")
    # a name the kernel cannot hold would only fail later as ENAMETOOLONG
    long = next((p for p in Path(path).parts if len(os.fsencode(p)) > _NAME_MAX), None)
    if long is not None:
        raise UsageError(f"exclusive scope {scope[:60]!r}...: cgroup name {long[:40]!r}... "
                         f"is longer than {_NAME_MAX} bytes")
    if len(os.fsencode(path)) > _PATH_MAX:
        raise UsageError(f"exclusive scope {scope[:60]!r}...: the cgroup path is longer "
                         f"than {_PATH_MAX} bytes")
    return "cgroup", path


def scope_pids(scope: str, proc: str = procfs.PROC,
               cgroup_roots: tuple[str, ...] = CGROUP_ROOTS, *,
               kids: dict[int, list[int]] | None = None) -> list[int]:
    """The processes of ``scope``; ``kids``: a procfs.children_map to use for a pid tree."""
    kind, arg = parse_scope(scope)
    if kind == "pid":
        root = int(arg)
        if procfs.read_start_time(root, proc) is None:
            raise UsageError(f"exclusive scope {scope!r}: no process {root}")
        return procfs.descendants(root, proc, kids=kids)
    for base in cgroup_roots:
        procs = Path(base + arg.rstrip("/")) / "cgroup.procs"
        if procs.is_file():
            try:
                return [int(x) for x in procfs.read_text(procs, None).split()]
            except OSError as err:
                raise UsageError(f"exclusive scope {scope!r}: cannot read {procs}: "
                                 f"{err.strerror}") from err
    raise UsageError(f"exclusive scope {scope!r}: no such cgroup under "
                     f"{', '.join(cgroup_roots)}")


class ExclusiveMover:
    """Keeps the record of every moved thread in ``section``; ``save`` persists it."""

    def __init__(self, section: dict[str, MovedEntry], save: Callable[[], None], *,
                 dry_run: bool = False, proc: str = procfs.PROC) -> None:
        self.moved = section
        self._save = save
        self.dry_run = dry_run
        self.proc = proc

    def move_off(self, key: str, scope: str, cpus: frozenset[int], keep_root: int | None,
                 requester_uid: int) -> MoveReport:
        """Move every thread in ``scope`` (except ``keep_root`` and its tree) off ``cpus``.

        Non-root requesters only move processes they own; others are skipped.
        """
        # one sweep of /proc (a stat read per process) serves both trees
        kids = (procfs.children_map(self.proc)
                if keep_root or parse_scope(scope)[0] == "pid" else None)
        pids = scope_pids(scope, self.proc, kids=kids)
        keep = (set(procfs.descendants(keep_root, self.proc, kids=kids)) if keep_root
                else set())
        keep.add(os.getpid())
        if not cpus:
            return MoveReport(scope)
        plan: dict[str, MovedThread] = {}
        notes: list[str] = []
        foreign = 0
        for pid in pids:
            if pid in keep:
                continue
            if requester_uid != 0 and procfs.read_uid(pid, self.proc) != requester_uid:
                foreign += 1
                continue
            for tid in procfs.list_tids(pid, self.proc):
                try:
                    cur = frozenset(os.sched_getaffinity(tid))
                except OSError:
                    continue
                new = cur - cpus
                if new == cur:
                    continue
                if not new:
                    notes.append(f"pid {pid} (thread {tid}) may only run on the job's CPUs "
                                 f"{format_cpulist(cur)}; left there")
                    continue
                st = procfs.read_start_time(tid, self.proc)
                if st is None:
                    continue
                plan[str(tid)] = MovedThread(pid=pid, start_time=st, orig=format_cpulist(cur),
                                             set=format_cpulist(new))
        if foreign:
            notes.append(f"{foreign} process(es) in {scope} belong to other users and were "
                         "not moved")
        if self.dry_run:
            notes.append(f"dry run: would move {len(plan)} thread(s) off "
                         f"{format_cpulist(cpus)}")
            return MoveReport(scope, notes=notes)
        entry = self.moved.setdefault(key, MovedEntry(scope=scope, cpus=format_cpulist(cpus),
                                                      threads={}))
        entry["threads"].update(plan)
        self._save()  # originals on disk before the first change
        moved = self._move(entry, plan)
        self._save()
        log.info("exclusive %s: moved %d thread(s) in %s off CPUs %s", key, moved, scope,
                 format_cpulist(cpus))
        return MoveReport(scope, moved, notes)

    def _move(self, entry: MovedEntry, plan: dict[str, MovedThread]) -> int:
        """Set the planned masks, each process pinned by a pidfd (tunerd.jobs.actuate);
        a thread not moved is dropped from ``entry``."""
        moved = 0
        for pid, threads in _by_pid(plan).items():
            got = set_threads(pid, {int(t): (None, parse_cpulist(r["set"]))
                                    for t, r in threads.items()},
                              thread_starts={int(t): r["start_time"]
                                             for t, r in threads.items()}, proc=self.proc)
            moved += len(got.done)
            for tkey in threads:
                if int(tkey) not in got.done:
                    entry["threads"].pop(tkey, None)
            if got.denied is not None:
                raise PermissionDenied(
                    f"cannot move thread {got.denied[0]}: {got.denied[1]} (EPERM: setting the "
                    "CPUs of another user's thread needs CAP_SYS_NICE, which tunerd does not "
                    "have)")
        return moved

    def restore(self, key: str) -> int:
        """Put back every thread moved for ``key``; returns how many were restored."""
        entry = self.moved.get(key)
        if entry is None:
            return 0
        restored = 0
        for pid, threads in _by_pid(entry["threads"]).items():
            # a thread whose mask changed since keeps it (theirs now); one that exited, or
            # whose tid was reused (its start time), is skipped
            got = set_threads(pid, {int(t): (parse_cpulist(r["set"]), parse_cpulist(r["orig"]))
                                    for t, r in threads.items()},
                              thread_starts={int(t): r["start_time"]
                                             for t, r in threads.items()}, proc=self.proc)
            restored += len(got.done)
            for tid, why in [*got.failed.items(), *([got.denied] if got.denied else [])]:
                log.warning("exclusive %s: cannot restore thread %s: %s", key, tid, why)
        del self.moved[key]
        self._save()
        log.info("exclusive %s: restored %d thread(s)", key, restored)
        return restored

    def originals_of(self, pid: int) -> dict[int, frozenset[int]]:
        """Masks threads of ``pid`` had before an exclusive job moved them (tid -> mask).

        A bind of such a process takes these as its originals, so that unbinding
        it later does not keep it off the exclusive job's CPUs for good.
        """
        out: dict[int, frozenset[int]] = {}
        for entry in self.moved.values():
            for tid_s, rec in entry["threads"].items():
                if rec.get("pid") == pid:
                    out[int(tid_s)] = parse_cpulist(rec["orig"])
        return out

    def disown(self, pid: int) -> int:
        """Stop tracking the moved threads of ``pid`` (a binding owns them now)."""
        n = 0
        for entry in self.moved.values():
            for tid_s in [t for t, r in entry["threads"].items() if r.get("pid") == pid]:
                del entry["threads"][tid_s]
                n += 1
        if n:
            self._save()
        return n


def _by_pid(threads: dict[str, MovedThread]) -> dict[int, dict[str, MovedThread]]:
    """Moved threads (tid -> record) grouped by their process."""
    out: dict[int, dict[str, MovedThread]] = {}
    for tid, rec in threads.items():
        out.setdefault(int(rec["pid"]), {})[tid] = rec
    return out
