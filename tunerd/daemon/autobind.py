"""Automatic binding: processes matching a ``[[job]]`` rule are bound when they exec.

The exec watcher (proc connector, or a /proc scan where that is unavailable)
calls ``on_exec(pid)`` for every exec on the host; ``RuleSet.match`` rejects
unrelated commands with one read and one regex. A match is placed near the
GPU it uses (LOCAL_RANK / CUDA_VISIBLE_DEVICES) and bound through the
JobRegistry with ``origin="rule"``. Ranks of one job (same rule and
TORCHELASTIC_RUN_ID, else same parent) get distinct CPUs while possible.

The watcher only runs while the policy has rules: with none, the daemon
does not even subscribe to exec events.
"""

from __future__ import annotations

import asyncio
import logging
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tunerd.cpulist import format_cpulist, parse_cpulist
from tunerd.daemon.placer import PlacedJob, applicability, gpus_from_env, mems_of
from tunerd.daemon.registry import Peer
from tunerd.errors import NoSuchProcess, TunerdError
from tunerd.watch import procfs
from tunerd.watch.proc_connector import ExecWatcher
from tunerd.watch.rules import RuleMatch, RuleSet

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon
    from tunerd.daemon.leases import LeaseService

__all__ = ["AutoBinder"]

log = logging.getLogger("tunerd.autobind")

ANCESTOR_DEPTH = 8  # how far up to look for a `tunerctl run` lease holder


@dataclass
class RuleBound:
    pid: int
    start_time: int
    rule: str
    group: str
    cpus: frozenset[int]
    gpus: tuple[int, ...]
    applied: bool
    notes: tuple[str, ...]
    exec_seen: float  # time.monotonic() of the exec event
    bound_at: float | None = None
    timing: dict[str, Any] | None = None
    exclusive: bool = False  # its CPUs are off limits to leases and other rules


class AutoBinder:
    def __init__(self, daemon: Daemon, leases: LeaseService) -> None:
        self.d = daemon
        self.leases = leases
        self.rules = RuleSet([])
        self.watcher: ExecWatcher | None = None
        self.bound: dict[int, RuleBound] = {}
        self.peer = Peer(pid=os.getpid(), uid=0, gid=0)  # the policy acts as root
        self.matched = 0
        self.failed = 0
        self.last_error: str | None = None
        self._pending: dict[int, asyncio.Task[None]] = {}
        # pid -> start time of processes whose binding failed: not retried (a /proc
        # scan or an overrun rescan would otherwise repeat the same error forever)
        self._failed: dict[int, int] = {}
        # exec event handled -> CPUs bound, as the daemon sees it (the last 1000)
        self.latencies_ms: deque[float] = deque(maxlen=1000)

    # -- lifecycle -------------------------------------------------------------
    async def policy_changed(self) -> None:
        self.rules = RuleSet.from_policy(self.d.policy.model.jobs if self.d.policy else ())
        if self.rules and self.watcher is None:
            self.watcher = ExecWatcher(self.on_exec, self.rescan,
                                       use_connector=self.d.cfg.watch_execs)
            self.watcher.start()
        elif not self.rules and self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.rules:
            log.info("automatic binding: %d rule(s): %s", len(self.rules.rules),
                     ", ".join(r.name for r in self.rules.rules))
            self._warm_up()
            self.rescan()  # processes that were already running match too

    def _warm_up(self) -> None:
        """Import and index the placement code now, not on the first exec (~15 ms)."""
        try:
            self.leases.place(gpus=0, cpus=1)
        except TunerdError:
            pass

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        for t in self._pending.values():
            t.cancel()

    def status(self) -> dict[str, Any]:
        w = self.watcher.status() if self.watcher else {"mode": "off"}
        n = len(self.rules.rules)
        summary = (f"automatic binding: {n} rule(s), watcher {w['mode']}, "
                   f"{len(self.bound)} process(es) bound" if n else "automatic binding: no rules")
        lat = sorted(self.latencies_ms)
        latency = {"n": len(lat), "median": round(statistics.median(lat), 3),
                   "p99": round(lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))], 3),
                   "max": round(lat[-1], 3)} if lat else {"n": 0}
        return {"summary": summary, "rules": [r.name for r in self.rules.rules], "watcher": w,
                "latency_ms": latency,
                "matched": self.matched, "failed": self.failed, "last_error": self.last_error,
                "bound": [{"pid": b.pid, "rule": b.rule, "cpus": format_cpulist(b.cpus),
                           "gpus": list(b.gpus), "applied": b.applied, "notes": list(b.notes),
                           "timing": b.timing,
                           "latency_ms": None if b.bound_at is None else
                           round((b.bound_at - b.exec_seen) * 1000, 3)}
                          for b in self.bound.values()]}

    # -- events ----------------------------------------------------------------
    def on_exec(self, pid: int) -> None:
        """Called for every exec on the host: keep the no-match path short."""
        m = self.rules.match(pid)
        if m is None or pid in self._pending:
            return
        self.matched += 1
        task = asyncio.ensure_future(self._bind(m, time.monotonic()))
        self._pending[pid] = task

    def rescan(self) -> None:
        me = os.getpid()
        for pid in procfs.list_pids():
            if pid != me and pid not in self.bound:
                self.on_exec(pid)

    # -- binding ---------------------------------------------------------------
    def _group(self, m: RuleMatch) -> str:
        run_id = m.env.get("TORCHELASTIC_RUN_ID") or m.env.get("SLURM_JOB_ID")
        if run_id:
            return f"{m.rule.name}/{run_id}"
        return f"{m.rule.name}/ppid {procfs.read_ppid(m.pid)}"

    def busy_gpus(self) -> dict[int, str]:
        return {g: f"pid {b.pid} (rule {b.rule})" for b in self.bound.values() for g in b.gpus}

    def exclusive_cpus(self) -> dict[int, str]:
        """CPUs held by processes of exclusive rules (placements must avoid them)."""
        return {c: f"pid {b.pid} (rule {b.rule}, exclusive)" for b in self.bound.values()
                if b.exclusive for c in b.cpus}

    def _lease_cpus_above(self, pid: int) -> frozenset[int] | None:
        """CPUs of the `tunerctl run` lease this process descends from, if any."""
        holders = {r["pid"]: r for r in self.leases.leases.values() if r.get("pid")}
        if not holders:
            return None
        p: int | None = pid
        for _ in range(ANCESTOR_DEPTH):
            if p is None or p <= 1:
                return None
            if p in holders:
                return parse_cpulist(holders[p]["cpus"])
            p = procfs.read_ppid(p)
        return None

    def _existing_job(self, pid: int, start: int) -> dict[str, Any] | None:
        if self.d.jobs is None:
            return None
        for j in self.d.jobs.jobs():
            if j.get("pid") == pid and j.get("start_time") in (None, start):
                return dict(j)
        return None

    def _place(self, m: RuleMatch, group: str) -> PlacedJob:
        rule = m.rule
        topo = self.d.topology
        allowed = self._lease_cpus_above(m.pid)
        gpu_ids = gpus_from_env(topo, m.env)
        if rule.cpus is not None:
            cpus = rule.cpus & allowed if allowed else rule.cpus
            mems = mems_of(topo, cpus)
            ok, notes = applicability(topo, cpus, mems, self.leases.host)
            return PlacedJob(gpu_ids or (), (), cpus, mems, f"rule {rule.name}: cpus {rule.cpus}",
                             tuple(notes), ok)
        siblings = {c: f"rank pid {b.pid} of the same job" for b in self.bound.values()
                    if b.group == group and b.pid != m.pid for c in b.cpus}
        exclusive = rule.exclusive or rule.placement == "exclusive"
        if gpu_ids:
            kw: dict[str, Any] = {"gpus": len(gpu_ids), "gpu_ids": gpu_ids, "busy": {}}
        elif rule.gpus:
            kw = {"gpus": int(rule.gpus), "busy": self.leases.busy_gpus()}
        else:
            kw = {"gpus": 0}
        try:
            return self.leases.place(mode=rule.placement, exclusive=exclusive,
                                     extra_exclusive=siblings, allowed_cpus=allowed, **kw)
        except TunerdError:
            if not siblings:
                raise
            # more ranks than CPUs to split: share rather than fail
            return self.leases.place(mode=rule.placement, exclusive=exclusive,
                                     allowed_cpus=allowed, **kw)

    async def _bind(self, m: RuleMatch, seen: float) -> None:
        pid = m.pid
        try:
            start = procfs.read_start_time(pid)
            if start is None or self._failed.get(pid) == start:
                return
            prev = self.bound.get(pid)
            if prev is not None and prev.start_time == start and prev.rule == m.rule.name:
                return  # the same process exec'd again (sh -> python): keep its place
            job = self._existing_job(pid, start)
            if job is not None and job.get("origin") != "rule":
                log.debug("pid %d matches rule %s but is bound by %s; left alone", pid,
                          m.rule.name, job.get("origin"))
                return
            group = self._group(m)
            if job is not None and prev is None:  # bound before a daemon restart: adopt
                self.bound[pid] = RuleBound(
                    pid, start, m.rule.name, group, parse_cpulist(str(job.get("cpus") or "")),
                    tuple(job.get("gpus") or ()), True, (), seen,
                    exclusive=m.rule.exclusive or m.rule.placement == "exclusive")
                self._watch(pid, start)
                return
            placed = self._place(m, group)
            # reserve before the first await so concurrent ranks see these CPUs taken
            rb = RuleBound(pid, start, m.rule.name, group, placed.cpus, placed.gpus,
                           placed.applicable, placed.notes, seen,
                           exclusive=m.rule.exclusive or m.rule.placement == "exclusive")
            self.bound[pid] = rb
            self._watch(pid, start)
            if not placed.applicable:
                log.info("rule %s: pid %d placed on the replayed topology (GPUs %s, CPUs %s); "
                         "%s", m.rule.name, pid, placed.gpus, format_cpulist(placed.cpus),
                         " ".join(placed.notes))
                return
            if self.d.jobs is None:
                raise TunerdError("binding service not running")
            t_bind = time.monotonic()
            # CPUs first: thread affinity is quick, while memory nodes need a cpuset
            # cgroup (and page migration) -- the process should not run on the
            # wrong CPUs while that is set up
            res = await self.d.jobs.bind(pid, peer=self.peer, cpus=placed.cpus,
                                         nofile=m.rule.nofile, gpus=placed.gpus,
                                         origin="rule", name=m.rule.name)
            rb.bound_at = time.monotonic()
            self.latencies_ms.append((rb.bound_at - seen) * 1000)
            rb.timing = {"queue_place_ms": round((t_bind - seen) * 1000, 3),
                         **{k: res.get(k) for k in ("save_ms", "apply_ms", "elapsed_ms")}}
            if placed.mems and not self.leases.host.mems <= placed.mems:
                # (memory on every node of the machine is no binding at all: skip the cpuset)
                await self.d.jobs.bind(pid, peer=self.peer, mems=placed.mems, origin="rule",
                                       name=m.rule.name)
            log.info("rule %s: bound pid %d (%s) to CPUs %s near GPU(s) %s in %.1f ms",
                     m.rule.name, pid, m.cmdline[:80], format_cpulist(placed.cpus),
                     ",".join(map(str, placed.gpus)) or "-", (rb.bound_at - seen) * 1000)
            if m.rule.exclusive and m.rule.exclusive_scope:
                self.leases.mover.move_off(f"rule:{pid}:{start}", m.rule.exclusive_scope,
                                           placed.cpus, pid, 0)
        except NoSuchProcess:
            self._forget(pid)  # exited before we got to it: the normal case for short jobs
        except TunerdError as err:
            self._remember_failure(pid)
            self.failed += 1
            self.last_error = f"rule {m.rule.name}, pid {pid}: {err.message}"
            self.d.record_error("autobind", self.last_error)
            self._forget(pid)
        except Exception as err:
            self._remember_failure(pid)
            self.failed += 1
            self.last_error = f"rule {m.rule.name}, pid {pid}: {err!r}"
            log.exception("automatic binding of pid %d failed", pid)
            self._forget(pid)
        finally:
            self._pending.pop(pid, None)

    def _remember_failure(self, pid: int) -> None:
        start = procfs.read_start_time(pid)
        if start is not None:
            if len(self._failed) > 10_000:
                self._failed.clear()
            self._failed[pid] = start

    def _watch(self, pid: int, start: int) -> None:
        if not self.leases.pidwatch.watch(pid, start, "rule", self._exited):
            self._forget(pid)

    def _forget(self, pid: int) -> None:
        rb = self.bound.pop(pid, None)
        if rb is not None:
            self.leases.pidwatch.unwatch(pid, "rule")

    def _exited(self, pid: int) -> None:
        rb = self.bound.pop(pid, None)
        if rb is None:
            return
        key = f"rule:{pid}:{rb.start_time}"
        if key in self.leases.mover.moved:
            self.leases.mover.restore(key)

    def restore_moves(self) -> None:
        """At start: put back what exclusive rule jobs moved if the job ended meanwhile."""
        for key in list(self.leases.mover.moved):
            if not key.startswith("rule:"):
                continue
            _, pid_s, start_s = key.split(":")
            pid, start = int(pid_s), int(start_s)
            if not self.leases.pidwatch.watch(pid, start, "rule-exclusive",
                                              self._restore_rule_moves):
                self.leases.mover.restore(key)

    def _restore_rule_moves(self, pid: int) -> None:
        for key in list(self.leases.mover.moved):
            if key.startswith(f"rule:{pid}:"):
                self.leases.mover.restore(key)
