"""Typed records the daemon keeps in its runtime state: bindings and leases.

They are serialised to the runtime store's sections in the layout the store has
always had (``bindings`` keyed by str(pid), ``leases.leases`` keyed by lease id), so
a state file written by an older daemon is read, and one written now is read back
by ``from_json``. A malformed record is refused with ``ValueError`` (dropped, with
a log line, by its owner).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from tunerd.base.cpulist import parse_cpulist
from tunerd.base.jsontypes import JSONObject, JSONValue, json_object
from tunerd.jobs.binding import Originals

__all__ = ["PUBLIC_BINDING", "Binding", "Hold", "Lease"]

T = TypeVar("T")

# fields of a binding shown by `tunerctl jobs` (besides the live ones)
PUBLIC_BINDING = ("pid", "start_time", "uid", "name", "cmdline", "cpus", "mems", "gpus",
                  "nofile", "origin", "lease", "bound_at", "explanation", "notes", "why")


# -- reading a record back -------------------------------------------------------------
# The state file is untyped JSON; it enters through ``_record`` only. A binding's fields
# are converted as the binding reader always converted them (``_as_int``: ``int()``...);
# a lease's must each be of their own JSON type (``_req``, ``_get``, ``_opt``...).
# Anything else makes the record malformed.
def _record(raw: object, what: str) -> JSONObject:
    """The untyped JSON of one record (the state file's) as a JSON object."""
    d = json_object(raw)
    if d is None:
        raise TypeError(f"{what} is a {type(raw).__name__}, not an object")
    return d


def _as_int(v: JSONValue) -> int:
    """``int(v)``: a number, a numeric text or a bool (anything else: TypeError)."""
    if isinstance(v, int | float | str):
        return int(v)
    raise TypeError(f"not a number: {v!r}")


def _as_opt_int(v: JSONValue) -> int | None:
    return None if v is None else _as_int(v)


def _as_opt_str(v: JSONValue) -> str | None:
    return None if v is None else str(v)


def _as_float(v: JSONValue) -> float:
    if isinstance(v, int | float | str):
        return float(v)
    raise TypeError(f"not a number: {v!r}")


def _items(v: JSONValue) -> Iterable[JSONValue]:
    """What ``for x in v`` gives: a list's items (a text's characters, an object's keys,
    as the readers always took them); TypeError for anything else."""
    if isinstance(v, list | str | dict):
        return v
    raise TypeError(f"not a list: {v!r}")


def _each(v: JSONValue) -> Iterable[JSONValue]:
    """``_items`` of an optional list (missing, null or empty: nothing)."""
    return _items(v) if v else ()


def _wrong(key: str, v: JSONValue) -> TypeError:
    return TypeError(f"field {key!r} is {v!r}")


def _req(d: JSONObject, key: str, kind: type[T]) -> T:
    """``d[key]``, of type ``kind`` (KeyError when missing, TypeError when not)."""
    v = d[key]
    if not isinstance(v, kind):
        raise _wrong(key, v)
    return v


def _get(d: JSONObject, key: str, kind: type[T], default: T) -> T:
    """``d[key]`` of type ``kind``, or ``default`` when missing."""
    return _req(d, key, kind) if key in d else default


def _opt(d: JSONObject, key: str, kind: type[T]) -> T | None:
    """``d[key]`` of type ``kind``, or None when missing or null."""
    return None if d.get(key) is None else _req(d, key, kind)


def _float_of(key: str, v: JSONValue) -> float:
    if not isinstance(v, int | float):
        raise _wrong(key, v)
    return float(v)


def _number(d: JSONObject, key: str, default: float) -> float:
    """A number (an int too) as a float, or ``default`` when missing."""
    return _float_of(key, d[key]) if key in d else default


def _opt_number(d: JSONObject, key: str) -> float | None:
    """A number as a float, or None when missing or null."""
    v = d.get(key)
    return None if v is None else _float_of(key, v)


def _texts(d: JSONObject, key: str) -> list[str] | None:
    """A list of texts, or None when missing or null."""
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _wrong(key, v)
    return [str(x) for x in v]


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
    ranked: bool = False  # a rank its launcher or scheduler identified (steers [irq])

    def to_json(self) -> JSONObject:
        d: JSONObject = {"group": self.group, "job": self.job, "exclusive": self.exclusive,
                         "uid": self.uid}
        if self.ranked:  # written only when set: older daemons' layout otherwise
            d["ranked"] = True
        return d

    @classmethod
    def from_json(cls, raw: JSONValue | None) -> Hold | None:
        """None for a record written before holds were kept, or a malformed one (the
        binding is re-adopted all the same; only its reservation is not restored)."""
        d = json_object(raw)
        if d is None:
            return None
        group, job, excl, uid = d.get("group"), d.get("job"), d.get("exclusive"), d.get("uid")
        ranked = d.get("ranked", False)
        if not (isinstance(group, str | None) and isinstance(job, str | None)
                and isinstance(excl, bool) and (uid is None or type(uid) is int)
                and isinstance(ranked, bool)):
            return None
        return cls(group=group, job=job, exclusive=excl, uid=uid, ranked=ranked)


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
    def _public(self) -> JSONObject:
        """The ``PUBLIC_BINDING`` fields, in that order (lists: fresh ones per copy)."""
        return {"pid": self.pid, "start_time": self.start_time, "uid": self.uid,
                "name": self.name, "cmdline": self.cmdline, "cpus": self.cpus,
                "mems": self.mems, "gpus": [], "nofile": self.nofile, "origin": self.origin,
                "lease": self.lease, "bound_at": self.bound_at,
                "explanation": self.explanation, "notes": [], "why": self.why}

    def public(self) -> dict[str, object]:
        """A new dict of the public fields, JSON values, for the caller to add to (the
        job list is made every monitor cycle: a copy of the fields read once per record,
        not 15 attribute reads)."""
        d: dict[str, object] = {**self._public}
        d["gpus"] = list(self.gpus)
        d["notes"] = list(self.notes)
        return d

    def to_json(self) -> JSONObject:
        d: JSONObject = {**self._public, "gpus": list(self.gpus), "notes": list(self.notes)}
        d["originals"] = self.originals.to_json()
        if self.hold is not None:
            d["hold"] = self.hold.to_json()
        return d

    @classmethod
    def from_json(cls, raw: object) -> Binding:
        """The binding of a state file's record (ValueError: malformed)."""
        try:
            return cls._read(_record(raw, "binding record"))
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"malformed binding record: {err!r}") from err

    @classmethod
    def _read(cls, d: JSONObject) -> Binding:
        return cls(
            pid=_as_int(d["pid"]), start_time=_as_int(d["start_time"]),
            originals=Originals.from_json(_record(d["originals"], "originals")),
            uid=_as_opt_int(d.get("uid")),
            name=str(d.get("name") or ""), cmdline=str(d.get("cmdline") or ""),
            cpus=_as_opt_str(d.get("cpus")), mems=_as_opt_str(d.get("mems")),
            gpus=tuple(_as_int(g) for g in _each(d.get("gpus"))),
            nofile=_as_opt_int(d.get("nofile")), origin=str(d.get("origin") or "cli"),
            lease=_as_opt_str(d.get("lease")), bound_at=_as_float(d.get("bound_at") or 0.0),
            explanation=_as_opt_str(d.get("explanation")),
            notes=tuple(str(n) for n in _each(d.get("notes"))), why=_as_opt_str(d.get("why")),
            hold=Hold.from_json(d.get("hold")))


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
    moved: int | None = None  # threads the exclusive mover moved off its CPUs
    job: str | None = None  # scheduler job it was made in ("slurm:12")
    job_cgroup: str | None = None  # that job's cgroup directory: gone = job ended

    def cpu_set(self) -> frozenset[int]:
        return parse_cpulist(self.cpus)

    def to_json(self) -> JSONObject:
        """Every field in order; the optional tail only where set."""
        d: JSONObject = {
            "id": self.id, "uid": self.uid, "user": self.user, "origin": self.origin,
            "gpus": list(self.gpus), "cpus": self.cpus, "mems": self.mems,
            "exclusive": self.exclusive, "scope": self.scope, "pid": self.pid,
            "start_time": self.start_time, "cmd": None if self.cmd is None else list(self.cmd),
            "tag": self.tag, "created": self.created, "expires": self.expires,
            "gpu_uuids": list(self.gpu_uuids), "explanation": self.explanation,
            "applied": self.applied, "notes": list(self.notes)}
        tail: JSONObject = {"cvd": self.cvd, "cpus_bound": self.cpus_bound,
                            "moved": self.moved, "job": self.job, "job_cgroup": self.job_cgroup}
        d.update((k, v) for k, v in tail.items() if v is not None)
        return d

    @classmethod
    def from_json(cls, raw: object) -> Lease:
        """The lease of a state file's record (ValueError: malformed, or a field not of
        its JSON type)."""
        try:
            return cls._read(_record(raw, "lease record"))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"malformed lease record: {err!r}") from err

    @classmethod
    def _read(cls, d: JSONObject) -> Lease:
        return cls(
            id=_req(d, "id", str), uid=_req(d, "uid", int), user=_req(d, "user", str),
            origin=_req(d, "origin", str), gpus=tuple(_as_int(g) for g in _items(d["gpus"])),
            cpus=_req(d, "cpus", str), mems=_req(d, "mems", str),
            exclusive=_get(d, "exclusive", bool, False), scope=_opt(d, "scope", str),
            pid=_opt(d, "pid", int), start_time=_opt(d, "start_time", int),
            cmd=_texts(d, "cmd"), tag=_opt(d, "tag", str), created=_number(d, "created", 0.0),
            expires=_opt_number(d, "expires"),
            gpu_uuids=tuple(str(u) for u in _each(d.get("gpu_uuids"))),
            explanation=_get(d, "explanation", str, ""), applied=_get(d, "applied", bool, True),
            notes=[str(n) for n in _each(d.get("notes"))], cvd=_opt(d, "cvd", str),
            cpus_bound=_opt(d, "cpus_bound", str), moved=_opt(d, "moved", int),
            job=_opt(d, "job", str), job_cgroup=_opt(d, "job_cgroup", str))
