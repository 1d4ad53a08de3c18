"""JobRegistry: the processes tunerd has bound, their originals, and their exits.

State: the runtime store's ``bindings`` section, keyed by str(pid). A record is
written (with the originals) *before* the process is changed, so a daemon crash
loses nothing; on start the daemon re-adopts records whose pid + start time still
match and drops the others. Exits are noticed without polling, through the pid
watcher (a pidfd per process on the loop).

Placements computed on a replayed topology that this machine cannot apply are
kept too (in memory, marked not applied), so ``tunerctl jobs`` and ``advise``
show what tunerd would have done.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import Failed, NoSuchProcess, PermissionDenied, TunerdError
from tunerd.base.groupsave import GroupSave
from tunerd.base.jsontypes import JSONObject, json_object
from tunerd.base.keyedlocks import KeyedLocks
from tunerd.jobs.actuate import Actuator
from tunerd.jobs.binding import BindResult, Originals, Plan, Target
from tunerd.jobs.exclusive import ExclusiveMover
from tunerd.jobs.ledger import Ledger, ProcKey, Slot
from tunerd.jobs.peer import Peer, require_owner
from tunerd.jobs.placement import Placement
from tunerd.jobs.records import Binding, Hold

__all__ = ["AdoptCallback", "Ask", "ChangeCallback", "ExitCallback", "JobRegistry", "Recorded"]

JSONRecord = JSONObject  # a record as the runtime state holds it

log = logging.getLogger("tunerd.jobs")

ExitCallback = Callable[[int, Binding], None]
# told each binding re-adopted at start (its owner restores what it held: a reservation)
AdoptCallback = Callable[[Binding], None]
# told the pid whose binding was stored, replaced or removed (read it back with record())
ChangeCallback = Callable[[int], None]

_FORGET_RETRIES = 5  # tries to rmdir a child cpuset still busy right after an exit


@dataclass(frozen=True)
class Ask:
    """What a bind keeps in its record besides the plan (tunerd.jobs.pipeline)."""

    placement: Placement | None
    nofile: int | None
    origin: str
    name: str | None = None
    lease: str | None = None
    cmdline: str | None = None
    why: str | None = None
    hold: Hold | None = None  # what the placer holds for it: saved with its first record


@dataclass(frozen=True)
class Recorded:
    """A change made, for ``JobRegistry.record``."""

    plan: Plan
    result: BindResult
    prev: Binding | None
    written: JSONRecord | None  # the record as ``persist`` wrote it (None: not written)
    on_disk: bool  # a re-bind whose originals were on disk already
    persist_after: bool  # bound first (a rule's just-exec'd process), saved now
    mems_asked: bool
    nofile_asked: int | None


@dataclass
class _Unapplied:
    """A placement computed on a replayed topology and never applied to the process."""

    pid: int
    start_time: int
    uid: int | None
    name: str
    cmdline: str
    placement: Placement
    origin: str
    at: float
    why: str | None = None  # how the intake told what it is (a rule's bind)


# what the registry keeps of a process, in the node's ledger (tunerd.jobs.ledger)
BINDING: Slot[Binding] = Slot("binding")  # bound: its record, saved in the runtime state
UNAPPLIED: Slot[_Unapplied] = Slot("placed only")  # placed on a replayed topology


class JobRegistry:
    """Binds processes and remembers them until they exit or are unbound."""

    name = "jobs"

    def __init__(self, binder: Actuator, records: dict[str, JSONRecord],
                 save: Callable[[], None], ledger: Ledger, errors: ErrorLog, *,
                 dry_run: bool = False, proc_root: str = procfs.PROC,
                 mover: ExclusiveMover | None = None) -> None:
        self.binder = binder
        self.mover = mover
        self._records = records  # the runtime store's section: JSON of the BINDING slots
        self._save = save
        # the saves of one loop turn's binds and unbinds: one write (save first still)
        self._commit = GroupSave(save)
        self.ledger = ledger
        self.errors = errors
        self.dry_run = dry_run
        self.proc = proc_root
        self._callbacks: list[ExitCallback] = []
        self._adopt_callbacks: list[AdoptCallback] = []
        self._change_callbacks: list[ChangeCallback] = []
        self._locks = KeyedLocks()  # per PID, only while in use: no state for absent PIDs
        self._save_handle: asyncio.TimerHandle | None = None
        self.binds_total = 0  # successful binds since start (tunerd_binds_total)
        # changes with every record stored or removed: a reader of jobs(live=False) keeps
        # its copy until this moves (the monitor, every cycle)
        self.version = 0

    # -- service -------------------------------------------------------------
    async def start(self) -> None:
        """Re-adopt bindings saved by a previous daemon; drop those whose process is gone."""
        self.ledger.attach()
        changed = False
        for key, raw in list(self._records.items()):
            try:
                rec = Binding.from_json(raw)
            except ValueError:
                log.error("dropping malformed binding record %r", key)
                del self._records[key]
                changed = True
                continue
            if not self.ledger.watch(rec.pid, rec.start_time, "jobs", self._exited):
                log.info("pid %d exited while tunerd was down; dropping its binding", rec.pid)
                del self._records[key]
                self._forget(rec.originals)
                changed = True
                continue
            self.ledger.put(ProcKey(rec.pid, rec.start_time), BINDING, rec)
            self._changed(rec.pid)
            log.info("re-adopted binding of pid %d (cpus %s)", rec.pid, rec.cpus)
            for cb in self._adopt_callbacks:
                cb(rec)
        if changed:
            self._save_quietly()
        for d in self.binder.sweep_stale_cpusets():
            log.info("removed child cpuset %s of a process that exited while unwatched", d)

    async def stop(self) -> None:
        """Bindings outlive the daemon (they are re-adopted on start)."""
        if self._save_handle is not None:
            self._save_handle.cancel()
            self._save_handle = None
            self._save_quietly()

    def status(self) -> JSONObject:
        n = self.ledger.count(BINDING)
        summary = f"{n} process{'es' if n != 1 else ''} bound"
        if self.ledger.count(UNAPPLIED):
            summary += f", {self.ledger.count(UNAPPLIED)} placed on the replayed topology only"
        out: JSONObject = {"summary": summary, "bound": n,
                           "pids": [k.pid for k, _ in self.ledger.each(BINDING)]}
        if self.ledger.count(UNAPPLIED):
            out["not_applied"] = [k.pid for k, _ in self.ledger.each(UNAPPLIED)]
        out["ledger"] = self.ledger.status()
        return out

    # -- queries -------------------------------------------------------------
    def on_exit(self, callback: ExitCallback) -> None:
        self._callbacks.append(callback)

    def on_adopt(self, callback: AdoptCallback) -> None:
        """``callback(binding)`` for each binding re-adopted at start (before the
        rules' /proc scan places anything)."""
        self._adopt_callbacks.append(callback)

    def set_hold(self, pid: int, hold: Hold | None) -> None:
        """Keep with pid's binding what the placer holds for it, so that a restarted
        daemon reserves it again (saved with the bind's own deferred save)."""
        rec = self.ledger.get(pid, BINDING)
        if rec is None or rec.hold == hold:
            return
        rec = dataclasses.replace(rec, hold=hold)
        self.ledger.put(ProcKey(pid, rec.start_time), BINDING, rec)
        self._records[str(pid)] = rec.to_json()
        self._save_soon()

    def on_change(self, callback: ChangeCallback) -> None:
        """``callback(pid)`` whenever pid's binding is stored, replaced or removed (bind,
        unbind, exit): a watcher follows the bindings without listing them all."""
        self._change_callbacks.append(callback)

    def pids(self) -> list[int]:
        """The bound pids (not the replay-only placements)."""
        return [k.pid for k, _ in self.ledger.each(BINDING)]

    def count_where(self, pred: Callable[[Binding], bool]) -> int:
        """Bindings ``pred`` accepts (the per-user bind count)."""
        return sum(1 for rec in [b for _, b in self.ledger.each(BINDING)] if pred(rec))

    def is_bound(self, pid: int) -> bool:
        return self.ledger.has(pid, BINDING)

    def record(self, pid: int) -> Binding | None:
        return self.ledger.get(pid, BINDING)

    def rank_cpus(self, pid: int) -> tuple[int, frozenset[int]] | None:
        """(start time, CPUs) of ``pid`` where tunerd placed it itself (bind, rule):
        the intake's test for "descends from a bound rank" (a `run` lease's process
        is an enclosing lease instead)."""
        b = self.ledger.get(pid, BINDING)
        if b is None or b.origin == "run" or not b.cpus:
            return None
        return b.start_time, b.cpu_set()

    def jobs(self, live: bool = True) -> list[JSONObject]:
        """Bound processes (and replay-only placements), with live name and threads."""
        out = []
        for rec in [b for _, b in self.ledger.each(BINDING)]:
            job: JSONObject = json_object(rec.public()) or {}
            job["applied"] = True
            if live:
                self._live(job, rec.pid)
            out.append(job)
        for u in [u for _, u in self.ledger.each(UNAPPLIED)]:
            job = {"pid": u.pid, "start_time": u.start_time, "uid": u.uid, "name": u.name,
                   "cmdline": u.cmdline, "origin": u.origin, "bound_at": u.at,
                   "applied": False, "lease": None, "nofile": None, "why": u.why,
                   **{k: v for k, v in u.placement.to_json().items()
                      if k in ("cpus", "mems", "gpus", "explanation", "notes")}}
            if live:
                self._live(job, u.pid)
            out.append(job)
        return out

    def _live(self, job: JSONObject, pid: int) -> None:
        """NAME and THREADS as /proc says now (a task bound in a prolog renames itself)."""
        p = procfs.Process(pid, self.proc)
        try:
            st = p.stat()
        except (NoSuchProcess, PermissionDenied):
            job["threads"] = None
            return
        job["threads"] = st.num_threads
        if st.start_time == job.get("start_time"):
            job["comm"] = st.comm
            if job.get("origin") not in ("rule", "run") or not job.get("name"):
                job["name"] = st.comm

    # -- binding: the record-keeping stages of tunerd.jobs.pipeline ------------------
    def lock(self, pid: int) -> contextlib.AbstractAsyncContextManager[None]:
        """One bind or unbind of ``pid`` at a time (on the loop)."""
        return self._locks.hold(pid)

    def previous(self, target: Target) -> Binding | None:
        """The binding ``target`` has now (one of an earlier process with its pid: dropped)."""
        prev = self.ledger.get(target.pid, BINDING)
        if prev is not None and prev.start_time != target.start_time:
            self._drop(target.pid)  # an earlier process with this pid: long gone
            self._forget(prev.originals)
            return None
        return prev

    def originals_for(self, target: Target, plan: Plan, prev: Binding | None) -> Originals:
        """The originals the record keeps: those on disk already for a re-bind that found
        nothing new, else the plan's with the masks from before an exclusive move."""
        if prev is not None and plan.originals == prev.originals:
            return prev.originals
        return _before_moves(plan.originals, self._moved(target, prev))

    def _moved(self, target: Target, prev: Binding | None) -> dict[int, frozenset[int]]:
        return self.mover.originals_of(target.pid) if self.mover is not None and prev is None \
            else {}

    def new_record(self, target: Target, ask: Ask, plan: Plan, prev: Binding | None,
                   originals: Originals) -> Binding:
        """The record a bind keeps (persisted before the change)."""
        p = ask.placement
        gpus = tuple(p.gpus) if p is not None and p.gpus else (prev.gpus if prev else ())
        return Binding(
            pid=target.pid, start_time=target.start_time, uid=target.uid,
            name=ask.name if ask.name is not None else (
                prev.name if prev and prev.name else self._comm(target.pid)),
            cmdline=prev.cmdline if prev is not None else self._cmdline(target.pid,
                                                                        ask.cmdline),
            cpus=_fmt(plan.cpus), mems=_fmt(plan.mems), gpus=gpus,
            nofile=ask.nofile if ask.nofile is not None else (prev.nofile if prev else None),
            origin=ask.origin if prev is None or ask.origin != "cli" else prev.origin,
            lease=ask.lease if ask.lease is not None else (prev.lease if prev else None),
            bound_at=time.time(),
            explanation=(p.explanation if p is not None and p.explanation
                         else (prev.explanation if prev else None)),
            why=ask.why if ask.why is not None else (prev.why if prev else None),
            hold=ask.hold or (prev.hold if prev is not None else None), originals=originals)

    async def persist(self, rec: Binding, prev: Binding | None,
                      on_disk: bool) -> tuple[float, JSONRecord | None]:
        """Keep the record, and save the originals before anything changes (the runtime
        store: tmpfs, no fsync; a crash of the daemon loses nothing, a reboot ends the
        process anyway). The binds of one loop turn share one write (GroupSave): this
        returns once it is done. A failed write refuses the bind: nothing changed.
        Returns the milliseconds it took and the record's JSON as written (None:
        nothing written)."""
        raw = self._put(rec)
        t_save = time.perf_counter()
        if on_disk:
            return _ms(t_save), None
        try:
            await self._commit()
        except TunerdError:
            self._restore(rec.pid, prev)
            raise
        return _ms(t_save), raw

    def unpersist(self, pid: int, prev: Binding | None, on_disk: bool) -> None:
        """The change failed: the record as it was before ``persist``."""
        self._restore(pid, prev)
        if not on_disk:
            self._save_quietly()

    def exited_meanwhile(self, pid: int) -> NoSuchProcess:
        """The process exited during the change: its record goes (the exit handler may
        have run already)."""
        self.ledger.pop(pid, BINDING)
        self._records.pop(str(pid), None)
        self._changed(pid)
        self._save_soon()
        return NoSuchProcess(f"process {pid} exited while being bound", pid=pid)

    def keep(self, target: Target, rec: Binding, step: Recorded) -> Binding:
        """After the change: keep what the bind really did (a partial bind may have left
        out mems or nofile), save where something new was learnt, watch the process."""
        pid, plan, result, prev = target.pid, step.plan, step.result, step.prev
        moved = self._moved(target, prev)
        rec = dataclasses.replace(
            rec, mems=_fmt(result.mems) if result.mems is not None else (
                None if plan.cpuset is None and step.mems_asked else rec.mems),
            nofile=rec.nofile if result.nofile_new is not None or step.nofile_asked is None
            else (prev.nofile if prev else None),
            notes=tuple(result.notes), originals=_before_moves(plan.originals, moved))
        kept = self._put(rec)
        if moved and self.mover is not None:
            self.mover.disown(pid)  # the binding's originals hold the masks from before
        if self.ledger.pop(pid, UNAPPLIED) is not None:
            self.version += 1
        self.binds_total += 1
        if step.persist_after and not step.on_disk:
            self._save_quietly()  # bound first: now its originals (and all the rest)
        elif kept != step.written:
            # learnt only from the change itself (a thread cloned meanwhile, a step a partial
            # bind left out, its notes), or a re-bind whose originals are on disk already:
            # coalesced. A bind that found nothing new is written once, before the change.
            self._save_soon()
        if prev is None:
            self.ledger.watch(pid, target.start_time, "jobs", self._exited)
        return rec

    def _put(self, rec: Binding) -> JSONRecord:
        """Keep ``rec`` (not saved); returns its JSON as the state holds it now."""
        self.ledger.put(ProcKey(rec.pid, rec.start_time), BINDING, rec)
        raw = self._records[str(rec.pid)] = rec.to_json()
        self._changed(rec.pid)
        return raw

    def _restore(self, pid: int, prev: Binding | None) -> None:
        if prev is not None:
            self._put(prev)
        else:
            self.ledger.pop(pid, BINDING)
            self._records.pop(str(pid), None)
            self._changed(pid)

    def note_unapplied(self, pid: int, start_time: int, placement: Placement, *,
                       origin: str, name: str, cmdline: str | None = None,
                       why: str | None = None) -> None:
        """Remember a placement made on a replayed topology that was not applied here."""
        if self.is_bound(pid):
            return
        self.version += 1
        self.ledger.put(ProcKey(pid, start_time), UNAPPLIED, _Unapplied(
            pid, start_time, procfs.read_uid(pid, self.proc), name,
            self._cmdline(pid, cmdline), placement, origin, time.time(), why))
        self.ledger.watch(pid, start_time, "jobs-unapplied", self._unapplied_exited)

    def _unapplied_exited(self, pid: int) -> None:
        self.ledger.pop(pid, UNAPPLIED)
        self.version += 1

    async def unbind(self, pid: int, *, peer: Peer) -> JSONObject:
        """Restore what bind changed and forget the process."""
        async with self.lock(pid):
            rec = self.ledger.get(pid, BINDING)
            target = self.binder.pin(pid)  # NoSuchProcess if it is gone
            try:
                require_owner(peer, pid, target.uid, target.euid)
                if rec is None or rec.start_time != target.start_time:
                    raise Failed(f"process {pid} is not bound by tunerd", pid=pid)
                summary = self.binder.restore(target, rec.originals)
                self._drop(pid)
            finally:
                target.close()
            notes = summary["notes"]
            try:
                await self._commit()  # with the other saves of this turn
            except TunerdError as err:  # done already: say so, do not fail the reply
                self.errors.record("jobs", f"unbind {pid}: {err.message}", key="save")
                notes.append(f"the process is unbound, but the runtime state was not saved: "
                             f"{err.message}")
            return {"pid": summary["pid"], "threads": summary["threads"], "notes": [*notes],
                    "unbound": True}

    # -- internals -------------------------------------------------------------
    def _drop(self, pid: int) -> Binding | None:
        """Forget a record and stop watching its process (state not saved)."""
        rec = self.ledger.pop(pid, BINDING)
        self._records.pop(str(pid), None)
        self.ledger.unwatch(pid, "jobs")
        self._locks.pop(pid, None)
        self._changed(pid)
        return rec

    def _exited(self, pid: int) -> None:
        rec = self.ledger.pop(pid, BINDING)
        self._records.pop(str(pid), None)
        self._locks.pop(pid, None)
        log.info("bound process %d exited", pid)
        if rec is None:
            return
        self._changed(pid)
        self._forget(rec.originals)
        # Deferred: a record of a dead process is harmless if a crash loses this save
        # (a restarted daemon drops records whose pid and start time no longer match).
        self._save_soon()
        for cb in list(self._callbacks):
            try:
                cb(pid, rec)
            except Exception as err:
                log.exception("exit callback for pid %d failed", pid)
                self.errors.record("jobs", f"exit callback for pid {pid} failed: {err!r}")

    def _changed(self, pid: int) -> None:
        self.version += 1
        for cb in self._change_callbacks:
            cb(pid)

    def _forget(self, orig: Originals, tries: int = _FORGET_RETRIES) -> None:
        """Remove the child cpuset of a process that exited (retried while still busy)."""
        if self.binder.forget(orig) or tries <= 0:
            return
        try:
            asyncio.get_running_loop().call_later(0.2, self._forget, orig, tries - 1)
        except RuntimeError:  # no loop (start-up sweep outside the loop): next start
            pass

    def _comm(self, pid: int) -> str:
        return procfs.read_comm(pid, self.proc) or ""

    def _cmdline(self, pid: int, known: str | None = None) -> str:
        # shown by `tunerctl jobs`: the first 4 KiB is plenty, and keeps the state small
        if known is None:
            known = procfs.read_cmdline(pid, self.proc, limit=4096)
        return (known or "").strip()

    def _save_quietly(self) -> None:
        try:
            self._save()
        except TunerdError as err:
            self.errors.record("jobs", err.message, key="save")
        else:
            self.errors.resolve("jobs", "save")

    def _save_soon(self) -> None:
        """Coalesced save for bookkeeping that a crash may lose (thread counts, exits)."""
        if self._save_handle is not None:
            return

        def save() -> None:
            self._save_handle = None
            self._save_quietly()

        self._save_handle = asyncio.get_running_loop().call_later(0.5, save)


def _before_moves(orig: Originals, moved: dict[int, frozenset[int]]) -> Originals:
    """``orig`` with the masks threads had before an exclusive job moved them.

    Without this, binding a process an exclusive lease had moved, then releasing
    the lease and unbinding, would leave it off the lease's CPUs for good.
    """
    if not moved:
        return orig
    out = orig.copy()
    for tid, mask in moved.items():
        if tid in out.threads:
            out.threads[tid] = mask
    if orig.pid in moved:
        out.process_cpus = moved[orig.pid]
    return out


def _fmt(ids: frozenset[int] | None) -> str | None:
    return format_cpulist(ids) if ids is not None else None


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000
