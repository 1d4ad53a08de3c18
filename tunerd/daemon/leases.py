"""Leases: GPUs + CPUs reserved for a job (``tunerctl alloc`` / ``run`` / ``release``).

A lease is a placement with an owner. ``alloc`` leases live until ``release``, the
Slurm epilog, or their time limit (``[leases] alloc_ttl``); ``run`` leases belong
to the requesting tunerctl process (the socket peer's PID, from SO_PEERCRED), which
the daemon binds before tunerctl exec()s the command, so the command and all its
children inherit the CPU affinity and the memory policy. A pidfd on that PID
releases the lease when the command exits, also when tunerctl is killed before
its exec.

Placement starts from the caller's allocation: inside a Slurm job a lease takes
only the job's CPUs and GPUs (``tunerd.allocation``).

Fair use on a shared node: a non-root user holds at most ``[leases] max_per_user``
leases, and takes exclusive ones only where ``[leases] user_exclusive`` allows.

Leases are kept in the runtime state (section ``leases``) and survive a daemon
restart; a lease whose holder process died meanwhile (PID + start time) is
dropped at start.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pwd
import time
from collections.abc import Callable
from typing import Any

from tunerd import procfs
from tunerd.allocation import cvd_names, read_allocation
from tunerd.cpulist import format_cpulist, parse_cpulist
from tunerd.daemon.errorlog import ErrorLog
from tunerd.daemon.exclusive import ExclusiveMover, parse_scope
from tunerd.daemon.gate import LeaseLimits, ReservationGate
from tunerd.daemon.jobs import JobRegistry
from tunerd.daemon.pidwatch import PidWatch
from tunerd.daemon.placer import Placer, PlaceRequest, Reservation
from tunerd.daemon.router import Peer
from tunerd.errors import Failed, NoSuchProcess, PermissionDenied, TunerdError, UsageError
from tunerd.placement import Placement

__all__ = ["LeaseLimits", "LeaseService", "lease_env", "user_name"]

log = logging.getLogger("tunerd.leases")


@functools.lru_cache(maxsize=1024)
def _pw_name(uid: int) -> str:
    return pwd.getpwuid(uid).pw_name  # KeyError is not cached: a user added later is found


def user_name(uid: int | None) -> str:
    """The login name of ``uid`` for messages; the number if it has none, "?" for None."""
    if uid is None:
        return "?"
    try:
        return _pw_name(uid)
    except KeyError:
        return str(uid)


class LeaseService:
    name = "leases"

    def __init__(self, placer: Placer, jobs: JobRegistry, pidwatch: PidWatch,
                 mover: ExclusiveMover, section: dict[str, Any], save: Callable[[], None],
                 errors: ErrorLog, *, limits: Callable[[], LeaseLimits],
                 default_nofile: Callable[[], int | None],
                 gate: ReservationGate | None = None,
                 proc_root: str = procfs.PROC) -> None:
        self.placer = placer
        self.jobs = jobs
        self.pidwatch = pidwatch
        self.mover = mover
        self.errors = errors
        self._limits = limits
        self.gate = gate or ReservationGate(limits)
        self.gate.count_with(self.held_by)
        self._default_nofile = default_nofile
        self.proc = proc_root
        section.setdefault("next_id", 1)
        section.setdefault("leases", {})
        section.setdefault("moved", {})
        self.section = section
        self.leases: dict[str, dict[str, Any]] = section["leases"]
        self._save = save
        self._expiry: asyncio.TimerHandle | None = None

    # -- service -------------------------------------------------------------
    async def start(self) -> None:
        dropped = 0
        for lid, rec in list(self.leases.items()):
            pid = rec.get("pid")
            if pid is not None and not self.pidwatch.watch(
                    pid, rec.get("start_time"), f"lease:{lid}", self._holder_exited):
                log.info("lease %s: holder pid %d exited while tunerd was down; dropped",
                         lid, pid)
                self._drop(lid, save=False)
                dropped += 1
                continue
            self.placer.reserve(self._reservation(rec))
        # exclusive moves whose job is gone (daemon was down when it ended): put back
        for key in list(self.mover.moved):
            if key.startswith("lease:") and key[6:] not in self.leases:
                self.mover.restore(key)
        if dropped:
            self._save_quietly()
        self._schedule_expiry()

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()

    def status(self) -> dict[str, Any]:
        n = len(self.leases)
        gpus = sorted(g for r in self.leases.values() for g in r["gpus"])
        return {"summary": f"{n} lease(s)" + (f" holding GPU(s) {','.join(map(str, gpus))}"
                                              if gpus else ""),
                "leases": n}

    # -- queries -------------------------------------------------------------
    def list_leases(self) -> list[dict[str, Any]]:
        return [self._public(r) for r in sorted(self.leases.values(),
                                                key=lambda r: int(r["id"][1:]))]

    def _holder(self, rec: dict[str, Any]) -> str:
        who = f"lease {rec['id']} ({rec['user']}"
        if rec.get("pid"):
            who += f", pid {rec['pid']}"
            if rec.get("cmd"):
                who += f" {os.path.basename(rec['cmd'][0])}"
        return who + ")"

    def _reservation(self, rec: dict[str, Any]) -> Reservation:
        return Reservation(key=f"lease:{rec['id']}", holder=self._holder(rec),
                           gpus=tuple(rec["gpus"]), cpus=parse_cpulist(rec["cpus"]),
                           exclusive=bool(rec.get("exclusive")), soft=True,
                           pid=rec.get("pid"))

    # -- alloc / run / release ----------------------------------------------
    def _check(self, peer: Peer, gpus: int, ncpus: int | None, exclusive: bool,
               scope: str | None) -> None:
        if gpus < 0:
            raise UsageError(f"--gpus must be 0 or more, got {gpus}")
        if ncpus is not None and ncpus < 1:
            raise UsageError(f"--ncpus must be 1 or more, got {ncpus}")
        if scope is not None:
            if not exclusive:
                raise UsageError("an exclusive scope needs --exclusive")
            parse_scope(scope)
        self.gate.admit(peer, exclusive=exclusive)  # one gate: tunerd.daemon.gate

    def held_by(self, uid: int) -> int:
        """Leases ``uid`` holds (the gate counts them with its other reservations)."""
        return sum(1 for r in self.leases.values() if r["uid"] == uid)

    def _environ(self, pid: int) -> dict[str, str]:
        """The caller's environment (up to 1 MiB): read once per request, used for its
        allocation and for naming its GPUs."""
        return procfs.read_environ(pid, self.proc) or {}

    def _request(self, peer: Peer, env: dict[str, str], *, gpus: int, ncpus: int | None,
                 cpus: frozenset[int] | None, exclusive: bool, workers: int) -> PlaceRequest:
        alloc = read_allocation(peer.pid, env, self.placer.topo, online=self.placer.host.cpus)
        return PlaceRequest(gpus=gpus, ncpus=ncpus, cpus=cpus, exclusive=exclusive,
                            allocation=alloc, workers=workers, what="lease")

    def _new_record(self, peer: Peer, placed: Placement, *, exclusive: bool,
                    scope: str | None, origin: str, pid: int | None = None,
                    cmd: list[str] | None = None, tag: str | None = None) -> dict[str, Any]:
        lid = f"L{self.section['next_id']}"
        self.section["next_id"] += 1
        now = time.time()
        ttl = self._limits().alloc_ttl
        return {
            "id": lid, "uid": peer.uid, "user": user_name(peer.uid), "origin": origin,
            "pid": pid, "start_time": procfs.read_start_time(pid, self.proc) if pid else None,
            "cmd": cmd, "tag": tag, "created": now,
            "expires": now + ttl if pid is None and ttl > 0 else None,
            "exclusive": exclusive, "scope": scope,
            "gpus": list(placed.gpus), "gpu_uuids": list(placed.gpu_uuids),
            "cpus": format_cpulist(placed.cpus or frozenset()),
            "mems": format_cpulist(placed.mems or frozenset()),
            "explanation": placed.explanation, "applied": placed.applicable,
            "notes": list(placed.notes),
        }

    def _name_gpus(self, rec: dict[str, Any], env: dict[str, str]) -> None:
        """CUDA_VISIBLE_DEVICES for the lease in the caller's own numbering."""
        names = cvd_names(self.placer.topo, env)
        if names and rec["gpus"] and all(g in names for g in rec["gpus"]):
            cvd = ",".join(names[g] for g in rec["gpus"])
            if cvd != ",".join(str(g) for g in rec["gpus"]):
                rec["cvd"] = cvd

    def _commit(self, rec: dict[str, Any]) -> None:
        """Keep a new lease: reserve its place and save; nothing is kept if the save fails."""
        self.leases[rec["id"]] = rec
        self.placer.reserve(self._reservation(rec))
        try:
            self._save()
        except TunerdError as err:
            self.leases.pop(rec["id"], None)
            self.placer.release(f"lease:{rec['id']}")
            raise Failed(f"lease not made: {err.message}") from err

    async def alloc(self, peer: Peer, *, gpus: int, ncpus: int | None,
                    cpus: frozenset[int] | None = None, exclusive: bool = False,
                    scope: str | None = None, tag: str | None = None,
                    workers: int = 0) -> dict[str, Any]:
        self._check(peer, gpus, ncpus, exclusive, scope)
        env = self._environ(peer.pid)
        placed = self.placer.place(self._request(peer, env, gpus=gpus, ncpus=ncpus,
                                                 cpus=cpus, exclusive=exclusive,
                                                 workers=workers))
        rec = self._new_record(peer, placed, exclusive=exclusive, scope=scope, origin="alloc",
                               tag=tag)
        self._name_gpus(rec, env)
        self._commit(rec)
        try:
            await self._exclusive(rec, None, peer)
        except BaseException:
            self._drop(rec["id"])  # nothing half-made: no lease without its exclusivity
            raise
        self._save_or_note(rec)
        self._schedule_expiry()
        log.info("lease %s for %s: GPUs %s CPUs %s", rec["id"], rec["user"], rec["gpus"],
                 rec["cpus"])
        return self._public(rec)

    async def run(self, peer: Peer, *, gpus: int, ncpus: int | None,
                  cpus: frozenset[int] | None = None, exclusive: bool = False,
                  scope: str | None = None, cmd: list[str], tag: str | None = None,
                  workers: int = 0) -> dict[str, Any]:
        """Lease for the peer process itself, bound before it exec()s ``cmd``."""
        self._check(peer, gpus, ncpus, exclusive, scope)
        pid = peer.pid
        uid = procfs.read_uid(pid, self.proc)
        if uid is None:
            raise NoSuchProcess(f"process {pid} (the caller) is gone", pid=pid)
        if uid != peer.uid and not peer.is_root:
            raise PermissionDenied(f"process {pid} is not yours", pid=pid)
        env = self._environ(pid)
        placed = self.placer.place(self._request(peer, env, gpus=gpus, ncpus=ncpus,
                                                 cpus=cpus, exclusive=exclusive,
                                                 workers=workers))
        rec = self._new_record(peer, placed, exclusive=exclusive, scope=scope, origin="run",
                               pid=pid, cmd=cmd[:8], tag=tag)
        self._name_gpus(rec, env)
        lid = rec["id"]
        self._commit(rec)
        if not self.pidwatch.watch(pid, rec["start_time"], f"lease:{lid}",
                                   self._holder_exited):
            self._drop(lid)
            raise NoSuchProcess(f"process {pid} exited before its lease was made", pid=pid)
        try:
            if placed.applicable:
                try:
                    job = await self.jobs.bind(
                        pid, peer=peer, placement=Placement(
                            cpus=placed.cpus, mems=self.placer.bindable_mems(placed.mems),
                            gpus=placed.gpus,
                            explanation=placed.explanation),
                        nofile=self._default_nofile(), origin="run",
                        name=os.path.basename(cmd[0]) if cmd else None, lease=lid,
                        partial=True)
                except PermissionDenied as err:
                    if "CAP_SYS_NICE" not in err.message:
                        raise
                    # a process may set its own CPUs: tunerctl does, before it execs
                    rec["notes"].append(f"{err.message}; tunerctl binds itself to CPUs "
                                        f"{rec['cpus']} before it runs the command")
                else:
                    rec["cpus_bound"] = job.get("cpus")
                    rec["notes"].extend(job.get("notes") or [])
            await self._exclusive(rec, pid, peer)
        except BaseException:
            self._drop(lid)
            raise
        self._save_or_note(rec)
        return self._public(rec)

    async def _exclusive(self, rec: dict[str, Any], pid: int | None, peer: Peer) -> None:
        if not (rec["exclusive"] and rec["scope"]):
            return
        if not rec["applied"]:
            rec["notes"].append(f"exclusive scope {rec['scope']}: nothing moved (not applied)")
            return
        res = self.mover.move_off(f"lease:{rec['id']}", rec["scope"],
                                  parse_cpulist(rec["cpus"]), pid, peer.uid)
        rec["moved"] = res["moved"]
        rec["notes"].extend(res["notes"])

    async def release_tagged(self, peer: Peer, tag: str) -> dict[str, Any]:
        """Release every lease with ``tag`` that ``peer`` may release (all, for root)."""
        tagged = [lid for lid, r in self.leases.items() if r.get("tag") == tag]
        mine = [lid for lid in tagged if peer.is_root or self.leases[lid]["uid"] == peer.uid]
        if tagged and not mine:
            raise PermissionDenied(
                f"the {len(tagged)} lease(s) tagged {tag!r} belong to other users; uid "
                f"{peer.uid} may only release its own", tag=tag)
        out = []
        for lid in mine:
            out.append(await self.release(peer, lid, save=False))
        notes: list[str] = []
        if mine:
            try:
                self._save()
            except TunerdError as err:
                self.errors.record("leases", f"release --tag {tag}: {err.message}", key="save")
                notes.append(f"released, but the runtime state was not saved: {err.message}")
        return {"tag": tag, "released": out, "notes": notes}

    async def release(self, peer: Peer, lid: str, save: bool = True) -> dict[str, Any]:
        rec = self.leases.get(lid)
        if rec is None:
            known = ", ".join(sorted(self.leases)) or "none"
            raise Failed(f"no lease {lid!r} (current leases: {known})", lease=lid)
        if not peer.is_root and rec["uid"] != peer.uid:
            raise PermissionDenied(
                f"lease {lid} belongs to {rec['user']} (uid {rec['uid']}); uid {peer.uid} "
                "may only release its own leases", lease=lid)
        pid = rec.get("pid")
        if pid:
            job = self.jobs.record(pid)
            if job is not None and job.get("lease") == lid:
                try:
                    await self.jobs.unbind(pid, peer=peer)
                except TunerdError as err:
                    log.warning("lease %s: unbinding pid %d: %s", lid, pid, err.message)
        out = self._public(rec)
        out["released"] = True
        self._drop(lid, save=False)
        if save:
            try:
                self._save()
            except TunerdError as err:  # released already: the reply must say so truthfully
                self.errors.record("leases", f"release {lid}: {err.message}", key="save")
                out.setdefault("notes", []).append(
                    f"released, but the runtime state was not saved: {err.message}")
        return out

    def _holder_exited(self, pid: int) -> None:
        for lid, rec in list(self.leases.items()):
            if rec.get("pid") == pid:
                log.info("lease %s released: holder pid %d exited", lid, pid)
                self._drop(lid)

    def _drop(self, lid: str, save: bool = True) -> None:
        rec = self.leases.pop(lid, None)
        if rec is None:
            return
        self.placer.release(f"lease:{lid}")
        if rec.get("pid"):
            self.pidwatch.unwatch(rec["pid"], f"lease:{lid}")
        if f"lease:{lid}" in self.mover.moved:
            self.mover.restore(f"lease:{lid}")
        if save:
            self._save_quietly()

    def _save_quietly(self) -> None:
        try:
            self._save()
        except TunerdError as err:
            self.errors.record("leases", err.message, key="save")
        else:
            self.errors.resolve("leases", "save")

    def _save_or_note(self, rec: dict[str, Any]) -> None:
        try:
            self._save()
        except TunerdError as err:
            self.errors.record("leases", err.message, key="save")
            rec["notes"].append(f"runtime state not saved: {err.message}")

    # -- expiry of alloc leases ---------------------------------------------------
    def _schedule_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        due = [r["expires"] for r in self.leases.values() if r.get("expires")]
        if not due:
            return
        delay = max(0.0, min(due) - time.time())
        self._expiry = asyncio.get_running_loop().call_later(min(delay, 3600.0), self._expire)

    def _expire(self) -> None:
        self._expiry = None
        now = time.time()
        gone = [lid for lid, r in self.leases.items() if r.get("expires") and r["expires"] <= now]
        for lid in gone:
            rec = self.leases[lid]
            log.info("lease %s of %s expired (alloc_ttl); released", lid, rec["user"])
            self._drop(lid, save=False)
        if gone:
            self._save_quietly()
        self._schedule_expiry()

    def _public(self, rec: dict[str, Any]) -> dict[str, Any]:
        out = dict(rec)
        out["env"] = lease_env(rec)
        if rec.get("cvd"):  # the job's own numbering of its GPUs (Slurm renumbers them)
            out["env"]["CUDA_VISIBLE_DEVICES"] = rec["cvd"]
        out["lease"] = rec["id"]
        return out


def lease_env(rec: dict[str, Any]) -> dict[str, str]:
    """Environment a job in this lease should run with (printed by alloc, set by run).

    CUDA_VISIBLE_DEVICES lists GPU *indices* in PCI bus order (NVML's and
    nvidia-smi's numbering), hence CUDA_DEVICE_ORDER=PCI_BUS_ID; the UUIDs are
    in TUNERD_GPU_UUIDS for containers that renumber devices.
    """
    gpus = rec["gpus"]
    ncpus = len(parse_cpulist(rec["cpus"]))
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TUNERD_LEASE": rec["id"],
        "TUNERD_CPUS": rec["cpus"],
        "TUNERD_MEMS": rec["mems"],
        "TUNERD_GPU_UUIDS": ",".join(rec.get("gpu_uuids") or []),
        # one process per GPU is the usual layout: split the CPUs between them
        "OMP_NUM_THREADS": str(max(1, ncpus // max(1, len(gpus)))),
    }
