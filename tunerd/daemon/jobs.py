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
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tunerd import procfs
from tunerd.binding import Binder, Originals, Target
from tunerd.cpulist import format_cpulist, parse_cpulist
from tunerd.daemon.errorlog import ErrorLog
from tunerd.daemon.exclusive import ExclusiveMover
from tunerd.daemon.keyedlocks import KeyedLocks
from tunerd.daemon.pidwatch import PidWatch
from tunerd.daemon.router import Peer, require_owner
from tunerd.errors import Failed, NoSuchProcess, PermissionDenied, TunerdError
from tunerd.placement import Placement

__all__ = ["ExitCallback", "JobRegistry"]

log = logging.getLogger("tunerd.jobs")

ExitCallback = Callable[[int, dict[str, Any]], None]

# fields of a record shown by `tunerctl jobs` (besides the live ones)
_PUBLIC = ("pid", "start_time", "uid", "name", "cmdline", "cpus", "mems", "gpus", "nofile",
           "origin", "lease", "bound_at", "explanation", "notes")
_FORGET_RETRIES = 5  # tries to rmdir a child cpuset still busy right after an exit


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


class JobRegistry:
    """Binds processes and remembers them until they exit or are unbound."""

    name = "jobs"

    def __init__(self, binder: Binder, records: dict[str, dict[str, Any]],
                 save: Callable[[], None], pidwatch: PidWatch, errors: ErrorLog, *,
                 dry_run: bool = False, proc_root: str = procfs.PROC,
                 mover: ExclusiveMover | None = None) -> None:
        self.binder = binder
        self.mover = mover
        self._records = records
        self._save = save
        self.pidwatch = pidwatch
        self.errors = errors
        self.dry_run = dry_run
        self.proc = proc_root
        self._originals: dict[int, Originals] = {}  # pid -> parsed record["originals"]
        self._callbacks: list[ExitCallback] = []
        self._locks = KeyedLocks()  # per PID, only while in use: no state for absent PIDs
        self._save_handle: asyncio.TimerHandle | None = None
        self._unapplied: dict[int, _Unapplied] = {}
        self.binds_total = 0  # successful binds since start (tunerd_binds_total)

    # -- service -------------------------------------------------------------
    async def start(self) -> None:
        """Re-adopt bindings saved by a previous daemon; drop those whose process is gone."""
        changed = False
        for key, rec in list(self._records.items()):
            try:
                pid, st = int(rec["pid"]), int(rec["start_time"])
            except (KeyError, TypeError, ValueError):
                log.error("dropping malformed binding record %r", key)
                del self._records[key]
                changed = True
                continue
            if not self.pidwatch.watch(pid, st, "jobs", self._exited):
                log.info("pid %d exited while tunerd was down; dropping its binding", pid)
                del self._records[key]
                self._forget(rec)
                changed = True
                continue
            log.info("re-adopted binding of pid %d (cpus %s)", pid, rec.get("cpus"))
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
        n = len(self._records)
        out: dict[str, Any] = {"summary": f"{n} process{'es' if n != 1 else ''} bound",
                               "bound": n, "pids": sorted(int(k) for k in self._records)}
        if self._unapplied:
            out["summary"] += f", {len(self._unapplied)} placed on the replayed topology only"
            out["not_applied"] = sorted(self._unapplied)
        return out

    # -- queries -------------------------------------------------------------
    def on_exit(self, callback: ExitCallback) -> None:
        self._callbacks.append(callback)

    def is_bound(self, pid: int) -> bool:
        return str(pid) in self._records

    def record(self, pid: int) -> dict[str, Any] | None:
        rec = self._records.get(str(pid))
        return dict(rec) if rec is not None else None

    def jobs(self, live: bool = True) -> list[dict[str, Any]]:
        """Bound processes (and replay-only placements), with live name and threads."""
        out = []
        for rec in sorted(self._records.values(), key=lambda r: int(r["pid"])):
            job = {k: rec.get(k) for k in _PUBLIC}
            job["applied"] = True
            if live:
                self._live(job)
            out.append(job)
        for u in sorted(self._unapplied.values(), key=lambda u: u.pid):
            job = {"pid": u.pid, "start_time": u.start_time, "uid": u.uid, "name": u.name,
                   "cmdline": u.cmdline, "origin": u.origin, "bound_at": u.at,
                   "applied": False, "lease": None, "nofile": None,
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
    def authorize(self, pid: int, peer: Peer) -> None:
        """Raise PermissionDenied unless ``peer`` may bind ``pid`` (root, or its owner)."""
        if not peer.is_root:
            require_owner(peer, pid, *self.binder.owner(pid))

    async def bind(self, pid: int, *, peer: Peer, placement: Placement | None,
                   nofile: int | None = None, origin: str = "cli", name: str | None = None,
                   lease: str | None = None, cmdline: str | None = None,
                   partial: bool = False, persist_after: bool = False) -> dict[str, Any]:
        """Bind ``pid`` to ``placement`` (and its fd limit); returns the job record plus
        what this call did. ``cmdline``: its command line where the caller read it
        already (at most 4 KiB, as a rule match has it); read from /proc otherwise.
        ``persist_after``: bind first, save the record right after (a process that
        just exec'd, bound by a rule: no write between the exec and its affinity).

        A process bound before is updated: values not given keep their previous
        setting, and the originals from the first bind are kept. ``partial``: a limit
        or memory-node step the daemon may not do is left out with a note (the CPU
        binding stays), instead of failing the whole bind.
        """
        t0 = time.perf_counter()
        async with self._lock(pid):
            target = self.binder.pin(pid)
            try:
                return await self._bind(target, t0, peer=peer, placement=placement,
                                        nofile=nofile, origin=origin, name=name, lease=lease,
                                        cmdline=cmdline, partial=partial,
                                        persist_after=persist_after)
            finally:
                target.close()

    async def _bind(self, target: Target, t0: float, *, peer: Peer,
                    placement: Placement | None, nofile: int | None, origin: str,
                    name: str | None, lease: str | None, cmdline: str | None,
                    partial: bool, persist_after: bool = False) -> dict[str, Any]:
        pid, key = target.pid, str(target.pid)
        require_owner(peer, pid, target.uid, target.euid)
        cpus = placement.cpus if placement is not None else None
        mems = placement.mems if placement is not None else None
        prev = self._records.get(key)
        if prev is not None and int(prev["start_time"]) != target.start_time:
            self._drop(key)  # an earlier process with this pid: long gone
            self._forget(prev)
            prev = None
        previous: Originals | None = None
        if prev is not None:
            previous = self._originals.get(pid)  # parsed once, not on every re-bind
            if previous is None or previous.start_time != target.start_time:
                previous = Originals.from_json(prev["originals"])
            # keep what was bound before unless changed now
            if cpus is None and prev.get("cpus"):
                cpus = parse_cpulist(prev["cpus"])
            if mems is None and prev.get("mems"):
                mems = parse_cpulist(prev["mems"])
        plan = self.binder.prepare(target, cpus=cpus, mems=mems, nofile=nofile,
                                   previous=previous, partial=partial)
        if self.dry_run:
            return {"pid": pid, "dry_run": True, "cpus": _fmt(plan.cpus),
                    "mems": _fmt(plan.mems), "nofile": nofile,
                    "notes": [*plan.notes, "dry run: nothing was changed"],
                    "elapsed_ms": _ms(t0)}
        originals_on_disk = prev is not None and plan.originals == previous
        moved = self.mover.originals_of(pid) if self.mover is not None and prev is None else {}
        gpus = placement.gpus if placement is not None and placement.gpus else None
        record: dict[str, Any] = {
            "pid": pid, "start_time": target.start_time, "uid": target.uid,
            "name": name if name is not None else (prev or {}).get("name") or self._comm(pid),
            "cmdline": prev["cmdline"] if prev is not None else self._cmdline(pid, cmdline),
            "cpus": _fmt(plan.cpus), "mems": _fmt(plan.mems),
            "gpus": list(gpus) if gpus else list((prev or {}).get("gpus") or []),
            "nofile": nofile if nofile is not None else (prev or {}).get("nofile"),
            "origin": origin if prev is None or origin != "cli" else prev.get("origin", origin),
            "lease": lease if lease is not None else (prev or {}).get("lease"),
            "bound_at": time.time(),
            "explanation": (placement.explanation if placement is not None
                            and placement.explanation else (prev or {}).get("explanation")),
            "notes": [],
            "originals": (prev["originals"] if prev is not None and originals_on_disk
                          else _before_moves(plan.originals, moved).to_json()),
        }
        n_threads_saved = len(plan.originals.threads)
        child_saved = plan.originals.cpuset_child
        self._records[key] = record
        t_save = time.perf_counter()
        if not originals_on_disk and not persist_after:
            # The originals are written before anything changes (the runtime store:
            # tmpfs, no fsync; a crash of the daemon loses nothing, a reboot ends the
            # process anyway). A failed write refuses the bind: nothing changed.
            try:
                self._save()
            except TunerdError:
                if prev is not None:
                    self._records[key] = prev
                else:
                    self._records.pop(key, None)
                raise
        save_ms = _ms(t_save)
        try:
            if plan.cpuset is not None or plan.migrate_from is not None:
                # moving pages can take long for a big process: keep the loop serving
                result = await asyncio.get_running_loop().run_in_executor(
                    None, self.binder.apply, plan)
            else:
                result = self.binder.apply(plan)
        except BaseException:
            if prev is not None:
                self._records[key] = prev
            else:
                self._records.pop(key, None)
            if not originals_on_disk:
                self._save_quietly()
            raise
        if target.exited():  # exited during an executor apply: the exit handler may have run
            self._records.pop(key, None)
            self._save_soon()
            raise NoSuchProcess(f"process {pid} exited while being bound", pid=pid)
        # what the bind really did (a partial bind may have left out mems or nofile)
        record["mems"] = _fmt(result.mems) if result.mems is not None else (
            None if plan.cpuset is None and mems is not None else record["mems"])
        if result.nofile_new is None and nofile is not None:
            record["nofile"] = (prev or {}).get("nofile")
        record["notes"] = list(result.notes)
        originals = _before_moves(plan.originals, moved)
        # threads born meanwhile, or a memory-node step left out (its child cpuset gone)
        if (len(plan.originals.threads) != n_threads_saved
                or plan.originals.cpuset_child != child_saved):
            record["originals"] = originals.to_json()
        self._originals[pid] = originals
        if moved and self.mover is not None:
            self.mover.disown(pid)  # the binding's originals hold the masks from before
        self._unapplied.pop(pid, None)
        self.binds_total += 1
        if persist_after and not originals_on_disk:
            self._save_quietly()  # bound first: now its originals
        self._save_soon()
        if prev is None:
            self.pidwatch.watch(pid, target.start_time, "jobs", self._exited)
        reply = {k: record.get(k) for k in _PUBLIC}
        reply.update(result.to_json())
        reply["gpus"] = record["gpus"]
        reply["rebind"] = prev is not None
        reply["apply_ms"] = reply.pop("elapsed_ms")
        reply["save_ms"] = round(save_ms, 3)
        reply["elapsed_ms"] = round(_ms(t0), 3)
        return reply

    def note_unapplied(self, pid: int, start_time: int, placement: Placement, *,
                       origin: str, name: str, cmdline: str | None = None) -> None:
        """Remember a placement made on a replayed topology that was not applied here."""
        if self.is_bound(pid):
            return
        self._unapplied[pid] = _Unapplied(
            pid, start_time, procfs.read_uid(pid, self.proc), name,
            self._cmdline(pid, cmdline), placement, origin, time.time())
        self.pidwatch.watch(pid, start_time, "jobs-unapplied", self._unapplied_exited)

    def _unapplied_exited(self, pid: int) -> None:
        self._unapplied.pop(pid, None)

    async def unbind(self, pid: int, *, peer: Peer) -> dict[str, Any]:
        """Restore what bind changed and forget the process."""
        async with self._lock(pid):
            key = str(pid)
            rec = self._records.get(key)
            target = self.binder.pin(pid)  # NoSuchProcess if it is gone
            try:
                require_owner(peer, pid, target.uid, target.euid)
                if rec is None or int(rec["start_time"]) != target.start_time:
                    raise Failed(f"process {pid} is not bound by tunerd", pid=pid)
                summary = self.binder.restore(target, Originals.from_json(rec["originals"]))
                self._drop(key)
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

    def _drop(self, key: str) -> dict[str, Any] | None:
        """Forget a record and stop watching its process (state not saved)."""
        rec = self._records.pop(key, None)
        self._originals.pop(int(key), None)
        self.pidwatch.unwatch(int(key), "jobs")
        self._locks.pop(int(key), None)
        return rec

    def _exited(self, pid: int) -> None:
        rec = self._records.pop(str(pid), None)
        self._originals.pop(pid, None)
        self._locks.pop(pid, None)
        log.info("bound process %d exited", pid)
        if rec is None:
            return
        self._forget(rec)
        # Deferred: a record of a dead process is harmless if a crash loses this save
        # (a restarted daemon drops records whose pid and start time no longer match).
        self._save_soon()
        for cb in list(self._callbacks):
            try:
                cb(pid, rec)
            except Exception as err:
                log.exception("exit callback for pid %d failed", pid)
                self.errors.record("jobs", f"exit callback for pid {pid} failed: {err!r}")

    def _forget(self, rec: dict[str, Any], tries: int = _FORGET_RETRIES) -> None:
        """Remove the child cpuset of a process that exited (retried while still busy)."""
        try:
            orig = Originals.from_json(rec["originals"])
        except (KeyError, TypeError, ValueError):
            return
        if self.binder.forget(orig) or tries <= 0:
            return
        try:
            asyncio.get_running_loop().call_later(0.2, self._forget, rec, tries - 1)
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
