"""JobRegistry: the processes tunerd has bound, their originals, and their exits.

State: section ``bindings`` of state.json, keyed by str(pid). A record is written
(with the originals) *before* the process is changed, so a crash loses nothing;
on start the daemon re-adopts records whose pid + start time still match and drops
the others. Exits are noticed without polling: each bound process's pidfd is a
reader on the loop and turns readable when the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from tunerd.binding import Binder, Originals, Target
from tunerd.cpulist import format_cpulist, parse_cpulist
from tunerd.daemon.registry import Peer, Request
from tunerd.errors import Failed, NoSuchProcess

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon

log = logging.getLogger("tunerd.jobs")

ExitCallback = Callable[[int, dict[str, Any]], None]
Placer = Callable[..., Awaitable[dict[str, Any]]]

_PUBLIC = ("pid", "start_time", "uid", "name", "cmdline", "cpus", "mems", "gpus", "nofile",
           "origin", "lease", "bound_at", "threads")
_FORGET_RETRIES = 5  # tries to rmdir a child cpuset still busy right after an exit


class JobRegistry:
    """Service that binds processes and remembers them (interfaces.md §3)."""

    name = "jobs"

    def __init__(self, daemon: Daemon, binder: Binder | None = None) -> None:
        self.daemon = daemon
        self.binder = binder or Binder()
        self.placer: Placer | None = None  # set by the leases area
        self._targets: dict[int, Target] = {}  # pid -> pinned process with a loop reader
        self._originals: dict[int, Originals] = {}  # pid -> parsed record["originals"]
        self._callbacks: list[ExitCallback] = []
        self._locks: dict[int, asyncio.Lock] = {}
        self._save_handle: asyncio.TimerHandle | None = None
        # records of processes that exited while the daemon was down (on_exit is not
        # called for them: other services may not have started yet); for leases etc.
        self.dropped_at_start: list[dict[str, Any]] = []
        self.binds_total = 0  # successful binds since start (tunerd_binds_total)
        daemon.jobs = self

    @property
    def _records(self) -> dict[str, dict[str, Any]]:
        recs: dict[str, dict[str, Any]] = self.daemon.state.section("bindings")
        return recs

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
            target = self.binder.adopt(pid, st)
            if target is None:
                log.info("pid %d exited while tunerd was down; dropping its binding", pid)
                del self._records[key]
                self._forget(rec)
                self.dropped_at_start.append(rec)
                changed = True
                continue
            self._watch(target)
            log.info("re-adopted binding of pid %d (cpus %s)", pid, rec.get("cpus"))
        if changed:
            self.daemon.state.save()
        for d in self.binder.sweep_stale_cpusets():
            log.info("removed child cpuset %s of a process that exited while unwatched", d)

    async def policy_changed(self) -> None:
        pass

    async def stop(self) -> None:
        """Bindings outlive the daemon (they are re-adopted on start): only let go of pidfds."""
        loop = asyncio.get_running_loop()
        for pid, target in list(self._targets.items()):
            loop.remove_reader(target.pidfd)
            target.close()
            del self._targets[pid]
        if self._save_handle is not None:
            self._save_handle.cancel()
            self.daemon.state.save()

    def status(self) -> dict[str, Any]:
        n = len(self._records)
        return {"summary": f"{n} process{'es' if n != 1 else ''} bound", "bound": n,
                "pids": sorted(int(k) for k in self._records)}

    # -- API -----------------------------------------------------------------
    def on_exit(self, callback: ExitCallback) -> None:
        self._callbacks.append(callback)

    def jobs(self) -> list[dict[str, Any]]:
        return [{k: rec.get(k) for k in _PUBLIC}
                for rec in sorted(self._records.values(), key=lambda r: int(r["pid"]))]

    def default_nofile(self) -> int | None:
        """[limits] nofile of the policy in force: for rule/lease binds (the CLI passes
        --nofile explicitly, so a plain `tunerctl bind` never touches limits)."""
        policy = getattr(self.daemon, "policy", None)
        limits = (getattr(policy, "data", None) or {}).get("limits") or {}
        value = limits.get("nofile")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def authorize(self, pid: int, peer: Peer) -> None:
        """Raise PermissionDenied unless ``peer`` may bind ``pid`` (root, or its owner)."""
        if peer.is_root:
            return
        uid, euid = self.binder.owner(pid)
        if peer.uid not in (uid, euid):
            Request(cmd="bind", args={}, peer=peer).require_owner(pid, uid)

    async def bind(self, pid: int, *, peer: Peer, cpus: frozenset[int] | None = None,
                   mems: frozenset[int] | None = None, nofile: int | None = None,
                   gpus: tuple[int, ...] = (), origin: str = "cli", name: str | None = None,
                   lease: str | None = None) -> dict[str, Any]:
        """Bind ``pid``; returns the job record plus what this call did.

        A process bound before is updated: values not given keep their previous
        setting, and the originals from the first bind are kept.
        """
        t0 = time.perf_counter()
        async with self._lock(pid):
            target = self.binder.pin(pid)
            try:
                return await self._bind(target, t0, peer=peer, cpus=cpus, mems=mems,
                                        nofile=nofile, gpus=gpus, origin=origin, name=name,
                                        lease=lease)
            finally:
                if self._targets.get(pid) is not target:
                    target.close()

    async def _bind(self, target: Target, t0: float, *, peer: Peer,
                    cpus: frozenset[int] | None, mems: frozenset[int] | None,
                    nofile: int | None, gpus: tuple[int, ...], origin: str, name: str | None,
                    lease: str | None) -> dict[str, Any]:
        pid, key = target.pid, str(target.pid)
        if not peer.is_root and peer.uid not in (target.uid, target.euid):
            Request(cmd="bind", args={}, peer=peer).require_owner(pid, target.uid)
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
        if prev is not None:  # keep what was bound before unless changed now
            if cpus is None and prev.get("cpus"):
                cpus = parse_cpulist(prev["cpus"])
            if mems is None and prev.get("mems"):
                mems = parse_cpulist(prev["mems"])
        plan = self.binder.prepare(target, cpus=cpus, mems=mems, nofile=nofile,
                                   previous=previous)
        if self.daemon.cfg.dry_run:
            return {"pid": pid, "dry_run": True, "cpus": _fmt(plan.cpus),
                    "mems": _fmt(plan.mems), "nofile": nofile,
                    "notes": [*plan.notes, "dry run: nothing was changed"],
                    "elapsed_ms": _ms(t0)}
        originals_on_disk = prev is not None and plan.originals == previous
        record: dict[str, Any] = {
            "pid": pid, "start_time": target.start_time, "uid": target.uid,
            "name": name if name is not None else (prev or {}).get("name") or self._comm(pid),
            "cmdline": prev["cmdline"] if prev is not None else self._cmdline(pid),
            "cpus": _fmt(plan.cpus), "mems": _fmt(plan.mems),
            "gpus": list(gpus) if gpus else list((prev or {}).get("gpus") or []),
            "nofile": nofile if nofile is not None else (prev or {}).get("nofile"),
            "origin": origin if prev is None or origin != "cli" else prev.get("origin", origin),
            "lease": lease if lease is not None else (prev or {}).get("lease"),
            "bound_at": time.time(),
            "threads": (prev or {}).get("threads"),
            "originals": (prev["originals"] if prev is not None and originals_on_disk
                          else plan.originals.to_json()),
        }
        n_threads_saved = len(plan.originals.threads)
        self._records[key] = record
        t_save = time.perf_counter()
        if not originals_on_disk:
            # The originals are on disk before anything changes. The directory fsync is
            # skipped: a power loss that could lose the rename also ends the process.
            self.daemon.state.save(sync_dir=False)
        # else a re-bind with nothing new to remember: what restore needs is already
        # on disk, and the new cpus/mems bookkeeping goes out with the deferred save
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
                self.daemon.state.save()
            raise
        if target.exited():  # exited during an executor apply: the exit handler may have run
            self._records.pop(key, None)
            self._save_soon()
            raise NoSuchProcess(f"process {pid} exited while being bound", pid=pid)
        record["threads"] = result.threads
        if len(plan.originals.threads) != n_threads_saved:  # threads born meanwhile
            record["originals"] = plan.originals.to_json()
        self._originals[pid] = plan.originals
        self.binds_total += 1
        self._save_soon()
        if pid not in self._targets:
            self._watch(target)
        reply = {k: record.get(k) for k in _PUBLIC}
        reply.update(result.to_json())
        reply["gpus"] = record["gpus"]
        reply["rebind"] = prev is not None
        reply["apply_ms"] = reply.pop("elapsed_ms")
        reply["save_ms"] = round(save_ms, 3)
        reply["elapsed_ms"] = round(_ms(t0), 3)
        return reply

    async def unbind(self, pid: int, *, peer: Peer) -> dict[str, Any]:
        """Restore what bind changed and forget the process."""
        async with self._lock(pid):
            key = str(pid)
            rec = self._records.get(key)
            target = self._targets.get(pid)
            own_target = target is None
            if target is None:
                target = self.binder.pin(pid)  # NoSuchProcess if it is gone
            try:
                if not peer.is_root and peer.uid not in (target.uid, target.euid):
                    Request(cmd="unbind", args={}, peer=peer).require_owner(pid, target.uid)
                if rec is None or int(rec["start_time"]) != target.start_time:
                    raise Failed(f"process {pid} is not bound by tunerd", pid=pid)
                summary = self.binder.restore(target, Originals.from_json(rec["originals"]))
                self._drop(key)
                self.daemon.state.save()
            finally:
                if own_target:
                    target.close()
            return {**summary, "unbound": True}

    # -- internals -------------------------------------------------------------
    def _lock(self, pid: int) -> asyncio.Lock:
        lock = self._locks.get(pid)
        if lock is None:
            lock = self._locks[pid] = asyncio.Lock()
        return lock

    def _watch(self, target: Target) -> None:
        self._targets[target.pid] = target
        asyncio.get_running_loop().add_reader(target.pidfd, self._exited, target.pid)

    def _drop(self, key: str) -> dict[str, Any] | None:
        """Forget a record and stop watching its process (state not saved)."""
        rec = self._records.pop(key, None)
        self._originals.pop(int(key), None)
        target = self._targets.pop(int(key), None)
        if target is not None:
            asyncio.get_running_loop().remove_reader(target.pidfd)
            target.close()
        self._locks.pop(int(key), None)
        return rec

    def _exited(self, pid: int) -> None:
        rec = self._drop(str(pid))
        log.info("bound process %d exited", pid)
        if rec is None:
            return
        self._forget(rec)
        # Deferred: a record of a dead process is harmless if a crash loses this save
        # (a restarted daemon drops records whose pid and start time no longer match),
        # and an fsync here would hold up the next exec event on the loop.
        self._save_soon()
        for cb in list(self._callbacks):
            try:
                cb(pid, rec)
            except Exception as err:
                log.exception("exit callback for pid %d failed", pid)
                self.daemon.record_error("jobs", f"exit callback for pid {pid} failed: {err!r}")

    def _forget(self, rec: dict[str, Any], tries: int = _FORGET_RETRIES) -> None:
        """Remove the child cpuset of a process that exited (retried while still busy)."""
        try:
            orig = Originals.from_json(rec["originals"])
        except (KeyError, TypeError, ValueError):
            return
        if self.binder.forget(orig) or tries <= 0:
            return
        asyncio.get_running_loop().call_later(0.2, self._forget, rec, tries - 1)

    def _comm(self, pid: int) -> str:
        try:
            return (self.binder.proc / str(pid) / "comm").read_text().strip()
        except OSError:
            return ""

    def _cmdline(self, pid: int) -> str:
        try:
            raw = (self.binder.proc / str(pid) / "cmdline").read_bytes()
        except OSError:
            return ""
        return raw.replace(b"\0", b" ").decode(errors="replace").strip()

    def _save_soon(self) -> None:
        """Coalesced save for bookkeeping that a crash may lose (thread counts)."""
        if self._save_handle is not None:
            return

        def save() -> None:
            self._save_handle = None
            self.daemon.state.save()

        self._save_handle = asyncio.get_running_loop().call_later(0.5, save)


def _fmt(ids: frozenset[int] | None) -> str | None:
    return format_cpulist(ids) if ids is not None else None


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


