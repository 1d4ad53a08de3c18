"""Typed records the daemon keeps in its runtime state: bindings and leases.

They are serialised to the runtime store's sections in the layout the store has
always had (``bindings`` keyed by str(pid), ``leases.leases`` keyed by lease id), so
a state file written by an older daemon is read, and one written now is read back
by ``from_json``. A malformed record is refused with ``ValueError`` (dropped, with
a log line, by its owner).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from tunerd.base.cpulist import parse_cpulist
from tunerd.jobs.binding import Originals

__all__ = ["PUBLIC_BINDING", "Binding", "Hold", "Lease"]

# fields of a binding shown by `tunerctl jobs` (besides the live ones)
PUBLIC_BINDING = ("pid", "start_time", "uid", "name", "cmdline", "cpus", "mems", "gpus",
                  "nofile", "origin", "lease", "bound_at", "explanation", "notes", "why")


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


@dataclass(frozen=True)
class Hold:
    """What a ``tunerctl bind`` holds in the placer beside its CPUs (a reservation,
    restored with the binding after a daemon restart): the CPUs against the other
    ranks/tasks of ``group`` (a Slurm step's tasks split the step), or against
    everyone (``exclusive``, with the binding's GPUs)."""

    group: str | None = None  # "slurm:12.0": the rank's job group
    job: str | None = None  # scheduler job ("slurm:12")
    exclusive: bool = False
    uid: int | None = None  # who bound it (an exclusive bind counts against them)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> Hold | None:
        """None for a record written before holds were kept, or a malformed one (the
        binding is re-adopted all the same; only its reservation is not restored)."""
        if not isinstance(d, dict):
            return None
        group, job, excl, uid = d.get("group"), d.get("job"), d.get("exclusive"), d.get("uid")
        if not (isinstance(group, str | None) and isinstance(job, str | None)
                and isinstance(excl, bool) and (uid is None or type(uid) is int)):
            return None
        return cls(group=group, job=job, exclusive=excl, uid=uid)


@dataclass(frozen=True)
class Binding:
    """A process tunerd bound, with what it had before (to restore on unbind)."""

    pid: int
    start_time: int
    originals: Originals
    uid: int | None = None
    name: str = ""
    cmdline: str = ""
    cpus: str | None = None  # cpulist as bound
    mems: str | None = None
    gpus: tuple[int, ...] = ()
    nofile: int | None = None
    origin: str = "cli"  # cli | rule | run | worker
    lease: str | None = None
    bound_at: float = 0.0
    explanation: str | None = None
    notes: tuple[str, ...] = ()
    why: str | None = None  # how the intake told what the process is ("LOCAL_RANK=1 ...")
    hold: Hold | None = None  # the reservation a `tunerctl bind` keeps (none: older records)

    def cpu_set(self) -> frozenset[int]:
        return parse_cpulist(self.cpus) if self.cpus else frozenset()

    def mem_set(self) -> frozenset[int] | None:
        return parse_cpulist(self.mems) if self.mems else None

    @functools.cached_property
    def _public(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in PUBLIC_BINDING}

    def public(self) -> dict[str, Any]:
        """A new dict of the public fields (the job list is made every monitor cycle:
        a copy of the fields read once per record, not 15 attribute reads)."""
        d = self._public.copy()
        d["gpus"] = list(self.gpus)
        d["notes"] = list(self.notes)
        return d

    def to_json(self) -> dict[str, Any]:
        d = self.public()
        d["originals"] = self.originals.to_json()
        if self.hold is not None:
            d["hold"] = self.hold.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Binding:
        try:
            return cls(
                pid=int(d["pid"]), start_time=int(d["start_time"]),
                originals=Originals.from_json(d["originals"]), uid=_opt_int(d.get("uid")),
                name=str(d.get("name") or ""), cmdline=str(d.get("cmdline") or ""),
                cpus=_opt_str(d.get("cpus")), mems=_opt_str(d.get("mems")),
                gpus=tuple(int(g) for g in d.get("gpus") or ()),
                nofile=_opt_int(d.get("nofile")), origin=str(d.get("origin") or "cli"),
                lease=_opt_str(d.get("lease")), bound_at=float(d.get("bound_at") or 0.0),
                explanation=_opt_str(d.get("explanation")),
                notes=tuple(str(n) for n in d.get("notes") or ()), why=_opt_str(d.get("why")),
                hold=Hold.from_json(d.get("hold")))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"malformed binding record: {err!r}") from err


@dataclass
class Lease:
    """GPUs + CPUs reserved for a job (``alloc``/``run``); mutable: notes grow."""

    id: str
    uid: int
    user: str
    origin: str  # alloc | run
    gpus: tuple[int, ...]
    cpus: str
    mems: str
    exclusive: bool = False
    scope: str | None = None
    pid: int | None = None
    start_time: int | None = None
    cmd: list[str] | None = None
    tag: str | None = None
    created: float = 0.0
    expires: float | None = None
    gpu_uuids: tuple[str, ...] = ()
    explanation: str = ""
    applied: bool = True
    notes: list[str] = field(default_factory=list)
    cvd: str | None = None  # the job's own numbering of its GPUs
    cpus_bound: str | None = None
    moved: Any = None
    job: str | None = None  # scheduler job it was made in ("slurm:12")
    job_cgroup: str | None = None  # that job's cgroup directory: gone = job ended

    def cpu_set(self) -> frozenset[int]:
        return parse_cpulist(self.cpus)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gpus"] = list(self.gpus)
        d["gpu_uuids"] = list(self.gpu_uuids)
        for k in ("cvd", "cpus_bound", "moved", "job", "job_cgroup"):
            if d[k] is None:
                del d[k]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Lease:
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            kw = {k: v for k, v in d.items() if k in names}
            kw["gpus"] = tuple(int(g) for g in d["gpus"])
            kw["gpu_uuids"] = tuple(str(u) for u in d.get("gpu_uuids") or ())
            kw["notes"] = [str(n) for n in d.get("notes") or ()]
            return cls(**kw)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed lease record: {err!r}") from err
