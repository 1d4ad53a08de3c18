"""Leases: GPUs + CPUs reserved for a job (``tunerctl alloc`` / ``run`` / ``release``).

A lease is a placement with an owner. ``alloc`` leases live until ``release``, the
Slurm epilog, or their time limit (``[leases] alloc_ttl``); ``run`` leases belong
to the requesting tunerctl process (the socket peer's PID, from SO_PEERCRED), which
the daemon binds before tunerctl exec()s the command, so the command and all its
children inherit the CPU affinity and the memory policy. A pidfd on that PID
releases the lease when the command exits, also when tunerctl is killed before
its exec.

Placement starts from the caller's allocation: inside a Slurm job a lease takes
only the job's CPUs and GPUs (``tunerd.jobs.allocation``).

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
import re
import time
from collections.abc import Callable, Mapping

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import Failed, NoSuchProcess, PermissionDenied, TunerdError, UsageError
from tunerd.base.jsontypes import JSONObject, JSONValue
from tunerd.jobs.allocation import Allocation, cvd_names
from tunerd.jobs.exclusive import ExclusiveMover, parse_scope
from tunerd.jobs.gate import LeaseLimits
from tunerd.jobs.intake import JobContext, request
from tunerd.jobs.ledger import Ledger
from tunerd.jobs.peer import Peer
from tunerd.jobs.pipeline import BindPipeline, BindRequest, BindSource
from tunerd.jobs.placement import Placement
from tunerd.jobs.placer import PlaceRequest, Reservation, ReservationKey, ReservationKind
from tunerd.jobs.records import Lease

__all__ = ["LeaseLimits", "LeaseService", "lease_env", "user_name"]

log = logging.getLogger("tunerd.leases")

JOB_CHECK_S = 10.0  # how often leases made inside a scheduler job check that it still runs


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

    def __init__(self, pipeline: BindPipeline, ledger: Ledger,
                 mover: ExclusiveMover, section: JSONObject, save: Callable[[], None],
                 errors: ErrorLog, *, limits: Callable[[], LeaseLimits],
                 default_nofile: Callable[[], int | None],
                 proc_root: str = procfs.PROC) -> None:
        self.pipeline = pipeline  # the lease's process is bound through it (``run``)
        self.placer = pipeline.placer
        self.intake = pipeline.intake
        self.jobs = pipeline.jobs
        self.ledger = ledger
        self.mover = mover
        self.errors = errors
        self._limits = limits
        self.gate = pipeline.gate
        self.gate.count_with(self.held_where)
        self._default_nofile = default_nofile
        self.proc = proc_root
        next_id = section.setdefault("next_id", 1)
        self._next_id = next_id if isinstance(next_id, int) else 1  # the state checked it
        raw_leases = section.setdefault("leases", {})
        section.setdefault("moved", {})
        self.section = section
        self.leases = _read_leases(raw_leases)
        self._store_save = save
        self._jobs_timer: asyncio.TimerHandle | None = None
        self._expiry: asyncio.TimerHandle | None = None

    def _save(self) -> None:
        """Write the typed leases into the runtime store's section, then save it."""
        self.section["leases"] = {lid: r.to_json() for lid, r in self.leases.items()}
        self._store_save()

    # -- service -------------------------------------------------------------
    async def start(self) -> None:
        dropped = self._ended_jobs(save=False)
        for lid, rec in list(self.leases.items()):
            pid = rec.pid
            if pid is not None and not self.ledger.watch(
                    pid, rec.start_time, f"lease:{lid}", self._holder_exited):
                log.info("lease %s: holder pid %d exited while tunerd was down; dropped",
                         lid, pid)
                self._drop(lid, save=False)
                dropped += 1
                continue
            self.pipeline.hold(self._reservation(rec))
        # exclusive moves whose job is gone (daemon was down when it ended): put back
        for key in list(self.mover.moved):
            k = ReservationKey.parse(key)
            if k is not None and k.kind is ReservationKind.LEASE and k.ident not in self.leases:
                self.mover.restore(key)
        if dropped:
            self._save_quietly()
        self._schedule_expiry()
        self._schedule_job_check()

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self._jobs_timer is not None:
            self._jobs_timer.cancel()

    # -- leases die with their scheduler job ------------------------------------
    def _ended_jobs(self, save: bool = True) -> int:
        """Release leases whose scheduler job ended (its cgroup is gone), whatever
        their tag: at start (the job may have ended while tunerd was down) and on a
        timer. Returns how many were released."""
        gone = [lid for lid, r in self.leases.items()
                if r.job_cgroup and not os.path.isdir(r.job_cgroup)]
        for lid in gone:
            log.info("lease %s released: its job (%s) ended", lid, self.leases[lid].job)
            self._drop(lid, save=False)
        if gone and save:
            self._save_quietly()
        return len(gone)

    def _schedule_job_check(self) -> None:
        self._jobs_timer = None
        if any(r.job_cgroup for r in self.leases.values()):
            self._jobs_timer = asyncio.get_running_loop().call_later(
                JOB_CHECK_S, self._job_check)

    def _job_check(self) -> None:
        self._ended_jobs()
        self._schedule_job_check()

    def rescan(self) -> None:
        """A /proc rescan happened (autobind): check the leases' jobs now too."""
        self._ended_jobs()

    def status(self) -> JSONObject:
        n = len(self.leases)
        gpus = sorted(g for r in self.leases.values() for g in r.gpus)
        return {"summary": f"{n} lease(s)" + (f" holding GPU(s) {','.join(map(str, gpus))}"
                                              if gpus else ""),
                "leases": n}

    # -- queries -------------------------------------------------------------
    def list_leases(self) -> list[JSONObject]:
        return [self._public(r) for r in sorted(self.leases.values(),
                                                key=lambda r: int(r.id[1:]))]

    def _holder(self, rec: Lease) -> str:
        # named in other users' conflict errors: no command (hidepid may hide it from
        # them; `tunerctl leases` shows it to those who may see it)
        who = f"lease {rec.id} ({rec.user}"
        if rec.pid:
            who += f", pid {rec.pid}"
        return who + (f", {rec.job}" if rec.job else "") + ")"

    def _reservation(self, rec: Lease) -> Reservation:
        return Reservation(key=ReservationKey.lease(rec.id), holder=self._holder(rec),
                           gpus=tuple(rec.gpus), cpus=parse_cpulist(rec.cpus),
                           exclusive=bool(rec.exclusive), soft=True,
                           pid=rec.pid, job=rec.job, uid=rec.uid)

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
        self.gate.admit(peer, exclusive=exclusive)  # one gate: tunerd.jobs.gate

    def held_by(self, uid: int) -> int:
        """Leases ``uid`` holds."""
        return sum(1 for r in self.leases.values() if r.uid == uid)

    def held_where(self, same: Callable[[int], bool]) -> int:
        """Leases whose uid ``same`` accepts (the gate counts a user's, her
        subordinate uids' too, with its other reservations)."""
        return sum(1 for r in self.leases.values() if r.uid is not None and same(r.uid))

    def _describe(self, peer: Peer) -> JobContext:
        """The caller, read once by the intake: its allocation, its job, its
        environment (to name its GPUs the way it sees them)."""
        return self.intake.describe(peer.pid)

    @staticmethod
    def _request(ctx: JobContext, *, gpus: int, ncpus: int | None,
                 cpus: frozenset[int] | None, exclusive: bool, workers: int) -> PlaceRequest:
        # job=None: a job's own leases are busy for its next lease (only its steps and
        # ranks may use what its exclusive lease holds)
        return request(ctx, gpus=gpus, ncpus=ncpus, cpus=cpus, exclusive=exclusive,
                       workers=workers, rank=None, ranks=None, group=None, job=None,
                       what="lease")

    def _new_record(self, peer: Peer, placed: Placement, ctx: JobContext, *,
                    exclusive: bool, scope: str | None, origin: str, pid: int | None = None,
                    cmd: list[str] | None = None, tag: str | None = None) -> Lease:
        lid = f"L{self._next_id}"
        self._next_id += 1
        self.section["next_id"] = self._next_id
        now = time.time()
        ttl = self._limits().alloc_ttl
        return Lease(
            id=lid, uid=peer.uid, user=user_name(peer.uid), origin=origin,
            pid=pid, start_time=procfs.read_start_time(pid, self.proc) if pid else None,
            cmd=cmd, tag=tag, created=now,
            expires=now + ttl if pid is None and ttl > 0 else None,
            exclusive=exclusive, scope=scope,
            gpus=tuple(placed.gpus), gpu_uuids=tuple(placed.gpu_uuids),
            cpus=format_cpulist(placed.cpus or frozenset()),
            mems=format_cpulist(placed.mems or frozenset()),
            explanation=placed.explanation, applied=placed.applicable,
            notes=list(placed.notes), job=ctx.job_key, job_cgroup=job_dir(ctx.allocation))

    def _no_gpus_note(self, ctx: JobContext) -> str:
        """`run` without --gpus on a node with GPUs: the job sees none; say so, once."""
        may = ctx.allocation.gpus
        n = len(may) if may is not None else len(self.placer.topo.gpus)
        if n == 0:
            return ""
        return (f"the job gets no GPU (CUDA_VISIBLE_DEVICES is empty) though {n} GPU(s) "
                f"are here; ask with --gpus N")

    def _name_gpus(self, rec: Lease, env: Mapping[str, str]) -> None:
        """CUDA_VISIBLE_DEVICES for the lease in the caller's own numbering."""
        names = cvd_names(self.placer.topo, env)
        if names and rec.gpus and all(g in names for g in rec.gpus):
            cvd = ",".join(names[g] for g in rec.gpus)
            if cvd != ",".join(str(g) for g in rec.gpus):
                rec.cvd = cvd

    def _commit(self, rec: Lease) -> None:
        """Keep a new lease: reserve its place and save; nothing is kept if the save fails."""
        self.leases[rec.id] = rec
        if rec.job_cgroup and self._jobs_timer is None:
            self._schedule_job_check()
        self.pipeline.hold(self._reservation(rec))
        try:
            self._save()
        except TunerdError as err:
            self.leases.pop(rec.id, None)
            self.placer.release(ReservationKey.lease(rec.id))
            raise Failed(f"lease not made: {err.message}") from err

    async def alloc(self, peer: Peer, *, gpus: int, ncpus: int | None,
                    cpus: frozenset[int] | None = None, exclusive: bool = False,
                    scope: str | None = None, tag: str | None = None,
                    workers: int = 0) -> JSONObject:
        self._check(peer, gpus, ncpus, exclusive, scope)
        ctx = self._describe(peer)
        placed = self.placer.place(self._request(ctx, gpus=gpus, ncpus=ncpus, cpus=cpus,
                                                 exclusive=exclusive, workers=workers))
        rec = self._new_record(peer, placed, ctx, exclusive=exclusive, scope=scope,
                               origin="alloc", tag=tag)
        self._name_gpus(rec, ctx.env)
        self._commit(rec)
        try:
            await self._exclusive(rec, None, peer)
        except BaseException:
            self._drop(rec.id)  # nothing half-made: no lease without its exclusivity
            raise
        self._save_or_note(rec)
        self._schedule_expiry()
        log.info("lease %s for %s: GPUs %s CPUs %s", rec.id, rec.user, rec.gpus,
                 rec.cpus)
        return self._public(rec)

    async def run(self, peer: Peer, *, gpus: int, ncpus: int | None,
                  cpus: frozenset[int] | None = None, exclusive: bool = False,
                  scope: str | None = None, cmd: list[str], tag: str | None = None,
                  workers: int = 0) -> JSONObject:
        """Lease for the peer process itself, bound before it exec()s ``cmd``."""
        self._check(peer, gpus, ncpus, exclusive, scope)
        pid = peer.pid
        uid = procfs.read_uid(pid, self.proc)
        if uid is None:
            raise NoSuchProcess(f"process {pid} (the caller) is gone", pid=pid)
        if uid != peer.uid and not peer.is_root:
            raise PermissionDenied(f"process {pid} is not yours", pid=pid)
        ctx = self._describe(peer)
        placed = self.placer.place(self._request(ctx, gpus=gpus, ncpus=ncpus, cpus=cpus,
                                                 exclusive=exclusive, workers=workers))
        rec = self._new_record(peer, placed, ctx, exclusive=exclusive, scope=scope,
                               origin="run", pid=pid, cmd=cmd[:8], tag=tag)
        if gpus == 0 and (note := self._no_gpus_note(ctx)):
            rec.notes.insert(0, note)
        self._name_gpus(rec, ctx.env)
        lid = rec.id
        self._commit(rec)
        if not self.ledger.watch(pid, rec.start_time, f"lease:{lid}",
                                   self._holder_exited):
            self._drop(lid)
            raise NoSuchProcess(f"process {pid} exited before its lease was made", pid=pid)
        try:
            if placed.applicable:
                await self._bind_holder(rec, peer, placed, cmd)
            await self._exclusive(rec, pid, peer)
        except BaseException:
            self._drop(lid)
            raise
        self._save_or_note(rec)
        return self._public(rec)

    async def _bind_holder(self, rec: Lease, peer: Peer, placed: Placement,
                           cmd: list[str]) -> None:
        """The lease's own process, bound through the pipeline before it execs."""
        assert rec.pid is not None
        try:
            out = await self.pipeline.bind(BindRequest(
                rec.pid, peer, BindSource.LEASE, placement=Placement(
                    cpus=placed.cpus, mems=self.placer.bindable_mems(placed.mems),
                    gpus=placed.gpus, explanation=placed.explanation),
                nofile=self._default_nofile(), lease=rec.id,
                name=os.path.basename(cmd[0]) if cmd else None))
        except PermissionDenied as err:
            if "CAP_SYS_NICE" not in err.message:
                raise
            # a process may set its own CPUs: tunerctl does, before it execs
            rec.notes.append(f"{err.message}; tunerctl binds itself to CPUs "
                             f"{rec.cpus} before it runs the command")
            return
        rec.cpus_bound = out.record.cpus if out.record is not None else None
        rec.notes.extend(out.notes)

    async def _exclusive(self, rec: Lease, pid: int | None, peer: Peer) -> None:
        if not (rec.exclusive and rec.scope):
            return
        if not rec.applied:
            rec.notes.append(f"exclusive scope {rec.scope}: nothing moved (not applied)")
            return
        res = self.mover.move_off(str(ReservationKey.lease(rec.id)), rec.scope,
                                  parse_cpulist(rec.cpus), pid, peer.uid)
        rec.moved = res.moved
        rec.notes.extend(res.notes)

    async def release_tagged(self, peer: Peer, tag: str) -> JSONObject:
        """Release every lease with ``tag`` that ``peer`` may release (all, for root)."""
        tagged = [lid for lid, r in self.leases.items() if r.tag == tag]
        mine = [lid for lid in tagged if peer.is_root or self.leases[lid].uid == peer.uid]
        if tagged and not mine:
            raise PermissionDenied(
                f"the {len(tagged)} lease(s) tagged {tag!r} belong to other users; uid "
                f"{peer.uid} may only release its own", tag=tag)
        out: list[JSONValue] = []
        for lid in mine:
            out.append(await self.release(peer, lid, save=False))
        notes: list[JSONValue] = []
        if mine:
            try:
                self._save()
            except TunerdError as err:
                self.errors.record("leases", f"release --tag {tag}: {err.message}", key="save")
                notes.append(f"released, but the runtime state was not saved: {err.message}")
        return {"tag": tag, "released": out, "notes": notes}

    async def release(self, peer: Peer, lid: str, save: bool = True) -> JSONObject:
        rec = self.leases.get(lid)
        if rec is None:
            known = ", ".join(sorted(self.leases)) or "none"
            raise Failed(f"no lease {lid!r} (current leases: {known})", lease=lid)
        if not peer.is_root and rec.uid != peer.uid:
            raise PermissionDenied(
                f"lease {lid} belongs to {rec.user} (uid {rec.uid}); uid {peer.uid} "
                "may only release its own leases", lease=lid)
        pid = rec.pid
        if pid:
            job = self.jobs.record(pid)
            if job is not None and job.lease == lid:
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
                notes = out.setdefault("notes", [])
                if isinstance(notes, list):  # a lease's record always has its notes
                    notes.append(f"released, but the runtime state was not saved: "
                                 f"{err.message}")
        return out

    def _holder_exited(self, pid: int) -> None:
        for lid, rec in list(self.leases.items()):
            if rec.pid == pid:
                log.info("lease %s released: holder pid %d exited", lid, pid)
                self._drop(lid)

    def _drop(self, lid: str, save: bool = True) -> None:
        rec = self.leases.pop(lid, None)
        if rec is None:
            return
        self.placer.release(ReservationKey.lease(lid))
        if rec.pid:
            self.ledger.unwatch(rec.pid, f"lease:{lid}")
        moved = str(ReservationKey.lease(lid))  # the mover's key: the text form
        if moved in self.mover.moved:
            self.mover.restore(moved)
        if save:
            self._save_quietly()

    def _save_quietly(self) -> None:
        try:
            self._save()
        except TunerdError as err:
            self.errors.record("leases", err.message, key="save")
        else:
            self.errors.resolve("leases", "save")

    def _save_or_note(self, rec: Lease) -> None:
        try:
            self._save()
        except TunerdError as err:
            self.errors.record("leases", err.message, key="save")
            rec.notes.append(f"runtime state not saved: {err.message}")

    # -- expiry of alloc leases ---------------------------------------------------
    def _schedule_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        due = [r.expires for r in self.leases.values() if r.expires]
        if not due:
            return
        delay = max(0.0, min(due) - time.time())
        self._expiry = asyncio.get_running_loop().call_later(min(delay, 3600.0), self._expire)

    def _expire(self) -> None:
        self._expiry = None
        now = time.time()
        gone = [lid for lid, r in self.leases.items() if r.expires and r.expires <= now]
        for lid in gone:
            rec = self.leases[lid]
            log.info("lease %s of %s expired (alloc_ttl); released", lid, rec.user)
            self._drop(lid, save=False)
        if gone:
            self._save_quietly()
        self._schedule_expiry()

    def _public(self, rec: Lease) -> JSONObject:
        out: JSONObject = rec.to_json()
        out.pop("job_cgroup", None)
        env: JSONObject = {**lease_env(rec)}
        if rec.cvd:  # the job's own numbering of its GPUs (Slurm renumbers them)
            env["CUDA_VISIBLE_DEVICES"] = rec.cvd
        out["env"] = env
        out["lease"] = rec.id
        return out


def _read_leases(raw: JSONValue) -> dict[str, Lease]:
    """The leases of the runtime state's section; a malformed one is dropped, logged."""
    out: dict[str, Lease] = {}
    for lid, rec in (raw.items() if isinstance(raw, dict) else ()):
        try:
            if not isinstance(rec, dict):
                raise ValueError(f"malformed lease record: {rec!r:.40}")
            out[lid] = Lease.from_json(rec)
        except ValueError as err:
            log.error("dropping lease %r: %s", lid, err)
    return out


def job_dir(alloc: Allocation) -> str | None:
    """The cgroup directory of the scheduler job ``alloc`` is in (Slurm's .../job_N, a
    Kubernetes pod's .../pod<uid>): while it exists the job runs. None outside one,
    and where the ids came only from the (user-writable) environment."""
    d = alloc.cgroup_dir
    if d is None:
        return None
    if alloc.slurm_job and alloc.job_from_cgroup:
        m = re.search(rf"^(.*/job_{re.escape(alloc.slurm_job)})(?:/|$)", d)
        return m.group(1) if m else None
    m = re.search(r"^(.*kubepods[^/]*/(?:[^/]*/)?[^/]*pod[0-9a-f_-]{8,}[^/]*)(?:/|$)", d)
    return m.group(1) if m else None


def lease_env(rec: Lease) -> dict[str, str]:
    """Environment a job in this lease should run with (printed by alloc, set by run).

    CUDA_VISIBLE_DEVICES lists GPU *indices* in PCI bus order (NVML's and
    nvidia-smi's numbering), hence CUDA_DEVICE_ORDER=PCI_BUS_ID; the UUIDs are
    in TUNERD_GPU_UUIDS for containers that renumber devices.
    """
    gpus = rec.gpus
    ncpus = len(rec.cpu_set())
    return {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TUNERD_LEASE": rec.id,
        "TUNERD_CPUS": rec.cpus,
        "TUNERD_MEMS": rec.mems,
        "TUNERD_GPU_UUIDS": ",".join(rec.gpu_uuids),
        # one process per GPU is the usual layout: split the CPUs between them
        "OMP_NUM_THREADS": str(max(1, ncpus // max(1, len(gpus)))),
    }
