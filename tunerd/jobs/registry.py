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
from typing import Any

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import Failed, NoSuchProcess, PermissionDenied, TunerdError
from tunerd.base.keyedlocks import KeyedLocks
from tunerd.jobs.binding import Binder, Originals, Target
from tunerd.jobs.exclusive import ExclusiveMover
from tunerd.jobs.peer import Peer, require_owner
from tunerd.jobs.pidwatch import PidWatch
from tunerd.jobs.placement import Placement
from tunerd.jobs.records import Binding, Hold

__all__ = ["AdoptCallback", "ChangeCallback", "ExitCallback", "JobRegistry"]

log = logging.getLogger("tunerd.jobs")

ExitCallback = Callable[[int, Binding], None]
# told each binding re-adopted at start (its owner restores what it held: a reservation)
AdoptCallback = Callable[[Binding], None]
# told the pid whose binding was stored, replaced or removed (read it back with record())
ChangeCallback = Callable[[int], None]
# computes the placement (and why) once the process is pinned and its owner checked
Placing = Callable[[], "tuple[Placement | None, str | None]"]

_FORGET_RETRIES = 5  # tries to rmdir a child cpuset still busy right after an exit


@dataclass(frozen=True)
class _Ask:
    """What a caller of ``bind`` asks for."""

    placement: Placement | None
    nofile: int | None
    origin: str
    name: str | None
    lease: str | None
    cmdline: str | None
    partial: bool
    why: str | None
    persist_after: bool = False  # bind first, save right after (a rule's just-exec'd process)
    originals: Originals | None = None  # masks from before a fast bind set the CPUs already
    hold: Callable[[], Hold | None] | None = None  # what the placer holds for it, once placed


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


class JobRegistry:
    """Binds processes and remembers them until they exit or are unbound."""

    name = "jobs"

    def __init__(self, binder: Binder, records: dict[str, dict[str, Any]],
                 save: Callable[[], None], pidwatch: PidWatch, errors: ErrorLog, *,
                 dry_run: bool = False, proc_root: str = procfs.PROC,
                 mover: ExclusiveMover | None = None, bind_delay: float = 0.0) -> None:
        self.binder = binder
        self.mover = mover
        self._records = records  # the runtime store's section: JSON of self._bindings
        self._bindings: dict[int, Binding] = {}
        self._save = save
        self.pidwatch = pidwatch
        self.errors = errors
        self.dry_run = dry_run
        self.proc = proc_root
        # debug_bind_delay (tests): a placed bind waits this long before it changes anything
        self.bind_delay = bind_delay
        self._callbacks: list[ExitCallback] = []
        self._adopt_callbacks: list[AdoptCallback] = []
        self._change_callbacks: list[ChangeCallback] = []
        self._locks = KeyedLocks()  # per PID, only while in use: no state for absent PIDs
        self._save_handle: asyncio.TimerHandle | None = None
        self._unapplied: dict[int, _Unapplied] = {}
        self.binds_total = 0  # successful binds since start (tunerd_binds_total)
        # changes with every record stored or removed: a reader of jobs(live=False) keeps
        # its copy until this moves (the monitor, every cycle)
        self.version = 0

    # -- service -------------------------------------------------------------
    async def start(self) -> None:
        """Re-adopt bindings saved by a previous daemon; drop those whose process is gone."""
        changed = False
        for key, raw in list(self._records.items()):
            try:
                rec = Binding.from_json(raw)
            except ValueError:
                log.error("dropping malformed binding record %r", key)
                del self._records[key]
                changed = True
                continue
            if not self.pidwatch.watch(rec.pid, rec.start_time, "jobs", self._exited):
                log.info("pid %d exited while tunerd was down; dropping its binding", rec.pid)
                del self._records[key]
                self._forget(rec.originals)
                changed = True
                continue
            self._bindings[rec.pid] = rec
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

    def status(self) -> dict[str, Any]:
        n = len(self._bindings)
        out: dict[str, Any] = {"summary": f"{n} process{'es' if n != 1 else ''} bound",
                               "bound": n, "pids": sorted(self._bindings)}
        if self._unapplied:
            out["summary"] += f", {len(self._unapplied)} placed on the replayed topology only"
            out["not_applied"] = sorted(self._unapplied)
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
        rec = self._bindings.get(pid)
        if rec is None or rec.hold == hold:
            return
        rec = dataclasses.replace(rec, hold=hold)
        self._bindings[pid] = rec
        self._records[str(pid)] = rec.to_json()
        self._save_soon()

    def on_change(self, callback: ChangeCallback) -> None:
        """``callback(pid)`` whenever pid's binding is stored, replaced or removed (bind,
        unbind, exit): a watcher follows the bindings without listing them all."""
        self._change_callbacks.append(callback)

    def pids(self) -> list[int]:
        """The bound pids (not the replay-only placements)."""
        return list(self._bindings)

    def count_where(self, pred: Callable[[Binding], bool]) -> int:
        """Bindings ``pred`` accepts (the per-user bind count)."""
        return sum(1 for rec in list(self._bindings.values()) if pred(rec))

    def is_bound(self, pid: int) -> bool:
        return pid in self._bindings

    def record(self, pid: int) -> Binding | None:
        return self._bindings.get(pid)

    def rank_cpus(self, pid: int) -> tuple[int, frozenset[int]] | None:
        """(start time, CPUs) of ``pid`` where tunerd placed it itself (bind, rule):
        the intake's test for "descends from a bound rank" (a `run` lease's process
        is an enclosing lease instead)."""
        b = self._bindings.get(pid)
        if b is None or b.origin == "run" or not b.cpus:
            return None
        return b.start_time, b.cpu_set()

    def jobs(self, live: bool = True) -> list[dict[str, Any]]:
        """Bound processes (and replay-only placements), with live name and threads."""
        out = []
        for rec in sorted(self._bindings.values(), key=lambda r: r.pid):
            job = rec.public()
            job["applied"] = True
            if live:
                self._live(job)
            out.append(job)
        for u in sorted(self._unapplied.values(), key=lambda u: u.pid):
            job = {"pid": u.pid, "start_time": u.start_time, "uid": u.uid, "name": u.name,
                   "cmdline": u.cmdline, "origin": u.origin, "bound_at": u.at,
                   "applied": False, "lease": None, "nofile": None, "why": u.why,
                   **{k: v for k, v in u.placement.to_json().items()
                      if k in ("cpus", "mems", "gpus", "explanation", "notes")}}
            if live:
                self._live(job)
            out.append(job)
        return out

    def _live(self, job: dict[str, Any]) -> None:
        """NAME and THREADS as /proc says now (a task bound in a prolog renames itself)."""
        p = procfs.Process(int(job["pid"]), self.proc)
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

    # -- binding ---------------------------------------------------------------
    async def bind(self, pid: int, *, peer: Peer, placement: Placement | Placing | None,
                   nofile: int | None = None, origin: str = "cli", name: str | None = None,
                   lease: str | None = None, cmdline: str | None = None,
                   partial: bool = False, why: str | None = None,
                   persist_after: bool = False,
                   originals: Originals | None = None,
                   hold: Callable[[], Hold | None] | None = None) -> dict[str, Any]:
        """Bind ``pid`` to ``placement`` (and its fd limit); returns the job record plus
        what this call did. ``cmdline``: its command line where the caller read it
        already (at most 4 KiB, as a rule match has it); read from /proc otherwise.
        ``persist_after``: bind first, save the record right after (a process that
        just exec'd, bound by a rule: no write between the exec and its affinity).
        ``originals``: the masks the process had before its CPUs were set already
        (a rule's fast bind in the exec watcher, ``tunerd.jobs.autobind``): recorded
        as its originals, where /proc now shows the new mask. ``hold``: what the
        placer holds for it, asked once it is placed: saved with its first record (a
        daemon killed right after the bind holds it again when it restarts).

        A process bound before is updated: values not given keep their previous
        setting, and the originals from the first bind are kept. ``partial``: a limit
        or memory-node step the daemon may not do is left out with a note (the CPU
        binding stays), instead of failing the whole bind. Ownership is checked here,
        once, on the process pinned by pidfd; a ``placement`` given as a callable
        (returning the placement and why) is computed only after that check.
        """
        t0 = time.perf_counter()
        async with self._lock(pid):
            target = self.binder.pin(pid)
            try:
                require_owner(peer, pid, target.uid, target.euid)
                if callable(placement):
                    placement, why = placement()
                    if self.bind_delay:  # tests: a window between the placement and the bind
                        log.debug("pid %d placed; binding it in %g s (debug_bind_delay)",
                                  pid, self.bind_delay)
                        await asyncio.sleep(self.bind_delay)
                ask = _Ask(placement, nofile, origin, name, lease, cmdline, partial, why,
                           persist_after, originals, hold)
                return await self._bind(target, t0, ask)
            finally:
                target.close()

    def _previous(self, target: Target) -> Binding | None:
        prev = self._bindings.get(target.pid)
        if prev is not None and prev.start_time != target.start_time:
            self._drop(target.pid)  # an earlier process with this pid: long gone
            self._forget(prev.originals)
            return None
        return prev

    async def _bind(self, target: Target, t0: float, ask: _Ask) -> dict[str, Any]:
        pid = target.pid
        prev = self._previous(target)
        p = ask.placement
        cpus = p.cpus if p is not None else None
        mems = p.mems if p is not None else None
        if prev is not None:  # keep what was bound before unless changed now
            cpus = cpus if cpus is not None else (prev.cpu_set() or None)
            mems = mems if mems is not None else prev.mem_set()
        plan = self.binder.prepare(target, cpus=cpus, mems=mems, nofile=ask.nofile,
                                   previous=prev.originals if prev else None,
                                   partial=ask.partial, originals=ask.originals)
        if self.dry_run:
            return {"pid": pid, "dry_run": True, "cpus": _fmt(plan.cpus),
                    "mems": _fmt(plan.mems), "nofile": ask.nofile,
                    "notes": [*plan.notes, "dry run: nothing was changed"],
                    "elapsed_ms": _ms(t0)}
        on_disk = prev is not None and plan.originals == prev.originals
        moved = self.mover.originals_of(pid) if self.mover is not None and prev is None else {}
        rec = self._new_record(target, ask, plan, prev,
                               prev.originals if prev is not None and on_disk
                               else _before_moves(plan.originals, moved))
        save_ms, written = self._save_first(rec, prev, on_disk or ask.persist_after)
        result = await self._apply(plan, rec, prev, on_disk)
        if target.exited():  # exited during an executor apply: the exit handler may have run
            self._bindings.pop(pid, None)
            self._records.pop(str(pid), None)
            self._changed(pid)
            self._save_soon()
            raise NoSuchProcess(f"process {pid} exited while being bound", pid=pid)
        # what the bind really did (a partial bind may have left out mems or nofile)
        rec = dataclasses.replace(
            rec, mems=_fmt(result.mems) if result.mems is not None else (
                None if plan.cpuset is None and mems is not None else rec.mems),
            nofile=rec.nofile if result.nofile_new is not None or ask.nofile is None
            else (prev.nofile if prev else None),
            notes=tuple(result.notes), originals=_before_moves(plan.originals, moved))
        kept = self._put(rec)
        if moved and self.mover is not None:
            self.mover.disown(pid)  # the binding's originals hold the masks from before
        if self._unapplied.pop(pid, None) is not None:
            self.version += 1
        self.binds_total += 1
        if ask.persist_after and not on_disk:
            self._save_quietly()  # bound first: now its originals (and all the rest)
        elif kept != written:
            # learnt only from the change itself (a thread cloned meanwhile, a step a partial
            # bind left out, its notes), or a re-bind whose originals are on disk already:
            # coalesced. A bind that found nothing new is written once, before the change.
            self._save_soon()
        if prev is None:
            self.pidwatch.watch(pid, target.start_time, "jobs", self._exited)
        reply = rec.public()
        reply.update(result.to_json())
        reply.update(gpus=list(rec.gpus), rebind=prev is not None,
                     apply_ms=reply.pop("elapsed_ms"), save_ms=round(save_ms, 3),
                     elapsed_ms=round(_ms(t0), 3))
        return reply

    def _new_record(self, target: Target, ask: _Ask, plan: Any, prev: Binding | None,
                    originals: Originals) -> Binding:
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
            hold=(ask.hold() if ask.hold is not None else None)
            or (prev.hold if prev is not None else None), originals=originals)

    def _put(self, rec: Binding) -> dict[str, Any]:
        """Keep ``rec`` (not saved); returns its JSON as the state holds it now."""
        self._bindings[rec.pid] = rec
        raw = self._records[str(rec.pid)] = rec.to_json()
        self._changed(rec.pid)
        return raw

    def _restore(self, pid: int, prev: Binding | None) -> None:
        if prev is not None:
            self._put(prev)
        else:
            self._bindings.pop(pid, None)
            self._records.pop(str(pid), None)
            self._changed(pid)

    def _save_first(self, rec: Binding, prev: Binding | None,
                    on_disk: bool) -> tuple[float, dict[str, Any] | None]:
        """Keep the record, and save the originals before anything changes (the runtime
        store: tmpfs, no fsync; a crash of the daemon loses nothing, a reboot ends the
        process anyway). A failed write refuses the bind: nothing changed. Returns the
        milliseconds it took and the record's JSON as written (None: nothing written)."""
        raw = self._put(rec)
        t_save = time.perf_counter()
        if on_disk:
            return _ms(t_save), None
        try:
            self._save()
        except TunerdError:
            self._restore(rec.pid, prev)
            raise
        return _ms(t_save), raw

    async def _apply(self, plan: Any, rec: Binding, prev: Binding | None,
                     on_disk: bool) -> Any:
        try:
            if plan.cpuset is not None or plan.migrate_from is not None:
                # moving pages can take long for a big process: keep the loop serving
                return await asyncio.get_running_loop().run_in_executor(
                    None, self.binder.apply, plan)
            return self.binder.apply(plan)
        except BaseException:
            self._restore(rec.pid, prev)
            if not on_disk:
                self._save_quietly()
            raise

    def note_unapplied(self, pid: int, start_time: int, placement: Placement, *,
                       origin: str, name: str, cmdline: str | None = None,
                       why: str | None = None) -> None:
        """Remember a placement made on a replayed topology that was not applied here."""
        if self.is_bound(pid):
            return
        self.version += 1
        self._unapplied[pid] = _Unapplied(
            pid, start_time, procfs.read_uid(pid, self.proc), name,
            self._cmdline(pid, cmdline), placement, origin, time.time(), why)
        self.pidwatch.watch(pid, start_time, "jobs-unapplied", self._unapplied_exited)

    def _unapplied_exited(self, pid: int) -> None:
        self._unapplied.pop(pid, None)
        self.version += 1

    async def unbind(self, pid: int, *, peer: Peer) -> dict[str, Any]:
        """Restore what bind changed and forget the process."""
        async with self._lock(pid):
            rec = self._bindings.get(pid)
            target = self.binder.pin(pid)  # NoSuchProcess if it is gone
            try:
                require_owner(peer, pid, target.uid, target.euid)
                if rec is None or rec.start_time != target.start_time:
                    raise Failed(f"process {pid} is not bound by tunerd", pid=pid)
                summary = self.binder.restore(target, rec.originals)
                self._drop(pid)
            finally:
                target.close()
            notes = summary.setdefault("notes", [])
            try:
                self._save()
            except TunerdError as err:  # done already: say so, do not fail the reply
                self.errors.record("jobs", f"unbind {pid}: {err.message}", key="save")
                notes.append(f"the process is unbound, but the runtime state was not saved: "
                             f"{err.message}")
            return {**summary, "unbound": True}

    # -- internals -------------------------------------------------------------
    def _lock(self, pid: int) -> contextlib.AbstractAsyncContextManager[None]:
        return self._locks.hold(pid)

    def _drop(self, pid: int) -> Binding | None:
        """Forget a record and stop watching its process (state not saved)."""
        rec = self._bindings.pop(pid, None)
        self._records.pop(str(pid), None)
        self.pidwatch.unwatch(pid, "jobs")
        self._locks.pop(pid, None)
        self._changed(pid)
        return rec

    def _exited(self, pid: int) -> None:
        rec = self._bindings.pop(pid, None)
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
