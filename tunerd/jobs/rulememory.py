"""What the ``[[job]]`` rules remember of processes they looked at and did not bind.

Wrappers, launchers and ranks that set their own CPUs are left alone (and listed, with
why); what a rescan need not look at again is settled; a process whose bind failed is
not retried; what a wrapper an explicit rule matched runs is that rule's match. Every
table is bounded, and each entry goes with its process (the pid watcher).
"""

from __future__ import annotations

import logging

from tunerd.adapters import procfs
from tunerd.base.errorlog import ErrorLog
from tunerd.base.jsontypes import JSONObject
from tunerd.jobs.intake import JobContext, Role
from tunerd.jobs.ledger import Ledger
from tunerd.watch.launchers import AFFINITY_WRAPPERS, wrapper_name
from tunerd.watch.rules import RuleMatch

__all__ = ["WRAPPED_MAX", "RuleMemory"]

WRAPPED_MAX = 1024  # wrappers matched by an explicit rule, remembered at once
log = logging.getLogger("tunerd.autobind")


class RuleMemory:
    """The rules' memory of processes: left alone, settled, failed, wrappers."""

    def __init__(self, ledger: Ledger, errors: ErrorLog,
                 proc_root: str = procfs.PROC) -> None:
        self.ledger = ledger
        self.errors = errors
        self.proc = proc_root
        # pid -> why: wrappers, launchers and self-bound ranks a rule matched, left alone
        self.left_alone: dict[int, str] = {}
        self.self_affined: set[int] = set()  # ... of those, ranks that set their own CPUs
        # descendants and left-alone processes a rescan need not look at again (until
        # they exec: an exec event looks at them afresh)
        self.settled: set[int] = set()
        # pid -> start time of processes whose binding failed: not retried (a /proc
        # scan or an overrun rescan would otherwise repeat the same error forever)
        self.failed: dict[int, int] = {}
        # wrappers an explicit rule matched: pid -> (start time, the match); what they
        # run matches that rule (``wrapped_match``)
        self.wrapped: dict[int, tuple[int, RuleMatch]] = {}
        # pid -> (start time, wrapper name) of wrappers left alone: the rank the same
        # process becomes once it execs was pinned by that wrapper (numactl, taskset)
        self.wrappers: dict[int, tuple[int, str]] = {}

    def left_alone_now(self) -> list[JSONObject]:
        """Processes a rule matched that tunerd left alone (wrappers, launchers, ranks
        that set their own affinity) and that still run, with why."""
        alive: list[JSONObject] = [
            {"pid": p, "why": w, "self_affined": p in self.self_affined}
            for p, w in sorted(self.left_alone.items())
            if procfs.read_start_time(p, self.proc) is not None]
        return alive[:100]

    def wrapped_match(self, pid: int) -> RuleMatch | None:
        """An explicit rule matched a wrapper (``bash myjob.sh``): what the wrapper runs
        -- the image it execs, the children it starts -- is that rule's match."""
        start = procfs.read_start_time(pid, self.proc)
        hit = self.wrapped.get(pid)
        if hit is None or hit[0] != start:
            ppid = procfs.read_ppid(pid, self.proc)
            hit = self.wrapped.get(ppid) if ppid is not None else None
            if hit is None or ppid is None or procfs.read_start_time(ppid, self.proc) != hit[0]:
                return None
        got = procfs.read_cmdline_prefix(pid, self.proc)
        env = procfs.read_environ_view(pid, self.proc)
        if got is None or env is None:
            return None
        wrapper = hit[1]
        return RuleMatch(rule=wrapper.rule, pid=pid, cmdline=got[0], uid=wrapper.uid,
                         env=env)

    def wrap(self, m: RuleMatch, ctx: JobContext) -> None:
        """Remember a wrapper an explicit rule matched (``wrapped_match``)."""
        if m.rule.rank or ctx.role != Role.WRAPPER:
            return
        if len(self.wrapped) >= WRAPPED_MAX:
            self.wrapped.clear()
        self.wrapped[ctx.pid] = (ctx.start_time, m)  # a stale entry never matches: the
        # start time is checked, and the table is bounded

    def settle(self, ctx: JobContext) -> None:
        if len(self.settled) > 100_000:
            self.settled.clear()
        if self.ledger.watch(ctx.pid, ctx.start_time, "rule-settled", self._settled_exited):
            self.settled.add(ctx.pid)
        else:
            self._settled_exited(ctx.pid)

    def _settled_exited(self, pid: int) -> None:
        """A settled process ended: not looked at, nor listed as left alone, any more
        (while none is, tunerd.jobs.gpuuse has no launch to follow and reads nothing)."""
        self.settled.discard(pid)
        self.left_alone.pop(pid, None)
        self.self_affined.discard(pid)
        self.wrappers.pop(pid, None)

    def placed_by(self, ctx: JobContext) -> str:
        """Who chose a self-pinned rank's CPUs: the wrapper this very process exec'd
        through where a rule saw it, else the one its parent's command line runs it
        through (``torchrun --no-python numactl ...``; torchrun ``--numa-binding``),
        else "self" (the rank, or a launcher that binds before exec: not told apart).
        A rank rule never matches a wrapper's own exec, and numactl execs at once: the
        parent's command line is what tells it."""
        hit = self.wrappers.get(ctx.pid)
        if hit is not None and hit[0] == ctx.start_time:
            return hit[1]
        got = procfs.read_cmdline_prefix(ctx.ppid, self.proc)
        words = [w.rsplit("/", 1)[-1] for w in got[0].split(" ")] if got else []
        named = next((w for w in words if w in AFFINITY_WRAPPERS), None)
        if named is not None:
            return named
        if any(w.startswith(("--numa-binding", "--numa_binding")) for w in words):
            return "torchrun --numa-binding"
        return "self"

    def leave_alone(self, ctx: JobContext) -> None:
        if len(self.left_alone) > 1000:
            self.left_alone.clear()
            self.self_affined.clear()
        if ctx.role == Role.WRAPPER:
            if len(self.wrappers) > 1000:
                self.wrappers.clear()
            self.wrappers[ctx.pid] = (ctx.start_time, wrapper_name(list(ctx.argv)) or "wrapper")
        if ctx.self_affined:
            self.self_affined.add(ctx.pid)
        else:
            self.self_affined.discard(ctx.pid)
        if ctx.pid not in self.left_alone:
            log.info("pid %d (%s) left alone: %s", ctx.pid, ctx.comm, ctx.why)
        self.left_alone[ctx.pid] = ctx.why

    def remember_failure(self, pid: int) -> None:
        start = procfs.read_start_time(pid, self.proc)
        if start is not None:
            if len(self.failed) > 10_000:
                self.failed.clear()
            self.failed[pid] = start
            # the failure's error resolves itself when the process ends
            self.ledger.watch(pid, start, "rule-failed", self._failed_exited)

    def _failed_exited(self, pid: int) -> None:
        self.failed.pop(pid, None)
        self.errors.resolve("autobind", pid)
