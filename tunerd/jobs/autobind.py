"""Automatic binding: processes matching a ``[[job]]`` rule are bound when they exec.

The exec watcher (proc connector, or a /proc scan where that is unavailable)
calls ``on_exec(pid)`` for every exec on the host; ``RuleSet.match`` rejects
unrelated commands with one bounded read and one regex. A match is placed by
the placing service inside the process's allocation (its cgroup cpuset, its
Slurm GPUs), near the GPU it uses (LOCAL_RANK / CUDA_VISIBLE_DEVICES), with
room for its DataLoader workers; ranks of one job (same rule and
TORCHELASTIC_RUN_ID / SLURM_JOB_ID, else same parent) split the CPUs using
LOCAL_WORLD_SIZE. It is bound through the JobRegistry with ``origin="rule"``;
a limit the daemon may not set is left out with a note, never the CPUs.

Bind first, persist after: a match is looked at (a quick intake), placed,
reserved and its CPUs set in the exec watcher's own thread, right after the rule
matched, with every thread's mask read just before (``_bind_now``). The loop then
records the binding with those originals, watches the process, saves the state and
does the rest (fd limit, memory nodes, exclusive moves, the log line: ``_finish``).
A process that exits meanwhile leaves nothing recorded and its reservation goes; if
the loop's part fails, the masks are put back. Anything but the plain case (a
wrapper, a descendant, a process seen before, a gate refusal, a replayed topology,
an error) is left to the loop's bind, as before.

The watcher only runs while the policy has rules: with none, the daemon
does not even subscribe to exec events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import select
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import NoSuchProcess, TunerdError
from tunerd.base.logutil import acting_for
from tunerd.jobs.binding import Originals, Plan, Target
from tunerd.jobs.exclusive import ExclusiveMover
from tunerd.jobs.gate import (
    LeaseLimits,
    ReservationGate,
    rule_reach_refused,
    rule_reaches_beyond,
)
from tunerd.jobs.intake import Intake, JobContext, bounded_int, request
from tunerd.jobs.journal import BindJournal, put_back
from tunerd.jobs.leases import user_name
from tunerd.jobs.peer import Peer
from tunerd.jobs.pidwatch import PidWatch
from tunerd.jobs.placement import Placement, mems_of
from tunerd.jobs.placer import Placer, Reservation
from tunerd.jobs.registry import JobRegistry
from tunerd.jobs.scope import ProcessScope
from tunerd.watch.proc_connector import ExecWatcher
from tunerd.watch.rules import RuleMatch, RuleSet

__all__ = ["AutoBinder"]

FOLLOWERS_MAX = 256  # processes a rank's bind looks at again (``_followers``)
FOLLOWERS_DEPTH = 4  # ... and how far down its tree
WRAPPED_MAX = 1024  # wrappers matched by an explicit rule, remembered at once
_CAP = re.compile(r"\bCAP_[A-Z_]+\b")  # a capability a left-out step needed
log = logging.getLogger("tunerd.autobind")

STOP_DRAIN_S = 0.3  # at stop, how long binds made in the watcher's thread get to be recorded

WATCHER_NICE = -10  # the exec watcher thread's (see AutoBinder.watcher_nice)
WATCHER_RT_PRIORITY = 1  # ... and its SCHED_FIFO priority while execs are sparse (lowest)


@dataclass
class RuleBound:
    pid: int
    start_time: int
    rule: str
    group: str
    uid: int | None
    placement: Placement
    exec_seen: float  # time.monotonic() of the exec event
    at_start: bool = False  # already running when the rule came into force
    bound_at: float | None = None
    timing: dict[str, Any] | None = None
    # a pidfd of it, where bound in the exec watcher's thread: there, before placing,
    # a rank of the same job that exited and whose exit the loop has not handled yet
    # no longer holds its CPUs (closed under the placer's lock when forgotten)
    pidfd: int = -1


@dataclass
class _Fast:
    """What the exec watcher's thread did for a match, for the loop to finish.

    ``target`` set: the CPUs are bound already (reservation made, ``originals`` read
    just before); the loop records, watches and saves it. Otherwise ``ctx`` is only
    the intake's look, which the loop's bind reuses."""

    ctx: JobContext
    group: str | None = None
    placed: Placement | None = None
    target: Target | None = None
    originals: Originals | None = None
    bound_at: float = 0.0
    ns: dict[str, int] | None = None  # perf_counter_ns per step, for the timing


Found = tuple[RuleMatch, float, "_Fast | None"]


def _cut(cmdline: str, width: int = 80) -> str:
    """A command line for one log line: an ellipsis where it is cut."""
    return cmdline if len(cmdline) <= width else cmdline[:width - 1] + "\u2026"


class AutoBinder:
    name = "autobind"

    def __init__(self, placer: Placer, jobs: JobRegistry, pidwatch: PidWatch,
                 mover: ExclusiveMover, errors: ErrorLog, intake: Intake, *,
                 default_nofile: Callable[[], int | None], use_connector: bool = True,
                 realtime: bool = True, gate: ReservationGate | None = None,
                 journal: Path | None = None, record_delay: float = 0.0,
                 proc_root: str = procfs.PROC, scope: ProcessScope | None = None) -> None:
        self.placer = placer
        self.scope = scope  # a test daemon's: rules bind only inside it (None: all)
        self.gate = gate or ReservationGate(LeaseLimits, default_nofile)
        self.jobs = jobs
        self.intake = intake
        self.pidwatch = pidwatch
        self.mover = mover
        self.errors = errors
        self._default_nofile = default_nofile
        self.use_connector = use_connector
        self.proc = proc_root
        self.rules = RuleSet([])
        self.watcher: ExecWatcher[Found] | None = None
        self.bound: dict[int, RuleBound] = {}
        self.peer = Peer(pid=os.getpid(), uid=0, gid=0)  # the policy acts as root
        self.matched = 0
        self.failed = 0
        self.partial = 0  # bound, but a limit or memory step was left out
        self.last_error: str | None = None
        self._pending: dict[int, asyncio.Task[None]] = {}
        # pid -> why: wrappers, launchers and self-bound ranks a rule matched, left alone
        self.left_alone: dict[int, str] = {}
        self._self_affined: set[int] = set()  # ... of those, ranks that set their own CPUs
        self.rescan_hooks: list[Callable[[], None]] = []  # run on every /proc rescan
        # descendants and left-alone processes a rescan need not look at again (until
        # they exec: an exec event looks at them afresh)
        self._settled: set[int] = set()
        self._scanning = False  # True while binding processes that ran before the rules
        # pid -> start time of processes whose binding failed: not retried (a /proc
        # scan or an overrun rescan would otherwise repeat the same error forever)
        self._failed: dict[int, int] = {}
        # exec event handled -> CPUs bound, as the daemon sees it (the last 1000)
        self.latencies_ms: deque[float] = deque(maxlen=1000)
        # bind first: a rule match is placed and its CPUs set in the exec watcher's
        # thread; the loop records, watches and saves it after (False: all on the loop)
        self.bind_in_watcher = True
        self.bound_first = 0  # matches whose CPUs were set in the watcher's thread
        # the watcher thread's nice value and, with ``realtime``, its SCHED_FIFO
        # priority while execs are sparse (it binds now: a wake-up that waits behind
        # other runnable tasks delays every bind); None: left as the daemon's
        self.watcher_nice: int | None = WATCHER_NICE
        self.watcher_rt: int | None = WATCHER_RT_PRIORITY if realtime else None
        self.left_to_loop: dict[str, int] = {}  # ... and why the others were not
        # ... and how long each step of that took (intake, place, bind; the handoff to
        # the loop after), the last 1000
        self.steps_ms: deque[dict[str, float]] = deque(maxlen=1000)
        # binds in the watcher's thread, the last 256: (pid, the kernel's exec stamp, the
        # watcher read it, the main thread's CPUs set), CLOCK_MONOTONIC ns (status
        # "timeline_ns", which bench/autobind.py cuts into steps)
        self.timeline: deque[tuple[int, int, int, int]] = deque(maxlen=256)
        self._match_ns = 0
        # stopping: no bind in the watcher's thread after ``stop`` took this lock, and the
        # ones whose CPUs are set already (``_inflight``) are recorded before we go
        self._fast_lock = threading.Lock()
        self._stopping = False
        self._inflight: set[int] = set()
        # bound in the watcher's thread, not recorded yet by the loop: in the journal
        # (tunerd.jobs.journal), emptied whenever this is
        self.journal = BindJournal(journal)
        self._unrecorded: set[int] = set()
        # wrappers an explicit rule matched: pid -> (start time, the match); what they
        # run matches that rule (``_wrapped_match``)
        self._wrapped: dict[int, tuple[int, RuleMatch]] = {}
        self.record_delay = record_delay  # debug_apply_delay: seconds before a record

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self.restore_moves()
        self._recover()

    def _recover(self) -> None:
        """At start, before any rescan: binds a killed daemon made but never recorded
        get their CPUs back, so that the rescan binds them afresh (with a record)."""
        for entry in self.journal.open():
            job = self.jobs.record(entry.pid)
            if job is not None and job.start_time == entry.start_time:
                continue  # recorded after all
            n = put_back(entry, self.proc)
            if n:
                log.warning("pid %d: bound by a rule (CPUs %s) just before the last daemon "
                            "stopped, never recorded: CPUs %s put back (%d thread(s)); the "
                            "rules look at it again now", entry.pid,
                            format_cpulist(entry.set_to), format_cpulist(entry.before), n)

    async def apply_rules(self, rules: RuleSet) -> None:
        """Put a new rule set in force (start and every reload)."""
        self.rules = rules
        if self.rules and self.watcher is None:
            self.watcher = ExecWatcher(self._matched, self.rescan, select=self.match,
                                       use_connector=self.use_connector, skip_exited=True,
                                       rt_priority=self.watcher_rt, nice=self.watcher_nice)
            self.watcher.start()
        elif not self.rules and self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.rules:
            log.info("automatic binding: %d rule(s): %s", len(self.rules.rules),
                     ", ".join(r.name for r in self.rules.rules))
            # processes that were already running match too: say so in the log
            self._scanning = True
            try:
                self.rescan()
            finally:
                self._scanning = False

    async def stop(self) -> None:
        with self._fast_lock:  # waits for a bind the watcher's thread is making now
            self._stopping = True
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        # a process the watcher's thread bound is recorded (with its originals) before
        # the daemon goes: else it would stay bound with nothing to put it back by
        deadline = time.monotonic() + STOP_DRAIN_S
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        pending = list(self._pending.values())
        if pending:
            await asyncio.wait(pending, timeout=max(deadline - time.monotonic(), 0.0))
        if self._inflight:
            log.warning("stopping: %d process(es) bound by a rule but not recorded: %s "
                        "(the next start puts their CPUs back: binds-in-flight)",
                        len(self._inflight), sorted(self._inflight))
        for t in self._pending.values():
            t.cancel()
        self.journal.close()

    def status(self) -> dict[str, Any]:
        w = self.watcher.status() if self.watcher else {"mode": "off"}
        n = len(self.rules.rules)
        bound = list(self.bound.values())  # the watcher thread adds to it meanwhile
        at_start = [b for b in bound if b.at_start]
        names = ", ".join(r.name for r in self.rules.rules)
        summary = (f"automatic binding: {n} rule(s) ({names}), watcher {w['mode']}, "
                   f"{len(self.bound)} process(es) bound" if n else "automatic binding: no rules")
        if at_start:
            users = sorted({user_name(b.uid) for b in at_start})
            summary += (f" ({len(at_start)} already running at start, of user(s) "
                        f"{', '.join(users)})")
        if self.failed:
            summary += f"; {self.failed} failed"
        if self.scope is not None:
            summary += (f"; scoped to pid {self.scope.root}'s subtree, "
                        f"{self.scope.out_of_scope} out of scope")
        lat = sorted(self.latencies_ms)
        latency: dict[str, Any] = {"n": len(lat), "median": round(statistics.median(lat), 3),
                   "p99": round(lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], 3),
                   "max": round(lat[-1], 3)} if lat else {"n": 0}
        steps = list(self.steps_ms)
        if steps:
            latency["bind_first_steps_median"] = {
                k: round(statistics.median(s[k] for s in steps if k in s), 3)
                for k in steps[-1]}
        return {"summary": summary, "rules": [r.name for r in self.rules.rules], "watcher": w,
                "latency_ms": latency, "matched": self.matched, "failed": self.failed,
                "partial": self.partial, "last_error": self.last_error,
                "bound_in_watcher": self.bound_first, "left_to_loop": dict(self.left_to_loop),
                "bound_at_start": len(at_start),
                "scope": None if self.scope is None else self.scope.status(),
                "timeline_ns": [list(t) for t in self.timeline],
                "left_alone": self.left_alone_now(),
                "bound": [{"pid": b.pid, "rule": b.rule, "user": user_name(b.uid),
                           "cpus": format_cpulist(b.placement.cpus or frozenset()),
                           "gpus": list(b.placement.gpus), "applied": b.placement.applicable,
                           "notes": list(b.placement.notes), "timing": b.timing,
                           "at_start": b.at_start,
                           "latency_ms": None if b.bound_at is None else
                           round((b.bound_at - b.exec_seen) * 1000, 3)}
                          for b in bound]}

    def left_alone_now(self) -> list[dict[str, Any]]:
        """Processes a rule matched that tunerd left alone (wrappers, launchers, ranks
        that set their own affinity) and that still run, with why."""
        return [{"pid": p, "why": w, "self_affined": p in self._self_affined}
                for p, w in sorted(self.left_alone.items())
                if procfs.read_start_time(p, self.proc) is not None][:100]

    def set_own_cpus(self, pid: int) -> bool:
        """Whether a rule left ``pid`` alone because it set its own CPUs (numactl,
        taskset): what it starts keeps them too (tunerd.jobs.gpuuse)."""
        return pid in self._self_affined

    # -- events ----------------------------------------------------------------
    def match(self, pid: int) -> Found | None:
        """For every exec on the host, in the watcher's thread: keep the no-match path
        short (a bounded read of the command line, compiled globs). A match carries the
        time it was seen, from which exec-to-bound latency is counted, and is bound
        right here (``_bind_now``: bind first, persist after, on the loop)."""
        self._match_ns = time.perf_counter_ns()  # this thread's: the match step's start
        self.intake.exec_seen(pid)  # what a quick look kept of it as a parent is stale
        fast_path = self.bind_in_watcher
        # binding first: the uid is read after the CPUs are set where the gate does not
        # need it before (a rule that reserves nothing for others)
        m = self.rules.match(pid, uid_for=rule_reaches_beyond if fast_path else None)
        if m is None and self._wrapped:
            m = self._wrapped_match(pid)
        if m is None or (self.scope is not None and not self.scope.admits(pid)):
            return None
        seen = time.monotonic()
        fast = self._bind_now(m) if fast_path else None
        if m.uid is None:
            uid = procfs.read_uid(pid, self.proc)
            m = dataclasses.replace(m, uid=uid)
            if fast is not None:
                self._uid_known(fast, uid)
        return m, seen, fast

    def _uid_known(self, fast: _Fast, uid: int | None) -> None:
        """The uid read after a bind in the watcher's thread, where the look and the
        record made before it left it out."""
        fast.ctx = dataclasses.replace(fast.ctx, uid=uid)
        if fast.target is not None:
            fast.target.uid = uid if uid is not None else -1
            rb = self.bound.get(fast.ctx.pid)
            if rb is not None and rb.uid is None:
                rb.uid = uid

    def _matched(self, found: Found) -> None:
        m, seen, fast = found
        self._inflight.discard(m.pid)
        if fast is not None and fast.target is not None:
            self._pending[m.pid] = asyncio.ensure_future(self._finish(m, seen, fast))
            return
        self.on_match(m, seen, fast.ctx if fast is not None else None)

    def _wrapped_match(self, pid: int) -> RuleMatch | None:
        """An explicit rule matched a wrapper (``bash myjob.sh``): what the wrapper runs
        -- the image it execs, the children it starts -- is that rule's match."""
        start = procfs.read_start_time(pid, self.proc)
        hit = self._wrapped.get(pid)
        if hit is None or hit[0] != start:
            ppid = procfs.read_ppid(pid, self.proc)
            hit = self._wrapped.get(ppid) if ppid is not None else None
            if hit is None or ppid is None or procfs.read_start_time(ppid, self.proc) != hit[0]:
                return None
        got = procfs.read_cmdline_prefix(pid, self.proc)
        env = procfs.read_environ_view(pid, self.proc)
        if got is None or env is None:
            return None
        wrapper = hit[1]
        return RuleMatch(rule=wrapper.rule, pid=pid, cmdline=got[0], uid=wrapper.uid,
                         env=env)

    def _wrap(self, m: RuleMatch, ctx: JobContext) -> None:
        """Remember a wrapper an explicit rule matched (``_wrapped_match``)."""
        if m.rule.rank or ctx.role != "wrapper":
            return
        if len(self._wrapped) >= WRAPPED_MAX:
            self._wrapped.clear()
        self._wrapped[ctx.pid] = (ctx.start_time, m)  # a stale entry never matches: the
        # start time is checked, and the table is bounded

    def on_exec(self, pid: int) -> None:
        """A process to look at on the loop (a /proc rescan)."""
        m = self.rules.match(pid)
        if m is None and self._wrapped:
            m = self._wrapped_match(pid)
        if m is None:
            return
        if self.scope is not None and not self.scope.admits(pid):
            self._settled.add(pid)  # outside for good: not looked at again until it execs
            return
        self.on_match(m)

    def on_match(self, m: RuleMatch, seen: float | None = None,
                 ctx: JobContext | None = None) -> None:
        """A process a rule matched: bind it (on the loop). ``ctx``: the intake's look
        taken in the watcher's thread already."""
        if m.pid in self._pending or self._stopping:
            return
        task = asyncio.ensure_future(self._bind(m, seen if seen is not None
                                                else time.monotonic(), self._scanning, ctx))
        self._pending[m.pid] = task

    def rescan(self) -> None:
        for hook in self.rescan_hooks:
            hook()
        me = os.getpid()
        for pid in procfs.list_pids(self.proc):
            if pid != me and pid not in self.bound and pid not in self._settled:
                self.on_exec(pid)

    def preview(self, m: RuleMatch) -> Placement:
        """Where ``m`` would be bound, computed as a bind would, changing nothing
        (``tunerctl plan --policy-dir``). Raises what placing raises."""
        ctx = self.intake.describe(m.pid, env=m.env, argv=m.cmdline.split(" "))
        return self._place(m, ctx, self._group(m, ctx))

    # -- binding ---------------------------------------------------------------
    def _group(self, m: RuleMatch, ctx: JobContext) -> str:
        if ctx.group:
            return f"{m.rule.name}/{ctx.group}"
        run_id = m.env.get("TORCHELASTIC_RUN_ID") or m.env.get("SLURM_JOB_ID")
        if run_id:
            return f"{m.rule.name}/{run_id[:64]}"
        return f"{m.rule.name}/ppid {ctx.ppid}"

    def _workers(self, m: RuleMatch) -> int:
        """DataLoader workers per rank: the job's own setting first, then the rule's."""
        env_n = bounded_int(m.env, "TUNERD_NUM_WORKERS", [], hi=4096)
        if env_n is not None:
            return env_n
        if m.rule.workers is not None:
            return m.rule.workers
        n = m.rule.torch.num_workers
        return n if n is not None else 0

    def _place(self, m: RuleMatch, ctx: JobContext, group: str) -> Placement:
        rule = m.rule
        gpu_ids = ctx.gpus
        what = f"rule {rule.name}"
        if rule.cpus is not None:
            return self.placer.place(request(ctx, cpus=rule.cpus, gpu_ids=gpu_ids or None,
                                             rank=None, ranks=None, group=None, what=what))
        return self.placer.place(request(
            ctx, gpus=int(rule.gpus) if not gpu_ids and rule.gpus else 0,
            gpu_ids=gpu_ids or None, mode=rule.placement,
            exclusive=rule.exclusive or rule.placement == "exclusive",
            workers=self._workers(m), group=group, ignore_busy_gpus=bool(gpu_ids), what=what))

    def _look(self, m: RuleMatch, ctx: JobContext | None = None) -> JobContext | None:
        """The intake's view of a match (``ctx``: taken already); None where there is
        nothing to do."""
        pid = m.pid
        try:
            if ctx is None:
                ctx = self.intake.describe(pid, env=m.env, argv=m.cmdline.split(" "))
        except TunerdError as err:
            self.matched += 1
            log.debug("pid %d (rule %s): %s", pid, m.rule.name, err.message)
            return None  # gone (or unreadable) before we got to it
        # a process seen before (a rescan, or another exec of it) is no new match
        if self._failed.get(pid) == ctx.start_time:
            return None
        prev = self.bound.get(pid)
        if prev is not None and prev.start_time == ctx.start_time and prev.rule == m.rule.name:
            return None  # the same process exec'd again (sh -> python): keep its place
        rec = self.jobs.record(pid)
        if ctx.self_affined and rec is not None and rec.start_time == ctx.start_time:
            # the mask tunerd set itself (a daemon restarted mid-job): known from its
            # record, never taken for the rank's own choice; ``_adopt`` holds it again
            ctx = replace(ctx, self_affined=False,
                          why=ctx.why.split("; its CPU mask ")[0] + "; bound by tunerd")
        if ctx.role in ("wrapper", "launcher") or ctx.self_affined:
            self._wrap(m, ctx)
            self._left_alone(ctx)
            self._settle(ctx)
            return None
        if m.rule.rank and ctx.role not in ("rank", "descendant"):
            return None
        log.debug("pid %d (rule %s): %s: %s", pid, m.rule.name, ctx.role, ctx.why)
        return ctx

    def _settle(self, ctx: JobContext) -> None:
        if len(self._settled) > 100_000:
            self._settled.clear()
        if self.pidwatch.watch(ctx.pid, ctx.start_time, "rule-settled", self._settled_exited):
            self._settled.add(ctx.pid)
        else:
            self._settled_exited(ctx.pid)

    def _settled_exited(self, pid: int) -> None:
        """A settled process ended: not looked at, nor listed as left alone, any more
        (while none is, tunerd.jobs.gpuuse has no launch to follow and reads nothing)."""
        self._settled.discard(pid)
        self.left_alone.pop(pid, None)
        self._self_affined.discard(pid)

    def _left_alone(self, ctx: JobContext) -> None:
        if len(self.left_alone) > 1000:
            self.left_alone.clear()
            self._self_affined.clear()
        if ctx.self_affined:
            self._self_affined.add(ctx.pid)
        else:
            self._self_affined.discard(ctx.pid)
        if ctx.pid not in self.left_alone:
            log.info("pid %d (%s) left alone: %s", ctx.pid, ctx.comm, ctx.why)
        self.left_alone[ctx.pid] = ctx.why

    async def _after_parent(self, m: RuleMatch, ctx: JobContext) -> JobContext:
        """A descendant whose rank is being bound right now (a /proc rescan finds both):
        wait for that, then look again, so that it is narrowed into the rank's CPUs."""
        parent = self._pending.get(ctx.ppid)
        if ctx.parent_cpus is not None or parent is None:
            return ctx
        await asyncio.wait([parent], timeout=5)
        return self.intake.describe(ctx.pid, env=m.env, argv=m.cmdline.split(" "))

    async def _narrow(self, m: RuleMatch, ctx: JobContext) -> None:
        """A descendant of a bound rank (worker, forkserver, compile helper): never a
        rank; kept inside its rank's CPUs (narrowed where it ran outside them)."""
        cpus = ctx.parent_cpus
        mask = ctx.allocation.mask
        if cpus is not None:
            self._settle(ctx)
        if cpus is None or (mask is not None and mask <= cpus):
            return
        self.matched += 1
        await self.jobs.bind(ctx.pid, peer=self.peer, placement=Placement(
            cpus=cpus, mems=None, explanation=f"worker of rank {ctx.parent_rank}: "
                                              "kept inside the rank's CPUs"),
            origin="worker", name=m.rule.name, cmdline=m.cmdline, partial=True,
            why=ctx.why)
        log.info("rule %s: pid %d (%s) narrowed to rank %s's CPUs %s", m.rule.name, ctx.pid,
                 ctx.comm, ctx.parent_rank, format_cpulist(cpus))

    def _adopt(self, m: RuleMatch, ctx: JobContext, group: str, seen: float,
               at_start: bool) -> bool:
        """A process bound by a rule before a daemon restart keeps its place."""
        job = self.jobs.record(ctx.pid)
        if job is None or job.start_time != ctx.start_time:
            return False
        if job.origin != "rule":
            log.debug("pid %d matches rule %s but is bound by %s; left alone", ctx.pid,
                      m.rule.name, job.origin)
            return True
        if ctx.pid not in self.bound:
            cpus = job.cpu_set()
            placed = Placement(cpus=cpus, mems=mems_of(self.placer.topo, cpus),
                               gpus=job.gpus, explanation=job.explanation or "")
            self._hold(m, ctx, group, placed, seen, at_start)
            return True
        return False

    async def _bind(self, m: RuleMatch, seen: float, at_start: bool,
                    known: JobContext | None = None) -> None:
        pid = m.pid
        acting_for(m.uid)  # its own task: what it logs counts against the process's owner
        try:
            ctx = self._look(m, known)
            if ctx is None:
                return
            if ctx.role == "descendant":
                await self._narrow(m, await self._after_parent(m, ctx))
                return
            group = self._group(m, ctx)
            if self._adopt(m, ctx, group, seen, at_start):
                return
            self.matched += 1
            refused = rule_reach_refused(m.rule, m.uid)  # the one gate (tunerd.jobs.gate)
            if refused is not None:
                log.debug("pid %d: %s; not bound", pid, refused)
                return
            placed = self._place(m, ctx, group)
            # reserve before the first await so concurrent ranks see these CPUs taken
            rb = self._hold(m, ctx, group, placed, seen, at_start)
            if rb is None:
                return
            if not placed.applicable:
                log.info("rule %s: pid %d placed on the replayed topology (GPUs %s, CPUs %s); "
                         "%s", m.rule.name, pid, placed.gpus,
                         format_cpulist(placed.cpus or frozenset()), " ".join(placed.notes))
                self.jobs.note_unapplied(pid, ctx.start_time, placed, origin="rule",
                                         name=m.rule.name, cmdline=m.cmdline, why=ctx.why)
                return
            await self._apply(m, ctx, rb, placed, seen, at_start)
        except NoSuchProcess:
            self._forget(pid)  # exited before we got to it: the normal case for short jobs
        except TunerdError as err:
            self._failure(m, pid, err.message)
        except Exception as err:
            log.exception("automatic binding of pid %d failed", pid)
            self._failure(m, pid, repr(err))
        finally:
            self._pending.pop(pid, None)

    # -- bind first: in the exec watcher's thread ------------------------------
    def _bind_now(self, m: RuleMatch) -> _Fast | None:
        """Look, place, reserve and set the CPUs of a just-exec'd match, in the watcher's
        thread, before the loop hears of it (the loop records and saves it after:
        ``_finish``). Everything that is not the plain case (wrappers, descendants, a
        process bound or failed before, a gate refusal, a replayed topology, an error)
        is left to the loop's bind, with the intake's look where it was taken."""
        with self._fast_lock:
            if self._stopping:
                return self._to_loop("stopping", None)
            fast = self._bind_now_locked(m)
            if fast is not None and fast.target is not None:
                self._inflight.add(m.pid)  # until the loop has it (``_matched``)
            return fast

    def _bind_now_locked(self, m: RuleMatch) -> _Fast | None:
        pid = m.pid
        if (pid in self._pending or pid in self.bound or pid in self._failed
                or self.jobs.record(pid) is not None or self.jobs.dry_run
                or rule_reach_refused(m.rule, m.uid) is not None):
            return self._to_loop("seen before, or refused", None)
        ns = {"m0": self._match_ns, "t0": time.perf_counter_ns()}
        ev = self.watcher.event_ns if self.watcher is not None else None
        if ev is not None:
            ns["stamped"], ns["read"] = ev
        try:
            # the pidfd first: what the intake reads next is of the process it holds
            pidfd = os.pidfd_open(pid)
        except OSError:
            return self._to_loop("gone", None)
        try:
            ctx = self.intake.describe(pid, env=m.env, argv=m.cmdline.split(" "), uid=m.uid,
                                       quick=True, uid_later=m.uid is None)
        except TunerdError:
            os.close(pidfd)
            return self._to_loop("gone", None)
        ns["intake"] = time.perf_counter_ns()
        target = Target(pid=pid, start_time=ctx.start_time, pidfd=pidfd,
                        uid=ctx.uid if ctx.uid is not None else -1, euid=-1)
        fast = self._place_now(m, ctx, target, ns)
        if fast is None or fast.target is None:
            target.close()
        return fast

    def _place_now(self, m: RuleMatch, ctx: JobContext, target: Target,
                   ns: dict[str, int]) -> _Fast | None:
        """``_bind_now`` once the intake looked: place, reserve, set the CPUs."""
        pid = m.pid
        if ctx.role == "wrapper":
            self._wrap(m, ctx)  # before what it starts execs (the loop's look may be later)
        if ctx.role not in ("rank", "process") or ctx.self_affined \
                or (m.rule.rank and ctx.role != "rank"):
            return self._to_loop(ctx.role, ctx)
        group = self._group(m, ctx)
        # place, set, reserve as one against the loop's placements (the reservation
        # after the CPUs: nothing to give back when setting them fails)
        with self.placer.lock:
            if pid in self.bound:
                return self._to_loop("seen before, or refused", ctx)
            self._release_exited(group)
            try:
                placed = self._place(m, ctx, group)
            except TunerdError:
                return self._to_loop("placing failed", ctx)  # the loop says why
            if not placed.applicable or not placed.cpus:
                return self._to_loop("not applicable here", ctx)
            ns["place"] = time.perf_counter_ns()
            try:
                # one thread when the intake read it: its mask as read there is every mask
                mask = ctx.allocation.mask if ctx.threads == 1 else None
                orig = self.jobs.binder.read_originals(target, mask)
                cpus, before, start = placed.cpus, orig.process_cpus, ctx.start_time
                self.jobs.binder.apply(Plan(
                    target=target, originals=orig, cpus=cpus, mems=None, nofile=None,
                    after_main=lambda: self._main_set(ns, pid, start, before, cpus)))
            except Exception as err:  # gone, or not ours to set: the loop's bind says why
                if isinstance(err, NoSuchProcess):
                    return self._to_loop("exited while being bound", None)
                return self._to_loop(type(err).__name__, ctx)
            self._reserve(m, ctx, group, placed, 0.0, False)
        orig.affinity_set = True
        ns["bound"] = time.perf_counter_ns()
        self._unrecorded.add(pid)
        at = time.monotonic()
        rb = self.bound.get(pid)
        if rb is not None:
            rb.pidfd = os.dup(target.pidfd)
        return _Fast(ctx, group, placed, target, orig, at, ns)

    def _main_set(self, ns: dict[str, int], pid: int, start_time: int,
                  before: frozenset[int], cpus: frozenset[int]) -> None:
        """The main thread of a bind in the watcher's thread has its CPUs: the time, the
        binds-in-flight line (still at real-time priority: the window in which a killed
        daemon would leave the process bound without either is a few microseconds), then
        the rest of the bind at a normal priority (``ExecWatcher.lower_for_rest``). A
        line whose bind then fails is harmless: recovery skips a recorded process and
        puts back only threads that still have ``cpus``."""
        ns["set"] = time.monotonic_ns()  # the clock of the kernel's stamp and the read
        self.journal.add(pid, start_time, before, cpus)
        if "stamped" in ns:  # also for a process that exits before the bind is done
            self.timeline.append((pid, ns["stamped"], ns["read"], ns["set"]))
        if self.watcher is not None:
            self.watcher.lower_for_rest()

    def _to_loop(self, why: str, ctx: JobContext | None) -> _Fast | None:
        """Not bound in the watcher's thread: counted by why, the look passed on."""
        self.left_to_loop[why] = self.left_to_loop.get(why, 0) + 1
        return None if ctx is None else _Fast(ctx)

    def _release_exited(self, group: str) -> None:
        """In the watcher's thread, under the placer's lock: ranks of ``group`` bound
        here that exited (the loop's exit handling may lag behind a quick relaunch)
        give their CPUs back now; the loop forgets them as usual."""
        peers = [rb for rb in list(self.bound.values()) if rb.group == group and rb.pidfd >= 0]
        if not peers:
            return
        poll = select.poll()
        for rb in peers:
            poll.register(rb.pidfd, select.POLLIN)
        gone = {fd for fd, _ in poll.poll(0)}
        for rb in peers:
            if rb.pidfd in gone:
                self.placer.release(f"rule:{rb.pid}")

    def _close(self, rb: RuleBound | None) -> None:
        if rb is not None and rb.pidfd >= 0:
            with self.placer.lock:
                os.close(rb.pidfd)
                rb.pidfd = -1

    async def _finish(self, m: RuleMatch, seen: float, fast: _Fast) -> None:
        """On the loop, after ``_bind_now`` set the CPUs: watch the process, record the
        binding with the originals read before, save, then the rest (fd limit, memory
        nodes, exclusive moves, log line). Exited meanwhile: the reservation goes,
        nothing is recorded; the rest failed: the CPUs are put back as they were."""
        pid, ctx, target = m.pid, fast.ctx, fast.target
        assert target is not None and fast.placed is not None
        acting_for(m.uid)
        rb = self.bound.get(pid)
        self.bound_first += 1
        self.latencies_ms.append((fast.bound_at - seen) * 1000)
        ns = fast.ns or {}
        steps = {f"{k}_ms": round((ns[k] - ns[prev]) / 1e6, 3)
                 for prev, k in zip(("t0", "intake", "place"), ("intake", "place", "bound"),
                                    strict=True) if k in ns and prev in ns}
        if "m0" in ns and "t0" in ns:  # the rule match, before the exec counts as seen
            steps["match_ms"] = round((ns["t0"] - ns["m0"]) / 1e6, 3)
        steps["handoff_ms"] = round((time.monotonic() - fast.bound_at) * 1000, 3)
        self.steps_ms.append(steps)
        try:
            if self.record_delay:  # crash tests: a window between the bind and its record
                await asyncio.sleep(self.record_delay)
            self.matched += 1
            if rb is None or not self.pidwatch.watch(pid, ctx.start_time, "rule", self._exited):
                self._forget(pid)
                return
            rb.exec_seen = seen
            rb.bound_at = fast.bound_at
            rb.timing = {"bind_first_ms": round((fast.bound_at - seen) * 1000, 3), **steps}
            await self._apply(m, ctx, rb, fast.placed, seen, False, fast.originals)
        except NoSuchProcess:
            self._forget(pid)
        except Exception as err:
            self._put_back(fast)
            if isinstance(err, TunerdError):
                self._failure(m, pid, err.message)
            else:
                log.exception("automatic binding of pid %d failed", pid)
                self._failure(m, pid, repr(err))
        finally:
            target.close()
            if self._pending.get(pid) is asyncio.current_task():
                del self._pending[pid]
            with self._fast_lock:  # against the watcher's thread adding one meanwhile
                self._unrecorded.discard(pid)
                if not self._unrecorded:
                    self.journal.clear()

    def _put_back(self, fast: _Fast) -> None:
        """Undo a fast bind whose recording failed: every thread's mask as it was."""
        if fast.target is None or fast.originals is None or self.jobs.is_bound(fast.ctx.pid):
            return
        try:
            self.jobs.binder.restore(fast.target, fast.originals)
        except TunerdError as err:
            log.warning("pid %d: CPUs not put back after a failed bind: %s", fast.ctx.pid,
                        err.message)

    async def _apply(self, m: RuleMatch, ctx: JobContext, rb: RuleBound, placed: Placement,
                     seen: float, at_start: bool, originals: Originals | None = None) -> None:
        """``originals``: the CPUs are set already (``_bind_now``), these are the masks
        from before."""
        pid = ctx.pid
        t_bind = time.monotonic()
        # CPUs first: thread affinity is quick, while memory nodes need a cpuset
        # cgroup (and page migration) -- the process should not run on the
        # wrong CPUs while that is set up
        nofile = m.rule.nofile if m.rule.nofile is not None else self._default_nofile()
        nofile = self.gate.cap_nofile(m.uid, pid, nofile, [])
        res = await self.jobs.bind(pid, peer=self.peer, placement=Placement(
            cpus=placed.cpus, mems=None, gpus=placed.gpus, explanation=placed.explanation),
            nofile=nofile, origin="rule", name=m.rule.name, cmdline=m.cmdline, partial=True,
            why=ctx.why, persist_after=True, originals=originals)  # bind first, persist after
        if originals is None:
            rb.bound_at = time.monotonic()
            self.latencies_ms.append((rb.bound_at - seen) * 1000)
            rb.timing = {"queue_place_ms": round((t_bind - seen) * 1000, 3)}
        rb.timing = {**(rb.timing or {}),
                     **{k: res.get(k) for k in ("save_ms", "apply_ms", "elapsed_ms")}}
        assert rb.bound_at is not None
        notes = list(res.get("notes") or [])
        mems = self.placer.bindable_mems(placed.mems)
        if mems:
            res2 = await self.jobs.bind(pid, peer=self.peer,
                                        placement=Placement(cpus=None, mems=mems),
                                        origin="rule", name=m.rule.name, partial=True)
            notes += [n for n in res2.get("notes") or [] if n not in notes]
        log.info("rule %s: bound pid %d (%s, user %s%s) to CPUs %s near GPU(s) %s in %.1f ms"
                 " (%s)", m.rule.name, pid, _cut(m.cmdline), user_name(m.uid),
                 ", already running at start" if at_start else "",
                 format_cpulist(placed.cpus or frozenset()),
                 ",".join(map(str, placed.gpus)) or "-", (rb.bound_at - seen) * 1000, ctx.why)
        self._partial(m, ctx, placed, notes)
        await self._followers(m, pid, placed.cpus or frozenset(), rb.group)
        if m.rule.exclusive and m.rule.exclusive_scope:
            self.mover.move_off(f"rule:{pid}:{ctx.start_time}", m.rule.exclusive_scope,
                                placed.cpus or frozenset(), pid, 0)

    async def _followers(self, m: RuleMatch, pid: int, cpus: frozenset[int],
                         group: str) -> None:
        """A rank just bound: what it started before its bind was recorded (a helper its
        shell ran before exec'ing it, workers forked meanwhile) was looked at while it
        was not bound yet -- and may have been taken for a rank of the same job, its
        parent being a shell then; look again, and narrow each into the rank's CPUs
        (a rank's descendants are never ranks: such a hold is given back). Bounded:
        FOLLOWERS_MAX processes, FOLLOWERS_DEPTH levels."""
        if not cpus:
            return
        todo, seen = [(pid, 0)], 0
        while todo and seen < FOLLOWERS_MAX:
            parent, depth = todo.pop()
            try:
                kids = procfs.Process(parent, self.proc).children()
            except TunerdError:
                continue
            for kid in kids[:FOLLOWERS_MAX]:
                seen += 1
                if depth + 1 < FOLLOWERS_DEPTH:
                    todo.append((kid, depth + 1))
                held, rec = self.bound.get(kid), self.jobs.record(kid)
                if held is not None and held.group == group:  # taken for a rank: it is not
                    self.placer.release(f"rule:{kid}")
                    self._close(self.bound.pop(kid, None))
                elif held is not None or (rec is not None and rec.origin != "worker"):
                    continue  # another job's rank, or bound by someone else
                try:
                    mask = frozenset(os.sched_getaffinity(kid))
                except OSError:
                    continue
                if mask <= cpus:
                    continue
                try:
                    await self.jobs.bind(kid, peer=self.peer, placement=Placement(
                        cpus=cpus, mems=None, explanation=f"follower of rank {pid}: "
                                                          "kept inside the rank's CPUs"),
                        origin="worker", name=m.rule.name, partial=True,
                        why=f"started by rank {pid} before its bind was recorded")
                    log.info("rule %s: pid %d, started by rank %d, narrowed to its CPUs %s",
                             m.rule.name, kid, pid, format_cpulist(cpus))
                except TunerdError as err:
                    log.debug("pid %d (follower of rank %d): %s", kid, pid, err.message)

    def _partial(self, m: RuleMatch, ctx: JobContext, placed: Placement,
                 notes: list[str]) -> None:
        left_out = [n for n in notes if "not set" in n]
        if not left_out:
            return
        # the rule asked for more than the daemon may do. A capability the daemon lacks
        # (CAP_SYS_RESOURCE for a limit, in a container) is a fact of this node, not of
        # the process: one warning per rule and capability, counted, and `status` stays
        # 0. Anything else is an error until the process ends (status exits 1).
        other = []
        for note in left_out:
            cap = _CAP.search(note)
            if cap is None:
                other.append(note)
                continue
            self.errors.record(
                "autobind", f"rule {m.rule.name}: {note.split(':', 1)[0]} for the processes "
                f"it binds: the daemon lacks {cap.group(0)} (their CPUs are bound; last pid "
                f"{ctx.pid}); grant tunerd {cap.group(0)} or lower the rule's value",
                key=f"nocap:{m.rule.name}:{cap.group(0)}", level="warning")
        if not other:
            return
        self.partial += 1
        self.errors.record("autobind", f"rule {m.rule.name}, pid {ctx.pid}: bound to CPUs "
                           f"{format_cpulist(placed.cpus or frozenset())}, but "
                           + "; ".join(other), key=f"partial:{ctx.pid}")
        self.pidwatch.watch(ctx.pid, ctx.start_time, "rule-partial", self._partial_exited)

    def _reserve(self, m: RuleMatch, ctx: JobContext, group: str, placed: Placement,
                 seen: float, at_start: bool) -> RuleBound:
        exclusive = m.rule.exclusive or m.rule.placement == "exclusive"
        rb = RuleBound(pid=m.pid, start_time=ctx.start_time, rule=m.rule.name, group=group,
                       uid=m.uid, placement=placed, exec_seen=seen, at_start=at_start)
        self.bound[m.pid] = rb
        self.placer.reserve(Reservation(
            key=f"rule:{m.pid}", holder=f"pid {m.pid} (rule {m.rule.name})",
            gpus=placed.gpus, cpus=placed.cpus or frozenset(), exclusive=exclusive,
            pid=m.pid, group=group, job=ctx.job_key, uid=m.uid))
        return rb

    def _hold(self, m: RuleMatch, ctx: JobContext, group: str, placed: Placement,
              seen: float, at_start: bool) -> RuleBound | None:
        rb = self._reserve(m, ctx, group, placed, seen, at_start)
        if not self.pidwatch.watch(m.pid, ctx.start_time, "rule", self._exited):
            self._forget(m.pid)
            return None
        return rb

    def _failure(self, m: RuleMatch, pid: int, message: str) -> None:
        self._remember_failure(pid)
        self.failed += 1
        self.last_error = f"rule {m.rule.name}, pid {pid}: {message}"
        self.errors.record("autobind", self.last_error, key=pid)
        self._forget(pid)

    def _remember_failure(self, pid: int) -> None:
        start = procfs.read_start_time(pid, self.proc)
        if start is not None:
            if len(self._failed) > 10_000:
                self._failed.clear()
            self._failed[pid] = start
            # the failure's error resolves itself when the process ends
            self.pidwatch.watch(pid, start, "rule-failed", self._failed_exited)

    def _partial_exited(self, pid: int) -> None:
        self.errors.resolve("autobind", f"partial:{pid}")

    def _failed_exited(self, pid: int) -> None:
        self._failed.pop(pid, None)
        self.errors.resolve("autobind", pid)

    def _forget(self, pid: int) -> None:
        rb = self.bound.pop(pid, None)
        self._close(rb)
        self.placer.release(f"rule:{pid}")
        if rb is not None:
            self.pidwatch.unwatch(pid, "rule")

    def _exited(self, pid: int) -> None:
        rb = self.bound.pop(pid, None)
        self._close(rb)
        self.placer.release(f"rule:{pid}")
        if rb is None:
            return
        key = f"rule:{pid}:{rb.start_time}"
        if key in self.mover.moved:
            self.mover.restore(key)

    def restore_moves(self) -> None:
        """At start: put back what exclusive rule jobs moved if the job ended meanwhile."""
        for key in list(self.mover.moved):
            if not key.startswith("rule:"):
                continue
            _, pid_s, start_s = key.split(":")
            pid, start = int(pid_s), int(start_s)
            if not self.pidwatch.watch(pid, start, "rule-exclusive", self._restore_rule_moves):
                self.mover.restore(key)

    def _restore_rule_moves(self, pid: int) -> None:
        for key in list(self.mover.moved):
            if key.startswith(f"rule:{pid}:"):
                self.mover.restore(key)
