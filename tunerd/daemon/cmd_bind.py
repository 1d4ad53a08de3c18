"""Handlers: bind, unbind, jobs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tunerd.base.cpulist import MAX_ID, CpuListError, format_cpulist, parse_cpulist
from tunerd.base.errors import Failed, PermissionDenied, PlacementError, UsageError
from tunerd.daemon.router import Request, Router
from tunerd.daemon.visibility import ProcVisibility
from tunerd.jobs.intake import Intake, JobContext, request
from tunerd.jobs.leases import LeaseService
from tunerd.jobs.peer import PidNamespaces
from tunerd.jobs.placement import Placement
from tunerd.jobs.placer import Placer, Reservation, ReservationKey, held_exclusively
from tunerd.jobs.records import Binding, Hold
from tunerd.jobs.registry import JobRegistry, Placing
from tunerd.topology.visible import gpus_from_nvml

log = logging.getLogger("tunerd.bind")

NO_PLACEMENT = "no --cpus/--mems given and GPU placement is not available"
MAX_BINDS_PER_USER = 1024  # config max_binds_per_user


def ids_arg(req: Request, name: str) -> frozenset[int] | None:
    """A cpulist argument: "2-5" or a list of ints; None when absent."""
    v = req.args.get(name)
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                   and 0 <= x < MAX_ID for x in v):
        return frozenset(v)
    if not isinstance(v, str):
        raise UsageError(f"{req.cmd}: argument {name!r} must be a cpulist string or a list "
                         f"of ids 0 to {MAX_ID - 1}, got {str(v)[:100]}")
    try:
        return parse_cpulist(v)
    except CpuListError as err:
        raise UsageError(f"--{name}: {err}") from err


class BindCommands:
    def __init__(self, jobs: JobRegistry, placer: Placer, leases: LeaseService,
                 intake: Intake,
                 left_alone: Callable[[], list[dict[str, Any]]] = list,
                 max_per_user: int = MAX_BINDS_PER_USER) -> None:
        self.jobs = jobs
        self.max_per_user = max_per_user
        self._left_alone = left_alone
        self.placer = placer
        self.leases = leases
        self.gate = leases.gate
        self.intake = intake
        self.namespaces = PidNamespaces()  # a caller in its own PID namespace
        jobs.on_exit(self._exited)
        jobs.on_adopt(self._adopted)

    def _adopted(self, rec: Binding) -> None:
        """A binding re-adopted after a restart holds again what its bind held (a Slurm
        task's CPUs against its step's other tasks, an exclusive bind's CPUs)."""
        hold = rec.hold
        if hold is None or not rec.cpus:
            return
        self.placer.reserve(_reservation(rec.pid, rec.cpu_set(), rec.gpus, hold))
        if hold.exclusive and hold.uid is not None:
            self.gate.hold(ReservationKey.bind(rec.pid), hold.uid)
        log.info("pid %d: reservation restored (CPUs %s%s)", rec.pid, rec.cpus,
                 f", group {hold.group}" if hold.group else ", exclusive")

    def _exited(self, pid: int, rec: Binding) -> None:
        self.placer.release(ReservationKey.bind(pid))
        self.gate.drop(ReservationKey.bind(pid))

    def register(self, router: Router) -> None:
        router.add("bind", self.bind)
        router.add("unbind", self.unbind)
        router.add("jobs", self.list_jobs)

    async def bind(self, req: Request) -> dict[str, Any]:
        pid = await self.namespaces.host_pid(req.peer, req.arg("pid", int))
        cpus, mems, gpus = ids_arg(req, "cpus"), ids_arg(req, "mems"), ids_arg(req, "gpus")
        nofile = req.arg("nofile", int, None)
        exclusive = req.arg("exclusive", bool, False)
        ncpus = req.arg("ncpus", int, None)
        notes: list[str] = []
        if not req.peer.is_root:
            self._count(req.peer.uid, pid)
            nofile = self.gate.cap_nofile(req.peer.uid, pid, nofile, notes) or nofile
        seen: list[JobContext] = []
        held_before: list[Reservation | None] = []  # what this bind's hold replaced
        holding: list[Hold] = []  # ... and that hold, saved with the binding's record

        def admit() -> None:
            """A reservation: the one gate of alloc and run (tunerd.jobs.gate); runs
            once the process is pinned and its owner checked, before anything moves."""
            if exclusive:
                self.gate.admit(req.peer, exclusive=True, key=ReservationKey.bind(pid))

        def place() -> tuple[Placement | None, str | None]:
            """Near its GPUs; runs once the process is pinned and its owner checked.
            Placed and held as one under the placer's lock: a rule's bind in the exec
            watcher's thread never gets these CPUs while this bind is applied."""
            admit()

            def hold(p: Placement, ctx: JobContext) -> None:  # under the placer's lock
                if p.cpus and not self.jobs.dry_run:
                    final = cpus if cpus is not None else p.cpus
                    self._gate(req, pid, final, tuple(p.gpus or ()), exclusive, notes)
                    held_before.extend(self._hold_cpus(
                        pid, final, tuple(p.gpus or ()), ctx, exclusive, req.peer.uid,
                        holding))

            placed, ctx = self._near_gpus(pid, tuple(sorted(gpus)) if gpus is not None
                                          else None, exclusive, ncpus, hold)
            seen.extend([ctx] if ctx is not None else [])
            if placed is None:  # the process uses no GPU (or is bound already)
                if nofile is None or gpus is not None:
                    # with what was ignored on the way (a 5,000-digit LOCAL_RANK)
                    raise UsageError("; ".join([NO_PLACEMENT, *notes,
                                                *(ctx.notes if ctx is not None else ())]))
                notes.append("CPUs and memory nodes unchanged: " + NO_PLACEMENT)
                return None, None
            notes.extend(n for n in placed.notes if not n.startswith("topology replay"))
            return Placement(cpus=cpus if cpus is not None else placed.cpus,
                             mems=mems if mems is not None else placed.mems,
                             gpus=placed.gpus, explanation=placed.explanation), \
                ctx.why if ctx is not None else None

        placing: Placement | Placing
        if (cpus is None and mems is None) or gpus is not None:
            placing = place
        else:
            def given() -> tuple[Placement | None, str | None]:
                """As asked; an exclusive bind's CPUs are held at once, as placed ones are
                (and its hold goes into the record that is saved before the change)."""
                admit()
                if cpus and not self.jobs.dry_run:
                    with self.placer.lock:
                        self._gate(req, pid, cpus, (), exclusive, notes)
                        held_before.extend(self._hold_cpus(pid, cpus, (), None, exclusive,
                                                           req.peer.uid, holding))
                return Placement.given(cpus, mems,
                                       explanation="as given on the command line"), None

            placing = given
        try:
            result = await self.jobs.bind(pid, peer=req.peer, placement=placing,
                                          nofile=nofile, origin="cli",
                                          hold=lambda: holding[0] if holding else None)
        except BaseException:
            if held_before:  # held while placing, not bound after all: as it was
                if held_before[0] is not None:
                    self.placer.reserve(held_before[0])
                else:
                    self.placer.release(ReservationKey.bind(pid))
            raise
        if result.get("cpus") and not result.get("dry_run"):
            self._reserve(pid, result, seen[0] if seen else None, exclusive, req.peer.uid)
        result["notes"] = [*notes, *result.get("notes", [])]
        return result

    def _count(self, uid: int, pid: int) -> None:
        """A non-root user holds at most ``max_binds_per_user`` processes bound with
        ``tunerctl bind`` (her subordinate uids' too): each one is a record in the
        runtime state, written on every bind (6,000 binds were a 2.5 MB state file)."""
        if self.jobs.is_bound(pid):
            return  # a re-bind replaces its record
        subids = self.gate.subids
        subids.refresh()
        owner = subids.owner_cached(uid)
        mine = self.jobs.count_where(
            lambda r: r.origin == "cli" and r.uid is not None
            and (r.uid == uid or subids.owner_cached(r.uid) == owner))
        if mine >= self.max_per_user:
            raise PermissionDenied(
                f"uid {uid} holds {mine} processes bound with tunerctl bind, the most a "
                f"user may on this node (max_binds_per_user = {self.max_per_user}); "
                "unbind some first (tunerctl jobs, tunerctl unbind PID)")

    def _gate(self, req: Request, pid: int, cpus: frozenset[int], gpus: tuple[int, ...],
              exclusive: bool, notes: list[str]) -> None:
        """The one gate of every bind, whatever its flags (``--cpus``, ``--gpus``,
        ``--mems``, ``--exclusive`` in any combination), on the CPUs it is about to get
        and, for an exclusive bind, the GPUs it is about to hold; called under the
        placer's lock, before anything is held or moved. It passes the gate ``run
        --cpus`` and placements do: CPUs another user's lease or exclusive bind holds
        are refused (PlacementError, exit 1), and so are GPUs another user's lease or
        exclusive bind holds for an exclusive bind; root may bind there (a lease's own
        processes, an operator's choice), with a note naming the holder."""
        key = ReservationKey.bind(pid)
        refusals: list[PlacementError] = []
        held = self.placer.held_by_others(cpus, req.peer.uid, key)
        if held:
            refusals.append(held_exclusively(held))
        taken = self.placer.gpus_held_by_others(gpus, req.peer.uid, key) if exclusive else {}
        if taken:
            refusals.append(PlacementError(
                f"GPU {','.join(map(str, sorted(taken)))} held by "
                f"{'; '.join(sorted(set(taken.values())))}",
                held_gpus={str(g): h for g, h in sorted(taken.items())}))
        if not refusals:
            return
        if not req.peer.is_root:
            raise refusals[0]
        notes.extend(f"{r.message}: bound there as root asked" for r in refusals)

    def _hold_cpus(self, pid: int, cpus: frozenset[int], gpus: tuple[int, ...],
                   ctx: JobContext | None, exclusive: bool, uid: int,
                   holding: list[Hold]) -> list[Reservation | None]:
        """While placing (under the placer's lock): the CPUs a bind is about to get are
        held at once, as ``_reserve`` holds them after it (which replaces this). Returns
        [the reservation this one replaced] where it made one, else []; the hold is
        added to ``holding``."""
        hold = _hold_of(ctx, exclusive, uid)
        if hold is None:
            return []
        holding.append(hold)
        return [self.placer.reserve(_reservation(pid, cpus, gpus if ctx is not None else (),
                                                 hold))]

    def _reserve(self, pid: int, result: dict[str, Any], ctx: JobContext | None,
                 exclusive: bool, uid: int) -> None:
        """An exclusive bind holds its CPUs; a rank or Slurm task holds them against
        the other ranks/tasks of its job (they split the allocation). What it holds is
        kept with its binding: a restarted daemon holds it again (``_adopted``)."""
        if exclusive:
            self.gate.hold(ReservationKey.bind(pid), uid)
        hold = _hold_of(ctx, exclusive, uid)
        if hold is None:
            return
        gpus = tuple(result.get("gpus") or ()) if ctx is not None else ()
        self.placer.reserve(_reservation(pid, parse_cpulist(result["cpus"]), gpus, hold))
        self.jobs.set_hold(pid, hold)

    def _near_gpus(self, pid: int, gpus: tuple[int, ...] | None, exclusive: bool,
                   ncpus: int | None,
                   hold: Callable[[Placement, JobContext], None] | None = None
                   ) -> tuple[Placement | None, JobContext | None]:
        """Placement near the GPUs ``pid`` uses; None when it uses none tunerd can see.
        ``hold``: called with the placement under the placer's lock, as it is made.

        A process bound already keeps its place (None) unless --gpus names GPUs.
        """
        topo = self.placer.topo
        if gpus is None and self.jobs.is_bound(pid):
            return None, None
        ctx = self.intake.describe(pid)
        how = "--gpus"
        if gpus is None:
            gpus, how = ctx.gpus, ctx.gpus_how
            if not gpus:
                gpus = tuple(gpus_from_nvml(pid) or ())
                how = "NVML (GPUs it has contexts on)"
        if not gpus:
            return None, ctx
        known = {g.index for g in topo.gpus}
        unknown = [g for g in gpus if g not in known]
        if unknown:
            raise UsageError(
                f"{NO_PLACEMENT} for GPU {','.join(map(str, unknown))}: not on this node "
                f"(GPUs: {','.join(map(str, sorted(known))) or 'none'})")
        with self.placer.lock:
            placed = self.placer.place(request(ctx, gpu_ids=tuple(gpus), exclusive=exclusive,
                                               ncpus=ncpus, ignore_busy_gpus=True))
            if hold is not None and placed.applicable:
                hold(placed, ctx)
        if not placed.applicable:
            raise Failed(" ".join(placed.notes) + f" (process {pid}, GPUs from {how}: "
                         f"{','.join(map(str, gpus))}; would bind CPUs "
                         f"{format_cpulist(placed.cpus or frozenset())})",
                         pid=pid, applied=False)
        return Placement(cpus=placed.cpus, mems=self.placer.bindable_mems(placed.mems),
                         gpus=placed.gpus,
                         explanation=f"GPUs from {how}; {placed.explanation}",
                         notes=placed.notes), ctx

    async def unbind(self, req: Request) -> dict[str, Any]:
        pid = await self.namespaces.host_pid(req.peer, req.arg("pid", int))
        out = await self.jobs.unbind(pid, peer=req.peer)
        self.placer.release(ReservationKey.bind(pid))
        self.gate.drop(ReservationKey.bind(pid))
        return out

    async def list_jobs(self, req: Request) -> dict[str, Any]:
        seen = ProcVisibility()  # hidepid: others' command lines stay hidden
        return {"jobs": seen.redact(req.peer, self.jobs.jobs()),
                "leases": seen.redact(req.peer, self.leases.list_leases()),
                "left_alone": seen.redact(req.peer, self._left_alone())}


def _hold_of(ctx: JobContext | None, exclusive: bool, uid: int) -> Hold | None:
    """What a bind holds: its CPUs against everyone (exclusive), or against the other
    ranks/tasks of its group; None for a bind that holds nothing."""
    group = request(ctx).group if ctx is not None else None
    if not exclusive and group is None:
        return None
    return Hold(group=group, job=ctx.job_key if ctx is not None else None,
                exclusive=exclusive, uid=uid)


def _reservation(pid: int, cpus: frozenset[int], gpus: tuple[int, ...],
                 hold: Hold) -> Reservation:
    """An exclusive bind holds its CPUs (and GPUs); a rank or Slurm task holds its CPUs
    against the other ranks/tasks of its job (they split the allocation)."""
    return Reservation(
        key=ReservationKey.bind(pid), holder=f"pid {pid} (tunerctl bind"
                                  f"{' --exclusive' if hold.exclusive else ''})",
        # a rank's bind holds its CPUs against its siblings, never its GPU (a lease
        # inside the job may take that GPU: the job's own processes use it)
        gpus=gpus if hold.exclusive else (), cpus=cpus, exclusive=hold.exclusive, pid=pid,
        group=hold.group, job=hold.job, uid=hold.uid)
