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

The watcher only runs while the policy has rules: with none, the daemon
does not even subscribe to exec events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tunerd import procfs
from tunerd.allocation import read_allocation, scheduler_gpus
from tunerd.cpulist import format_cpulist
from tunerd.daemon.errorlog import ErrorLog
from tunerd.daemon.exclusive import ExclusiveMover
from tunerd.daemon.gate import LeaseLimits, ReservationGate, rule_reach_refused
from tunerd.daemon.jobs import JobRegistry
from tunerd.daemon.leases import user_name
from tunerd.daemon.pidwatch import PidWatch
from tunerd.daemon.placer import Placer, PlaceRequest, Reservation
from tunerd.daemon.router import Peer
from tunerd.errors import NoSuchProcess, TunerdError
from tunerd.logutil import acting_for
from tunerd.placement import Placement, mems_of
from tunerd.text import bounded_int
from tunerd.topology.visible import gpus_from_env
from tunerd.watch.proc_connector import ExecWatcher
from tunerd.watch.rules import RuleMatch, RuleSet

__all__ = ["AutoBinder"]

log = logging.getLogger("tunerd.autobind")


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


def _cut(cmdline: str, width: int = 80) -> str:
    """A command line for one log line: an ellipsis where it is cut."""
    return cmdline if len(cmdline) <= width else cmdline[:width - 1] + "\u2026"


def _int_env(env: dict[str, str], name: str) -> int | None:
    return bounded_int(env.get(name), 0, 1 << 20)  # 5,000 digits: ignored, no ValueError


class AutoBinder:
    name = "autobind"

    def __init__(self, placer: Placer, jobs: JobRegistry, pidwatch: PidWatch,
                 mover: ExclusiveMover, errors: ErrorLog, *,
                 default_nofile: Callable[[], int | None], use_connector: bool = True,
                 gate: ReservationGate | None = None,
                 proc_root: str = procfs.PROC) -> None:
        self.placer = placer
        self.gate = gate or ReservationGate(LeaseLimits, default_nofile)
        self.jobs = jobs
        self.pidwatch = pidwatch
        self.mover = mover
        self.errors = errors
        self._default_nofile = default_nofile
        self.use_connector = use_connector
        self.proc = proc_root
        self.rules = RuleSet([])
        self.watcher: ExecWatcher[tuple[RuleMatch, float]] | None = None
        self.bound: dict[int, RuleBound] = {}
        self.peer = Peer(pid=os.getpid(), uid=0, gid=0)  # the policy acts as root
        self.matched = 0
        self.failed = 0
        self.partial = 0  # bound, but a limit or memory step was left out
        self.last_error: str | None = None
        self._pending: dict[int, asyncio.Task[None]] = {}
        self._scanning = False  # True while binding processes that ran before the rules
        # pid -> start time of processes whose binding failed: not retried (a /proc
        # scan or an overrun rescan would otherwise repeat the same error forever)
        self._failed: dict[int, int] = {}
        # exec event handled -> CPUs bound, as the daemon sees it (the last 1000)
        self.latencies_ms: deque[float] = deque(maxlen=1000)

    # -- lifecycle -------------------------------------------------------------
    async def start(self) -> None:
        self.restore_moves()

    async def apply_rules(self, rules: RuleSet) -> None:
        """Put a new rule set in force (start and every reload)."""
        self.rules = rules
        if self.rules and self.watcher is None:
            self.watcher = ExecWatcher(self._matched, self.rescan, select=self.match,
                                       use_connector=self.use_connector)
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
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        for t in self._pending.values():
            t.cancel()

    def status(self) -> dict[str, Any]:
        w = self.watcher.status() if self.watcher else {"mode": "off"}
        n = len(self.rules.rules)
        at_start = [b for b in self.bound.values() if b.at_start]
        summary = (f"automatic binding: {n} rule(s), watcher {w['mode']}, "
                   f"{len(self.bound)} process(es) bound" if n else "automatic binding: no rules")
        if at_start:
            users = sorted({user_name(b.uid) for b in at_start})
            summary += (f" ({len(at_start)} already running at start, of user(s) "
                        f"{', '.join(users)})")
        if self.failed:
            summary += f"; {self.failed} failed"
        lat = sorted(self.latencies_ms)
        latency = {"n": len(lat), "median": round(statistics.median(lat), 3),
                   "p99": round(lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], 3),
                   "max": round(lat[-1], 3)} if lat else {"n": 0}
        return {"summary": summary, "rules": [r.name for r in self.rules.rules], "watcher": w,
                "latency_ms": latency, "matched": self.matched, "failed": self.failed,
                "partial": self.partial, "last_error": self.last_error,
                "bound_at_start": len(at_start),
                "bound": [{"pid": b.pid, "rule": b.rule,
                           "cpus": format_cpulist(b.placement.cpus or frozenset()),
                           "gpus": list(b.placement.gpus), "applied": b.placement.applicable,
                           "notes": list(b.placement.notes), "timing": b.timing,
                           "at_start": b.at_start,
                           "latency_ms": None if b.bound_at is None else
                           round((b.bound_at - b.exec_seen) * 1000, 3)}
                          for b in self.bound.values()]}

    # -- events ----------------------------------------------------------------
    def match(self, pid: int) -> tuple[RuleMatch, float] | None:
        """For every exec on the host, in the watcher's thread: keep the no-match path
        short (a bounded read of the command line, compiled globs). A match carries the
        time it was seen, from which exec-to-bound latency is counted."""
        m = self.rules.match(pid)
        return None if m is None else (m, time.monotonic())

    def _matched(self, found: tuple[RuleMatch, float]) -> None:
        self.on_match(*found)

    def on_exec(self, pid: int) -> None:
        """A process to look at on the loop (a /proc rescan)."""
        m = self.rules.match(pid)
        if m is not None:
            self.on_match(m)

    def on_match(self, m: RuleMatch, seen: float | None = None) -> None:
        """A process a rule matched: bind it (on the loop)."""
        if m.pid in self._pending:
            return
        task = asyncio.ensure_future(self._bind(m, seen if seen is not None
                                                else time.monotonic(), self._scanning))
        self._pending[m.pid] = task

    def rescan(self) -> None:
        me = os.getpid()
        for pid in procfs.list_pids(self.proc):
            if pid != me and pid not in self.bound:
                self.on_exec(pid)

    def preview(self, m: RuleMatch) -> Placement:
        """Where ``m`` would be bound, computed as a bind would, changing nothing
        (``tunerctl plan --policy-dir``). Raises what placing raises."""
        ppid = procfs.Process(m.pid, self.proc).stat().ppid
        return self._place(m, self._group(m, ppid))

    # -- binding ---------------------------------------------------------------
    def _group(self, m: RuleMatch, ppid: int) -> str:
        run_id = m.env.get("TORCHELASTIC_RUN_ID") or m.env.get("SLURM_JOB_ID")
        if run_id:
            return f"{m.rule.name}/{run_id}"
        return f"{m.rule.name}/ppid {ppid}"

    def _workers(self, m: RuleMatch) -> int:
        """DataLoader workers per rank: the job's own setting first, then the rule's."""
        env_n = _int_env(m.env, "TUNERD_NUM_WORKERS")
        if env_n is not None:
            return env_n
        if m.rule.workers is not None:
            return m.rule.workers
        n = m.rule.torch.num_workers
        return n if n is not None else 0

    def _place(self, m: RuleMatch, group: str) -> Placement:
        rule = m.rule
        topo = self.placer.topo
        alloc = read_allocation(m.pid, m.env, topo, online=self.placer.host.cpus)
        enclosing = self.placer.enclosing_cpus(m.pid)
        if enclosing is not None:  # under a `tunerctl run` lease: stay inside it
            cpus = enclosing if alloc.cpus is None else (alloc.cpus & enclosing or alloc.cpus)
            alloc = dataclasses.replace(alloc, cpus=cpus,
                                        scheduler=alloc.scheduler or "tunerctl run")
        gpu_ids = gpus_from_env(topo, m.env, allowed=scheduler_gpus(m.pid, topo, m.env))
        if rule.cpus is not None:
            return self.placer.place(PlaceRequest(
                cpus=rule.cpus, gpu_ids=gpu_ids or None, allocation=alloc,
                what=f"rule {rule.name}"))
        exclusive = rule.exclusive or rule.placement == "exclusive"
        req = PlaceRequest(
            gpus=int(rule.gpus) if not gpu_ids and rule.gpus else 0,
            gpu_ids=gpu_ids or None, mode=rule.placement, exclusive=exclusive,
            allocation=alloc, workers=self._workers(m), rank=_int_env(m.env, "LOCAL_RANK"),
            ranks=_int_env(m.env, "LOCAL_WORLD_SIZE"), group=group,
            ignore_busy_gpus=bool(gpu_ids), what=f"rule {rule.name}")
        return self.placer.place(req)

    async def _bind(self, m: RuleMatch, seen: float, at_start: bool) -> None:
        pid = m.pid
        acting_for(m.uid)  # its own task: what it logs counts against the process's owner
        try:
            try:  # one read of /proc/PID/stat: the start time, and the parent for _group
                stat = procfs.Process(pid, self.proc).stat()
            except TunerdError:
                self.matched += 1
                return  # gone (or unreadable) before we got to it
            start = stat.start_time
            # a process seen before (a rescan, or another exec of it) is no new match
            if self._failed.get(pid) == start:
                return
            prev = self.bound.get(pid)
            if prev is not None and prev.start_time == start and prev.rule == m.rule.name:
                return  # the same process exec'd again (sh -> python): keep its place
            job = self.jobs.record(pid)
            if job is not None and job.get("start_time") not in (None, start):
                job = None
            if job is not None and job.get("origin") != "rule":
                log.debug("pid %d matches rule %s but is bound by %s; left alone", pid,
                          m.rule.name, job.get("origin"))
                return
            self.matched += 1
            refused = rule_reach_refused(m.rule, m.uid)  # the one gate (tunerd.daemon.gate)
            if refused is not None:
                log.debug("pid %d: %s; not bound", pid, refused)
                return
            group = self._group(m, stat.ppid)
            exclusive = m.rule.exclusive or m.rule.placement == "exclusive"
            if job is not None and prev is None:  # bound before a daemon restart: adopt
                from tunerd.cpulist import parse_cpulist

                cpus = parse_cpulist(str(job.get("cpus") or ""))
                placed = Placement(cpus=cpus, mems=mems_of(self.placer.topo, cpus),
                                   gpus=tuple(job.get("gpus") or ()),
                                   explanation=str(job.get("explanation") or ""))
                self._hold(m, start, group, placed, seen, at_start, exclusive)
                return
            placed = self._place(m, group)
            # reserve before the first await so concurrent ranks see these CPUs taken
            rb = self._hold(m, start, group, placed, seen, at_start, exclusive)
            if rb is None:
                return
            if not placed.applicable:
                log.info("rule %s: pid %d placed on the replayed topology (GPUs %s, CPUs %s); "
                         "%s", m.rule.name, pid, placed.gpus,
                         format_cpulist(placed.cpus or frozenset()), " ".join(placed.notes))
                self.jobs.note_unapplied(pid, start, placed, origin="rule", name=m.rule.name,
                                         cmdline=m.cmdline)
                return
            t_bind = time.monotonic()
            # CPUs first: thread affinity is quick, while memory nodes need a cpuset
            # cgroup (and page migration) -- the process should not run on the
            # wrong CPUs while that is set up
            nofile = m.rule.nofile if m.rule.nofile is not None else self._default_nofile()
            nofile = self.gate.cap_nofile(m.uid, pid, nofile, [])
            res = await self.jobs.bind(pid, peer=self.peer,
                                       placement=Placement(
                                           cpus=placed.cpus, mems=None, gpus=placed.gpus,
                                           explanation=placed.explanation),
                                       nofile=nofile, origin="rule", name=m.rule.name,
                                       cmdline=m.cmdline, partial=True,
                                       persist_after=True)  # bind first, persist after
            rb.bound_at = time.monotonic()
            self.latencies_ms.append((rb.bound_at - seen) * 1000)
            rb.timing = {"queue_place_ms": round((t_bind - seen) * 1000, 3),
                         **{k: res.get(k) for k in ("save_ms", "apply_ms", "elapsed_ms")}}
            notes = list(res.get("notes") or [])
            mems = self.placer.bindable_mems(placed.mems)
            if mems:
                res2 = await self.jobs.bind(pid, peer=self.peer,
                                            placement=Placement(cpus=None, mems=mems),
                                            origin="rule", name=m.rule.name, partial=True)
                notes += [n for n in res2.get("notes") or [] if n not in notes]
            owner = user_name(m.uid)
            log.info("rule %s: bound pid %d (%s, user %s%s) to CPUs %s near GPU(s) %s in %.1f ms",
                     m.rule.name, pid, _cut(m.cmdline), owner,
                     ", already running at start" if at_start else "",
                     format_cpulist(placed.cpus or frozenset()),
                     ",".join(map(str, placed.gpus)) or "-", (rb.bound_at - seen) * 1000)
            left_out = [n for n in notes if "not set" in n]
            if left_out:
                # the rule asked for more than the daemon may do (a limit without
                # CAP_SYS_RESOURCE): the CPUs are bound, the rest is an error until the
                # process ends, so `tunerctl status` exits 1 and an operator hears of it
                self.partial += 1
                self.errors.record("autobind", f"rule {m.rule.name}, pid {pid}: bound to CPUs "
                                   f"{format_cpulist(placed.cpus or frozenset())}, but "
                                   + "; ".join(left_out), key=f"partial:{pid}")
                self.pidwatch.watch(pid, start, "rule-partial", self._partial_exited)
            if m.rule.exclusive and m.rule.exclusive_scope:
                self.mover.move_off(f"rule:{pid}:{start}", m.rule.exclusive_scope,
                                    placed.cpus or frozenset(), pid, 0)
        except NoSuchProcess:
            self._forget(pid)  # exited before we got to it: the normal case for short jobs
        except TunerdError as err:
            self._failure(m, pid, err.message)
        except Exception as err:
            log.exception("automatic binding of pid %d failed", pid)
            self._failure(m, pid, repr(err))
        finally:
            self._pending.pop(pid, None)

    def _hold(self, m: RuleMatch, start: int, group: str, placed: Placement, seen: float,
              at_start: bool, exclusive: bool) -> RuleBound | None:
        rb = RuleBound(pid=m.pid, start_time=start, rule=m.rule.name, group=group, uid=m.uid,
                       placement=placed, exec_seen=seen, at_start=at_start)
        self.bound[m.pid] = rb
        self.placer.reserve(Reservation(
            key=f"rule:{m.pid}", holder=f"pid {m.pid} (rule {m.rule.name})",
            gpus=placed.gpus, cpus=placed.cpus or frozenset(), exclusive=exclusive,
            pid=m.pid, group=group))
        if not self.pidwatch.watch(m.pid, start, "rule", self._exited):
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
        self.placer.release(f"rule:{pid}")
        if rb is not None:
            self.pidwatch.unwatch(pid, "rule")

    def _exited(self, pid: int) -> None:
        rb = self.bound.pop(pid, None)
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
