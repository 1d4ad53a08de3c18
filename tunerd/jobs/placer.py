"""The placing service: every placement is decided here, every reservation kept here.

Leases (``alloc``/``run``), automatic binding of ``[[job]]`` matches and
``tunerctl bind PID`` without placement flags all call ``Placer.place``, and
what they hold (GPUs, exclusive CPUs, a rank's CPUs) is registered here as a
reservation, so every placement sees every other one.

How a request becomes a placement (``tunerd.jobs.placement.place`` does the topology
work):

1. The allocation first (``tunerd.jobs.allocation``): the caller's cgroup cpuset and
   its scheduler's GPUs bound what may be chosen. A CPU count the scheduler
   granted (``SLURM_CPUS_PER_TASK``, or the size of the mask a scheduler bound
   the task to) is kept: tunerd only picks where inside the allocation those
   CPUs lie. An allocation smaller than asked gives what it has, with a note.
2. Housekeeping CPUs, grown to whole cores (their SMT siblings too), are never
   given out; neither are CPUs another job holds exclusively.
3. Ranks of one job split the allowed CPUs (``LOCAL_WORLD_SIZE``), with or
   without GPUs, and each rank's share counts its DataLoader workers: on a node
   without a scheduler, a share that cannot hold a rank and its workers is pooled
   with the next ranks' (they share those CPUs) rather than crowding a rank and its
   workers onto one core; inside a scheduler's allocation the ranks split it all
   the same (disjoint shares: the allocation is all the job has).
4. On a replayed topology (``tunerd --topology``) a placement naming CPUs or
   memory nodes this machine lacks is marked not applicable, and says so.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from tunerd.adapters import procfs
from tunerd.adapters.procfs import read_text
from tunerd.base.cpulist import CpuListError, format_cpulist, parse_cpulist
from tunerd.base.errors import PlacementError, UsageError
from tunerd.base.jsontypes import JSONObject
from tunerd.base.modes import parse_mode
from tunerd.jobs.allocation import Allocation
from tunerd.jobs.gate import verified_gpus
from tunerd.jobs.placement import (
    Mode,
    Placement,
    PlacementRequest,
    is_exclusive,
    mems_of,
    ordered_cpus,
    per_gpu_cpu_share,
    whole_cores,
)
from tunerd.jobs.placement import place as place_on_topology
from tunerd.topology.model import Topology
from tunerd.topology.nodemap import node_map
from tunerd.topology.visible import gpus_from_nvml

__all__ = ["HostCapacity", "PlaceRequest", "Placer", "Reservation", "ReservationKey",
           "ReservationKind"]

log = logging.getLogger("tunerd.placer")

ANCESTOR_DEPTH = 8  # how far up to look for a `tunerctl run` lease holder
MEMO_SIZE = 256  # placements kept (``Placer.place``); all dropped when full


@dataclass(frozen=True)
class HostCapacity:
    """CPUs and NUMA nodes this machine really has (not the replayed snapshot's)."""

    cpus: frozenset[int]
    mems: frozenset[int] = field(default=frozenset({0}))

    @classmethod
    def read(cls, sys_root: str | Path = "/sys") -> HostCapacity:
        def one(path: str, default: frozenset[int]) -> frozenset[int]:
            try:
                return parse_cpulist(read_text(Path(sys_root, path)))
            except (OSError, CpuListError):
                return default

        cpus = one("devices/system/cpu/online", frozenset(os.sched_getaffinity(0)))
        mems = one("devices/system/node/online", frozenset({0}))
        return cls(cpus, mems)


@dataclass(frozen=True)
class PlaceRequest:
    """What a caller asks for. Counts are per process (a rank, a lease)."""

    gpus: int = 0  # how many GPUs to choose
    gpu_ids: tuple[int, ...] | None = None  # exactly these GPUs
    ncpus: int | None = None  # how many CPUs (None: the share the node gives)
    cpus: frozenset[int] | None = None  # exactly these CPUs
    mode: Mode = Mode.GPU_LOCAL
    exclusive: bool = False
    allocation: Allocation | None = None
    workers: int = 0  # DataLoader worker processes of each rank
    rank: int | None = None  # LOCAL_RANK
    ranks: int | None = None  # LOCAL_WORLD_SIZE: ranks splitting the allocation
    gpu_sharers: int | None = None  # ranks of the job on the same GPU(s): they split its slice
    gpu_peers: tuple[int, ...] | None = None  # the GPUs the job's ranks see (rank k: k % len)
    group: str | None = None  # job the rank belongs to (siblings avoid each other)
    job: str | None = None  # scheduler job ("slurm:12"): its own exclusive leases never block it
    ignore_busy_gpus: bool = False  # bind: the process already uses these GPUs
    what: str = "job"  # for messages: "lease", "rule torch-training", ...

    def __post_init__(self) -> None:
        if type(self.mode) is not Mode:  # text from a caller: parsed here, once
            object.__setattr__(self, "mode", parse_mode(self.mode))


class ReservationKind(enum.Enum):
    """Who holds a reservation (the text before the colon of a key's written form)."""

    BIND = "bind"  # tunerctl bind: an exclusive bind, a rank's or Slurm task's CPUs
    RULE = "rule"  # a [[job]] rule's rank
    LEASE = "lease"  # alloc / run
    # a rank that pinned itself (numactl/taskset wrapper, in-app binding, torchrun
    # --numa-binding): left as it is, held as an outside owner of the CPUs it runs on
    EXTERNAL = "external"


@dataclass(frozen=True)
class ReservationKey:
    """A reservation's key: its kind and what it is of (a pid, a lease id)."""

    kind: ReservationKind
    ident: str

    def __str__(self) -> str:  # the text form, as state files and messages have it
        return f"{self.kind.value}:{self.ident}"

    @classmethod
    def bind(cls, pid: int) -> ReservationKey:
        return cls(ReservationKind.BIND, str(pid))

    @classmethod
    def rule(cls, pid: int) -> ReservationKey:
        return cls(ReservationKind.RULE, str(pid))

    @classmethod
    def lease(cls, lid: str) -> ReservationKey:
        return cls(ReservationKind.LEASE, lid)

    @classmethod
    def external(cls, pid: int) -> ReservationKey:
        return cls(ReservationKind.EXTERNAL, str(pid))

    @classmethod
    def parse(cls, text: str) -> ReservationKey | None:
        """The text form ("lease:L3", "rule:PID", "rule:PID:START" of a rule's exclusive
        move); None for any other text."""
        kind, sep, ident = text.partition(":")
        try:
            return cls(ReservationKind(kind), ident) if sep and ident else None
        except ValueError:
            return None


@dataclass(frozen=True)
class Reservation:
    key: ReservationKey  # the old text form ("rule:PID") is read too
    holder: str  # who, for messages: "lease L3 (alice, pid 42 python)"
    gpus: tuple[int, ...]
    cpus: frozenset[int]
    exclusive: bool = False
    soft: bool = False  # other placements avoid these CPUs while they can (leases)
    pid: int | None = None  # the process that holds it (a `run` lease: children inherit)
    group: str | None = None
    job: str | None = None  # scheduler job it was made in ("slurm:12")
    uid: int | None = None  # whose it is (None: not known, counts as someone else's)
    ranked: bool = False  # a rank (a rule's, a launcher's or scheduler's): steers [irq]
    start_time: int | None = None  # the holding process's (an external hold's identity)
    placed_by: str | None = None  # an external hold: who chose its CPUs (numactl, self)
    uses_gpus: tuple[int, ...] = ()  # an external hold: the GPUs it uses (shown, not held)

    def __post_init__(self) -> None:
        key: object = self.key
        if isinstance(key, str):  # the text form (older callers)
            parsed = ReservationKey.parse(key)
            if parsed is None:
                raise ValueError(f"reservation key {key!r}: expected KIND:ID")
            object.__setattr__(self, "key", parsed)


def steers_irq(r: Reservation) -> bool:
    """Whether ``r``'s CPUs keep ``[irq]``'s interrupts off them: a rule's rank, a
    self-pinned rank, a rank its launcher or scheduler identified, root's binds and
    leases, a lease inside a scheduler's job. Never a user's plain ``tunerctl bind``."""
    if r.key.kind in (ReservationKind.RULE, ReservationKind.EXTERNAL):
        return True
    if r.key.kind is ReservationKind.LEASE and r.job is not None:
        return True
    return r.ranked or r.uid == 0


def held_exclusively(taken: Mapping[int, str]) -> PlacementError:
    """The refusal of CPUs others hold exclusively (CPU -> holder), in one wording for
    given placements and ``bind --cpus``."""
    return PlacementError(f"CPU {format_cpulist(taken)} held exclusively by "
                          f"{'; '.join(sorted(set(taken.values())))}",
                          held_cpus={str(c): h for c, h in sorted(taken.items())})


def _rank_index(req: PlaceRequest) -> int:
    """The rank's local rank (0 when not known)."""
    return req.rank if req.rank is not None else 0


# a placement's memo key: the request, the housekeeping CPUs, the reservations' digest
# and their number
_MemoKey = tuple[PlaceRequest, frozenset[int], int, int]


class Placer:
    name = "placer"

    def __init__(self, topology: Topology, host: HostCapacity,
                 housekeeping: Callable[[], frozenset[int]], *, dry_run: bool = False,
                 proc_root: str = procfs.PROC) -> None:
        self.topo = topology
        self.host = host
        self._housekeeping = housekeeping
        self.dry_run = dry_run
        self.proc = proc_root
        self._res: dict[ReservationKey, Reservation] = {}
        # place + reserve of a rule match run in the exec watcher's thread (bind first,
        # tunerd.jobs.autobind): it holds this lock across both, and place/reserve/
        # release take it, so a placement on the loop never sees half of another
        self.lock = threading.RLock()
        # placements as computed for a request while the reservations were as they are
        # (``place``): the ranks of one job, a relaunch of the same script. Keyed by the
        # request, the housekeeping CPUs and a digest of the reservations (kept by
        # reserve/release: the XOR of their hashes and their number), so that any
        # change of them is a miss; dropped whole when the topology or host changes.
        self._memo: dict[_MemoKey, Placement] = {}
        self._memo_for: tuple[Topology, HostCapacity] = (topology, host)
        self._res_digest = 0
        self._res_gpus = 0  # reservations holding GPUs (busy GPUs are read live then)
        self._res_external = 0  # external holds (none: the placement path skips them)

    # -- service -------------------------------------------------------------
    async def start(self) -> None:
        self.warm_up()

    async def stop(self) -> None:
        pass

    def status(self) -> JSONObject:
        gpus = sorted({g for r in self._held() for g in r.gpus})
        excl = format_cpulist(frozenset(self.exclusive_cpus()))
        ext = self._res_external
        return {"summary": f"{len(self._res)} reservation(s)"
                           + (f" ({ext} external: self-pinned ranks)" if ext else "")
                           + (f", GPUs {format_cpulist(gpus)} held" if gpus else "")
                           + (f", CPUs {excl} exclusive" if excl else ""),
                "reservations": len(self._res), "external": ext, "busy_gpus": list(gpus),
                "exclusive_cpus": excl, "housekeeping": format_cpulist(self.housekeeping())}

    def warm_up(self) -> None:
        """Build the placement indexes now, not on the first exec (~15 ms on a big node)."""
        try:
            self.place(PlaceRequest(ncpus=1))
        except Exception:  # a node with nothing free still starts
            pass

    # -- reservations ----------------------------------------------------------
    def reserve(self, res: Reservation) -> Reservation | None:
        """Hold ``res`` (in place of one with its key: that one is returned)."""
        return self._put(res)

    def _put(self, res: Reservation) -> Reservation | None:
        with self.lock:
            old = self._res.get(res.key)
            self._forget_res(old)
            self._res[res.key] = res
            self._res_digest ^= hash(res)
            self._res_gpus += bool(res.gpus)
            self._res_external += res.key.kind is ReservationKind.EXTERNAL
            return old

    def hold_external(self, res: Reservation) -> Reservation | None:
        """Note an outside owner's CPUs in the ledger (a process that pinned itself:
        tunerd binds nothing of it, so this is no bind and needs no pipeline); only
        holds of kind EXTERNAL are taken here."""
        if res.key.kind is not ReservationKind.EXTERNAL:
            raise ValueError(f"hold_external: {res.key} is not an external hold")
        return self._put(res)

    def release(self, key: ReservationKey | str) -> Reservation | None:
        """Give up the reservation ``key`` (its text form, "lease:L3", is read too)."""
        if isinstance(key, str):
            parsed = ReservationKey.parse(key)
            if parsed is None:
                return None
            key = parsed
        with self.lock:
            res = self._res.pop(key, None)
            self._forget_res(res)
            return res

    def _forget_res(self, res: Reservation | None) -> None:
        if res is not None:
            self._res_digest ^= hash(res)
            self._res_gpus -= bool(res.gpus)
            self._res_external -= res.key.kind is ReservationKind.EXTERNAL

    def _held(self) -> list[Reservation]:
        """The reservations now (a copy: another thread may reserve meanwhile)."""
        return list(self._res.values())

    def reservations(self) -> list[Reservation]:
        """Every reservation now (a copy; read-only use: the [irq] placement)."""
        return self._held()

    def busy_gpus(self, job: str | None = None) -> dict[int, str]:
        """GPUs held, and by whom (``job``: not those the same scheduler job holds)."""
        return {g: r.holder for r in self._held() for g in self._held_gpus(r)
                if job is None or r.job != job}

    def _held_gpus(self, r: Reservation) -> tuple[int, ...]:
        """A rule-bound process holds the GPUs seen from outside only (tunerd.jobs.gate)."""
        if r.key.kind is ReservationKind.RULE and r.pid is not None and r.gpus:
            return verified_gpus(r.pid, r.gpus, nvml_gpus=gpus_from_nvml, proc_root=self.proc)
        return r.gpus

    def exclusive_cpus(self, soft: bool = False, group: str | None = None,
                       job: str | None = None) -> dict[int, str]:
        """CPUs no other placement may take (``soft``: also every lease's).

        ``group``: the ranks of that job hold their CPUs against each other too.
        ``job``: what that scheduler job holds itself (its own exclusive lease) does
        not count against it.
        """
        def counts(r: Reservation) -> bool:
            if job is not None and r.job == job and (group is None or r.group != group):
                return False
            return r.exclusive or (soft and r.soft) or (group is not None and r.group == group)

        return self.held_cpus(where=counts)

    def held_cpus(self, *, steering: bool = False,
                  where: Callable[[Reservation], bool] | None = None) -> dict[int, str]:
        """Every CPU a reservation holds -> its holder (the first one): the one source
        of held CPUs for placement (``exclusive_cpus``, ``external_cpus``), ``[irq]``
        and ``jobs``.

        ``steering``: only the holds that steer ``[irq]`` (``steers_irq``): ranks (a
        rule's, a launcher's or scheduler's, a self-pinned one) and root's binds and
        leases; a user's plain bind of her own process never moves host interrupts.
        ``where``: only the reservations it accepts."""
        out: dict[int, str] = {}
        for r in self._held():
            if (steering and not steers_irq(r)) or (where is not None and not where(r)):
                continue
            for c in r.cpus:
                out.setdefault(c, r.holder)
        return out

    def held_listing(self) -> list[JSONObject]:
        """``held_cpus`` by holder, for ``tunerctl jobs``: who holds which CPUs, and
        whether that steers ``[irq]``."""
        by: dict[str, set[int]] = {}
        steer: dict[str, bool] = {}
        for r in self._held():
            by.setdefault(r.holder, set()).update(r.cpus)
            steer[r.holder] = steer.get(r.holder, False) or steers_irq(r)
        return [{"holder": h, "cpus": format_cpulist(c), "steers_irq": steer[h]}
                for h, c in sorted(by.items()) if c]

    def external_holds(self) -> list[Reservation]:
        """Ranks that pinned themselves, held as outside owners of their CPUs."""
        if not self._res_external:  # the usual case, on the exec path: no walk
            return []
        return [r for r in self._held() if r.key.kind is ReservationKind.EXTERNAL]

    def external_cpus(self) -> dict[int, str]:
        """CPU -> the self-pinned rank holding it (later placements avoid them)."""
        if not self._res_external:
            return {}
        return self.held_cpus(where=lambda r: r.key.kind is ReservationKind.EXTERNAL)

    def held_by_others(self, cpus: frozenset[int], uid: int,
                       key: ReservationKey) -> dict[int, str]:
        """CPUs of ``cpus`` that a reservation other than ``key`` holds exclusively and
        that is not ``uid``'s: CPU -> its holder (``bind --cpus``'s gate)."""
        return {c: r.holder for r in self._held() if r.exclusive and r.key != key
                and r.uid != uid for c in r.cpus & cpus}

    def gpus_held_by_others(self, gpus: Iterable[int], uid: int,
                            key: ReservationKey) -> dict[int, str]:
        """GPUs of ``gpus`` that a reservation other than ``key`` holds and that is not
        ``uid``'s: GPU -> its holder (``bind --exclusive``'s gate)."""
        want = set(gpus)
        return {g: r.holder for r in self._held() if r.key != key and r.uid != uid
                for g in self._held_gpus(r) if g in want}

    def enclosing_cpus(self, pid: int) -> frozenset[int] | None:
        """CPUs of the `tunerctl run` lease ``pid`` descends from, if any."""
        holders = {r.pid: r for r in self._held()
                   if r.pid and r.key.kind is ReservationKind.LEASE}
        if not holders:
            return None
        p: int | None = pid
        for _ in range(ANCESTOR_DEPTH):
            if p is None or p <= 1:
                return None
            if p in holders:
                return holders[p].cpus
            p = procfs.read_ppid(p, self.proc)
        return None

    def lease_of(self, pid: int) -> tuple[str, frozenset[int]] | None:
        """(lease id, CPUs) of the `tunerctl run` lease process ``pid`` holds, if any."""
        for r in self._held():
            if r.pid == pid and r.key.kind is ReservationKind.LEASE:
                return r.key.ident, r.cpus
        return None

    def bindable_mems(self, mems: frozenset[int] | None) -> frozenset[int] | None:
        """``mems`` as something to bind: None where it binds nothing (None, or every
        memory node this machine has), so that no cpuset is made for it."""
        if mems is None or self.host.mems <= mems:
            return None
        return mems

    def housekeeping(self) -> frozenset[int]:
        """Housekeeping CPUs of the policy, grown to whole cores (SMT siblings too)."""
        hk = self._housekeeping()
        return whole_cores(self.topo, hk) if hk else frozenset()

    # -- deciding --------------------------------------------------------------
    def place(self, req: PlaceRequest) -> Placement:
        """Choose GPUs, CPUs and memory nodes for ``req`` (see the module docstring).

        The same request against the same reservations gets the placement computed
        before (a Placement is immutable); not where GPUs are held and the request
        counts busy GPUs (those are verified live)."""
        with self.lock:
            if self._memo_for[0] is not self.topo or self._memo_for[1] is not self.host:
                self._memo.clear()
                self._memo_for = (self.topo, self.host)
            key: _MemoKey | None = None
            if req.ignore_busy_gpus or not self._res_gpus:
                key = (req, self._housekeeping(), self._res_digest, len(self._res))
                hit = self._memo.get(key)
                if hit is not None:
                    return hit
            p = self._place(req)
            if key is not None:
                if len(self._memo) >= MEMO_SIZE:
                    self._memo.clear()
                self._memo[key] = p
            return p

    def _place(self, req: PlaceRequest) -> Placement:
        notes: list[str] = []
        alloc = req.allocation
        hk = self.housekeeping()
        allowed = self._allowed_cpus(alloc, hk, notes)
        busy = {} if req.ignore_busy_gpus else self.busy_gpus(req.job)
        if alloc is not None and alloc.gpus is not None:
            busy = {**self._outside_allocation(req, alloc, alloc.gpus), **busy}
        if req.cpus is not None:
            return self._given_cpus(req, allowed, notes)
        count, pooled = self._count(req, allowed, hk, notes)
        preq = PlacementRequest(gpus=req.gpus if req.gpu_ids is None else len(req.gpu_ids),
                                cpus=count, mode=req.mode,
                                exclusive=is_exclusive(req.exclusive, req.mode),
                                gpu_ids=req.gpu_ids)
        if pooled is not None:  # ranks share a fixed slice: no further choice of CPUs
            return self._pooled(req, preq, pooled, busy, hk, notes)
        return self._finish(self._against_holds(req, preq, busy, hk, allowed, notes), notes)

    # -- parts of place() ------------------------------------------------------
    def _outside_allocation(self, req: PlaceRequest, alloc: Allocation,
                            may: tuple[int, ...]) -> dict[int, str]:
        """The GPUs outside the allocation (``may``: its GPUs), as busy GPUs with why;
        a request naming one of them, or more GPUs than it has, is refused."""
        outside = {g.index: f"outside {alloc.describe()}" for g in self.topo.gpus
                   if g.index not in may}
        if req.gpu_ids is not None:
            bad = [g for g in req.gpu_ids if g in outside]
            if bad:
                raise PlacementError(f"GPU {format_cpulist(bad)} not in {alloc.describe()}",
                                     allocation_gpus=list(may))
        elif req.gpus and req.gpus > len(may):
            raise PlacementError(
                f"need {req.gpus} GPU(s) but {alloc.describe()} has "
                f"{len(may) or 'no'} GPU(s)"
                + (f" ({format_cpulist(may)})" if may else
                   ": ask the scheduler for GPUs (e.g. srun --gres=gpu:N)"),
                allocation_gpus=list(may))
        return outside

    def _against_holds(self, req: PlaceRequest, preq: PlacementRequest,
                       busy: Mapping[int, str], hk: frozenset[int],
                       allowed: frozenset[int] | None, notes: list[str]) -> Placement:
        """``preq`` on the topology, avoiding every hold it can: first the exclusive
        holds, the job's ranks' and every lease's; then leases' CPUs may be shared; last
        (a rank) the CPUs of the job's other ranks too, with a note."""
        held = self.exclusive_cpus(group=req.group, job=req.job)
        soft = {**self.exclusive_cpus(soft=True, job=req.job), **held}
        ext = self.external_cpus()
        # self-pinned ranks' CPUs are avoided first (as leases' are), then shared with
        # a note naming them (``_clash``); other leases' CPUs may be shared last
        tiers = [{**ext, **soft}, {**ext, **held}, soft, held]
        for i, tier in enumerate(tiers):
            if tier in tiers[:i]:
                continue
            try:
                return place_on_topology(self.topo, preq, busy_gpus=busy,
                                         exclusive_cpus=tier, housekeeping=hk,
                                         allowed_cpus=allowed)
            except PlacementError:
                if tier is tiers[-1] and not req.group:
                    raise
        # more ranks than CPUs to split: share with the job's other ranks
        p = place_on_topology(self.topo, preq, busy_gpus=busy,
                              exclusive_cpus=self.exclusive_cpus(job=req.job),
                              housekeeping=hk, allowed_cpus=allowed)
        notes.append("shares CPUs with other ranks of the same job: not enough "
                     "free CPUs to give each its own")
        return p

    def _allowed_cpus(self, alloc: Allocation | None, hk: frozenset[int],
                      notes: list[str]) -> frozenset[int] | None:
        """CPUs of the allocation on the topology placed on (None: no restriction)."""
        if alloc is None or alloc.cpus is None:
            allowed = None
        elif alloc.cpus <= self.topo.online_cpus():
            allowed = alloc.cpus
        else:  # a replayed topology unlike this machine: the cgroup says nothing about it
            notes.append(f"{alloc.describe()} is not on the replayed topology; ignored")
            allowed = None
        if allowed is not None and not (allowed - hk):
            notes.append(f"{alloc.describe() if alloc else 'allocation'} holds only "
                         f"housekeeping CPUs {format_cpulist(allowed)}; using them")
        return allowed

    def _smt(self) -> int:
        return max((len(c.siblings) for c in self.topo.cpus.values()), default=1) or 1

    def _usable(self, allowed: frozenset[int] | None, hk: frozenset[int]) -> frozenset[int]:
        online = self.topo.online_cpus()
        base = online & allowed if allowed is not None else online
        # a self-pinned rank's CPUs are no one's share while others are left: a rank of
        # that slice gets fewer CPUs rather than some of its neighbour's
        return (base - hk - self.external_cpus().keys()) or (base - hk) or base

    def _count(self, req: PlaceRequest, allowed: frozenset[int] | None, hk: frozenset[int],
               notes: list[str]) -> tuple[int | None, frozenset[int] | None]:
        """(CPU count, pooled CPUs) for a request without an explicit CPU list; what was
        decided on the way is said in ``notes``.

        ``pooled``: when a rank's share cannot hold the rank and its workers, the
        exact CPUs the rank shares with its neighbours (no further choice needed).
        """
        usable = self._usable(allowed, hk)
        count = self._granted_count(req, usable, notes)
        ranks = req.ranks if req.ranks and req.ranks > 1 else None
        if count is None and ranks is not None:
            return self._rank_count(req, usable, hk, ranks, notes)
        if count is None and (req.gpus or req.gpu_ids):
            count = self._gpu_share(req, usable, hk)
        if count is not None and req.workers and count < 1 + req.workers:
            notes.append(f"{count} CPU(s) for a process with {req.workers} DataLoader "
                         "worker(s): they will share them")
        return count, None

    def _granted_count(self, req: PlaceRequest, usable: frozenset[int],
                       notes: list[str]) -> int | None:
        """The count asked for or granted (``--ncpus``, the scheduler's CPUs per task, a
        Slurm task's mask), at most what the allocation has; None: not fixed."""
        alloc = req.allocation
        count = req.ncpus
        if count is None and alloc is not None and alloc.ncpus is not None:
            count = alloc.ncpus
            notes.append(f"{alloc.ncpus} CPUs as granted by {alloc.describe()}")
        if count is None and alloc is not None and alloc.slurm and alloc.mask is not None \
                and not req.ranks:
            # the task's mask is what Slurm granted it (-c N): keep the count, refine where
            count = len(alloc.mask & usable) or None
            if count:
                notes.append(f"{count} CPUs, as {alloc.scheduler} granted the task")
        if count is not None and count > len(usable):
            notes.append(f"asked for {count} CPUs, the allocation has {len(usable)} "
                         f"({format_cpulist(usable)}): using those")
            count = len(usable)
        return count

    def _gpu_share(self, req: PlaceRequest, usable: frozenset[int], hk: frozenset[int]) -> int:
        """A process with GPUs: its GPUs' slices (split by the job's processes on them)."""
        if req.gpu_ids:
            share = sum(per_gpu_cpu_share(self.topo, g, usable, hk) for g in req.gpu_ids)
        else:
            first = self.topo.gpus[0].index if self.topo.gpus else -1
            share = per_gpu_cpu_share(self.topo, first, usable, hk) * req.gpus
        return min(len(usable), share // max(1, req.gpu_sharers or 1))

    def _rank_share(self, req: PlaceRequest, usable: frozenset[int], hk: frozenset[int],
                    ranks: int) -> int:
        """One of ``ranks`` ranks' CPU count, in whole cores where it is over one core."""
        if req.gpu_ids:
            # per GPU: its slice of the node map, split by the job's ranks on it
            share = sum(per_gpu_cpu_share(self.topo, g, usable, hk) for g in req.gpu_ids)
            count = max(1, min(share // max(1, req.gpu_sharers or 1),
                               len(usable) // ranks or 1))
        else:
            count = max(1, len(usable) // ranks)
        smt = self._smt()
        if count > smt:  # whole cores: a rank never shares a core with the next one
            count -= count % smt
        return count

    def _rank_count(self, req: PlaceRequest, usable: frozenset[int], hk: frozenset[int],
                    ranks: int, notes: list[str]) -> tuple[int, frozenset[int] | None]:
        """(count, pooled CPUs) of one of ``ranks`` ranks splitting the allowed CPUs.

        A share too small for the rank and its workers: inside its GPU's slice, see
        ``_small_slice``; on a node without a scheduler, pooled with the next ranks'
        (``_pool``); a scheduler's allocation is split all the same, never pooled.
        """
        count = self._rank_share(req, usable, hk, ranks)
        need = 1 + max(0, req.workers)
        own = node_map(self.topo, hk).slice_cpus(req.gpu_ids or ()) & usable
        if own and count < need:  # its GPU's slice is too small: never other slices
            return count, self._small_slice(req, usable, own, count, need, ranks, notes)
        alloc = req.allocation
        if count < need and not (alloc is not None and alloc.scheduler):
            return count, self._pool(req, usable, count, need, _rank_index(req), ranks, notes)
        rank = req.rank if req.rank is not None else "?"
        if count < need:  # a scheduler's allocation is split, never pooled
            notes.append(f"rank {rank} of {ranks}: {count} CPU(s) of "
                         f"{alloc.describe() if alloc else '?'}; its {req.workers} "
                         "DataLoader worker(s) share them")
        else:
            notes.append(f"rank {rank} of {ranks}: {count} CPUs (room for the rank and "
                         f"{req.workers} DataLoader worker(s))")
        return count, None

    def _small_slice(self, req: PlaceRequest, usable: frozenset[int], own: frozenset[int],
                     count: int, need: int, ranks: int,
                     notes: list[str]) -> frozenset[int] | None:
        """A rank whose GPU's slice (``own``) cannot hold it and its workers: the ranks on
        that GPU share the slice; a job over several GPUs pools its ranks' slices (no
        scheduler); else the rank keeps its share, with a note. Never others' slices."""
        gpus = format_cpulist(req.gpu_ids or ())
        sharers = req.gpu_sharers or 1
        if sharers > 1:
            notes.append(f"GPU {gpus}'s slice (CPU {format_cpulist(own)}) cannot give "
                         f"each of the {sharers} ranks on it room for {req.workers} "
                         f"DataLoader worker(s): they share the slice")
            return own
        alloc = req.allocation
        if req.gpu_peers and len(req.gpu_peers) > 1 \
                and not (alloc is not None and alloc.scheduler):
            return self._pool(req, usable, count, need, _rank_index(req), ranks, notes)
        notes.append(f"GPU {gpus}'s slice has {len(own)} CPU(s), too few for the "
                     f"rank and its {req.workers} DataLoader worker(s): they share them")
        return None

    def _pool(self, req: PlaceRequest, usable: frozenset[int], share: int, need: int,
              rank: int, ranks: int, notes: list[str]) -> frozenset[int]:
        """The CPUs a rank shares with its neighbours when its own share is too small.

        ``g`` consecutive ranks pool their shares so each pool holds every rank and
        its workers: ranks 0..g-1 share the first g shares, and so on.
        """
        near: tuple[int, ...] = ()
        if req.gpu_ids:
            near = tuple(c for g in self.topo.gpus if g.index in req.gpu_ids
                         for c in g.local_cpus)
        order = ordered_cpus(self.topo, usable, near)
        g = min(ranks, math.ceil(need / max(1, share)))
        pools = max(1, ranks // g)
        peers = req.gpu_peers or ()
        nm = node_map(self.topo, self.housekeeping())
        if peers and nm.slice_cpus(peers) & usable:
            # the job's own GPUs' slices, pooled by consecutive ranks: never another's
            k = min(rank // g, pools - 1)
            last = ranks if k == pools - 1 else (k + 1) * g
            mine = {peers[j % len(peers)] for j in range(k * g, last)}
            pooled = (nm.slice_cpus(mine) & usable) or frozenset(order)
            notes.append(f"a share of {share} CPU(s) per rank cannot hold a rank and its "
                         f"{req.workers} DataLoader worker(s): ranks {k * g}-{last - 1} of "
                         f"{ranks} share CPUs {format_cpulist(pooled)} (the slices of GPU "
                         f"{format_cpulist(mine)}) instead of crowding onto one core")
            return pooled
        size = max(1, len(order) // pools)
        k = min(rank // g, pools - 1)
        lo, hi = k * size, (len(order) if k == pools - 1 else (k + 1) * size)
        pooled = frozenset(order[lo:hi])
        first, last = k * g, min(ranks, (k + 1) * g) - 1 if k < pools - 1 else ranks - 1
        notes.append(f"a share of {share} CPU(s) per rank cannot hold a rank and its "
                     f"{req.workers} DataLoader worker(s): ranks {first}-{last} of {ranks} "
                     f"share CPUs {format_cpulist(pooled)} instead of crowding onto one core")
        return pooled

    def _pooled(self, req: PlaceRequest, preq: PlacementRequest, pooled: frozenset[int],
                busy: Mapping[int, str], hk: frozenset[int], notes: list[str]) -> Placement:
        gpus: tuple[int, ...] = ()
        uuids: tuple[str, ...] = ()
        score = 0
        if preq.gpus or preq.gpu_ids:
            p = place_on_topology(self.topo, replace(preq, cpus=None, exclusive=False),
                                  busy_gpus=busy, housekeeping=hk, allowed_cpus=pooled)
            gpus, uuids, score = p.gpus, p.gpu_uuids, p.score
        mems = mems_of(self.topo, pooled)
        expl = (f"{'GPU ' + format_cpulist(gpus) + '; ' if gpus else ''}CPU "
                f"{format_cpulist(pooled)} ({len(pooled)} CPUs, shared by ranks); memory "
                f"node {format_cpulist(mems)}")
        return self._finish(Placement(cpus=pooled, mems=mems, gpus=gpus, gpu_uuids=uuids,
                                      score=score, explanation=expl), notes)

    def _given_cpus(self, req: PlaceRequest, allowed: frozenset[int] | None,
                    notes: list[str]) -> Placement:
        """An exact CPU list (``run --cpus LIST``, a rule's ``cpus``): checked, not chosen."""
        assert req.cpus is not None
        topo = self.topo
        cpus = req.cpus
        unknown = cpus - topo.online_cpus()
        if unknown:
            raise UsageError(f"CPU {format_cpulist(unknown)} is not on {topo.hostname} "
                             f"(CPUs {format_cpulist(topo.online_cpus())})")
        if allowed is not None and not cpus <= allowed:
            inside = cpus & allowed
            alloc = req.allocation
            if not inside:
                raise PlacementError(
                    f"CPUs {format_cpulist(cpus)} are all outside "
                    f"{alloc.describe() if alloc else 'the allocation'}, which allows "
                    f"{format_cpulist(allowed)}")
            notes.append(f"CPUs {format_cpulist(cpus - inside)} left out: outside "
                         f"{alloc.describe() if alloc else 'the allocation'}")
            cpus = inside
        held = self.exclusive_cpus(job=req.job)
        taken = {c: held[c] for c in cpus if c in held}
        if taken:
            raise held_exclusively(taken)
        gpus: tuple[int, ...] = tuple(req.gpu_ids or ())
        if req.gpus and not gpus:
            busy = self.busy_gpus(req.job)
            p = place_on_topology(topo, PlacementRequest(gpus=req.gpus), busy_gpus=busy,
                                  allowed_cpus=None)
            gpus = p.gpus
        uuids = tuple(g.uuid for g in topo.gpus if g.index in gpus)
        mems = mems_of(topo, cpus)
        expl = (f"{'GPU ' + format_cpulist(gpus) + '; ' if gpus else ''}CPU "
                f"{format_cpulist(cpus)} as given ({len(cpus)} CPUs); memory node "
                f"{format_cpulist(mems)}")
        return self._finish(Placement(cpus=cpus, mems=mems, gpus=gpus, gpu_uuids=uuids,
                                      explanation=expl), notes)

    def _clash(self, p: Placement) -> str | None:
        """A note naming the self-pinned ranks whose CPUs ``p`` shares, if any."""
        ext = self.external_cpus()
        shared = {c: ext[c] for c in (p.cpus or ()) if c in ext}
        if not shared:
            return None
        return (f"CPU {format_cpulist(shared)} shared with "
                f"{'; '.join(sorted(set(shared.values())))}: no free CPU was left")

    def _finish(self, p: Placement, notes: list[str]) -> Placement:
        clash = self._clash(p)
        if clash is not None:
            notes = [*notes, clash]
        if notes:
            p = replace(p, explanation="; ".join([p.explanation, *notes]) if p.explanation
                        else "; ".join(notes))
        extra: list[str] = []
        applicable = True
        if self.topo.replayed:
            applicable, extra = self.applicability(p)
        if applicable and self.dry_run:
            applicable = False
            extra.append("dry run: placement computed, nothing was bound or moved")
        return p.with_notes(*notes, *extra, applicable=applicable)

    def applicability(self, p: Placement) -> tuple[bool, list[str]]:
        """May ``p`` be applied on this machine? (False + a note on a foreign replay)."""
        cpus, mems = p.cpus or frozenset(), p.mems or frozenset()
        missing_c = cpus - self.host.cpus
        missing_m = mems - self.host.mems
        if not missing_c and not missing_m:
            return True, [f"topology replay ({self.topo.hostname}): this machine has every "
                          "CPU and memory node of the placement; applied here"]
        parts = []
        if missing_c:
            parts.append(f"CPUs {format_cpulist(missing_c)}")
        if missing_m:
            parts.append(f"memory nodes {format_cpulist(missing_m)}")
        return False, [
            f"topology replay ({self.topo.hostname}): placement computed on the snapshot; "
            f"this machine lacks {' and '.join(parts)} (it has CPUs "
            f"{format_cpulist(self.host.cpus)}), so nothing was applied to CPUs or memory"]
