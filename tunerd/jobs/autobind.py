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
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import NoSuchProcess, TunerdError
from tunerd.base.jsontypes import JSONObject
from tunerd.base.logutil import acting_for
from tunerd.jobs.exclusive import ExclusiveMover
from tunerd.jobs.external import ExternalHolds
from tunerd.jobs.gate import (
    LeaseLimits,
    ReservationGate,
    rule_reach_refused,
    rule_reaches_beyond,
)
from tunerd.jobs.intake import JobContext, Role
from tunerd.jobs.journal import put_back
from tunerd.jobs.leases import user_name
from tunerd.jobs.ledger import Ledger, ProcKey, Slot
from tunerd.jobs.peer import Peer
from tunerd.jobs.pipeline import (
    BindOutcome,
    BindPipeline,
    BindRequest,
    BindSource,
    RuleTake,
    ThreadBind,
    Verdict,
    rule_group,
    rule_mems,
    rule_request,
    rule_take,
)
from tunerd.jobs.placement import Placement, mems_of
from tunerd.jobs.placer import ReservationKey, ReservationKind
from tunerd.jobs.rulememory import RuleMemory
from tunerd.jobs.scope import ProcessScope
from tunerd.watch.proc_connector import ExecWatcher
from tunerd.watch.rules import JobRule, RuleMatch, RuleSet

__all__ = ["AutoBinder"]

FOLLOWERS_MAX = 256  # processes a rank's bind looks at again (``_followers``)
FOLLOWERS_DEPTH = 4  # ... and how far down its tree
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
    at_reload: bool = False  # ... and that was at a reload, not at the daemon's start
    bound_at: float | None = None
    timing: dict[str, float | None] | None = None


Found = tuple[RuleMatch, float, "BindOutcome | None"]


# what the rules keep of a process, in the node's ledger (tunerd.jobs.ledger)
RULE: Slot[RuleBound] = Slot("rule")  # a rank a rule placed (held, bound or replayed)
TOLD: Slot[bool] = Slot("told rank")  # a rank another source told: never a follower
INFLIGHT: Slot[bool] = Slot("in flight")  # bound in the watcher's thread, not on the loop yet
PENDING: Slot[asyncio.Task[None]] = Slot("pending bind")  # its bind on the loop


def _cut(cmdline: str, width: int = 80) -> str:
    """A command line for one log line: an ellipsis where it is cut."""
    return cmdline if len(cmdline) <= width else cmdline[:width - 1] + "\u2026"


class AutoBinder:
    name = "autobind"

    def __init__(self, pipeline: BindPipeline, ledger: Ledger,
                 mover: ExclusiveMover, errors: ErrorLog, *,
                 default_nofile: Callable[[], int | None], use_connector: bool = True,
                 realtime: bool = True, gate: ReservationGate | None = None,
                 record_delay: float = 0.0,
                 proc_root: str = procfs.PROC, scope: ProcessScope | None = None,
                 external: ExternalHolds | None = None) -> None:
        self.pipeline = pipeline  # every bind: tunerd.jobs.pipeline
        self.placer = pipeline.placer
        self.jobs = pipeline.jobs
        self.intake = pipeline.intake
        self.scope = scope  # a test daemon's: rules bind only inside it (None: all)
        self.gate = gate or ReservationGate(LeaseLimits, default_nofile)
        self.ledger = ledger
        self.mover = mover
        self.errors = errors
        self._default_nofile = default_nofile
        self.use_connector = use_connector
        self.proc = proc_root
        self.record_delay = record_delay  # debug_apply_delay: seconds before a record
        self.rules = RuleSet([])
        self.watcher: ExecWatcher[Found] | None = None
        self.peer = Peer(pid=os.getpid(), uid=0, gid=0)  # the policy acts as root
        self.rescan_hooks: list[Callable[[], None]] = []  # run on every /proc rescan
        self._scanning = False  # True while binding processes that ran before the rules
        self._rule_sets = 0  # apply_rules calls: the first is the start, the others reloads
        # what the rules remember of processes they looked at and did not bind
        self.memory = RuleMemory(ledger, errors, proc_root)
        # ranks that pinned themselves: held in the ledger as outside owners of CPUs
        self.external = external or ExternalHolds(self.placer, ledger)
        self._memory_steps: set[asyncio.Future[None]] = set()  # their memory binds
        self._init_counters()
        self._init_watcher_thread(realtime)

    def _init_counters(self) -> None:
        """What ``status`` reports: counts, latencies, the steps of binds."""
        self.matched = 0
        self.failed = 0
        self.partial = 0  # bound, but a limit or memory step was left out
        self.last_error: str | None = None
        # exec event handled -> CPUs bound, as the daemon sees it (the last 1000)
        self.latencies_ms: deque[float] = deque(maxlen=1000)
        self.bound_first = 0  # matches whose CPUs were set in the watcher's thread
        self.left_to_loop: dict[str, int] = {}  # ... and why the others were not
        # ... and how long each step of that took (intake, place, bind; the handoff to
        # the loop after), the last 1000
        self.steps_ms: deque[dict[str, float]] = deque(maxlen=1000)
        # binds in the watcher's thread, the last 256: (pid, the kernel's exec stamp, the
        # watcher read it, the main thread's CPUs set), CLOCK_MONOTONIC ns (status
        # "timeline_ns", which bench/autobind.py cuts into steps)
        self.timeline: deque[tuple[int, int, int, int]] = deque(maxlen=256)

    def _init_watcher_thread(self, realtime: bool) -> None:
        """Bind first: a rule match is placed and its CPUs set in the exec watcher's
        thread; the loop records, watches and saves it after (False: all on the loop)."""
        self.bind_in_watcher = True
        # the watcher thread's nice value and, with ``realtime``, its SCHED_FIFO
        # priority while execs are sparse (it binds now: a wake-up that waits behind
        # other runnable tasks delays every bind); None: left as the daemon's
        self.watcher_nice: int | None = WATCHER_NICE
        self.watcher_rt: int | None = WATCHER_RT_PRIORITY if realtime else None
        self._match_ns = 0
        # stopping: no bind in the watcher's thread after ``stop`` took this lock, and the
        # ones whose CPUs are set already (``_inflight``) are recorded before we go
        self._fast_lock = threading.Lock()
        self._stopping = False

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self.external.restore()  # self-pinned ranks held again before anything is placed
        self.restore_moves()
        self._recover()

    def _recover(self) -> None:
        """At start, before any rescan: binds a killed daemon made but never recorded
        get their CPUs back, so that the rescan binds them afresh (with a record)."""
        for entry in self.pipeline.journal.open():
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
        self._rule_sets += 1
        if self.rules and self.watcher is None:
            self.watcher = ExecWatcher(self._matched, self.rescan, select=self.match,
                                       use_connector=self.use_connector, skip_exited=True,
                                       rt_priority=self.watcher_rt, nice=self.watcher_nice)
            self.watcher.start()
        elif not self.rules and self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        self.pipeline.watcher = self.watcher  # lowers its priority once a main thread is set
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
            self.pipeline.watcher = None
        # a process the watcher's thread bound is recorded (with its originals) before
        # the daemon goes: else it would stay bound with nothing to put it back by
        deadline = time.monotonic() + STOP_DRAIN_S
        while self.ledger.count(INFLIGHT) and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        pending = [t for _, t in self.ledger.each(PENDING)]
        if pending:
            await asyncio.wait(pending, timeout=max(deadline - time.monotonic(), 0.0))
        if self.ledger.count(INFLIGHT):
            log.warning("stopping: %d process(es) bound by a rule but not recorded: %s "
                        "(the next start puts their CPUs back: binds-in-flight)",
                        self.ledger.count(INFLIGHT),
                        [k.pid for k, _ in self.ledger.each(INFLIGHT)])
        for _, t in self.ledger.each(PENDING):
            t.cancel()
        self.pipeline.journal.close()

    def status(self) -> JSONObject:
        bound = [rb for _, rb in self.ledger.each(RULE)]
        at_start = [b for b in bound if b.at_start]
        return {"summary": self._summary(at_start),
                "rules": [r.name for r in self.rules.rules],
                "watcher": self.watcher.status() if self.watcher else {"mode": "off"},
                "latency_ms": self._latency(), "matched": self.matched, "failed": self.failed,
                "partial": self.partial, "last_error": self.last_error,
                "bound_in_watcher": self.bound_first, "left_to_loop": {**self.left_to_loop},
                "bound_at_start": len(at_start),
                "scope": None if self.scope is None else {**self.scope.status()},
                "timeline_ns": [[*t] for t in self.timeline],
                "left_alone": [*self.memory.left_alone_now()],
                "bound": [_bound_json(b) for b in bound]}

    def _summary(self, at_start: list[RuleBound]) -> str:
        n = len(self.rules.rules)
        names = ", ".join(r.name for r in self.rules.rules)
        mode = self.watcher.mode if self.watcher else "off"
        if self.watcher is not None and self.watcher.mode == "proc-scan" and self.watcher.reason:
            mode += f" (proc connector: {self.watcher.reason})"  # never silent about why
        summary = (f"automatic binding: {n} rule(s) ({names}), watcher {mode}, "
                   f"{self.ledger.count(RULE)} process(es) bound" if n
                   else "automatic binding: no rules")
        for when, group in (("at start", [b for b in at_start if not b.at_reload]),
                            ("at a reload", [b for b in at_start if b.at_reload])):
            if group:
                users = sorted({user_name(b.uid) for b in group})
                summary += (f" ({len(group)} already running {when}, of user(s) "
                            f"{', '.join(users)})")
        if self.failed:
            summary += f"; {self.failed} failed"
        if self.scope is not None:
            summary += (f"; scoped to pid {self.scope.root}'s subtree, "
                        f"{self.scope.out_of_scope} out of scope")
        return summary

    def _latency(self) -> JSONObject:
        """Exec to bound (ms): median, p99, max; the median of each step of a bind in
        the watcher's thread."""
        lat = sorted(self.latencies_ms)
        latency: JSONObject = {
            "n": len(lat), "median": round(statistics.median(lat), 3),
            "p99": round(lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], 3),
            "max": round(lat[-1], 3)} if lat else {"n": 0}
        steps = list(self.steps_ms)
        if steps:
            latency["bind_first_steps_median"] = {
                k: round(statistics.median(s[k] for s in steps if k in s), 3)
                for k in steps[-1]}
        return latency

    def left_alone_now(self) -> list[JSONObject]:
        """Processes a rule matched and left alone that still run, with why."""
        return self.memory.left_alone_now()

    # -- what the GPU-use service asks (tunerd.jobs.gpuuse.RuleBinds) ------------
    def set_own_cpus(self, pid: int) -> bool:
        """Whether a rule left ``pid`` alone because it set its own CPUs (numactl,
        taskset): what it starts keeps them too (tunerd.jobs.gpuuse)."""
        return self.memory.set_own_cpus(pid)

    def rule_set(self) -> RuleSet:
        """The rules in force."""
        return self.rules

    def rule_bound(self, pid: int) -> tuple[int, str] | None:
        """(start time, rule name) of ``pid`` where a rule bound it."""
        rb = self.ledger.get(pid, RULE)
        return None if rb is None else (rb.start_time, rb.rule)

    def rule_bound_pids(self) -> list[int]:
        return [k.pid for k, _ in self.ledger.each(RULE)]

    def rule_name(self, pid: int) -> str | None:
        """The name of the rule that bound ``pid`` (None: none did)."""
        rb = self.ledger.get(pid, RULE)
        return None if rb is None else rb.rule

    def looked_at(self) -> bool:
        """Whether the rules bound or left alone a process (counts: nothing read)."""
        return bool(self.ledger.count(RULE) or self.memory.anyone_left_alone())

    def rules_peer(self) -> Peer:
        """Who the rules act as (root)."""
        return self.peer

    def place_rank(self, rule: JobRule, ctx: JobContext) -> None:
        """Bind ``ctx`` (a rank another source told: tunerd.jobs.gpuuse) under ``rule``:
        the same gate, placer, ledger and registry as every rule bind."""
        m = RuleMatch(rule=rule, pid=ctx.pid, cmdline=ctx.cmdline, uid=ctx.uid, env=ctx.env)
        # a parent rank's bind made meanwhile leaves it be (never a rank's follower)
        self.ledger.put(ProcKey(ctx.pid, ctx.start_time), TOLD, True)
        self.on_match(m, time.monotonic(), ctx)

    # -- events ----------------------------------------------------------------
    def match(self, pid: int) -> Found | None:
        """For every exec on the host, in the watcher's thread: keep the no-match path
        short (a bounded read of the command line, compiled globs). A match carries the
        time it was seen, from which exec-to-bound latency is counted, and is bound
        right here (``_bind_now``: the pipeline's thread shell, recorded on the loop)."""
        self._match_ns = time.perf_counter_ns()  # this thread's: the match step's start
        self.intake.exec_seen(pid)  # what a quick look kept of it as a parent is stale
        fast_path = self.bind_in_watcher
        # binding first: the uid is read after the CPUs are set where the gate does not
        # need it before (a rule that reserves nothing for others)
        m = self.rules.match(pid, uid_for=rule_reaches_beyond if fast_path else None)
        if m is None and self.memory.wrapping():
            m = self.memory.wrapped_match(pid)
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

    def _uid_known(self, fast: BindOutcome, uid: int | None) -> None:
        """The uid read after a bind in the watcher's thread, where the look and the
        record made before it left it out."""
        if fast.context is not None:
            fast.context = dataclasses.replace(fast.context, uid=uid)
        if fast.thread is not None:
            fast.thread.target.uid = uid if uid is not None else -1
            rb = self.ledger.get(fast.pid, RULE)
            if rb is not None and rb.uid is None:
                rb.uid = uid

    def _matched(self, found: Found) -> None:
        m, seen, fast = found
        self.ledger.pop(m.pid, INFLIGHT)
        if fast is not None and fast.thread is not None:
            assert fast.context is not None
            self.ledger.put(ProcKey(m.pid, fast.context.start_time), PENDING,
                            asyncio.ensure_future(self._finish(m, seen, fast)))
            return
        self.on_match(m, seen, fast.context if fast is not None else None)

    def on_exec(self, pid: int) -> None:
        """A process to look at on the loop (a /proc rescan)."""
        m = self.rules.match(pid)
        if m is None and self.memory.wrapping():
            m = self.memory.wrapped_match(pid)
        if m is None:
            return
        if self.scope is not None and not self.scope.admits(pid):
            self.memory.settle_outside(pid)  # outside for good: not looked at again until it execs
            return
        self.on_match(m)

    def on_match(self, m: RuleMatch, seen: float | None = None,
                 ctx: JobContext | None = None) -> None:
        """A process a rule matched: bind it (on the loop). ``ctx``: the intake's look
        taken in the watcher's thread already."""
        if self._stopping or self.ledger.has(m.pid, PENDING):
            return
        key = ProcKey(m.pid, ctx.start_time) if ctx is not None \
            else self.ledger.key(m.pid) or self.ledger.key_of(m.pid)
        if key is None:
            return  # gone already
        task = asyncio.ensure_future(self._bind(m, seen if seen is not None
                                                else time.monotonic(), self._scanning, ctx))
        self.ledger.put(key, PENDING, task)

    def rescan(self) -> None:
        for hook in self.rescan_hooks:
            hook()
        me = os.getpid()
        for pid in procfs.list_pids(self.proc):
            if pid != me and not self.ledger.has(pid, RULE) \
                    and not self.memory.is_settled(pid):
                self.on_exec(pid)

    def preview(self, m: RuleMatch) -> Placement:
        """Where ``m`` would be bound, computed as a bind would, changing nothing
        (``tunerctl plan --policy-dir``). Raises what placing raises."""
        ctx = self.intake.describe(m.pid, env=m.env, argv=m.cmdline.split(" "))
        return self.placer.place(rule_request(m, ctx, rule_group(m, ctx)))

    # -- binding ---------------------------------------------------------------
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
        if self.memory.failed_before(pid, ctx.start_time):
            return None
        prev = self.ledger.get(pid, RULE)
        if prev is not None and prev.start_time == ctx.start_time and prev.rule == m.rule.name:
            return None  # the same process exec'd again (sh -> python): keep its place
        rec = self.jobs.record(pid)
        if ctx.self_affined and rec is not None and rec.start_time == ctx.start_time \
                and rec.cpus:
            # the mask tunerd set itself (a daemon restarted mid-job): known from its
            # record, never taken for the rank's own choice; ``_adopt`` holds it again
            ctx = replace(ctx, self_affined=False,
                          why=ctx.why.split("; its CPU mask ")[0] + "; bound by tunerd")
        take = rule_take(m.rule, ctx)
        if take is RuleTake.LEAVE:
            self.memory.wrap(m, ctx)
            self.memory.leave_alone(ctx)
            self.memory.settle(ctx)
            if self.external.hold(ctx, self.memory.placed_by(ctx)) is not None:
                self._memory_steps.add(asyncio.ensure_future(self._self_pinned_memory(m, ctx)))
            return None
        if take is RuleTake.SKIP:
            return None
        log.debug("pid %d (rule %s): %s: %s", pid, m.rule.name, ctx.role, ctx.why)
        return ctx

    async def _self_pinned_memory(self, m: RuleMatch, ctx: JobContext) -> None:
        """A self-pinned rank's memory bound to its CPUs' NUMA node(s), as the rule's
        ``self_pinned_memory`` says (default "bind": numactl --physcpubind, taskset and
        torchrun --numa-binding set CPUs only). Its CPUs are never touched."""
        task = asyncio.current_task()
        try:
            mems, why = self.external.memory_to_bind(ctx, m.rule.self_pinned_memory)
            rec = self.jobs.record(ctx.pid)
            if mems is None or (rec is not None and rec.start_time == ctx.start_time):
                log.debug("pid %d: memory left as it is: %s", ctx.pid, why)
                return
            out = await self.pipeline.bind(BindRequest(
                ctx.pid, self.peer, BindSource.RULE, placement=Placement(cpus=None, mems=mems),
                match=m, context=ctx, why=ctx.why))
            log.info("rule %s: self-pinned pid %d: memory bound to node(s) %s (%s)",
                     m.rule.name, ctx.pid, format_cpulist(mems), out.verdict.value)
        except TunerdError as err:
            log.info("pid %d: its memory not bound: %s", ctx.pid, err.message)
        finally:
            self._memory_steps.discard(task)

    async def _after_parent(self, m: RuleMatch, ctx: JobContext) -> JobContext:
        """A descendant whose rank is being bound right now (a /proc rescan finds both):
        wait for that, then look again, so that it is narrowed into the rank's CPUs."""
        parent = self.ledger.get(ctx.ppid, PENDING)
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
            self.memory.settle(ctx)
        if cpus is None or (mask is not None and mask <= cpus):
            return
        self.matched += 1
        await self.pipeline.bind(BindRequest(
            ctx.pid, self.peer, BindSource.WORKER, placement=Placement(
                cpus=cpus, mems=None, explanation=f"worker of rank {ctx.parent_rank}: "
                                                  "kept inside the rank's CPUs"),
            match=m, context=ctx, why=ctx.why))
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
        if not self.ledger.has(ctx.pid, RULE):
            cpus = job.cpu_set()
            placed = Placement(cpus=cpus, mems=mems_of(self.placer.topo, cpus),
                               gpus=job.gpus, explanation=job.explanation or "")
            self.pipeline.hold_again(m, ctx, group, placed)
            self._track(m, ctx, group, placed, seen, at_start)
            return True
        return False

    async def _bind(self, m: RuleMatch, seen: float, at_start: bool,
                    known: JobContext | None = None) -> None:
        """A match on the loop: look, then the pipeline (gate, place, hold, bind)."""
        pid = m.pid
        acting_for(m.uid)  # its own task: what it logs counts against the process's owner
        try:
            ctx = self._look(m, known)
            if ctx is None:
                return
            if rule_take(m.rule, ctx) is RuleTake.NARROW:
                await self._narrow(m, await self._after_parent(m, ctx))
                return
            if self._adopt(m, ctx, rule_group(m, ctx), seen, at_start):
                return
            self.matched += 1
            t_bind = time.monotonic()
            out = await self.pipeline.bind(BindRequest(
                pid, self.peer, BindSource.RULE, nofile=self._nofile(m), match=m,
                context=ctx))
            await self._bound(m, ctx, out, seen, at_start, t_bind)
        except NoSuchProcess:
            self._forget(pid)  # exited before we got to it: the normal case for short jobs
        except TunerdError as err:
            self._failure(m, pid, err.message)
        except Exception as err:
            log.exception("automatic binding of pid %d failed", pid)
            self._failure(m, pid, repr(err))
        finally:
            if self.ledger.get(pid, PENDING) is asyncio.current_task():
                self.ledger.pop(pid, PENDING)

    async def _bound(self, m: RuleMatch, ctx: JobContext, out: BindOutcome, seen: float,
                     at_start: bool, t_bind: float) -> None:
        """What the loop's bind came to: refused, placed only (a replayed node), bound."""
        placed = out.placement
        if out.verdict is Verdict.REFUSED or placed is None:
            log.debug("pid %d: %s; not bound", m.pid, out.reason)
            return
        rb = self._track(m, ctx, rule_group(m, ctx), placed, seen, at_start)
        if rb is None:
            return
        if out.verdict is Verdict.LEFT_ALONE:
            log.info("rule %s: pid %d placed on the replayed topology (GPUs %s, CPUs %s); "
                     "%s", m.rule.name, m.pid, placed.gpus,
                     format_cpulist(placed.cpus or frozenset()), " ".join(placed.notes))
            return
        rb.bound_at = time.monotonic()
        self.latencies_ms.append((rb.bound_at - seen) * 1000)
        rb.timing = {"queue_place_ms": round((t_bind - seen) * 1000, 3)}
        await self._after_cpus(m, ctx, rb, placed, out, at_start)

    # -- bind first: in the exec watcher's thread ------------------------------
    # -- bind first: in the exec watcher's thread ------------------------------
    def _bind_now(self, m: RuleMatch) -> BindOutcome | None:
        """The pipeline's thread shell for a just-exec'd match, before the loop hears of
        it (the loop records and saves it after: ``_finish``). Anything but the plain
        case is left to the loop's bind, with the intake's look where it was taken."""
        with self._fast_lock:
            if self._stopping:
                return self._to_loop("stopping", None)
            pid = m.pid
            if (self.ledger.has(pid, PENDING) or self.ledger.has(pid, RULE)
                    or self.memory.failed_before(pid)
                    or self.jobs.record(pid) is not None or self.jobs.dry_run
                    or rule_reach_refused(m.rule, m.uid) is not None):
                return self._to_loop("seen before, or refused", None)
            ev = self.watcher.event_ns if self.watcher is not None else None
            out = self.pipeline.bind_in_thread(BindRequest(
                pid, self.peer, BindSource.RULE, match=m,
                stamps=(self._match_ns, *ev) if ev is not None else (self._match_ns,)))
            tb, ns = out.thread, out.ns
            if "set" in ns and "stamped" in ns:  # also for a process that exits meanwhile
                self.timeline.append((pid, ns["stamped"], ns["read"], ns["set"]))
            if tb is None or out.context is None or out.placement is None:
                if out.context is not None and out.context.role == Role.WRAPPER:
                    self.memory.wrap(m, out.context)  # before what it starts execs
                return self._to_loop(out.reason, out.context)
            self._track(m, out.context, tb.group, out.placement, 0.0, False, watch=False)
            # until the loop has it (``_matched``)
            self.ledger.put(ProcKey(pid, out.context.start_time), INFLIGHT, True)
            return out

    def _to_loop(self, why: str, ctx: JobContext | None) -> BindOutcome | None:
        """Not bound in the watcher's thread: counted by why, the look passed on."""
        self.left_to_loop[why] = self.left_to_loop.get(why, 0) + 1
        return None if ctx is None else BindOutcome(Verdict.LEFT_ALONE, ctx.pid,
                                                    reason=why, context=ctx)

    async def _finish(self, m: RuleMatch, seen: float, fast: BindOutcome) -> None:
        """On the loop, after the watcher's thread set the CPUs: watch the process,
        record the binding with the originals read before (the pipeline's ``bind``),
        then the rest. Exited meanwhile: the reservation goes, nothing is recorded; the
        rest failed: the CPUs are put back as they were."""
        pid, ctx, tb = m.pid, fast.context, fast.thread
        assert tb is not None and ctx is not None and fast.placement is not None
        acting_for(m.uid)
        rb = self.ledger.get(pid, RULE)
        self.bound_first += 1
        self.latencies_ms.append((tb.bound_at - seen) * 1000)
        steps = _steps(tb)
        self.steps_ms.append(steps)
        try:
            if self.record_delay:  # crash tests: a window between the bind and its record
                await asyncio.sleep(self.record_delay)
            self.matched += 1
            if rb is None or not self.ledger.watch(pid, ctx.start_time, "rule", self._exited):
                self._forget(pid)
                return
            rb.exec_seen, rb.bound_at = seen, tb.bound_at
            rb.timing = {"bind_first_ms": round((tb.bound_at - seen) * 1000, 3), **steps}
            out = await self.pipeline.commit(self._commit_request(m, ctx, fast.placement), tb,
                                             fast.placement,
                                             rule_mems(self.placer, m, fast.placement))
            await self._after_cpus(m, ctx, rb, fast.placement, out, False)
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
            tb.target.close()
            if self.ledger.get(pid, PENDING) is asyncio.current_task():
                self.ledger.pop(pid, PENDING)
            self.pipeline.recorded(pid)

    def _commit_request(self, m: RuleMatch, ctx: JobContext, placed: Placement) -> BindRequest:
        """What the loop's commit of a bind made in the watcher's thread records."""
        return BindRequest(m.pid, self.peer, BindSource.RULE, placement=placed,
                           nofile=self._nofile(m), match=m, context=ctx, why=ctx.why)

    def _nofile(self, m: RuleMatch) -> int | None:
        return m.rule.nofile if m.rule.nofile is not None else self._default_nofile()

    def _put_back(self, fast: BindOutcome) -> None:
        """Undo a fast bind whose recording failed: every thread's mask as it was."""
        tb = fast.thread
        if tb is None or self.jobs.is_bound(fast.pid):
            return
        try:
            self.pipeline.actuator.restore(tb.target, tb.originals)
        except TunerdError as err:
            log.warning("pid %d: CPUs not put back after a failed bind: %s", fast.pid,
                        err.message)

    async def _after_cpus(self, m: RuleMatch, ctx: JobContext, rb: RuleBound,
                          placed: Placement, out: BindOutcome, at_start: bool) -> None:
        """The CPUs and memory nodes are bound (and recorded, in one pass): the log
        line, its followers, an exclusive rule's moves."""
        pid = ctx.pid
        rb.timing = {**(rb.timing or {}), "save_ms": round(out.save_ms, 3),
                     "apply_ms": round(out.result.elapsed_ms, 3) if out.result else None,
                     "elapsed_ms": round(out.elapsed_ms, 3)}
        assert rb.bound_at is not None
        notes = list(dict.fromkeys(out.notes))
        log.info("rule %s: bound pid %d (%s, user %s%s) to CPUs %s near GPU(s) %s in %.1f ms"
                 " (%s)", m.rule.name, pid, _cut(m.cmdline), user_name(m.uid),
                 "" if not at_start else ", already running at a reload" if rb.at_reload
                 else ", already running at start",
                 format_cpulist(placed.cpus or frozenset()),
                 ",".join(map(str, placed.gpus)) or "-", (rb.bound_at - rb.exec_seen) * 1000,
                 ctx.why)
        self._partial(m, ctx, placed, notes)
        await self._followers(m, pid, placed.cpus or frozenset(), rb.group)
        if m.rule.exclusive and m.rule.exclusive_scope:
            self.mover.move_off(_move_key(pid, ctx.start_time), m.rule.exclusive_scope,
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
                if self.ledger.has(kid, TOLD):
                    continue  # a rank of its own (Lightning's rank 1): not a follower
                if depth + 1 < FOLLOWERS_DEPTH:
                    todo.append((kid, depth + 1))
                held, rec = self.ledger.get(kid, RULE), self.jobs.record(kid)
                if held is not None and held.group == group:  # taken for a rank: it is not
                    self.ledger.pop(kid, RULE)
                    self.pipeline.forget_rule_hold(kid)
                elif held is not None or (rec is not None and rec.origin != "worker"):
                    continue  # another job's rank, or bound by someone else
                try:
                    mask = frozenset(os.sched_getaffinity(kid))
                except OSError:
                    continue
                if mask <= cpus:
                    continue
                try:
                    await self.pipeline.bind(BindRequest(
                        kid, self.peer, BindSource.WORKER, placement=Placement(
                            cpus=cpus, mems=None, explanation=f"follower of rank {pid}: "
                                                              "kept inside the rank's CPUs"),
                        name=m.rule.name,
                        why=f"started by rank {pid} before its bind was recorded"))
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
                f"{ctx.pid}); grant tunerd {cap.group(0)} or {_lower_what(m, cap.group(0))}",
                key=f"nocap:{m.rule.name}:{cap.group(0)}", level="warning")
        if not other:
            return
        self.partial += 1
        self.errors.record("autobind", f"rule {m.rule.name}, pid {ctx.pid}: bound to CPUs "
                           f"{format_cpulist(placed.cpus or frozenset())}, but "
                           + "; ".join(other), key=f"partial:{ctx.pid}")
        self.ledger.watch(ctx.pid, ctx.start_time, "rule-partial", self._partial_exited)

    def _track(self, m: RuleMatch, ctx: JobContext, group: str, placed: Placement,
               seen: float, at_start: bool, watch: bool = True) -> RuleBound | None:
        """A rank the pipeline holds: kept for status and exits (``watch``: its exit
        now; a bind in the watcher's thread is watched once the loop has it)."""
        rb = RuleBound(pid=m.pid, start_time=ctx.start_time, rule=m.rule.name, group=group,
                       uid=m.uid, placement=placed, exec_seen=seen, at_start=at_start,
                       at_reload=at_start and self._rule_sets > 1)
        self.ledger.put(ProcKey(m.pid, ctx.start_time), RULE, rb)
        if watch and not self.ledger.watch(m.pid, ctx.start_time, "rule", self._exited):
            self._forget(m.pid)
            return None
        return rb

    def _failure(self, m: RuleMatch, pid: int, message: str) -> None:
        self.memory.remember_failure(pid)
        self.failed += 1
        self.last_error = f"rule {m.rule.name}, pid {pid}: {message}"
        self.errors.record("autobind", self.last_error, key=pid)
        self._forget(pid)

    def _partial_exited(self, pid: int) -> None:
        self.errors.resolve("autobind", f"partial:{pid}")

    def _forget(self, pid: int) -> None:
        rb = self.ledger.pop(pid, RULE)
        self.pipeline.forget_rule_hold(pid)
        if rb is not None:
            self.ledger.unwatch(pid, "rule")

    def _exited(self, pid: int) -> None:
        rb = self.ledger.pop(pid, RULE)
        self.pipeline.forget_rule_hold(pid)
        if rb is None:
            return
        key = _move_key(pid, rb.start_time)
        if key in self.mover.moved:
            self.mover.restore(key)

    def restore_moves(self) -> None:
        """At start: put back what exclusive rule jobs moved if the job ended meanwhile."""
        for key in list(self.mover.moved):
            k = ReservationKey.parse(key)
            if k is None or k.kind is not ReservationKind.RULE:
                continue
            pid_s, _, start_s = k.ident.partition(":")
            pid, start = int(pid_s), int(start_s)
            if not self.ledger.watch(pid, start, "rule-exclusive", self._restore_rule_moves):
                self.mover.restore(key)

    def _restore_rule_moves(self, pid: int) -> None:
        for key in list(self.mover.moved):
            k = ReservationKey.parse(key)
            if k is not None and k.kind is ReservationKind.RULE \
                    and k.ident.partition(":")[0] == str(pid):
                self.mover.restore(key)


def _bound_json(b: RuleBound) -> JSONObject:
    """A rank a rule holds, as ``status`` lists it."""
    return {"pid": b.pid, "rule": b.rule, "user": user_name(b.uid),
            "cpus": format_cpulist(b.placement.cpus or frozenset()),
            "gpus": [*b.placement.gpus], "applied": b.placement.applicable,
            "notes": [*b.placement.notes],
            "timing": None if b.timing is None else {**b.timing},
            "at_start": b.at_start,
            "latency_ms": None if b.bound_at is None else
            round((b.bound_at - b.exec_seen) * 1000, 3)}


def _move_key(pid: int, start_time: int) -> str:
    """A rule's exclusive move, in the mover's state: "rule:PID:START" (text form)."""
    return str(ReservationKey(ReservationKind.RULE, f"{pid}:{start_time}"))


def _steps(tb: ThreadBind) -> dict[str, float]:
    """How long each step of a bind in the watcher's thread took (ms), and the handoff
    to the loop after."""
    ns = tb.ns
    steps: dict[str, float] = {
        f"{k}_ms": round((ns[k] - ns[prev]) / 1e6, 3)
        for prev, k in zip(("t0", "intake", "place"), ("intake", "place", "bound"),
                           strict=True) if k in ns and prev in ns}
    if "m0" in ns and "t0" in ns:  # the rule match, before the exec counts as seen
        steps["match_ms"] = round((ns["t0"] - ns["m0"]) / 1e6, 3)
    steps["handoff_ms"] = round((time.monotonic() - tb.bound_at) * 1000, 3)
    return steps


def _lower_what(m: RuleMatch, cap: str) -> str:
    """Where the value a missing capability refused comes from: the rule's own `nofile`,
    or (a rule that sets none) the policy's [limits] nofile, which applies to it."""
    if cap != "CAP_SYS_RESOURCE":
        return "lower the rule's value"
    if m.rule.nofile is None:
        return "lower [limits] nofile (the rule sets no nofile: the policy's applies)"
    return "lower the rule's nofile"
