"""Leases: GPUs + CPUs reserved for a job (``tunerctl alloc`` / ``run`` / ``release``).

A lease is a placement with an owner. ``alloc`` leases live until ``release``;
``run`` leases belong to the requesting tunerctl process (the socket peer's
PID, from SO_PEERCRED), which the daemon binds before tunerctl exec()s the
command, so the command and all its children inherit the CPU affinity and the
memory policy. A pidfd on that PID releases the lease when the command exits,
also when tunerctl is killed before its exec.

Leases are kept in state.json (section ``leases``) and survive a daemon
restart; a lease whose holder process died meanwhile (PID + start time) is
dropped at start.
"""

from __future__ import annotations

import logging
import os
import pwd
import time
from typing import TYPE_CHECKING, Any

from tunerd.cpulist import CpuListError, format_cpulist, parse_cpulist
from tunerd.daemon.autobind import AutoBinder
from tunerd.daemon.exclusive import ExclusiveMover, parse_scope
from tunerd.daemon.pidwatch import PidWatch
from tunerd.daemon.placer import (
    HostCapacity,
    PlacedJob,
    applicability,
    gpus_from_env,
    gpus_from_nvml,
    per_gpu_cpu_share,
)
from tunerd.errors import Failed, NoSuchProcess, PermissionDenied, TunerdError, UsageError
from tunerd.watch import procfs

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon
    from tunerd.daemon.registry import Peer

__all__ = ["LeaseService"]

log = logging.getLogger("tunerd.leases")


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class LeaseService:
    name = "leases"

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        daemon.leases = self
        sec = daemon.state.section("leases")
        sec.setdefault("next_id", 1)
        sec.setdefault("leases", {})
        sec.setdefault("moved", {})
        self.section: dict[str, Any] = sec
        self.leases: dict[str, dict[str, Any]] = sec["leases"]
        self.pidwatch = PidWatch()
        self.mover = ExclusiveMover(daemon, sec["moved"])
        self.autobind = AutoBinder(daemon, self)
        self.host = HostCapacity.read()

    # -- service -------------------------------------------------------------
    async def start(self) -> None:
        dropped = 0
        for lid, rec in list(self.leases.items()):
            pid = rec.get("pid")
            if pid is None:
                continue
            if not self.pidwatch.watch(pid, rec.get("start_time"), f"lease:{lid}",
                                       self._holder_exited):
                log.info("lease %s: holder pid %d exited while tunerd was down; dropped",
                         lid, pid)
                self._drop(lid, save=False)
                dropped += 1
        # exclusive moves whose job is gone (daemon was down when it ended): put back
        for key in list(self.mover.moved):
            if key.startswith("lease:") and key[6:] not in self.leases:
                self.mover.restore(key)
        if dropped:
            self.d.state.save()
        if self.d.jobs is not None:
            self.d.jobs.placer = self.place_for_bind
        self.autobind.restore_moves()

    async def policy_changed(self) -> None:
        await self.autobind.policy_changed()

    async def stop(self) -> None:
        self.autobind.stop()
        self.pidwatch.close()

    def status(self) -> dict[str, Any]:
        n = len(self.leases)
        gpus = sorted(g for r in self.leases.values() for g in r["gpus"])
        ab = self.autobind.status()
        return {
            "summary": f"{n} lease(s)" + (f" holding GPU(s) {','.join(map(str, gpus))}"
                                          if gpus else "") + f"; {ab['summary']}",
            "leases": self.list_leases(),
            "autobind": ab,
        }

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

    def busy_gpus(self) -> dict[int, str]:
        """GPUs held by leases, and used by processes that rules bound near them."""
        out = self.autobind.busy_gpus()
        out.update({g: self._holder(r) for r in self.leases.values() for g in r["gpus"]})
        return out

    def exclusive_cpus(self, soft: bool = False) -> dict[int, str]:
        """CPUs no other placement may take (``soft``: also every non-exclusive lease's).

        Exclusive leases and processes bound by exclusive rules hold theirs.
        """
        out: dict[int, str] = self.autobind.exclusive_cpus()
        for r in self.leases.values():
            if r.get("exclusive") or soft:
                for c in parse_cpulist(r["cpus"]):
                    out.setdefault(c, self._holder(r))
        return out

    def housekeeping(self) -> frozenset[int]:
        policy = self.d.policy.data if self.d.policy else {}
        hk = (policy.get("cpu") or {}).get("housekeeping")
        if not hk:
            return frozenset()
        try:
            return parse_cpulist(str(hk))
        except CpuListError:
            return frozenset()

    # -- placement -----------------------------------------------------------
    def place(self, *, gpus: int = 0, cpus: int | None = None, exclusive: bool = False,
              gpu_ids: tuple[int, ...] | None = None, mode: str = "gpu-local",
              busy: dict[int, str] | None = None,
              extra_exclusive: dict[int, str] | None = None,
              allowed_cpus: frozenset[int] | None = None) -> PlacedJob:
        """Place on the topology in force, avoiding leased GPUs and exclusive CPUs.

        First try also keeps clear of every other lease's CPUs; if that cannot
        be met, only exclusive leases' CPUs are off limits.
        """
        from tunerd.placement import PlacementRequest
        from tunerd.placement import place as do_place

        topo = self.d.topology
        busy = self.busy_gpus() if busy is None else busy
        hk = self.housekeeping()
        if gpus and cpus is None:
            share = per_gpu_cpu_share(topo, gpu_ids[0] if gpu_ids else
                                      int(topo.gpus[0].index) if topo.gpus else -1, hk)
            cpus = share * gpus
        req = PlacementRequest(gpus=gpus, cpus=cpus, mode=mode, exclusive=exclusive,
                               gpu_ids=gpu_ids)
        hard = {**self.exclusive_cpus(), **(extra_exclusive or {})}
        soft = {**self.exclusive_cpus(soft=True), **hard}
        try:
            p = do_place(topo, req, busy_gpus=busy, exclusive_cpus=soft, housekeeping=hk,
                         allowed_cpus=allowed_cpus)
        except TunerdError:
            if soft == hard:
                raise
            p = do_place(topo, req, busy_gpus=busy, exclusive_cpus=hard, housekeeping=hk,
                         allowed_cpus=allowed_cpus)
        ok, notes = applicability(topo, frozenset(p.cpus), frozenset(p.mems), self.host)
        if ok and self.d.cfg.dry_run:
            ok = False
            notes.append("dry run: placement computed, nothing was bound or moved")
        return PlacedJob(tuple(p.gpus), tuple(p.gpu_uuids), frozenset(p.cpus),
                         frozenset(p.mems), p.explanation, tuple(notes), ok)

    # -- alloc / run / release ----------------------------------------------
    def _validate(self, gpus: int, cpus: int | None, exclusive: bool,
                  scope: str | None) -> None:
        if gpus < 0:
            raise UsageError(f"--gpus must be 0 or more, got {gpus}")
        if cpus is not None and cpus < 1:
            raise UsageError(f"--cpus must be 1 or more, got {cpus}")
        if scope is not None:
            if not exclusive:
                raise UsageError("an exclusive scope needs --exclusive")
            parse_scope(scope)

    def _new_record(self, peer: Peer, placed: PlacedJob, *, exclusive: bool,
                    scope: str | None, origin: str, pid: int | None = None,
                    cmd: list[str] | None = None, tag: str | None = None) -> dict[str, Any]:
        lid = f"L{self.section['next_id']}"
        self.section["next_id"] += 1
        return {
            "id": lid, "uid": peer.uid, "user": user_name(peer.uid), "origin": origin,
            "pid": pid, "start_time": procfs.read_start_time(pid) if pid else None,
            "cmd": cmd, "tag": tag, "created": time.time(), "exclusive": exclusive, "scope": scope,
            "gpus": list(placed.gpus), "gpu_uuids": list(placed.gpu_uuids),
            "cpus": format_cpulist(placed.cpus), "mems": format_cpulist(placed.mems),
            "explanation": placed.explanation, "applied": placed.applicable,
            "notes": list(placed.notes),
        }

    async def alloc(self, peer: Peer, *, gpus: int, cpus: int | None, exclusive: bool,
                    scope: str | None, tag: str | None = None) -> dict[str, Any]:
        self._validate(gpus, cpus, exclusive, scope)
        placed = self.place(gpus=gpus, cpus=cpus, exclusive=exclusive)
        rec = self._new_record(peer, placed, exclusive=exclusive, scope=scope, origin="alloc",
                               tag=tag)
        self.leases[rec["id"]] = rec
        self.d.state.save()
        try:
            await self._exclusive(rec, None, peer)
        except BaseException:
            self._drop(rec["id"])  # nothing half-made: no lease without its exclusivity
            raise
        self.d.state.save()
        log.info("lease %s for %s: GPUs %s CPUs %s", rec["id"], rec["user"], rec["gpus"],
                 rec["cpus"])
        return self._public(rec)

    async def run(self, peer: Peer, *, gpus: int, cpus: int | None, exclusive: bool,
                  scope: str | None, cmd: list[str], tag: str | None = None) -> dict[str, Any]:
        """Lease for the peer process itself, bound before it exec()s ``cmd``."""
        self._validate(gpus, cpus, exclusive, scope)
        pid = peer.pid
        uid = procfs.read_uid(pid)
        if uid is None:
            raise NoSuchProcess(f"process {pid} (the caller) is gone", pid=pid)
        if uid != peer.uid and not peer.is_root:
            raise PermissionDenied(f"process {pid} is not yours", pid=pid)
        placed = self.place(gpus=gpus, cpus=cpus, exclusive=exclusive)
        rec = self._new_record(peer, placed, exclusive=exclusive, scope=scope, origin="run",
                               pid=pid, cmd=cmd[:8], tag=tag)
        lid = rec["id"]
        self.leases[lid] = rec
        self.d.state.save()
        if not self.pidwatch.watch(pid, rec["start_time"], f"lease:{lid}",
                                   self._holder_exited):
            self._drop(lid)
            raise NoSuchProcess(f"process {pid} exited before its lease was made", pid=pid)
        try:
            if placed.applicable and self.d.jobs is not None:
                # memory on every node of the machine is no binding: no cpuset for that
                mems = None if self.host.mems <= placed.mems else placed.mems
                job = await self.d.jobs.bind(
                    pid, peer=peer, cpus=placed.cpus, mems=mems, gpus=placed.gpus,
                    origin="run", name=os.path.basename(cmd[0]) if cmd else None, lease=lid)
                rec["cpus_bound"] = job.get("cpus") if isinstance(job, dict) else None
            elif self.d.jobs is None:
                rec["notes"].append("binding service not running: nothing was bound")
                rec["applied"] = False
            await self._exclusive(rec, pid, peer)
        except BaseException:
            self._drop(lid)
            raise
        self.d.state.save()
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

    async def release_tagged(self, peer: Peer, tag: str) -> list[dict[str, Any]]:
        """Release every lease with ``tag`` that ``peer`` may release (all, for root)."""
        out = []
        for lid, rec in list(self.leases.items()):
            if rec.get("tag") == tag and (peer.is_root or rec["uid"] == peer.uid):
                out.append(await self.release(peer, lid))
        return out

    async def release(self, peer: Peer, lid: str) -> dict[str, Any]:
        rec = self.leases.get(lid)
        if rec is None:
            known = ", ".join(sorted(self.leases)) or "none"
            raise Failed(f"no lease {lid!r} (current leases: {known})", lease=lid)
        if not peer.is_root and rec["uid"] != peer.uid:
            raise PermissionDenied(
                f"lease {lid} belongs to {rec['user']} (uid {rec['uid']}); uid {peer.uid} "
                "may only release its own leases", lease=lid)
        pid = rec.get("pid")
        if pid and self.d.jobs is not None:
            bound = [j for j in self.d.jobs.jobs() if j.get("pid") == pid
                     and j.get("lease") == lid]
            if bound:
                try:
                    await self.d.jobs.unbind(pid, peer=peer)
                except TunerdError as err:
                    log.warning("lease %s: unbinding pid %d: %s", lid, pid, err.message)
        out = self._public(rec)
        self._drop(lid)
        out["released"] = True
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
        if rec.get("pid"):
            self.pidwatch.unwatch(rec["pid"], f"lease:{lid}")
        if f"lease:{lid}" in self.section["moved"]:
            self.mover.restore(f"lease:{lid}")
        if save:
            self.d.state.save()

    def _public(self, rec: dict[str, Any]) -> dict[str, Any]:
        out = dict(rec)
        out["env"] = lease_env(rec)
        out["lease"] = rec["id"]
        return out

    # -- JobRegistry.placer: `tunerctl bind PID` without placement flags ----------
    async def place_for_bind(self, *, pid: int, peer: Peer, gpus: tuple[int, ...] | None = None,
                             exclusive: bool = False) -> dict[str, Any] | None:
        """Placement near the GPUs ``pid`` uses; None when it uses none tunerd can see.

        A process bound already keeps its place (None) unless --gpus names GPUs.
        """
        topo = self.d.topology
        how = "--gpus"
        if gpus is None and self.d.jobs is not None and any(
                j.get("pid") == pid for j in self.d.jobs.jobs()):
            return None
        if gpus is None:
            env = procfs.read_environ(pid)
            if env is None:
                raise NoSuchProcess(f"cannot read the environment of process {pid}", pid=pid)
            gpus = gpus_from_env(topo, env)
            how = "its CUDA_VISIBLE_DEVICES/LOCAL_RANK"
            if not gpus:
                gpus = gpus_from_nvml(pid)
                how = "NVML (GPUs it has contexts on)"
        if not gpus:
            log.info("bind %d: no GPU in its CUDA_VISIBLE_DEVICES/LOCAL_RANK or NVML", pid)
            return None
        known = {int(g.index) for g in topo.gpus}
        unknown = [g for g in gpus if g not in known]
        if unknown:
            raise UsageError(
                f"no --cpus/--mems given and GPU placement is not available for GPU "
                f"{','.join(map(str, unknown))}: not on this node "
                f"(GPUs: {','.join(map(str, sorted(known))) or 'none'})")
        placed = self.place(gpus=len(gpus), gpu_ids=tuple(gpus), exclusive=exclusive, busy={})
        if not placed.applicable:
            raise Failed(" ".join(placed.notes) + f" (process {pid}, GPUs from {how}: "
                         f"{','.join(map(str, gpus))}; would bind CPUs "
                         f"{format_cpulist(placed.cpus)})", pid=pid, applied=False)
        return {"cpus": placed.cpus, "mems": placed.mems, "gpus": placed.gpus,
                "explanation": f"GPUs from {how}; {placed.explanation}"}


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
