"""What a bind is, as values: the pinned target, the plan, the originals, the result.

Pure types (no system call but a pidfd's close and poll): ``tunerd.jobs.actuate`` makes
and carries out plans; the registry keeps the originals in the runtime state.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tunerd.adapters.cpuset import CpusetCgroup
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.base.jsontypes import JSONObject

__all__ = ["BindResult", "Originals", "Plan", "Target"]


@dataclass
class Target:
    """A process pinned by pidfd + start time."""

    pid: int
    start_time: int
    pidfd: int
    uid: int  # real uid
    euid: int
    owned: bool = True  # False: the pidfd is the ledger's (closed when the process exits)

    _poll: select.poll | None = field(default=None, repr=False, compare=False)

    def close(self) -> None:
        if self.pidfd >= 0:
            if self.owned:
                os.close(self.pidfd)
            self.pidfd = -1
            self._poll = None

    def exited(self) -> bool:
        """True once the process has exited (its pidfd is readable); one cheap poll(2)."""
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.pidfd, select.POLLIN)
        return bool(self._poll.poll(0))


@dataclass
class Originals:
    """What bind changed, as it was before the first bind (JSON-able, kept in state)."""

    pid: int
    start_time: int
    process_cpus: frozenset[int]
    threads: dict[int, frozenset[int]] = field(default_factory=dict)
    nofile: tuple[int, int] | None = None
    cpuset_base: CpusetCgroup | None = None  # cgroup the process was in
    cpuset_child: CpusetCgroup | None = None  # the child cpuset tunerd made
    affinity_set: bool = False  # whether bind changed CPU masks (restore only what changed)

    def to_json(self) -> JSONObject:
        return {
            "pid": self.pid,
            "start_time": self.start_time,
            "process_cpus": format_cpulist(self.process_cpus),
            "threads": _group_masks(self.threads),
            "nofile": list(self.nofile) if self.nofile else None,
            "cpuset_base": self.cpuset_base.to_json() if self.cpuset_base else None,
            "cpuset_child": self.cpuset_child.to_json() if self.cpuset_child else None,
            "affinity_set": self.affinity_set,
        }

    @classmethod
    def from_json(cls, d: object) -> Originals:
        """Read back what ``to_json`` wrote; TypeError, KeyError or ValueError for a
        malformed record (its owner drops it)."""
        if not isinstance(d, dict):
            raise TypeError(f"originals: expected an object, got {type(d).__name__}")
        nof, base, child = d.get("nofile"), d.get("cpuset_base"), d.get("cpuset_child")
        threads: dict[int, frozenset[int]] = {}
        for text, tids in _mapping(d.get("threads") or {}).items():
            mask = parse_cpulist(text)
            for tid in _sequence(tids):
                threads[_int(tid)] = mask
        pair = _sequence(nof) if nof else None
        return cls(
            pid=_int(d["pid"]),
            start_time=_int(d["start_time"]),
            process_cpus=parse_cpulist(_str(d["process_cpus"])),
            threads=threads,
            nofile=(_int(pair[0]), _int(pair[1])) if pair else None,
            cpuset_base=CpusetCgroup.from_json(_mapping(base)) if base else None,
            cpuset_child=CpusetCgroup.from_json(_mapping(child)) if child else None,
            affinity_set=bool(d.get("affinity_set")),
        )

    def copy(self) -> Originals:
        return replace(self, threads=dict(self.threads))


def _group_masks(masks: dict[int, frozenset[int]]) -> JSONObject:
    """cpulist -> [tid, ...]: threads mostly share one mask, so this stays small."""
    by_mask: dict[frozenset[int], list[int]] = {}
    for tid, mask in masks.items():
        by_mask.setdefault(mask, []).append(tid)
    return {format_cpulist(m): [*sorted(tids)] for m, tids in by_mask.items()}


# -- narrowing a JSON value read back (a wrong type raises as int() and [] would) -----
def _int(v: object) -> int:
    if isinstance(v, int | float | str):
        return int(v)
    raise TypeError(f"expected a number, got {type(v).__name__}")


def _str(v: object) -> str:
    if isinstance(v, str):
        return v
    raise TypeError(f"expected a string, got {type(v).__name__}")


def _mapping(v: object) -> dict[str, object]:
    if isinstance(v, dict):
        return v
    raise TypeError(f"expected an object, got {type(v).__name__}")


def _sequence(v: object) -> list[object]:
    if isinstance(v, list | tuple):
        return list(v)
    raise TypeError(f"expected a list, got {type(v).__name__}")


@dataclass
class Plan:
    """A validated bind: what will be written, and the originals to save first."""

    target: Target
    originals: Originals
    cpus: frozenset[int] | None
    mems: frozenset[int] | None
    nofile: tuple[int, int] | None  # new (soft, hard)
    cpuset: CpusetCgroup | None = None  # child cpuset to create/update and attach to
    cpuset_cpus: frozenset[int] = frozenset()
    migrate_from: frozenset[int] | None = None  # migrate_pages fallback: old nodes
    notes: list[str] = field(default_factory=list)
    first: bool = True  # False for a re-bind of an already bound process
    # a failing fd-limit or memory-node step is a note, not a failure: the CPU binding
    # stays (rule and lease binds; an explicit `tunerctl bind --nofile` is all or nothing)
    partial: bool = False
    # called once, right after the main thread's mask is set and before the other
    # threads are listed (the exec watcher's thread lowers its priority there: what
    # follows is not what the starting process waits for)
    after_main: Callable[[], None] | None = None


@dataclass
class BindResult:
    pid: int
    cpus: frozenset[int] | None
    mems: frozenset[int] | None
    threads: int
    pages_moved: int | None
    nofile_old: int | None
    nofile_new: int | None
    notes: list[str]
    elapsed_ms: float

    def to_json(self) -> JSONObject:
        return {
            "pid": self.pid,
            "cpus": format_cpulist(self.cpus) if self.cpus is not None else None,
            "mems": format_cpulist(self.mems) if self.mems is not None else None,
            "threads": self.threads,
            "pages_moved": self.pages_moved,
            "nofile": ({"old": self.nofile_old, "new": self.nofile_new}
                       if self.nofile_new is not None else None),
            "notes": [*self.notes],
            "elapsed_ms": round(self.elapsed_ms, 3),
        }

