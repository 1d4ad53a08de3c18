"""The bind pipeline: every bind of a process is one pass of ``BindPipeline``.

    pin        a pidfd on the process, and its start time
    authorize  may the asker bind it (its owner; a user's quota; a rule's reach)
    describe   what the process is (the intake's JobContext), where it is to be placed
    decide     under the ledger's lock (the placer's): gate, place, hold
    prepare    the plan, checked against its cgroup and the kernel, and the originals
    persist    its record (the runtime state), or a rule's journal line, before the change
    apply      the change (tunerd.jobs.actuate, the one writer)
    record     what the change did, kept; the process watched

Callers say what they want (a ``BindRequest``) and read what happened (a ``BindOutcome``):
``tunerctl bind`` (daemon/cmd_bind.py), ``[[job]]`` rules (tunerd.jobs.autobind: in the exec
watcher's thread, journal first, recorded by the loop after), ``tunerctl run`` (the
lease's own process), workers and followers narrowed into their rank's CPUs, and
re-binds inside a cpuset the kubelet changed. The stages are written once; ``bind`` is
their async shell on the loop (one bind of a pid at a time, page moves in an executor),
``bind_in_thread`` their sync shell in the exec watcher's thread (nothing there waits
on the loop): it pins, decides and applies the CPUs and hands what it did (a
``ThreadBind``: the pidfd, the plan, the result) to the loop's ``commit``, which never
runs the request again: it records and saves the bind, then applies on the same pidfd
only what the thread left out (the fd limit, the memory nodes). The thread's pidfd is
the process's one pidfd, kept by the node's ledger (tunerd.jobs.ledger) until it exits.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from tunerd.base.cpulist import format_cpulist
from tunerd.base.errors import (
    Failed,
    NoSuchProcess,
    PermissionDenied,
    PlacementError,
    TunerdError,
    UsageError,
)
from tunerd.jobs.actuate import Actuator
from tunerd.jobs.binding import BindResult, Originals, Plan, Target
from tunerd.jobs.gate import ReservationGate, rule_reach_refused
from tunerd.jobs.intake import Intake, JobContext, Role, bounded_int, request
from tunerd.jobs.journal import BindJournal
from tunerd.jobs.ledger import ProcKey, Slot
from tunerd.jobs.peer import Peer, require_owner
from tunerd.jobs.placement import Placement, is_exclusive
from tunerd.jobs.placer import (
    Placer,
    PlaceRequest,
    Reservation,
    ReservationKey,
    held_exclusively,
)
from tunerd.jobs.records import Binding, Hold
from tunerd.jobs.registry import Ask, JobRegistry, JSONRecord, Recorded
from tunerd.topology.nodemap import rank_mems
from tunerd.topology.visible import gpus_from_nvml
from tunerd.watch.rules import JobRule, RuleMatch

__all__ = ["BindOutcome", "BindPipeline", "BindRequest", "BindSource", "RuleTake",
           "ThreadBind", "Verdict", "rule_group", "rule_mems", "rule_request", "rule_take"]

log = logging.getLogger("tunerd.bind")

# a rank bound in the watcher's thread and not recorded by the loop yet (its line is in
# the binds-in-flight journal, emptied when no process holds this)
UNRECORDED: Slot[bool] = Slot("unrecorded")
NO_PLACEMENT = "no --cpus/--mems given and GPU placement is not available"
MAX_BINDS_PER_USER = 1024  # config max_binds_per_user


class BindSource(enum.Enum):
    """Who asks for a bind (and the ``origin`` its record keeps)."""

    CLI = "cli"  # tunerctl bind PID
    RULE = "rule"  # a [[job]] rule's match
    LEASE = "run"  # tunerctl run: the lease's own process, before it execs
    WORKER = "worker"  # a rank's worker or follower, narrowed into the rank's CPUs
    CPUSET = "cpuset"  # the same binding again, inside a cpuset the kubelet changed

    @property
    def origin(self) -> str:
        return "cli" if self is BindSource.CPUSET else self.value

    @property
    def partial(self) -> bool:
        """A limit or memory step it may not do is a note, not a failure (the CPUs stay)."""
        return self in (BindSource.RULE, BindSource.LEASE, BindSource.WORKER)


class RuleTake(enum.Enum):
    """What a rule does with a process it matched (``rule_take``: decided there only)."""

    BIND = "bind"  # a rank (or, under a rule that is not rank-only, any process): placed
    NARROW = "narrow"  # a descendant of a bound rank: kept inside the rank's CPUs
    LEAVE = "leave alone"  # a wrapper, a launcher, a rank that set its own CPUs
    SKIP = "not a rank"  # a rank-only rule and no rank: nothing to do


def rule_take(rule: JobRule, ctx: JobContext) -> RuleTake:
    """Whether a rule's match is bound, narrowed, left alone or skipped: the one place
    this is decided (the watcher's thread binds only ``BIND`` and leaves the rest to
    the loop's look, ``AutoBinder._look``, which reads the same answer)."""
    if ctx.role in (Role.WRAPPER, Role.LAUNCHER) or ctx.self_affined:
        return RuleTake.LEAVE
    if ctx.role == Role.DESCENDANT:
        return RuleTake.NARROW
    if rule.rank and ctx.role != Role.RANK:
        return RuleTake.SKIP
    return RuleTake.BIND


class Verdict(enum.Enum):
    BOUND = "bound"
    REFUSED = "refused"  # the gate said no (a rule's reach)
    LEFT_ALONE = "left alone"  # nothing to do, or not here (see ``reason``)


@dataclass(frozen=True)
class BindRequest:
    pid: int  # in the daemon's PID namespace
    peer: Peer  # who asks (a rule, the daemon itself: root)
    source: BindSource
    placement: Placement | None = None  # decided already: a lease's, a rank's, a re-bind's
    cpus: frozenset[int] | None = None  # tunerctl bind --cpus
    mems: frozenset[int] | None = None  # ... --mems
    gpus: tuple[int, ...] | None = None  # ... --gpus: near these
    ncpus: int | None = None
    nofile: int | None = None
    exclusive: bool = False
    match: RuleMatch | None = None  # RULE: the rule's match
    context: JobContext | None = None  # the intake's look, taken already
    lease: str | None = None
    name: str | None = None
    why: str | None = None
    originals: Originals | None = None  # masks from before a bind in the watcher's thread
    stamps: tuple[int, ...] = ()  # the watcher's: (match start[, kernel exec stamp, read])


@dataclass
class ThreadBind:
    """A bind made in the exec watcher's thread, for the loop to record."""

    target: Target
    originals: Originals
    group: str
    bound_at: float  # time.monotonic()
    ns: dict[str, int]  # the steps' clocks (perf_counter_ns; "set": CLOCK_MONOTONIC)
    plan: Plan | None = None  # what the thread applied (the CPUs)
    result: BindResult | None = None  # ... and what it came to


@dataclass
class BindOutcome:
    verdict: Verdict
    pid: int
    placement: Placement | None = None
    reason: str = ""
    record: Binding | None = None
    result: BindResult | None = None
    context: JobContext | None = None
    notes: list[str] = field(default_factory=list)
    rebind: bool = False
    save_ms: float = 0.0
    elapsed_ms: float = 0.0
    dry_run: Plan | None = None  # --dry-run: what would have been done
    thread: ThreadBind | None = None
    ns: dict[str, int] = field(default_factory=dict)  # the watcher thread's step clocks


class Lowering(Protocol):
    """The exec watcher: its priority is lowered once a main thread has its CPUs."""

    def lower_for_rest(self) -> None: ...


@dataclass
class _Run:
    """One pass through the stages."""

    req: BindRequest
    t0: float
    nofile: int | None
    in_thread: bool = False  # the exec watcher's (``bind_in_thread``)
    placed: Placement | None = None  # a rule's placement, whole (its mems bound after)
    target: Target | None = None
    ctx: JobContext | None = None
    placement: Placement | None = None
    why: str | None = None
    notes: list[str] = field(default_factory=list)
    hold: Hold | None = None  # what a tunerctl bind holds, saved with its record
    key: ReservationKey | None = None  # the reservation this pass made
    replaced: Reservation | None = None  # ... and the one it replaced (put back on failure)
    group: str = ""
    plan: Plan | None = None
    prev: Binding | None = None
    rec: Binding | None = None
    on_disk: bool = False
    written: JSONRecord | None = None
    save_ms: float = 0.0
    ns: dict[str, int] = field(default_factory=dict)
    result: BindResult | None = None  # the watcher thread's apply
    rest: Plan | None = None  # commit: what the thread left out (fd limit, memory nodes)


class _Stop(Exception):
    """A stage ended the pass with an outcome (refused, left alone)."""

    def __init__(self, outcome: BindOutcome) -> None:
        super().__init__(outcome.reason)
        self.outcome = outcome


class BindPipeline:
    """pin, authorize, describe, decide (gate, place, hold), prepare, persist, apply,
    record; see the module docstring."""

    name = "pipeline"

    def __init__(self, jobs: JobRegistry, placer: Placer, gate: ReservationGate,
                 intake: Intake, actuator: Actuator, *, journal: BindJournal | None = None,
                 max_per_user: int = MAX_BINDS_PER_USER, bind_delay: float = 0.0) -> None:
        self.jobs = jobs
        self.placer = placer
        self.gate = gate
        self.intake = intake
        self.actuator = actuator
        self.journal = journal or BindJournal(None)
        self.max_per_user = max_per_user
        self.bind_delay = bind_delay  # debug_bind_delay (tests): between placing and binding
        self.watcher: Lowering | None = None
        self.dry_run = jobs.dry_run
        # binds made in the watcher's thread, not recorded yet: in the journal, emptied
        # whenever no process holds this slot (each rank's pidfd: in the ledger)
        self.ledger = jobs.ledger
        self._journal_lock = threading.Lock()
        self._in_flight = 0  # processes whose UNRECORDED slot is set
        jobs.on_exit(self._exited)
        jobs.on_adopt(self._adopted)

    # -- the shells ------------------------------------------------------------------
    async def bind(self, req: BindRequest) -> BindOutcome:
        """One bind on the loop: the stages in order, one pass per pid at a time."""
        run = _Run(req, time.perf_counter(), req.nofile)
        async with self.jobs.lock(req.pid):
            try:
                self._pin(run)
                self._authorize(run)
                self._keep_pin(run)
                self._describe(run)
                self._decide(run)
                if self.bind_delay and req.source is BindSource.CLI:  # tests: a window
                    log.debug("pid %d placed; binding it in %g s (debug_bind_delay)",
                              req.pid, self.bind_delay)
                    await asyncio.sleep(self.bind_delay)
                self._prepare(run)
                await self._persist(run)
                result = await self._apply_on_loop(run)
                return self._record(run, result)
            except _Stop as stop:
                self._unhold(run)
                return stop.outcome
            except BaseException:
                self._unhold(run)
                raise
            finally:
                if run.target is not None:
                    self._drop_pin(run.target)
                    run.target.close()

    def bind_in_thread(self, req: BindRequest) -> BindOutcome:
        """A rule's match in the exec watcher's thread: the same stages (pin by pidfd,
        a quick look, journal first); the record is the loop's (``bind`` with
        ``originals``). Anything but the plain case is LEFT_ALONE for the loop, with
        the look where it was taken."""
        run = _Run(req, time.perf_counter(), None, in_thread=True)
        run.ns = _stamps(req.stamps)
        try:
            self._pin_fd(run)
            self._authorize(run)
            self._describe_quick(run)
            self._decide(run)
            self._prepare_quick(run)
            self._journal(run)
            self._apply(run)
        except _Stop as stop:
            self._unhold(run)
            self._close(run)
            stop.outcome.ns = run.ns
            return stop.outcome
        except Exception as err:  # gone, or not ours to set: the loop's bind says why
            self._unhold(run)
            self._close(run)
            self.recorded(req.pid)
            why = "exited while being bound" if isinstance(err, NoSuchProcess) \
                else type(err).__name__
            left = self._left(run, why, keep_ctx=not isinstance(err, NoSuchProcess))
            left.ns = run.ns  # the main thread may have had its CPUs before it exited
            return left
        return self._bound_in_thread(run)

    async def commit(self, req: BindRequest, tb: ThreadBind, placed: Placement,
                     mems: frozenset[int] | None) -> BindOutcome:
        """On the loop, after ``bind_in_thread`` set a rule's rank's CPUs: the record,
        saved, and on the same pidfd what the thread left out (``req.nofile``, ``mems``)
        in one more apply, the CPUs set again only where a new cpuset resets them.
        Nothing is pinned, decided or placed again (the thread's hold stands)."""
        t = tb.target
        run = _Run(req, time.perf_counter(), req.nofile, target=t, ctx=req.context,
                   placed=placed, why=req.why, group=tb.group, result=tb.result)
        run.placement = Placement(cpus=placed.cpus, mems=mems, gpus=placed.gpus,
                                  explanation=placed.explanation)
        async with self.jobs.lock(req.pid):
            self._authorize_rest(run)
            self._prepare_rest(run, tb)
            await self._persist(run)
            result = await self._apply_rest(run)
            return self._record(run, result)

    # -- pin ---------------------------------------------------------------------------
    def _pin(self, run: _Run) -> None:
        run.target = self.actuator.pin(run.req.pid)

    def _keep_pin(self, run: _Run) -> None:
        """Authorized: the pin's pidfd is the process's one pidfd from now on (the
        ledger's), so whoever watches it during this bind (the record's exit watch, the
        cpuset watcher) opens none of its own."""
        t = run.target
        assert t is not None
        if t.owned:
            t.owned = not self.ledger.adopt_fd(ProcKey(t.pid, t.start_time), t.pidfd)

    def _drop_pin(self, t: Target) -> None:
        """After the pass: a pidfd the ledger took from it that nobody watches and no
        slot needs (the bind was refused or failed) is closed now, not at the exit."""
        if not t.owned:
            self.ledger.release_idle(t.pid, t.pidfd)

    def _pin_fd(self, run: _Run) -> None:
        """The pidfd first: what the intake reads next is of the process it holds."""
        try:
            run.target = self.actuator.pin_fd(run.req.pid)
        except NoSuchProcess:
            raise _Stop(BindOutcome(Verdict.LEFT_ALONE, run.req.pid, reason="gone")) from None

    # -- authorize ---------------------------------------------------------------------
    def _authorize(self, run: _Run) -> None:
        req, t = run.req, run.target
        assert t is not None
        if req.source is BindSource.RULE:
            m = req.match
            assert m is not None
            refused = rule_reach_refused(m.rule, m.uid)  # the one gate (tunerd.jobs.gate)
            if refused is not None:
                raise _Stop(BindOutcome(Verdict.REFUSED, req.pid, reason=refused,
                                        context=req.context))
            run.nofile = self.gate.cap_nofile(m.uid, req.pid, run.nofile, [])
            return
        require_owner(req.peer, req.pid, t.uid, t.euid)
        if req.source is BindSource.CLI and not req.peer.is_root:
            self._count(req.peer.uid, req.pid)
            run.nofile = self.gate.cap_nofile(req.peer.uid, req.pid, run.nofile,
                                              run.notes) or run.nofile
        if req.source is BindSource.CLI and req.exclusive:
            self.gate.admit(req.peer, exclusive=True, key=ReservationKey.bind(req.pid))

    def _authorize_rest(self, run: _Run) -> None:
        """Commit: the fd limit the thread left out, capped as a rule's is."""
        m = run.req.match
        assert m is not None
        if run.nofile is not None:
            run.nofile = self.gate.cap_nofile(m.uid, run.req.pid, run.nofile, [])

    def _count(self, uid: int, pid: int) -> None:
        """A non-root user holds at most ``max_per_user`` processes bound with ``tunerctl
        bind`` (her subordinate uids' too): each one is a record in the runtime state,
        written on every bind (6,000 binds were a 2.5 MB state file)."""
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

    # -- describe ------------------------------------------------------------------------
    def _describe(self, run: _Run) -> None:
        req = run.req
        run.ctx = req.context
        if run.ctx is not None or req.placement is not None:
            return
        if req.source is BindSource.CLI and not _near(req):
            return  # as given: nothing to look at
        if req.source is BindSource.CLI and req.gpus is None and self.jobs.is_bound(req.pid):
            return  # bound already: keeps its place unless --gpus names GPUs
        m = req.match
        run.ctx = self.intake.describe(req.pid, env=m.env if m else None,
                                       argv=m.cmdline.split(" ") if m else None)

    def _describe_quick(self, run: _Run) -> None:
        """The watcher's look: quick, the uid later where the gate does not need it."""
        req, t = run.req, run.target
        m = req.match
        assert m is not None and t is not None
        try:
            run.ctx = self.intake.describe(req.pid, env=m.env, argv=m.cmdline.split(" "),
                                           uid=m.uid, quick=True, uid_later=m.uid is None)
        except TunerdError:
            raise _Stop(BindOutcome(Verdict.LEFT_ALONE, req.pid, reason="gone")) from None
        run.ns["intake"] = time.perf_counter_ns()
        ctx = run.ctx
        t.start_time, t.uid = ctx.start_time, ctx.uid if ctx.uid is not None else -1
        if rule_take(m.rule, ctx) is not RuleTake.BIND:
            raise _Stop(self._left(run, ctx.role, keep_ctx=True))

    # -- decide: gate, place, hold, under the ledger's lock ---------------------------
    def _decide(self, run: _Run) -> None:
        req = run.req
        if req.placement is not None:
            run.placement, run.why = req.placement, req.why
        elif req.source is BindSource.RULE:
            self._decide_rule(run)
        elif _near(req):
            self._decide_near(run)
        else:
            self._decide_given(run)

    def _decide_given(self, run: _Run) -> None:
        """As asked; an exclusive bind's CPUs are held at once, as placed ones are (and
        its hold goes into the record that is saved before the change)."""
        req = run.req
        if req.cpus and not self.dry_run:
            with self.placer.lock:
                self._gate(run, req.cpus, ())
                self._hold_bind(run, req.cpus, ())
        run.placement = Placement.given(req.cpus, req.mems,
                                        explanation="as given on the command line")

    def _decide_near(self, run: _Run) -> None:
        """Near the GPUs the process uses (or --gpus), placed and held as one under the
        placer's lock: a rule's bind in the watcher's thread never gets these CPUs while
        this bind is applied."""
        req, ctx = run.req, run.ctx
        gpus, how = _gpus_of(req, ctx)
        if not gpus:  # it uses no GPU (or is bound already)
            if req.nofile is None or req.gpus is not None:
                # with what was ignored on the way (a 5,000-digit LOCAL_RANK)
                raise UsageError("; ".join([NO_PLACEMENT, *run.notes,
                                            *(ctx.notes if ctx is not None else ())]))
            run.notes.append("CPUs and memory nodes unchanged: " + NO_PLACEMENT)
            return
        self._known_gpus(gpus)
        assert ctx is not None
        with self.placer.lock:
            placed = self.placer.place(request(ctx, gpu_ids=gpus, exclusive=req.exclusive,
                                               ncpus=req.ncpus, ignore_busy_gpus=True))
            if placed.applicable and placed.cpus and not self.dry_run:
                final = req.cpus if req.cpus is not None else placed.cpus
                self._gate(run, final, tuple(placed.gpus or ()))
                self._hold_bind(run, final, tuple(placed.gpus or ()))
        if not placed.applicable:
            raise Failed(" ".join(placed.notes) + f" (process {req.pid}, GPUs from {how}: "
                         f"{','.join(map(str, gpus))}; would bind CPUs "
                         f"{format_cpulist(placed.cpus or frozenset())})",
                         pid=req.pid, applied=False)
        run.notes.extend(n for n in placed.notes if not n.startswith("topology replay"))
        run.placement = Placement(
            cpus=req.cpus if req.cpus is not None else placed.cpus,
            mems=req.mems if req.mems is not None else self.placer.bindable_mems(placed.mems),
            gpus=placed.gpus, explanation=f"GPUs from {how}; {placed.explanation}")
        run.why = ctx.why

    def _known_gpus(self, gpus: tuple[int, ...]) -> None:
        known = {g.index for g in self.placer.topo.gpus}
        unknown = [g for g in gpus if g not in known]
        if unknown:
            raise UsageError(
                f"{NO_PLACEMENT} for GPU {','.join(map(str, unknown))}: not on this node "
                f"(GPUs: {','.join(map(str, sorted(known))) or 'none'})")

    def _gate(self, run: _Run, cpus: frozenset[int], gpus: tuple[int, ...]) -> None:
        """The one gate of every ``tunerctl bind``, whatever its flags, on the CPUs it is
        about to get and, for an exclusive bind, the GPUs it is about to hold (under the
        placer's lock, before anything is held or moved): CPUs another user's lease or
        exclusive bind holds are refused (PlacementError, exit 1), and so are GPUs
        another user holds for an exclusive bind; root may bind there, with a note
        naming the holder."""
        req = run.req
        key = ReservationKey.bind(req.pid)
        refusals: list[PlacementError] = []
        held = self.placer.held_by_others(cpus, req.peer.uid, key)
        if held:
            refusals.append(held_exclusively(held))
        taken = self.placer.gpus_held_by_others(gpus, req.peer.uid, key) \
            if req.exclusive else {}
        if taken:
            refusals.append(PlacementError(
                f"GPU {','.join(map(str, sorted(taken)))} held by "
                f"{'; '.join(sorted(set(taken.values())))}",
                held_gpus={str(g): h for g, h in sorted(taken.items())}))
        if refusals and not req.peer.is_root:
            raise refusals[0]
        run.notes.extend(f"{r.message}: bound there as root asked" for r in refusals)

    def _hold_bind(self, run: _Run, cpus: frozenset[int], gpus: tuple[int, ...]) -> None:
        """An exclusive bind holds its CPUs (and GPUs); a rank or Slurm task holds its
        CPUs against the other ranks/tasks of its job (they split the allocation)."""
        req, ctx = run.req, run.ctx
        group = request(ctx).group if ctx is not None else None
        # root's binds are held too (nothing avoids them: they only steer [irq])
        if not req.exclusive and group is None and not req.peer.is_root:
            return
        ranked = ctx is not None and ctx.rank is not None \
            and (ctx.launcher is not None or ctx.rank.slurm_task)
        run.hold = Hold(group=group, job=ctx.job_key if ctx is not None else None,
                        exclusive=req.exclusive, uid=req.peer.uid, ranked=ranked)
        self._reserve(run, _bind_reservation(req.pid, cpus, gpus if ctx else (), run.hold))

    def _decide_rule(self, run: _Run) -> None:
        """A rule's match: placed in its job's group, held against every other."""
        req, ctx, m = run.req, run.ctx, run.req.match
        assert ctx is not None and m is not None
        run.group = rule_group(m, ctx)
        with self.placer.lock:
            key = ReservationKey.rule(req.pid)
            if run.in_thread and any(r.key == key for r in self.placer.reservations()):
                raise _Stop(self._left(run, "seen before, or refused", keep_ctx=True))
            self._release_exited(run.group)
            try:
                placed = self.placer.place(rule_request(m, ctx, run.group))
            except TunerdError as err:
                if run.in_thread:
                    raise _Stop(self._left(run, "placing failed", keep_ctx=True)) from err
                raise
            if run.in_thread and (not placed.applicable or not placed.cpus):
                raise _Stop(self._left(run, "not applicable here", keep_ctx=True))
            self._reserve(run, Reservation(
                key=key, holder=f"pid {req.pid} (rule {m.rule.name})", gpus=placed.gpus,
                cpus=placed.cpus or frozenset(), pid=req.pid, group=run.group,
                exclusive=is_exclusive(m.rule.exclusive, m.rule.placement),
                job=ctx.job_key, uid=m.uid))
        if not placed.applicable:
            run.key = None  # held all the same: the ledger of a replayed node
            raise _Stop(self._unapplied(run, placed))
        run.ns["place"] = time.perf_counter_ns()
        # in the watcher's thread the CPUs only: memory nodes need a cpuset (and page
        # moves), the loop's ``commit`` applies them; on the loop, both in this pass
        run.placed, run.why = placed, ctx.why
        run.placement = Placement(cpus=placed.cpus,
                                  mems=None if run.in_thread else rule_mems(self.placer, m,
                                                                            placed),
                                  gpus=placed.gpus, explanation=placed.explanation)

    def _unapplied(self, run: _Run, placed: Placement) -> BindOutcome:
        """Placed on a replayed topology this machine cannot apply: kept, not applied."""
        req, ctx, m = run.req, run.ctx, run.req.match
        assert ctx is not None and m is not None
        self.jobs.note_unapplied(req.pid, ctx.start_time, placed, origin="rule",
                                 name=m.rule.name, cmdline=m.cmdline, why=ctx.why)
        return BindOutcome(Verdict.LEFT_ALONE, req.pid, placement=placed, context=ctx,
                           reason="placed on the replayed topology only: "
                                  + " ".join(placed.notes))

    def _reserve(self, run: _Run, res: Reservation) -> None:
        run.key = res.key
        run.replaced = self.placer.reserve(res)

    def _unhold(self, run: _Run) -> None:
        """Not bound after all: the ledger as it was before this pass held anything."""
        if run.key is None:
            return
        if run.replaced is not None:
            self.placer.reserve(run.replaced)
        else:
            self.placer.release(run.key)
        run.key = None

    def _release_exited(self, group: str) -> None:
        """Under the placer's lock: ranks of ``group`` bound in the watcher's thread that
        exited (the loop's exit handling may lag behind a quick relaunch) give their CPUs
        back now; the loop forgets them as usual."""
        for r in self.placer.reservations():
            if r.group == group and r.pid is not None and r.key == ReservationKey.rule(r.pid) \
                    and self.ledger.exited(r.pid):
                self.placer.release(r.key)

    # -- prepare -------------------------------------------------------------------------
    def _prepare(self, run: _Run) -> None:
        req, t, p = run.req, run.target, run.placement
        assert t is not None
        if p is None and run.nofile is None:
            raise _Stop(BindOutcome(Verdict.LEFT_ALONE, req.pid, context=run.ctx,
                                    notes=run.notes, reason="nothing to bind"))
        run.prev = prev = self.jobs.previous(t)
        cpus = p.cpus if p is not None else None
        mems = p.mems if p is not None else None
        if prev is not None:  # keep what was bound before unless changed now
            cpus = cpus if cpus is not None else (prev.cpu_set() or None)
            mems = mems if mems is not None else prev.mem_set()
        run.plan = self.actuator.prepare(t, cpus=cpus, mems=mems, nofile=run.nofile,
                                         previous=prev.originals if prev else None,
                                         partial=req.source.partial, originals=req.originals)
        if self.dry_run:
            raise _Stop(BindOutcome(Verdict.LEFT_ALONE, req.pid, placement=p,
                                    notes=[*run.notes, *run.plan.notes],
                                    reason="dry run", dry_run=run.plan,
                                    elapsed_ms=_ms(run.t0)))

    def _prepare_quick(self, run: _Run) -> None:
        """In the watcher's thread: the CPUs only, with the masks from before (one thread
        when the intake read it: its mask as read there is every mask)."""
        t, ctx, p = run.target, run.ctx, run.placement
        assert t is not None and ctx is not None and p is not None
        mask = ctx.allocation.mask if ctx.threads == 1 else None
        orig = self.actuator.read_originals(t, mask)
        run.plan = Plan(target=t, originals=orig, cpus=p.cpus, mems=None, nofile=None,
                        after_main=lambda: self._main_set(run))

    def _prepare_rest(self, run: _Run, tb: ThreadBind) -> None:
        """Commit: the record's plan is the thread's (its CPUs, its originals); what is
        left to apply (``run.rest``) is the fd limit and the memory nodes, with the
        CPUs only where a child cpuset is made (attaching to it resets every mask)."""
        t, first, p = run.target, tb.plan, run.placement
        assert t is not None and first is not None and p is not None
        run.prev = self.jobs.previous(t)
        run.plan = first
        if run.nofile is None and not p.mems:
            return
        try:
            rest = self.actuator.prepare(t, cpus=p.cpus if p.mems else None,
                                         mems=p.mems or None, nofile=run.nofile,
                                         partial=True, originals=first.originals)
        except PermissionDenied as err:  # the fd limit alone, and not ours to set
            if p.mems:
                raise
            assert run.result is not None  # the note goes into the record, as a bind's does
            run.result = replace(run.result, notes=[*run.result.notes,
                                                    f"fd limit not set: {err.message}"])
            return
        rest.originals.affinity_set = True
        run.rest = rest
        run.plan = replace(rest, cpus=first.cpus)  # what the record keeps

    async def _apply_rest(self, run: _Run) -> BindResult:
        """Commit: the rest applied (a cpuset, page moves: in an executor), and the
        thread's result with it."""
        first, rest = run.result, run.rest
        assert first is not None
        if rest is None:
            return first
        try:
            got = await self._apply_on_loop(run, rest)
        finally:  # the record keeps what the apply left of the rest (a step left out)
            run.plan = replace(rest, cpus=first.cpus)
        return BindResult(pid=first.pid, cpus=first.cpus, mems=got.mems,
                          threads=max(first.threads, got.threads),
                          pages_moved=got.pages_moved, nofile_old=got.nofile_old,
                          nofile_new=got.nofile_new, notes=[*first.notes, *got.notes],
                          elapsed_ms=first.elapsed_ms + got.elapsed_ms)

    def _main_set(self, run: _Run) -> None:
        """The main thread has its CPUs: the time, then the rest of the bind at a normal
        priority (``ExecWatcher.lower_for_rest``)."""
        run.ns["set"] = time.monotonic_ns()  # the clock of the kernel's stamp and the read
        if self.watcher is not None:
            self.watcher.lower_for_rest()

    # -- persist -------------------------------------------------------------------------
    async def _persist(self, run: _Run) -> None:
        """The record, with the originals, before the change (a rule's record of a bind
        made in the watcher's thread: after, its journal line stood for it)."""
        req, t, plan, prev = run.req, run.target, run.plan, run.prev
        assert t is not None and plan is not None
        run.on_disk = prev is not None and plan.originals == prev.originals
        rec = self.jobs.new_record(t, Ask(
            placement=run.placement, nofile=run.nofile, origin=req.source.origin,
            name=req.name if req.name is not None else (req.match.rule.name
                                                        if req.match else None),
            lease=req.lease, cmdline=req.match.cmdline if req.match else None,
            why=run.why if run.why is not None else req.why, hold=run.hold),
            plan, prev, self.jobs.originals_for(t, plan, prev))
        run.rec = rec
        run.save_ms, run.written = await self.jobs.persist(rec, prev,
                                                           run.on_disk or _after(run))

    def _journal(self, run: _Run) -> None:
        """In the watcher's thread: one line in the binds-in-flight journal, before the
        change (a daemon killed before the loop records it: the next start puts the
        CPUs back, ``tunerd.jobs.journal``)."""
        t, plan = run.target, run.plan
        assert t is not None and plan is not None and plan.cpus is not None
        with self._journal_lock:
            if self.ledger.get(t.pid, UNRECORDED) is None:
                self._in_flight += 1
            self.ledger.put(ProcKey(t.pid, t.start_time), UNRECORDED, True)
            self.journal.add(t.pid, t.start_time, plan.originals.process_cpus, plan.cpus)

    def recorded(self, pid: int) -> None:
        """The loop recorded (or gave up) a bind made in the watcher's thread."""
        with self._journal_lock:
            if self.ledger.pop(pid, UNRECORDED) is not None:
                self._in_flight -= 1
            if self._in_flight <= 0:
                self._in_flight = 0
                self.journal.clear()

    # -- apply ---------------------------------------------------------------------------
    async def _apply_on_loop(self, run: _Run, plan: Plan | None = None) -> BindResult:
        """``plan`` (default: the pass's own) applied; page moves in an executor."""
        plan, t = plan or run.plan, run.target
        assert plan is not None and t is not None
        try:
            if plan.cpuset is not None or plan.migrate_from is not None:
                # moving pages can take long for a big process: keep the loop serving
                result = await asyncio.get_running_loop().run_in_executor(
                    None, self.actuator.apply, plan)
            else:
                result = self.actuator.apply(plan)
        except BaseException:
            self.jobs.unpersist(t.pid, run.prev, run.on_disk)
            raise
        if t.exited():  # exited during an executor apply: the exit handler may have run
            raise self.jobs.exited_meanwhile(t.pid)
        return result

    def _apply(self, run: _Run) -> None:
        assert run.plan is not None
        run.result = self.actuator.apply(run.plan)
        run.plan.originals.affinity_set = True
        run.ns["bound"] = time.perf_counter_ns()

    # -- record --------------------------------------------------------------------------
    def _record(self, run: _Run, result: BindResult) -> BindOutcome:
        req, t, plan, rec = run.req, run.target, run.plan, run.rec
        assert t is not None and plan is not None and rec is not None
        p = run.placement
        # the pin's pidfd is the process's one pidfd from now on (the ledger's)
        if t.owned:
            t.owned = not self.ledger.adopt_fd(ProcKey(t.pid, t.start_time), t.pidfd)
        kept = self.jobs.keep(t, rec, Recorded(
            plan=plan, result=result, prev=run.prev, written=run.written,
            on_disk=run.on_disk, persist_after=_after(run),
            mems_asked=p is not None and p.mems is not None, nofile_asked=run.nofile))
        if run.hold is not None and run.hold.exclusive:
            self.gate.hold(ReservationKey.bind(req.pid), req.peer.uid)
        if run.hold is not None and kept.cpus:  # the CPUs really bound (cgroup-narrowed)
            self.placer.reserve(_bind_reservation(
                req.pid, kept.cpu_set(), kept.gpus if run.ctx else (), run.hold))
        run.key = None  # held for good
        return BindOutcome(Verdict.BOUND, req.pid, placement=run.placed or p, record=kept,
                           result=result,
                           context=run.ctx, notes=[*run.notes, *result.notes],
                           rebind=run.prev is not None, save_ms=run.save_ms,
                           elapsed_ms=_ms(run.t0))

    def _bound_in_thread(self, run: _Run) -> BindOutcome:
        t, plan = run.target, run.plan
        assert t is not None and plan is not None
        # the rank's one pidfd, kept by the ledger: an exit the loop lags behind frees
        # its CPUs (``_release_exited``), the loop watches the process with it
        t.owned = not self.ledger.adopt_fd(ProcKey(t.pid, t.start_time), t.pidfd)
        run.key = None
        return BindOutcome(Verdict.BOUND, t.pid, placement=run.placed, context=run.ctx,
                           thread=ThreadBind(t, plan.originals, run.group, time.monotonic(),
                                             run.ns, plan, run.result), ns=run.ns)

    # -- holds kept beyond a pass ----------------------------------------------------------
    def hold(self, res: Reservation) -> Reservation | None:
        """A hold with no process bound by this pass: a lease (``alloc``; ``run`` before
        its process is bound; each lease again at start)."""
        return self.placer.reserve(res)

    def hold_again(self, m: RuleMatch, ctx: JobContext, group: str,
                   placed: Placement) -> None:
        """A rank a rule bound before a daemon restart (its record says so) holds its CPUs
        again, as the bind that placed it did."""
        self.placer.reserve(Reservation(
            key=ReservationKey.rule(ctx.pid), holder=f"pid {ctx.pid} (rule {m.rule.name})",
            gpus=placed.gpus, cpus=placed.cpus or frozenset(), pid=ctx.pid, group=group,
            exclusive=is_exclusive(m.rule.exclusive, m.rule.placement),
            job=ctx.job_key, uid=m.uid))

    def forget_rule_hold(self, pid: int) -> None:
        """A rule's rank is gone or no longer held: its reservation (its pidfd is the
        ledger's, closed when it exits)."""
        with self.placer.lock:
            self.placer.release(ReservationKey.rule(pid))

    def _adopted(self, rec: Binding) -> None:
        """A binding re-adopted after a restart holds again what its bind held (a Slurm
        task's CPUs against its step's other tasks, an exclusive bind's CPUs)."""
        hold = rec.hold
        if hold is None or not rec.cpus:
            return
        self.placer.reserve(_bind_reservation(rec.pid, rec.cpu_set(), rec.gpus, hold))
        if hold.exclusive and hold.uid is not None:
            self.gate.hold(ReservationKey.bind(rec.pid), hold.uid)
        log.info("pid %d: reservation restored (CPUs %s%s)", rec.pid, rec.cpus,
                 f", group {hold.group}" if hold.group else ", exclusive")

    def _exited(self, pid: int, rec: Binding) -> None:
        self.unheld(pid)

    def unheld(self, pid: int) -> None:
        """pid is unbound or gone: what its ``tunerctl bind`` held goes."""
        self.placer.release(ReservationKey.bind(pid))
        self.gate.drop(ReservationKey.bind(pid))

    # -- outcomes ------------------------------------------------------------------------
    def _left(self, run: _Run, why: str, keep_ctx: bool) -> BindOutcome:
        return BindOutcome(Verdict.LEFT_ALONE, run.req.pid, reason=why,
                           context=run.ctx if keep_ctx else None)

    def _close(self, run: _Run) -> None:
        if run.target is not None:
            run.target.close()


# -- the rule's placement (also `tunerctl plan`'s preview) ------------------------------
def rule_group(m: RuleMatch, ctx: JobContext) -> str:
    """The job a rank belongs to, for its rule: its ranks split the job's CPUs."""
    if ctx.group:
        return f"{m.rule.name}/{ctx.group}"
    run_id = m.env.get("TORCHELASTIC_RUN_ID") or m.env.get("SLURM_JOB_ID")
    if run_id:
        return f"{m.rule.name}/{run_id[:64]}"
    return f"{m.rule.name}/ppid {ctx.ppid}"


def rule_mems(placer: Placer, m: RuleMatch, placed: Placement) -> frozenset[int] | None:
    """The memory nodes a rule's rank is bound to (None: none to bind: one node, or
    the cpuset cannot say)."""
    return placer.bindable_mems(rank_mems(placer.topo, placed.mems, placed.gpus,
                                          m.rule.gpu_memory)) or None


def rule_workers(m: RuleMatch) -> int:
    """DataLoader workers per rank: the job's own setting first, then the rule's."""
    env_n = bounded_int(m.env, "TUNERD_NUM_WORKERS", [], hi=4096)
    if env_n is not None:
        return env_n
    if m.rule.workers is not None:
        return m.rule.workers
    n = m.rule.torch.num_workers
    return n if n is not None else 0


def rule_request(m: RuleMatch, ctx: JobContext, group: str) -> PlaceRequest:
    """What a rule asks the placer for a match."""
    rule = m.rule
    gpu_ids = ctx.gpus
    what = f"rule {rule.name}"
    if rule.cpus is not None:
        return request(ctx, cpus=rule.cpus, gpu_ids=gpu_ids or None, rank=None, ranks=None,
                       group=None, what=what)
    return request(
        ctx, gpus=int(rule.gpus) if not gpu_ids and rule.gpus else 0,
        gpu_ids=gpu_ids or None, mode=rule.placement,
        exclusive=is_exclusive(rule.exclusive, rule.placement),
        workers=rule_workers(m), group=group, ignore_busy_gpus=bool(gpu_ids), what=what)


# -- small parts ----------------------------------------------------------------------------
def _near(req: BindRequest) -> bool:
    """tunerctl bind with no --cpus/--mems, or with --gpus: placed near the GPUs."""
    return (req.cpus is None and req.mems is None) or req.gpus is not None


def _gpus_of(req: BindRequest, ctx: JobContext | None) -> tuple[tuple[int, ...], str]:
    if req.gpus is not None:
        return tuple(sorted(req.gpus)), "--gpus"
    if ctx is None:
        return (), ""
    if ctx.gpus:
        return ctx.gpus, ctx.gpus_how
    return tuple(gpus_from_nvml(req.pid) or ()), "NVML (GPUs it has contexts on)"


def _bind_reservation(pid: int, cpus: frozenset[int], gpus: tuple[int, ...],
                      hold: Hold) -> Reservation:
    """An exclusive bind holds its CPUs (and GPUs); a rank or Slurm task holds its CPUs
    against the other ranks/tasks of its job (they split the allocation)."""
    return Reservation(
        key=ReservationKey.bind(pid), holder=f"pid {pid} (tunerctl bind"
                                             f"{' --exclusive' if hold.exclusive else ''})",
        # a rank's bind holds its CPUs against its siblings, never its GPU (a lease
        # inside the job may take that GPU: the job's own processes use it)
        gpus=gpus if hold.exclusive else (), cpus=cpus, exclusive=hold.exclusive, pid=pid,
        group=hold.group, job=hold.job, uid=hold.uid, ranked=hold.ranked)


def _stamps(stamps: tuple[int, ...]) -> dict[str, int]:
    ns = {"t0": time.perf_counter_ns()}
    if stamps:
        ns["m0"] = stamps[0]
    if len(stamps) >= 3:
        ns["stamped"], ns["read"] = stamps[1], stamps[2]
    return ns


def _after(run: _Run) -> bool:
    """Bind first, persist right after: a rule's CPUs (a just-exec'd process: no write
    between its exec and its affinity; in the watcher's thread the journal line stood
    for it). A step that makes a cpuset or moves pages is persisted before, always."""
    plan = run.plan
    return run.req.source is BindSource.RULE and plan is not None \
        and plan.cpuset is None and plan.migrate_from is None


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000

