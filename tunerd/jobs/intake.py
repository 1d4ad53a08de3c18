"""The intake: one look at a process for everything placement needs (a ``JobContext``).

``bind``, ``[[job]]`` rules and ``run``/``alloc`` all start here, so a process is read
once: its stat (parent, start time), command line, environment, the allocation it
lives in (``tunerd.jobs.allocation``: cgroup cpuset, Slurm job/step/task ids -- from the
cgroup path where Slurm made one, the environment being the job owner's to write --,
its GPUs), its rank identity and its place in the process tree.

Real training jobs are trees inside an allocation::

    launcher (slurmstepd, torchrun agent, mpirun/orted, deepspeed, accelerate)
      -> [wrappers: numactl, taskset, env, nsys, sh ...]  never bound
        -> rank (LOCAL_RANK / OMPI_COMM_WORLD_LOCAL_RANK / SLURM_LOCALID)  placed
          -> its DataLoader workers, forkserver, compile helpers: descendants, never ranks

``role`` says which of these a process is, and ``why`` says how it was told.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypedDict, TypeVar

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist
from tunerd.base.errors import NoSuchProcess, TunerdError
from tunerd.base.modes import Mode
from tunerd.base.strenum import TextEnum
from tunerd.jobs.allocation import Allocation, read_allocation, scheduler_gpus
from tunerd.jobs.ledger import Ledger, ProcKey, Slot
from tunerd.jobs.placer import PlaceRequest
from tunerd.topology.model import Topology
from tunerd.topology.visible import resolve_gpus, visible_list
from tunerd.watch.launchers import WRAPPERS, is_launcher, launcher_comm, wrapper_name
from tunerd.watch.launchers import _base as _base

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["CHAIN", "LAUNCHER", "PARENT", "WRAPPERS", "Intake", "JobContext", "RankId",
           "bounded_int", "request", "seen_rank"]

T = TypeVar("T")
ANCESTOR_DEPTH = 8  # how far up the tree to look for a rank, a lease, a launcher
# a quick look (a rule's bind in the exec watcher) takes a parent's ancestry, command
# line and environment as read for a sibling less than this long ago: the ranks of one
# launcher, or the burst of one script, share them. Kept in the parent's record of the
# node's ledger (its pid and start time), and dropped when that pid execs (``exec_seen``).
PARENT_TTL_S = 2.0
MAX_PARENTS = 256  # parents whose ancestry, or command line and environment, are kept
MAX_LAUNCHERS = 1024  # processes whose launcher verdict is kept
MAX_RANK = 1 << 16  # a local rank or world size above this is no rank number
# a parent's environment is read as a rank's own is by the rules (ENVIRON_MATCH_BYTES):
# at most 64 KiB, also in the exec watcher's real-time thread (1 MiB before)
PARENT_ENV_BYTES = 64 << 10

# rank identity: (variable, local world size variable, what sets it)
_RANK_VARS = (
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun/deepspeed/accelerate"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MPICH/Intel MPI"),
    ("SLURM_LOCALID", None, "a Slurm task"),
)


def bounded_int(env: Mapping[str, str], name: str, notes: list[str],
                hi: int = MAX_RANK) -> int | None:
    """``env[name]`` as a number in 0..hi; anything else is ignored with a note."""
    raw = env.get(name)
    if raw is None:
        return None
    text = raw.strip()
    if text.isdigit() and len(text) <= 6 and int(text) <= hi:
        return int(text)
    shown = text[:16] + ("..." if len(text) > 16 else "")
    notes.append(f"{name}={shown!r} ignored ({len(text)} characters): not a number in 0-{hi}")
    return None


@dataclass(frozen=True)
class RankId:
    """Which rank of its job a process is, from its launcher's environment."""

    local_rank: int
    local_world: int | None
    source: str  # "LOCAL_RANK=1 (torchrun/deepspeed/accelerate)"
    group: str  # the ranks that split one allocation: "torch:RUNID", "slurm:12.0"
    slurm_task: bool = False  # the rank is a Slurm task itself (its grant is per task)
    var: str = "LOCAL_RANK"  # the variable it was told by


@dataclass(frozen=True)
class Ancestor:
    pid: int
    comm: str


class Role(TextEnum):
    """What a process is to its job; a str so the wire and state JSON keep the same spelling."""

    RANK = "rank"
    DESCENDANT = "descendant"
    WRAPPER = "wrapper"
    LAUNCHER = "launcher"
    PROCESS = "process"


@dataclass(frozen=True)
class JobContext:
    """Everything placement needs to know about one process, read once."""

    pid: int
    start_time: int
    ppid: int
    uid: int | None
    comm: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    allocation: Allocation
    gpus: tuple[int, ...]  # GPUs it uses by its environment (CUDA_VISIBLE_DEVICES/rank)
    gpus_how: str
    rank: RankId | None
    role: Role
    why: str  # how the role was told, for `tunerctl jobs` and `policy show`
    parent_rank: int | None = None  # the bound rank this process descends from
    parent_cpus: frozenset[int] | None = None  # ... and that rank's CPUs
    lease: str | None = None  # the `tunerctl run` lease it runs inside
    enclosing: frozenset[int] | None = None  # CPUs of that lease, or of a bound launcher
    self_affined: bool = False  # it set its own affinity (numactl, taskset)
    notes: tuple[str, ...] = field(default=())
    threads: int = 0  # its number of threads when read (stat), 0: not known
    visible: tuple[int, ...] = ()  # the node GPUs it sees, in CUDA order (its grant's)
    launcher: str | None = None  # the launcher or scheduler step above it ("torchrun 42")

    @property
    def cmdline(self) -> str:
        return " ".join(self.argv)

    @property
    def job_key(self) -> str | None:
        """The scheduler job the process belongs to ("slurm:12"), if any."""
        a = self.allocation
        return f"slurm:{a.slurm_job}" if a.slurm_job else None

    @property
    def group(self) -> str | None:
        return self.rank.group if self.rank is not None else None


Up = tuple[int, procfs.Stat]  # an ancestor: its pid and stat


class Chain(NamedTuple):
    """A parent's ancestry as a quick look read it (its ``CHAIN`` slot)."""

    at: float  # time.monotonic() of the walk
    ups: list[Up]  # the parent itself, its parent ...
    watched: bool  # the ledger opened the parent's pidfd for it (``Intake._keep_chain``)


class ParentLook(NamedTuple):
    """A parent's command line and environment as a quick look read them (``PARENT``)."""

    at: float
    argv: list[str]
    env: Mapping[str, str]


# What the intake keeps of a process (as a parent, or an ancestor): slots of its record in
# the node's ledger, gone when it exits, checked by its start time
CHAIN = Slot[Chain]("intake.chain")
PARENT = Slot[ParentLook]("intake.parent")
LAUNCHER = Slot[str]("intake.launcher")  # the launcher a Python process is ("": none)
_WATCH = "intake"  # the exit key of a pidfd the ledger opened for a kept ancestry

# bound(pid) -> (start time, CPUs) of a process tunerd placed as a rank, or None
BoundLookup = Callable[[int], "tuple[int, frozenset[int]] | None"]
# lease(pid) -> (lease id, CPUs) of a `run` lease held by pid, or None
LeaseLookup = Callable[[int], "tuple[str, frozenset[int]] | None"]


class Intake:
    """Turns a pid into a ``JobContext`` (see the module docstring)."""

    def __init__(self, topo: Topology, online: frozenset[int], *, bound: BoundLookup,
                 lease: LeaseLookup, proc_root: str = procfs.PROC,
                 ledger: Ledger | None = None) -> None:
        """``ledger``: the daemon's, attached to its loop before any quick look (it may
        then hold a parent's pidfd for a kept ancestry); without one (tests, benches), a
        ledger of its own, and a kept ancestry is checked by the parent's start time."""
        self.topo = topo
        self.online = online
        self._bound = bound
        self._lease = lease
        self.proc = proc_root
        self._proc_path = Path(proc_root)
        self.ledger = ledger if ledger is not None else Ledger(proc_root)
        self._watch = ledger is not None
        # entries put in CHAIN, PARENT, LAUNCHER since each was last emptied (never fewer
        # than it holds): past MAX_PARENTS / MAX_LAUNCHERS the slot is emptied whole
        self._kept: dict[str, int] = {CHAIN.name: 0, PARENT.name: 0, LAUNCHER.name: 0}
        self._cache_lock = threading.Lock()
        # the walk up ends below the host's init; in a PID namespace of our own its pid 1
        # is the container's entry point, which may be the launcher (torchrun as PID 1)
        self._top = 1 if procfs.in_initial_pid_namespace(proc_root) else 0

    def exec_seen(self, pid: int) -> None:
        """``pid`` exec'd: what a quick look kept of it as a parent is no longer so
        (called for every exec on the host: one ledger lookup where it has no record)."""
        if self.ledger.key(pid) is not None:
            self.ledger.pop(pid, PARENT)
            self._drop_chain(pid)

    def describe(self, pid: int, env: Mapping[str, str] | None = None,
                 argv: list[str] | None = None, *, uid: int | None = None,
                 quick: bool = False, uid_later: bool = False) -> JobContext:
        """Read process ``pid`` (raises NoSuchProcess when it is gone). ``uid``: its
        real uid, read already (``uid_later``: the caller reads it after, ``uid`` is
        None in the context until then). ``quick``: a rule's bind in the exec watcher,
        where what a parent and a cgroup were a moment ago will do (PARENT_TTL_S)."""
        p = procfs.Process(pid, self.proc)
        st = p.stat()
        if env is None:
            env = procfs.read_environ_view(pid, self.proc)
            if env is None:
                raise NoSuchProcess(f"cannot read the environment of process {pid}", pid=pid)
        if argv is None:
            argv = p.cmdline(4096)
        notes: list[str] = []
        alloc = read_allocation(pid, env, self.topo, proc_root=self._proc_path,
                                online=self.online, quick=quick)
        rank = _rank_of(env, alloc, st.ppid, notes)
        gpus, how, visible = self._gpus(pid, env, rank, alloc)
        role, why = Role.PROCESS, "no rank identity in its environment"
        if is_launcher(argv, st.comm):
            role, why = Role.LAUNCHER, f"{_base(argv[0]) if argv else st.comm} starts ranks"
        elif (wrapper := wrapper_name(argv, st.comm)) is not None:
            role, why = Role.WRAPPER, f"{wrapper} only starts the next process"
        elif rank is not None:
            role, why = Role.RANK, f"{rank.source}, group {rank.group}"
        ctx = JobContext(pid=pid, start_time=st.start_time, ppid=st.ppid,
                         uid=uid if uid is not None or uid_later else _uid(p), comm=st.comm,
                         argv=tuple(argv), env=env,
                         allocation=alloc, gpus=gpus, gpus_how=how, rank=rank, role=role,
                         why=why, notes=tuple(notes), threads=st.num_threads, visible=visible)
        return self._tree(ctx, quick)

    def _gpus(self, pid: int, env: Mapping[str, str], rank: RankId | None,
              alloc: Allocation | None = None) -> tuple[tuple[int, ...], str, tuple[int, ...]]:
        """(GPUs, how told, how many GPUs it sees). The scheduler's grant bounds them:
        Slurm's, else the pod's (PodResources), as the allocation read them; its
        CUDA_VISIBLE_DEVICES is resolved through that grant (Slurm's ConstrainDevices
        renumbers from 0), and a rank's local rank picks its GPU, whichever launcher
        told it (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID)."""
        granted = alloc.granted if alloc is not None else scheduler_gpus(pid, self.topo, env)
        seen = visible_list(self.topo, env, granted)
        visible = tuple(seen) if seen is not None else tuple(g.index for g in self.topo.gpus)
        if rank is not None:
            gpus = resolve_gpus(self.topo, env, granted=granted, local_rank=rank.local_rank)
            how = f"its CUDA_VISIBLE_DEVICES/{rank.var}"
        else:
            gpus = resolve_gpus(self.topo, env, granted=granted)
            how = "its CUDA_VISIBLE_DEVICES/LOCAL_RANK"
        return tuple(gpus or ()), how, visible

    def _walk(self, ctx: JobContext) -> Iterator[Up]:
        """``ctx``'s parent, its parent, ... (up to ANCESTOR_DEPTH, to pid 1 (included
        in a PID namespace of our own) or slurmstepd), read as the walk goes."""
        ppid = ctx.ppid
        for _ in range(ANCESTOR_DEPTH):
            if ppid <= self._top or ppid == ctx.pid:
                return
            try:
                st = procfs.Process(ppid, self.proc).stat()
            except TunerdError:
                return
            yield ppid, st
            if st.comm == "slurmstepd":
                return
            ppid = st.ppid

    def _ancestors(self, ctx: JobContext, quick: bool) -> Iterable[Up]:
        """The walk up (``_walk``). Quick: the ancestry as read for a sibling within
        PARENT_TTL_S, where the parent is still that process."""
        if not quick:
            return self._walk(ctx)
        hit = self.ledger.get(ctx.ppid, CHAIN)
        if hit is not None and time.monotonic() - hit.at < PARENT_TTL_S \
                and self._same_parent(ctx.ppid, hit):
            return hit.ups  # the same parent, alive: its ancestry as read for a sibling
        out = list(self._walk(ctx))
        if out:
            self._keep_chain(out, hit)
        return out

    def _same_parent(self, ppid: int, hit: Chain) -> bool:
        """Whether ``ppid`` is still the parent ``hit`` was read for: while the pidfd the
        ledger holds of it is not readable it is (no read of /proc); a parent the ledger
        holds no pidfd of, by its start time (one stat read)."""
        if hit.watched or self.ledger.pidfd(ppid) >= 0:
            return not self.ledger.exited(ppid)
        return procfs.read_start_time(ppid, self.proc) == hit.ups[0][1].start_time

    def _keep_chain(self, out: list[Up], old: Chain | None) -> None:
        """Keep ``out``, a parent's ancestry, in the parent's record. With the daemon's
        ledger, the record holds the parent's pidfd: the one it has (another service's;
        not watched here, so never released here either), else one opened for it here
        (watched until the parent exits, execs, or the ancestries are dropped)."""
        pid, start = out[0][0], out[0][1].start_time
        key = ProcKey(pid, start)
        watched = old is not None and old.watched and self.ledger.key(pid) == key
        opened = False
        if self._watch and not watched and self.ledger.pidfd(pid) < 0:
            if not self.ledger.watch(pid, start, _WATCH, _kept_parent_exited):
                return  # the parent went (and its pid may be another's) meanwhile
            watched = opened = True
        kept = self._put(key, CHAIN, Chain(time.monotonic(), out, watched), MAX_PARENTS,
                         fresh=old is None)
        if opened and not kept:  # another process holds the pid now: nor its pidfd
            self.ledger.unwatch(pid, _WATCH)

    def _put(self, key: ProcKey, slot: Slot[T], value: T, limit: int, *,
             fresh: bool = True) -> bool:
        """``value`` in ``key``'s ``slot`` (False: not put, the ledger holds another
        process under that pid: a key read a moment ago must not retire its record);
        ``fresh``: a new entry, counted toward ``limit`` (the slot is emptied past it)."""
        held = self.ledger.key(key.pid)
        if held is not None and held != key:
            return False
        if fresh:
            with self._cache_lock:
                self._kept[slot.name] += 1
                full = self._kept[slot.name] > limit
                if full:
                    self._kept[slot.name] = 1
            if full:
                self._empty(slot)
        self.ledger.put(key, slot, value)
        return True

    def _empty(self, slot: Slot[T]) -> None:
        """Every entry of ``slot`` dropped (the ancestries' pidfds opened here with them)."""
        if slot.name != CHAIN.name:
            self.ledger.clear(slot)
            return
        for key, _ in self.ledger.each(CHAIN):
            self._drop_chain(key.pid)

    def _drop_chain(self, pid: int) -> None:
        hit = self.ledger.pop(pid, CHAIN)
        if hit is not None and hit.watched:
            self.ledger.unwatch(pid, _WATCH)

    def _parent(self, ppid: int, start: int | None,
                quick: bool) -> tuple[list[str], Mapping[str, str]]:
        """A parent's command line and environment (quick: as read within PARENT_TTL_S
        for the same pid + start time). Raises TunerdError where it is gone."""
        hit = self.ledger.get(ppid, PARENT, start=start) if quick and start is not None \
            else None
        if hit is not None and time.monotonic() - hit.at < PARENT_TTL_S:
            return hit.argv, hit.env
        argv = procfs.Process(ppid, self.proc).cmdline(4096)
        env = procfs.read_environ_view(ppid, self.proc, PARENT_ENV_BYTES) or {}
        if quick and start is not None:
            self._put(ProcKey(ppid, start), PARENT, ParentLook(time.monotonic(), argv, env),
                      MAX_PARENTS, fresh=hit is None)
        return argv, env

    def _tree(self, ctx: JobContext, quick: bool = False) -> JobContext:
        """Walk up: the bound rank it descends from, the lease or bound launcher it runs
        in, and whether it set its own affinity (a mask narrower than its parent's)."""
        changes: dict[str, object] = {}
        first: Up | None = None
        launcher: tuple[int, int, str] | None = None
        for depth, (ppid, st) in enumerate(self._ancestors(ctx, quick)):
            if depth == 0:
                first = (ppid, st)
            if launcher is None and ctx.rank is not None:
                name = self._launcher_name(ppid, st)
                if name is not None:
                    launcher = (ppid, st.start_time, name)
            lease = self._lease(ppid)
            if lease is not None and "lease" not in changes:
                changes.update(lease=lease[0], enclosing=lease[1])
            bound = self._bound(ppid)
            if bound is not None and bound[0] == st.start_time and ctx.role != Role.LAUNCHER:
                changes.update(self._under_bound(ctx, ppid, st.comm, bound[1]))
                break
            if depth == 0 and ctx.role == Role.RANK:
                changes.update(_self_affinity(ctx, ppid, st.comm))
        if ctx.role == Role.RANK and "parent_rank" not in changes and ctx.rank is not None \
                and self._same_rank_above(ctx, first, quick):
            changes.update(role=Role.DESCENDANT,
                           why=f"{ctx.rank.source} inherited from its parent {ctx.ppid}, "
                               "which is that rank")
        if ctx.rank is not None:
            changes.update(_identity(ctx, launcher, changes))
        return replace(ctx, **changes) if changes else ctx  # type: ignore[arg-type]

    def _launcher_name(self, pid: int, st: procfs.Stat) -> str | None:
        """The launcher ``pid`` is (``torchrun``, ``mpirun``, ``slurmstepd`` ...), or None.
        Told by its name, or for a Python process by its command line (``python -m
        torch.distributed.run``), read once per process (pid + start time)."""
        name = launcher_comm(st.comm)
        if name is not None or not st.comm.startswith(("python", "pt_")):
            return name
        known = self.ledger.get(pid, LAUNCHER, start=st.start_time)
        if known is not None:
            return known or None
        try:
            argv = procfs.Process(pid, self.proc).cmdline(4096)
        except TunerdError:
            return None
        found = _launcher_of_argv(argv, st.comm)
        self._put(ProcKey(pid, st.start_time), LAUNCHER, found or "", MAX_LAUNCHERS)
        return found

    def _under_bound(self, ctx: JobContext, ppid: int, comm: str,
                     cpus: frozenset[int]) -> dict[str, object]:
        """``ctx`` has a bound ancestor ``ppid``. A launcher or wrapper tunerd bound (a
        Slurm task -- torchrun, a batch script -- bound by the TaskProlog), or a
        process that is a rank of another kind (a Slurm task that starts LOCAL_RANK
        ranks itself), encloses its ranks: they split its CPUs. Anything else is that
        rank's descendant."""
        try:
            argv = procfs.Process(ppid, self.proc).cmdline(4096)
        except TunerdError:
            argv = []
        encloses = is_launcher(argv, comm) or wrapper_name(argv, comm) is not None
        if not encloses and ctx.rank is not None:
            penv = procfs.read_environ_view(ppid, self.proc, PARENT_ENV_BYTES) or {}
            prank = _rank_of(penv, ctx.allocation, -1, [])
            encloses = prank is None or prank.var != ctx.rank.var
        if encloses:
            return {"enclosing": cpus}
        out: dict[str, object] = {"parent_rank": ppid, "parent_cpus": cpus}
        if ctx.role in (Role.RANK, Role.PROCESS):
            out.update(role=Role.DESCENDANT, why=f"descends from rank {ppid}, bound by tunerd")
        return out

    def _same_rank_above(self, ctx: JobContext, parent: Up | None = None,
                         quick: bool = False) -> bool:
        """A spawn/forkserver helper or a rank's own subprocess: its parent (not a
        launcher or wrapper) has the same rank identity."""
        assert ctx.rank is not None
        try:
            if parent is not None and parent[0] == ctx.ppid:
                comm, start = parent[1].comm, parent[1].start_time
            else:
                comm, start = procfs.read_comm(ctx.ppid, self.proc) or "", None
            argv, penv = self._parent(ctx.ppid, start, quick)
        except TunerdError:
            return False
        if is_launcher(argv, comm) or wrapper_name(argv, comm):
            return False
        prank = _rank_of(penv, ctx.allocation, -1, [])
        return prank is not None and prank.local_rank == ctx.rank.local_rank \
            and prank.var == ctx.rank.var


def _launcher_of_argv(argv: list[str], comm: str) -> str | None:
    if not is_launcher(argv, comm):
        return None
    for i, a in enumerate(argv[1:6], 1):
        if a == "-m" and i + 1 < len(argv):
            return argv[i + 1][:48]
    return _base(argv[0])[:48] if argv else comm


def _identity(ctx: JobContext, launcher: tuple[int, int, str] | None,
              changes: Mapping[str, object]) -> dict[str, object]:
    """A rank identity counts only under a launcher or a scheduler step (a Slurm job's
    cgroup or slurmstepd, a pod, a ``tunerctl run`` lease): ``LOCAL_RANK=0 python
    prep.py`` typed in a shell is no rank for ``match.rank`` (an explicit rule may still
    name it). The job is keyed by that launcher (pid and start time), never by a run id
    such as torchrun's ``none``."""
    assert ctx.rank is not None
    a = ctx.allocation
    out: dict[str, object] = {}
    rank = ctx.rank
    if launcher is not None:
        pid, start, name = launcher
        out["launcher"] = f"{name} {pid}"
        if not rank.slurm_task:
            inside = f"slurm:{a.slurm_job}.{a.slurm_step}/" if a.slurm_job else ""
            group = f"{inside}{name}:{pid}.{start}"
            out["rank"] = replace(rank, group=group)
            why = str(changes.get("why", ctx.why))
            out["why"] = why.replace(f"group {rank.group}", f"group {group}")
        return out
    scheduler = None
    if a.job_from_cgroup and a.slurm_job:
        scheduler = f"Slurm job {a.slurm_job}"
    elif changes.get("lease") is not None or ctx.lease is not None:
        scheduler = "tunerctl run"
    elif a.scheduler is not None and a.scheduler.startswith("Kubernetes pod"):
        scheduler = a.scheduler
    if scheduler is not None:
        out["launcher"] = scheduler
        return out
    if changes.get("role", ctx.role) == Role.RANK:
        out.update(role=Role.PROCESS,
                   why=f"{changes.get('why', ctx.why)}; but no launcher or scheduler step "
                       "above it (torchrun, mpirun, srun, deepspeed, accelerate ...): not a "
                       "rank")
    return out


def _kept_parent_exited(pid: int) -> None:
    """A parent whose ancestry was kept exited: its record goes, and that with it."""

def seen_rank(ctx: JobContext, rank: RankId, *, gpus: tuple[int, ...], how: str, why: str,
              visible: tuple[int, ...], launcher: str, mask_is_tunerds: bool) -> JobContext:
    """``ctx`` as a rank that its use of ``gpus`` told, not its environment (the GPU-use
    service, tunerd.jobs.gpuuse): no longer another rank's worker, nor enclosed by a
    rank tunerd bound above it (a lease still encloses it). ``mask_is_tunerds``: its
    CPU mask is the one tunerd gave its parent, which it inherited, not its own choice."""
    alloc = replace(ctx.allocation, current=None) if mask_is_tunerds else ctx.allocation
    return replace(ctx, role=Role.RANK, rank=rank, gpus=gpus, gpus_how=how, why=why,
                   visible=visible, allocation=alloc, parent_rank=None, parent_cpus=None,
                   enclosing=ctx.enclosing if ctx.lease is not None else None,
                   self_affined=False, launcher=launcher)


class PlaceAsk(TypedDict, total=False):
    """A caller's own asks for ``request``: PlaceRequest's fields, each optional."""

    gpus: int
    gpu_ids: tuple[int, ...] | None
    ncpus: int | None
    cpus: frozenset[int] | None
    mode: Mode
    exclusive: bool
    allocation: Allocation | None
    workers: int
    rank: int | None
    ranks: int | None
    gpu_sharers: int | None
    gpu_peers: tuple[int, ...] | None
    group: str | None
    job: str | None
    ignore_busy_gpus: bool
    what: str


def request(ctx: JobContext, **kw: Unpack[PlaceAsk]) -> PlaceRequest:
    """The PlaceRequest for ``ctx`` (``kw``: the caller's own asks, PlaceRequest fields).

    The allocation is narrowed to what the job tree says: a `tunerctl run` lease
    above the process; a Slurm task's own CPUs where Slurm bound the task to fewer
    than the step's (tasks Slurm gave disjoint CPUs keep disjoint CPUs); the CPUs a
    launcher was started on, which its ranks split (a grant per Slurm task is then the
    pool of all its ranks, not each rank's count).
    """
    a = ctx.allocation
    cpus, ncpus, scheduler = a.cpus, a.ncpus, a.scheduler
    if ctx.enclosing is not None:  # under a `tunerctl run` lease: stay inside it
        cpus = ctx.enclosing if cpus is None else (cpus & ctx.enclosing or cpus)
        scheduler = scheduler or ("tunerctl run" if ctx.lease else "its launcher's binding")
    if a.current is not None and not ctx.self_affined and (a.slurm or ctx.rank is not None):
        # Slurm bound the task (or the launcher was started) on fewer CPUs: stay there
        cpus = (cpus & a.current if cpus is not None else a.current) or cpus
    if ctx.rank is not None and not ctx.rank.slurm_task:
        ncpus = None  # a grant per Slurm task is split by the ranks the task starts
    rank = ctx.rank
    group = ctx.group or (f"slurm:{a.slurm_job}.{a.slurm_step}"
                          if a.job_from_cgroup and a.slurm_step else None)
    alloc = replace(a, cpus=cpus, ncpus=ncpus, scheduler=scheduler,
                    cpus_what=a.cpus_what if cpus == a.cpus else "CPU mask")
    sharers = None
    if rank is not None and rank.local_world and ctx.visible:
        sharers = -(-rank.local_world // len(ctx.visible))  # ranks per GPU, rounded up
    base: PlaceAsk = {
        "allocation": alloc, "rank": rank.local_rank if rank else None,
        "ranks": rank.local_world if rank else None, "group": group, "job": ctx.job_key,
        "gpu_sharers": sharers, "gpu_peers": ctx.visible if rank is not None else None,
        "what": f"process {ctx.pid}"}
    base.update(kw)
    return PlaceRequest(**base)


def _self_affinity(ctx: JobContext, ppid: int, parent_comm: str) -> dict[str, object]:
    """A rank whose mask is narrower than its parent's, where the parent is not
    slurmstepd (Slurm's task/affinity binds tasks itself): it, or a numactl/taskset
    it was exec'd through, chose its CPUs."""
    if parent_comm == "slurmstepd" or ctx.allocation.mask is None:
        return {}
    try:
        pmask = frozenset(os.sched_getaffinity(ppid))
    except OSError:
        return {}
    if ctx.allocation.mask < pmask:
        # who narrowed it is not known: the process itself, a wrapper it was exec'd
        # through (numactl, taskset) or its launcher (mpirun --bind-to, torchrun
        # --numa-binding): the message names the parent and both masks, not a guess
        return {"self_affined": True,
                "why": ctx.why + f"; its CPU mask {format_cpulist(ctx.allocation.mask)} was "
                f"set narrower than its parent's ({parent_comm} pid {ppid}: "
                f"{format_cpulist(pmask)}) by the launcher, a wrapper (numactl, taskset) or "
                f"itself: left as it is"}
    return {}


def _rank_of(env: Mapping[str, str], alloc: Allocation, ppid: int,
             notes: list[str]) -> RankId | None:
    for var, size_var, who in _RANK_VARS:
        if var not in env:
            continue
        rank = bounded_int(env, var, notes)
        if rank is None:
            continue
        world = bounded_int(env, size_var, notes) if size_var else None
        if var == "SLURM_LOCALID":
            if not alloc.slurm_job or alloc.gpus == ():
                notes.append("a Slurm task without GPUs: left to Slurm's own CPU binding")
                continue
            world = _tasks_on_node(env, notes)
            if alloc.slurm_task is not None and alloc.job_from_cgroup:
                rank = alloc.slurm_task
            return RankId(rank, world, f"Slurm task {rank} of {world or '?'}",
                          f"slurm:{alloc.slurm_job}.{alloc.slurm_step or '?'}",
                          slurm_task=True, var=var)
        # the launcher above keys the job (``_identity``); without one, the parent. A
        # run id is no key: torchrun without --rdzv-id exports TORCHELASTIC_RUN_ID=none
        # in every job
        run = f"ppid {ppid}"
        inside = f"slurm:{alloc.slurm_job}.{alloc.slurm_step}/" if alloc.slurm_job else ""
        return RankId(rank, world, f"{var}={rank} ({who})", f"{inside}{who.split('/')[0]}:"
                      f"{run[:64]}", var=var)
    return None


def _tasks_on_node(env: Mapping[str, str], notes: list[str]) -> int | None:
    """Tasks of the step on this node: SLURM_STEP_TASKS_PER_NODE looks like "2",
    "2(x3)" or "4,2" (SLURM_NODEID picks the entry)."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in text.split(",")[:64]:
        num, _, rep = part.partition("(x")
        if not (num.isdigit() and len(num) <= 6):
            return None
        times = rep.rstrip(")")
        n = int(times) if times.isdigit() and len(times) <= 6 else 1
        counts.extend([int(num)] * min(n, 4096))
    node = bounded_int(env, "SLURM_NODEID", notes) or 0
    return counts[node] if node < len(counts) else (counts[0] if counts else None)


def _uid(p: procfs.Process) -> int | None:
    try:
        return p.uids()[0]
    except TunerdError:
        return None

