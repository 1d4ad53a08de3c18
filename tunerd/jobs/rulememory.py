"""What the ``[[job]]`` rules remember of processes they looked at and did not bind.

Wrappers, launchers and ranks that set their own CPUs are left alone (and listed, with
why); what a rescan need not look at again is settled; a process whose bind failed is
not retried; what a wrapper an explicit rule matched runs is that rule's match. Each of
these is a slot of the process's record in the node's ledger (tunerd.jobs.ledger), so
it goes with its process: a left-alone or settled process is watched (its exit
callback), a failed one too; an unwatched entry (a wrapper's match, a process settled as
outside the daemon's scope) is checked by its start time where that matters and bounded
with the ledger's other caches (``UNWATCHED_MAX``), the wrappers' matches also by
``WRAPPED_MAX``.
"""

from __future__ import annotations

import logging

from tunerd.adapters import procfs
from tunerd.base.errorlog import ErrorLog
from tunerd.base.jsontypes import JSONObject
from tunerd.jobs.intake import JobContext, Role
from tunerd.jobs.ledger import Ledger, ProcKey, Slot
from tunerd.watch.launchers import AFFINITY_WRAPPERS, wrapper_name
from tunerd.watch.rules import RuleMatch

__all__ = ["FAILED", "LEFT_ALONE", "SELF_AFFINED", "SETTLED", "WRAPPED", "WRAPPED_MAX",
           "WRAPPER", "RuleMemory"]

WRAPPED_MAX = 1024  # wrappers matched by an explicit rule, remembered at once
log = logging.getLogger("tunerd.autobind")

# why a rule left the process alone (a wrapper, a launcher, a rank that set its own CPUs)
LEFT_ALONE = Slot[str]("left-alone")
SELF_AFFINED = Slot[bool]("self-affined")  # ... of those, a rank that set its own CPUs
# a rescan need not look at it again (until it execs: an exec event looks afresh)
SETTLED = Slot[bool]("settled")
# its binding failed: not retried (a /proc scan or an overrun rescan would otherwise
# repeat the same error forever); the record's start time tells the process
FAILED = Slot[bool]("rule-failed")
# a wrapper an explicit rule matched: what it runs matches that rule (``wrapped_match``)
WRAPPED = Slot[RuleMatch]("wrapped")
# a wrapper left alone (numactl, taskset): the rank the same process becomes once it
# execs was pinned by it
WRAPPER = Slot[str]("wrapper")


class RuleMemory:
    """The rules' memory of processes: left alone, settled, failed, wrappers."""

    def __init__(self, ledger: Ledger, errors: ErrorLog,
                 proc_root: str = procfs.PROC) -> None:
        self.ledger = ledger
        self.errors = errors
        self.proc = proc_root
        # processes left alone now (exact on the loop, where they come and go; what
        # ``left_alone_now`` finds resets it): ``anyone_left_alone`` reads no record
        self._left_alone = 0
        # wrappers' matches remembered since the last clear (never less than are held):
        # ``wrapping`` tells the exec path whether to look for a wrapper at all
        self._wrapped = 0

    # -- what the binder asks (on the loop, or the exec watcher's thread) ------------
    def is_settled(self, pid: int) -> bool:
        """Whether a rescan need not look at ``pid`` again."""
        return self.ledger.has(pid, SETTLED)

    def failed_before(self, pid: int, start: int | None = None) -> bool:
        """Whether a bind of ``pid`` (the process started at ``start``) failed."""
        return self.ledger.get(pid, FAILED, start=start) is not None

    def set_own_cpus(self, pid: int) -> bool:
        """Whether ``pid`` was left alone because it set its own CPUs."""
        return self.ledger.has(pid, SELF_AFFINED)

    def anyone_left_alone(self) -> bool:
        """Whether a process left alone runs (a counter: nothing read)."""
        return self._left_alone > 0

    def wrapping(self) -> bool:
        """Whether a wrapper an explicit rule matched is remembered (a counter)."""
        return self._wrapped > 0

    def left_alone_now(self) -> list[JSONObject]:
        """Processes a rule matched that tunerd left alone (wrappers, launchers, ranks
        that set their own affinity) and that still run, with why."""
        held = self.ledger.each(LEFT_ALONE)
        self._left_alone = len(held)
        alive: list[JSONObject] = [
            {"pid": k.pid, "why": w, "self_affined": self.ledger.has(k.pid, SELF_AFFINED)}
            for k, w in held if procfs.read_start_time(k.pid, self.proc) == k.start]
        return alive[:100]

    def wrapped_match(self, pid: int) -> RuleMatch | None:
        """An explicit rule matched a wrapper (``bash myjob.sh``): what the wrapper runs
        -- the image it execs, the children it starts -- is that rule's match."""
        start = procfs.read_start_time(pid, self.proc)
        wrapper = self.ledger.get(pid, WRAPPED, start=start) if start is not None else None
        if wrapper is None:
            ppid = procfs.read_ppid(pid, self.proc)
            pstart = procfs.read_start_time(ppid, self.proc) if ppid is not None else None
            if ppid is None or pstart is None:
                return None
            wrapper = self.ledger.get(ppid, WRAPPED, start=pstart)
            if wrapper is None:
                return None
        got = procfs.read_cmdline_prefix(pid, self.proc)
        env = procfs.read_environ_view(pid, self.proc)
        if got is None or env is None:
            return None
        return RuleMatch(rule=wrapper.rule, pid=pid, cmdline=got[0], uid=wrapper.uid,
                         env=env)

    # -- what the binder tells ------------------------------------------------------
    def wrap(self, m: RuleMatch, ctx: JobContext) -> None:
        """Remember a wrapper an explicit rule matched (``wrapped_match``)."""
        if m.rule.rank or ctx.role != Role.WRAPPER:
            return
        if self._wrapped >= WRAPPED_MAX:
            self.ledger.clear(WRAPPED)
            self._wrapped = 0
        new = self.ledger.get(ctx.pid, WRAPPED, start=ctx.start_time) is None
        # a stale entry never matches: the start time is checked, and it goes with its
        # process where that is watched (a wrapper left alone is)
        self.ledger.put(ProcKey(ctx.pid, ctx.start_time), WRAPPED, m)
        if new:
            self._wrapped += 1

    def settle(self, ctx: JobContext) -> None:
        """A rescan need not look at ``ctx`` again while it runs."""
        self.ledger.put(ProcKey(ctx.pid, ctx.start_time), SETTLED, True)
        if not self.ledger.watch(ctx.pid, ctx.start_time, "rule-settled",
                                 self._settled_exited):
            self._settled_exited(ctx.pid)

    def settle_outside(self, pid: int) -> None:
        """``pid`` is outside the daemon's scope: not looked at again until it execs
        (unwatched: the ledger bounds it with its other caches)."""
        key = self.ledger.key_of(pid)
        if key is not None:
            self.ledger.put(key, SETTLED, True)

    def _settled_exited(self, pid: int) -> None:
        """A settled process ended: not looked at, nor listed as left alone, any more
        (while none is, tunerd.jobs.gpuuse has no launch to follow and reads nothing).
        Its record goes whole after this; the pops are for a process gone before it
        was watched."""
        self.ledger.pop(pid, SETTLED)
        self.ledger.pop(pid, SELF_AFFINED)
        self.ledger.pop(pid, WRAPPER)
        if self.ledger.pop(pid, LEFT_ALONE) is not None and self._left_alone > 0:
            self._left_alone -= 1

    def placed_by(self, ctx: JobContext) -> str:
        """Who chose a self-pinned rank's CPUs: the wrapper this very process exec'd
        through where a rule saw it, else the one its parent's command line runs it
        through (``torchrun --no-python numactl ...``; torchrun ``--numa-binding``),
        else "self" (the rank, or a launcher that binds before exec: not told apart).
        A rank rule never matches a wrapper's own exec, and numactl execs at once: the
        parent's command line is what tells it."""
        hit = self.ledger.get(ctx.pid, WRAPPER, start=ctx.start_time)
        if hit is not None:
            return hit
        got = procfs.read_cmdline_prefix(ctx.ppid, self.proc)
        words = [w.rsplit("/", 1)[-1] for w in got[0].split(" ")] if got else []
        named = next((w for w in words if w in AFFINITY_WRAPPERS), None)
        if named is not None:
            return named
        if any(w.startswith(("--numa-binding", "--numa_binding")) for w in words):
            return "torchrun --numa-binding"
        return "self"

    def leave_alone(self, ctx: JobContext) -> None:
        """Remember why ``ctx`` is left alone (``settle`` watches it: it goes at exit)."""
        key = ProcKey(ctx.pid, ctx.start_time)
        if ctx.role == Role.WRAPPER:
            self.ledger.put(key, WRAPPER, wrapper_name(list(ctx.argv)) or "wrapper")
        if ctx.self_affined:
            self.ledger.put(key, SELF_AFFINED, True)
        else:
            self.ledger.pop(ctx.pid, SELF_AFFINED)
        new = self.ledger.get(ctx.pid, LEFT_ALONE, start=ctx.start_time) is None
        self.ledger.put(key, LEFT_ALONE, ctx.why)
        if new:  # counted once it is there: a count taken meanwhile is never short
            log.info("pid %d (%s) left alone: %s", ctx.pid, ctx.comm, ctx.why)
            self._left_alone += 1

    def remember_failure(self, pid: int) -> None:
        """A bind of ``pid`` failed: not retried while it runs; its error resolves
        itself when it ends."""
        key = self.ledger.key_of(pid)
        if key is None:
            return
        self.ledger.put(key, FAILED, True)
        if not self.ledger.watch(pid, key.start, "rule-failed", self._failed_exited):
            self._failed_exited(pid)

    def _failed_exited(self, pid: int) -> None:
        self.ledger.pop(pid, FAILED)
        self.errors.resolve("autobind", pid)
