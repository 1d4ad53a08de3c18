"""Ranks that pinned themselves, held in the node's ledger as outside owners of CPUs.

A rank started through ``numactl``/``taskset`` (torchrun ``--numa-binding``, SGLang,
vLLM ``--numa-bind``), or one that set its own affinity, is left as it is by the rules
(``tunerd.jobs.intake``: its mask is narrower than its parent's). Its CPUs are still
taken: it is held here as an ``external`` reservation of the placer (pid + start time,
its job, who chose the CPUs), so that later jobs avoid those CPUs as they avoid
tunerd's own holds, and where they cannot, their explanation names the rank. The hold
is a slot of the rank's record in the node's ledger and goes when the process exits
(its pidfd); the runtime state keeps an image of those slots, so that a restarted
daemon holds them again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tunerd.base.cpulist import CpuListError, format_cpulist, parse_cpulist
from tunerd.base.jsontypes import JSONObject, json_object
from tunerd.jobs.intake import JobContext, Role
from tunerd.jobs.ledger import Ledger, ProcKey, Slot
from tunerd.jobs.placement import mems_of
from tunerd.jobs.placer import Placer, Reservation, ReservationKey

__all__ = ["EXTERNAL", "ExternalHolds", "external_reservation"]

log = logging.getLogger("tunerd.autobind")

EXTERNAL = Slot[Reservation]("external")  # a self-pinned rank's hold


def external_reservation(ctx: JobContext, placed_by: str) -> Reservation | None:
    """The hold of a self-pinned rank ``ctx`` (None: not one, or no mask known)."""
    cpus = ctx.allocation.mask
    if not ctx.self_affined or ctx.role != Role.RANK or not cpus:
        return None
    job = ctx.group or ctx.launcher
    gpus = f", GPU {format_cpulist(ctx.gpus)}" if ctx.gpus else ""
    how = f" via {placed_by}" if placed_by != "self" else ""
    # named in other users' placements: no command (hidepid may hide it from them)
    holder = (f"pid {ctx.pid} (rank{gpus}{', job ' + job if job else ''}, "
              f"pinned itself{how})")
    return Reservation(key=ReservationKey.external(ctx.pid), holder=holder, gpus=(),
                       cpus=cpus, pid=ctx.pid, group=ctx.group, job=ctx.job_key,
                       uid=ctx.uid, ranked=True, start_time=ctx.start_time,
                       placed_by=placed_by, uses_gpus=ctx.gpus)


class ExternalHolds:
    """Self-pinned ranks as external holders in the placer, released at their exit.

    Each hold is in its rank's ledger record (``EXTERNAL``); the runtime state keeps
    their image (``state``: str(pid) -> the reservation's fields, written whole from the
    ledger on each change), so that a restarted daemon holds them again at start,
    before anything is placed, as it does its binds' and leases' holds."""

    def __init__(self, placer: Placer, ledger: Ledger, state: JSONObject | None = None,
                 save: Callable[[], None] = lambda: None) -> None:
        self.placer = placer
        self.ledger = ledger
        self.state: JSONObject = state if state is not None else {}
        self.save = save

    def restore(self) -> int:
        """At start (on the loop): the holds of the last daemon whose ranks still run
        (same pid and start time) are held again; the others are dropped."""
        held = 0
        saved = list(self.state.items())
        for key, raw in saved:
            res = _from_json(raw)
            if res is None or res.pid is None or res.start_time is None \
                    or str(res.pid) != key or not self.ledger.watch(
                        res.pid, res.start_time, "external", self._exited):
                continue
            self.ledger.put(ProcKey(res.pid, res.start_time), EXTERNAL, res)
            self.placer.hold_external(res)
            held += 1
        if held < len(saved):
            self._persist()  # the others are dropped
        if held:
            log.info("%d external hold(s) of self-pinned ranks restored", held)
        return held

    def hold(self, ctx: JobContext, placed_by: str) -> Reservation | None:
        """Hold ``ctx``'s CPUs as an outside owner's (on the loop); None: nothing held."""
        saved = self.ledger.get(ctx.pid, EXTERNAL, start=ctx.start_time)
        if saved is not None and placed_by == "self":
            placed_by = saved.placed_by or placed_by  # seen by the daemon before this one
        res = external_reservation(ctx, placed_by)
        if res is None:
            return None
        if not self.ledger.watch(ctx.pid, ctx.start_time, "external", self._exited):
            return None  # gone already
        self.ledger.put(ProcKey(ctx.pid, ctx.start_time), EXTERNAL, res)
        self._persist()
        old = self.placer.hold_external(res)
        if old is None or old.cpus != res.cpus:
            log.info("pid %d held as an external owner of CPU %s (%s)", ctx.pid,
                     format_cpulist(res.cpus), res.holder)
        return res

    def memory_to_bind(self, ctx: JobContext,
                       policy: str) -> tuple[frozenset[int] | None, str]:
        """(memory nodes to bind a self-pinned rank's memory to, why) -- None: nothing
        (the rule says "leave", a replayed node, one memory node, CPUs on every node)."""
        cpus = ctx.allocation.mask
        if policy != "bind":
            return None, f"self_pinned_memory = {policy!r}"
        if self.placer.topo.replayed:
            return None, "a replayed topology: its CPUs are not this node's"
        if not cpus:
            return None, "its CPUs are not known"
        mems = self.placer.bindable_mems(mems_of(self.placer.topo, cpus))
        if mems is None:
            return None, "its CPUs span every memory node (or the node has one)"
        return mems, f"CPUs {format_cpulist(cpus)} are on node(s) {format_cpulist(mems)}"

    def _persist(self) -> None:
        """The runtime state's image of the holds, written whole from the ledger."""
        self.state.clear()
        self.state.update({str(k.pid): _to_json(r) for k, r in self.ledger.each(EXTERNAL)})
        self.save()

    def _exited(self, pid: int) -> None:
        """The rank ended (its record goes after this): its hold goes."""
        if self.ledger.pop(pid, EXTERNAL) is not None:
            self._persist()
        if self.placer.release(ReservationKey.external(pid)) is not None:
            log.info("pid %d exited: its external hold is released", pid)

    def listing(self) -> list[JSONObject]:
        """The external holders, for ``tunerctl jobs``."""
        return [{"pid": r.pid, "start_time": r.start_time, "cpus": format_cpulist(r.cpus),
                 "gpus": list(r.uses_gpus),
                 "job": r.group or r.job, "placed_by": r.placed_by, "why": r.holder,
                 "uid": r.uid}
                for r in sorted(self.placer.external_holds(), key=lambda r: r.pid or 0)]


def _to_json(r: Reservation) -> JSONObject:
    return {"pid": r.pid, "start_time": r.start_time, "cpus": format_cpulist(r.cpus),
            "holder": r.holder, "group": r.group, "job": r.job, "uid": r.uid,
            "placed_by": r.placed_by, "gpus": list(r.uses_gpus)}


def _from_json(raw: object) -> Reservation | None:
    """A saved hold (None: missing or malformed: dropped)."""
    d = json_object(raw)
    if d is None:
        return None
    pid, start, cpus, holder = d.get("pid"), d.get("start_time"), d.get("cpus"), d.get("holder")
    group, job, uid, by = d.get("group"), d.get("job"), d.get("uid"), d.get("placed_by")
    gpus = d.get("gpus")
    if not (type(pid) is int and type(start) is int and isinstance(cpus, str)
            and isinstance(holder, str) and isinstance(group, str | None)
            and isinstance(job, str | None) and (uid is None or type(uid) is int)
            and isinstance(by, str | None) and isinstance(gpus, list)
            and all(type(g) is int for g in gpus)):
        return None
    try:
        cpu_set = parse_cpulist(cpus)
    except CpuListError:
        return None
    return Reservation(key=ReservationKey.external(pid), holder=holder, gpus=(),
                       cpus=cpu_set, pid=pid, group=group, job=job, uid=uid, ranked=True,
                       start_time=start, placed_by=by,
                       uses_gpus=tuple(g for g in gpus if isinstance(g, int)))
