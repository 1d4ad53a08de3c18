"""Placed at first GPU use: a process that uses a GPU is a rank of that GPU's slice,
however it was launched (issue 33 item 1).

``torch.multiprocessing.spawn`` gives each rank its number as an argument, Lightning's
``python train.py`` starts rank 1 itself (``LOCAL_RANK=1`` under no launcher), Ray Train
workers are children of a raylet, a notebook kernel of a Jupyter server: none of them is
a rank to the exec watcher. They are placed here instead, once they use a GPU, in the
slice of the GPU they use (ranks of one job that share a GPU split it), with their
memory on the slice's node; their DataLoader workers follow them as a rank's do.

Every ``TICK_S``, while a ``[[job]]`` rule places GPU users (``gpu_use.enabled``, the
bundled ``torch-training`` rule) or a rule bound or left alone a process, the service
asks who uses a GPU. The evidence, in order:

1. NVML's compute and graphics process lists of every GPU, as the monitor's last sample
   has them (``listing``: no NVML call of its own);
2. for processes inside a job tunerd knows (mp.spawn children of rule-bound processes,
   which NVML cannot see from inside another PID namespace), an fd open for reading or
   writing on ``/dev/nvidiaN`` (``tunerd.jobs.gate.gpu_fds``: never an ``O_PATH``
   handle, and only on a node the process may open);
3. the process's ``CUDA_VISIBLE_DEVICES``/``LOCAL_RANK``, resolved (``_env_gpus``, the
   one call to the GPU resolver), which picks among the nodes an fd look found (CUDA
   opens every visible GPU's node) -- never evidence of use on its own.

The fd look is bounded (issue 34 item 3): at most ``MAX_FDS_PER_PROCESS`` fd entries of
one process and ``MAX_FDS_PER_TICK`` of all together are read, a verdict is kept per
process (pid and start time) so no fd table is listed again before it is due (a process
holding no GPU is looked at again after 2, 4, 8, 16, 30 s), and the whole gathering runs
in a worker thread, off the event loop (without fd tables to read, the monitor's sample
is read on the loop); ``status`` reports its cost (``scan``).

A process found is placed when it is unbound, inside the daemon's scope, no system GPU
service (``SYSTEM_SERVICES``, tunerd itself), no launcher or wrapper, no rank a launcher
told (those are the exec-time rules'), no worker of a bound rank, and did not narrow its
own CPUs (nor did its parent: numactl, taskset). Its job and rule:

* a launch tunerd knows (``launch``): an mp.spawn child of a process a rule bound or
  matched, any child of a process such a rule bound, a child of a launcher (torchrun,
  mpirun ...) -- under that rule, keyed by the parent;
* else its launch tree (``tree_launch``), under the first rule with ``gpu_use`` whose
  keys match: keyed by its highest ancestor below a shell, a session, a launcher, a
  system service, init or another user (Lightning's rank 0 and the rank 1 it starts
  are one job; a Ray run is keyed by its driver, or by its raylet when that runs on its
  own, and by the Ray job a worker runs for (``RAY_JOB_ID``): two runs on one standalone
  raylet are two jobs; a notebook kernel is its own job).

It is handed to the rules' bind through a narrow interface (``RuleBinds``): the same
gate, placer, ledger and registry as every rule bind, recorded with why ("uses GPU 2
(NVML) ..."). A verdict is kept per pid while the process stays listed (a left-alone
one is looked at again after ``RECHECK_S``), so a tick over known processes reads
nothing of them; after that, one stat read tells whether what the verdict rested on
(the process, its parent's binding, the rules) is still so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

from tunerd.adapters import nvml, procfs
from tunerd.base.errors import TunerdError
from tunerd.base.jsontypes import JSONObject
from tunerd.jobs.gate import gpu_fds
from tunerd.jobs.intake import Intake, JobContext, RankId, Role, seen_rank
from tunerd.jobs.ledger import ProcKey, Slot
from tunerd.jobs.peer import Peer
from tunerd.jobs.registry import JobRegistry
from tunerd.jobs.scope import ProcessScope
from tunerd.topology.visible import gpus_from_env, nvml_users
from tunerd.watch.launchers import is_launcher, launcher_comm
from tunerd.watch.rules import JobRule, RuleSet

__all__ = ["FD_LOOK", "JOB", "SPAWN", "VERDICT", "GpuUse", "Launch", "RuleBinds",
           "is_spawn_child", "is_system_service"]

log = logging.getLogger("tunerd.gpuuse")
T = TypeVar("T")

TICK_S = 1.0  # how often GPU users are looked for
RECHECK_S = 30.0  # a process left alone is looked at again after this
MAX_LISTED = 1024  # GPU users taken per tick (NVML's lists together)
MAX_NEW = 32  # processes not seen before looked at per tick
MAX_FD_PARENTS = 16  # rule-bound processes whose children are looked at per tick
MAX_FD_KIDS = 256  # ... their children looked at per tick
MAX_FD_SCANS = 8  # ... and of those children, whose fd tables are read
# fd entries one look reads: CUDA opens its nodes when it initialises, among a spawn
# rank's first files (the gate's look at a rule-bound rank reads up to MAX_FDS_SCANNED)
MAX_FDS_PER_PROCESS = 512
MAX_FDS_PER_TICK = 512  # ... all looks of one tick together: ~4 ms of CPU at most
FD_BACKOFF_S = (2.0, 4.0, 8.0, 16.0, 30.0)  # a process holding no GPU: looked at again
MAX_KNOWN = 4096  # verdicts (and fd looks, spawn verdicts, placed ranks) kept
TREE_DEPTH = 16  # how far up a launch tree is walked
SPAWN_MARKS = ("--multiprocessing-fork", "multiprocessing.spawn")
NVML = "NVML"
FD = "an open /dev/nvidiaN"

# never ranks, whatever NVML lists (the comm, 15 characters, or the program's name)
SYSTEM_SERVICES = frozenset({
    "nvidia-persistenced", "nv-hostengine", "dcgm-exporter", "dcgmi", "nvidia-smi",
    "nvidia-cuda-mps-control", "nvidia-cuda-mps-server", "nv-fabricmanager",
    "nvidia-fabricmanager", "nvidia-device-plugin", "gpu-feature-discovery",
    "nvidia_gpu_exporter", "Xorg", "Xwayland", "gnome-shell", "kwin_wayland", "kwin_x11",
    "tunerd", "tunerctl",
})
_SERVICES_15 = frozenset(n[:15] for n in SYSTEM_SERVICES)
# a launch tree stops below these (the user's shell, session, terminal, init, container)
SESSION_COMMS = frozenset({
    "bash", "sh", "dash", "zsh", "fish", "ksh", "tcsh", "csh", "ash", "busybox",
    "sshd", "sshd-session", "login", "su", "sudo", "tmux: server", "tmux", "screen",
    "SCREEN", "systemd", "init", "containerd-shim", "conmon", "runc", "docker-init",
    "tini", "dumb-init", "cron", "atd", "srun", "sbatch", "salloc",
})
JOB_ROOT_MARKS = ("ipykernel_launcher", "ipykernel")  # a notebook kernel: a job of its own


def is_spawn_child(argv: list[str] | tuple[str, ...],
                   parent_argv: list[str] | tuple[str, ...] | None = None) -> bool:
    """A ``multiprocessing`` spawn child (``torch.multiprocessing.spawn``'s ranks):
    ``python -c "from multiprocessing.spawn import spawn_main; ..." --multiprocessing-fork``.
    Given its parent's command line: not one the child only inherited (a DataLoader
    worker a spawn rank forked has the rank's command line, word for word; a spawn
    child's names its own pipe)."""
    if parent_argv is not None and tuple(argv) == tuple(parent_argv):
        return False
    return any(mark in a for a in argv[1:8] for mark in SPAWN_MARKS)


def is_system_service(comm: str, argv: tuple[str, ...] | list[str]) -> bool:
    """A GPU service of the node (nvidia-persistenced, nv-hostengine, dcgm-exporter,
    tunerd ...): it uses the GPUs for everyone and is never a rank."""
    prog = os.path.basename(argv[0]) if argv else ""
    if comm[:15] in _SERVICES_15 or prog in SYSTEM_SERVICES:
        return True
    return any(a in ("tunerd", "tunerd.daemon.main") for a in argv[1:4])


@dataclass(frozen=True)
class Launch:
    """What started a GPU user: its parent (or its launch tree's root), the rule it is
    placed under, the job key."""

    parent: int
    parent_start: int
    rule: JobRule
    kind: str  # "mp.spawn parent", "launcher torchrun", "launch tree train.py" ...
    group: str  # the job: "mp.spawn:4242.1234", "train.py:4242.1234"
    parent_bound: bool  # the parent's CPUs are tunerd's (its children inherited them)


class RuleBinds(Protocol):
    """What the GPU-use service asks of the rules' binder (``AutoBinder``), and all."""

    def rule_set(self) -> RuleSet: ...
    def rule_bound(self, pid: int) -> tuple[int, str] | None: ...
    def rule_bound_pids(self) -> list[int]: ...
    def looked_at(self) -> bool: ...
    def set_own_cpus(self, pid: int) -> bool: ...
    def rules_peer(self) -> Peer: ...
    def place_rank(self, rule: JobRule, ctx: JobContext) -> None: ...


Users = dict[int, tuple[tuple[int, ...], str]]  # pid -> (GPU indices, how seen)
Basis = tuple[int, int, int, bool, bool]  # what a verdict rests on (GpuUse._basis)
# (GPU index, pid) of every compute and graphics process, as another reader of NVML
# last saw them (the monitor's sample), or None where it has no fresh list
Listing = Callable[[], "list[tuple[int, int]] | None"]


@dataclass(frozen=True)
class Snapshot:
    """What a tick's gathering (in a worker thread) needs from the loop's state."""

    parents: tuple[int, ...]  # rule-bound processes whose children may be spawn ranks
    now: float  # time.monotonic() at its start
    round: int  # the last round that decided (``GpuUse._round``)


@dataclass(slots=True)
class Verdict:
    """The service's verdict on a GPU user (its ``VERDICT`` slot). It stands while the
    process stays listed round after round: one not listed a round is looked at afresh
    (its pid may be another process's by then)."""

    verdict: str  # "placed", or why it was left alone
    at: float  # time.monotonic() of the verdict (or of its last confirmation)
    basis: Basis | None  # what it rests on (``GpuUse._basis``)
    listed: int  # the last round that listed the process (``GpuUse._round``)


class FdLook(NamedTuple):
    """An fd look's verdict on a child of a rule-bound process (its ``FD_LOOK`` slot)."""

    due: float  # time.monotonic() when its fd table may be read again
    looks: int  # looks so far (its backoff)
    gpus: tuple[int, ...]  # GPUs its open device nodes name (): none


# What the service keeps of a process: slots of its record in the node's ledger (gone
# with it), each bounded by MAX_KNOWN (counted as put, emptied whole past it)
VERDICT = Slot[Verdict]("gpuuse.verdict")
FD_LOOK = Slot[FdLook]("gpuuse.fd-look")  # keyed by start time: checked on every read
SPAWN = Slot[bool]("gpuuse.spawn")  # a rule-bound process's child: an mp.spawn child?
JOB = Slot[str]("gpuuse.job")  # the job group this service placed it in as a rank
GONE = -1  # the start time a verdict on a pid /proc does not show is kept under


@dataclass
class ScanCost:
    """What gathering GPU users cost (``status``'s ``scan``)."""

    cpu_s: float = 0.0  # thread CPU time of every gathering
    fd_entries: int = 0  # fd entries read
    fd_tables: int = 0  # fd tables listed
    cut: int = 0  # ... of which cut at MAX_FDS_PER_PROCESS or the tick's budget
    since: float = 0.0  # time.monotonic() of the first tick

    def json(self) -> JSONObject:
        up = time.monotonic() - self.since if self.since else 0.0
        return {"cpu_ms": round(self.cpu_s * 1000, 3), "fd_entries_read": self.fd_entries,
                "fd_tables_listed": self.fd_tables, "fd_tables_cut": self.cut,
                "cpu_ms_per_s": round(self.cpu_s * 1000 / up, 4) if up > 0 else 0.0,
                "max_fds_per_process": MAX_FDS_PER_PROCESS,
                "max_fds_per_tick": MAX_FDS_PER_TICK}


class GpuUse:
    """The service (module docstring)."""

    name = "gpuuse"

    def __init__(self, rules: RuleBinds, intake: Intake, jobs: JobRegistry, *,
                 scope: ProcessScope | None = None, tick_s: float = TICK_S,
                 listing: Listing | None = None, proc_root: str = procfs.PROC) -> None:
        self.rules = rules
        self.intake = intake
        self.jobs = jobs
        self.scope = scope
        self.tick_s = tick_s
        self.listing = listing
        self.proc = proc_root
        self.placed = 0
        self.ticks = 0  # ticks that looked (armed)
        self.left_alone: dict[str, int] = {}  # why -> how many (first verdicts)
        self.last: list[JSONObject] = []  # the last placements handed over
        self.cost = ScanCost()
        # what it keeps of each process: slots of its record in the node's ledger
        self.ledger = jobs.ledger
        self._round = 0  # rounds decided (a verdict stands while listed every round)
        # entries put in each slot since it was last emptied (never fewer than it
        # holds): VERDICT, JOB on the loop, SPAWN, FD_LOOK in the worker thread
        self._kept: dict[str, int] = {VERDICT.name: 0, JOB.name: 0, SPAWN.name: 0,
                                      FD_LOOK.name: 0}
        self._fd_cursor = 0
        self._minors: dict[int, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Future[None]] = set()  # worker bindings being undone

    # -- service ----------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for t in list(self._tasks):
            t.cancel()

    def status(self) -> JSONObject:
        return {"summary": f"placed at first GPU use: {self.placed} process(es)",
                "placed": self.placed, "ticks": self.ticks,
                "left_alone": {**self.left_alone}, "last": [*self.last],
                "scan": self.cost.json()}

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick_off_loop()
            except Exception:  # one bad tick must not end the service
                log.exception("placing GPU users failed")

    # -- one tick ---------------------------------------------------------------
    def armed(self) -> bool:
        """Whether there is anything to follow: a rule that places GPU users, or rules
        that bound or left alone a process."""
        rules = self.rules.rule_set()
        return bool(rules) and (any(r.gpu_use is not None for r in rules.rules)
                                or self.rules.looked_at())

    async def tick_off_loop(self) -> None:
        """One tick: GPU users gathered in a worker thread where fd tables may be read
        (on the loop where only the monitor's sample is: a list copied under its lock
        costs less than the hop), decided on the loop."""
        snap = self._begin()
        if snap is None:
            return
        users = await asyncio.to_thread(self.gather, snap) if snap.parents \
            else self.gather(snap)
        self._decide(users)

    def tick(self) -> None:
        """One tick, all on the caller's thread."""
        snap = self._begin()
        if snap is not None:
            self._decide(self.gather(snap))

    def _begin(self) -> Snapshot | None:
        if not self.armed():
            if self._kept[VERDICT.name]:
                self._empty(VERDICT)
            return None
        self.ticks += 1
        if not self.cost.since:
            self.cost.since = time.monotonic()
        return Snapshot(tuple(self.rules.rule_bound_pids()), time.monotonic(), self._round)

    def _decide(self, users: Users) -> None:
        now = time.monotonic()
        self._round += 1
        new = 0
        for pid in sorted(users):
            kept = self.ledger.get(pid, VERDICT)
            seen = kept if kept is not None and kept.listed >= self._round - 1 else None
            if seen is not None:
                seen.listed = self._round  # still listed: its verdict stands a round more
            if new >= MAX_NEW:
                continue  # looked at in a later tick
            if seen is not None and self._still(pid, seen, now):
                continue
            new += 1
            basis = self._basis(pid)
            verdict = self.consider(pid, *users[pid], users)
            if seen is None and verdict != "placed":
                self.left_alone[verdict] = self.left_alone.get(verdict, 0) + 1
            self._keep_verdict(pid, Verdict(verdict, now, basis, self._round), kept is None)

    def _keep_verdict(self, pid: int, v: Verdict, fresh: bool) -> None:
        """``v`` in ``pid``'s record: of the process its basis read, or under ``GONE``
        where /proc shows no such pid (a pid of another PID namespace NVML lists: looked
        at again after RECHECK_S, as any left alone), unless the ledger holds it then."""
        key = ProcKey(pid, v.basis[0] if v.basis is not None else GONE)
        held = self.ledger.key(pid)
        if v.basis is None and held is not None and held != key:
            return  # a process the ledger knows: a verdict of one /proc does not show
        if fresh and self._kept[VERDICT.name] >= MAX_KNOWN:
            self._empty(VERDICT)
        self._put(key, VERDICT, v, fresh)

    def _put(self, key: ProcKey, slot: Slot[T], value: T, fresh: bool = True) -> None:
        """``value`` in ``key``'s ``slot``; a ``fresh`` entry is counted (MAX_KNOWN)."""
        if fresh:
            self._kept[slot.name] += 1
        self.ledger.put(key, slot, value)

    def _empty(self, slot: Slot[T]) -> None:
        self.ledger.clear(slot)
        self._kept[slot.name] = 0

    def _still(self, pid: int, seen: Verdict, now: float) -> bool:
        """Whether ``pid``'s verdict stands: placed, younger than RECHECK_S, or older
        but resting on what is still so (one stat read: a left-alone process costs
        nothing more while it, its parent's binding and the rules stay as they were)."""
        if seen.verdict == "placed" or now - seen.at < RECHECK_S:
            return True
        if seen.basis is not None and self._basis(pid) == seen.basis:
            seen.at = now
            return True
        return False

    def _skip(self, pid: int, snap: Snapshot) -> bool:
        """Whether ``pid`` has a verdict that stands (the worker thread: its fd table is
        not read)."""
        v = self.ledger.get(pid, VERDICT)
        return v is not None and v.listed >= snap.round \
            and (v.verdict == "placed" or snap.now - v.at < RECHECK_S)

    def _basis(self, pid: int) -> Basis | None:
        """What a verdict on ``pid`` rests on: its start time and parent, the rules in
        force, whether a rule or anyone bound its parent."""
        st = _stat(pid, self.proc)
        if st is None:
            return None
        return (st.start_time, st.ppid, id(self.rules.rule_set()),
                self.rules.rule_bound(st.ppid) is not None, self.jobs.is_bound(st.ppid))

    def gather(self, snap: Snapshot) -> Users:
        """pid -> (GPUs, how seen): NVML's lists, then open device nodes (bounded).
        Runs in a worker thread: reads /proc and the monitor's sample, never the loop's
        state beyond ``snap``."""
        t0 = time.thread_time()
        try:
            out = self._listed()
            out.update(self._fd_users(snap, out))
        finally:
            self.cost.cpu_s += time.thread_time() - t0
        return out

    def _listed(self) -> Users:
        out: Users = {}
        # no monitor (a test's service): NVML asked here
        seen = ((self.listing() or []) if self.listing is not None
                else nvml_users(nvml.devices()))
        for gpu, pid in seen:
            if len(out) >= MAX_LISTED and pid not in out:
                continue
            gpus = out.get(pid, ((), ""))[0]
            if gpu not in gpus:
                out[pid] = ((*gpus, gpu), NVML)
        return out

    def _fd_users(self, snap: Snapshot, listed: Users) -> Users:
        """mp.spawn children of rule-bound processes holding ``/dev/nvidiaN`` open that
        NVML did not list: ``MAX_FD_PARENTS`` parents a tick, in turn; at most
        ``MAX_FD_SCANS`` fd tables and ``MAX_FDS_PER_TICK`` entries read, each table
        only when its verdict is due."""
        parents = list(snap.parents)
        if not parents:
            if self._kept[SPAWN.name]:
                self._empty(SPAWN)
            if self._kept[FD_LOOK.name]:
                self._empty(FD_LOOK)
            return {}
        start = self._fd_cursor % len(parents)
        turn = (parents[start:] + parents[:start])[:MAX_FD_PARENTS]
        self._fd_cursor = start + len(turn)
        now = time.monotonic()
        out: Users = {}
        budget, scans, kids = MAX_FDS_PER_TICK, 0, 0
        kids_now: set[int] = set()
        for ppid in turn:
            for kid in self._children(ppid):
                kids_now.add(kid)
                kids += 1
                if kid in listed or kids > MAX_FD_KIDS or not self._spawn_child(kid, ppid):
                    continue
                if scans >= MAX_FD_SCANS or budget <= 0 or self._skip(kid, snap):
                    self._found_before(kid, out)  # no table read: what it was found using
                    continue
                looked = self._fd_look(kid, now, budget, out)
                if looked is not None:
                    scans += 1
                    budget -= looked
        self._prune(kids_now)
        return out

    def _fd_look(self, pid: int, now: float, budget: int, out: Users) -> int | None:
        """One fd look at ``pid`` where its verdict is due: the entries read (None: not
        due, or gone); a GPU found goes into ``out``."""
        start = procfs.read_start_time(pid, self.proc)
        if start is None:
            return None
        key = ProcKey(pid, start)
        due = self.ledger.get(pid, FD_LOOK, start=start)
        if due is not None and now < due.due:
            if due.gpus:  # found using a GPU: still listed, its table not read again
                out[pid] = (due.gpus, FD)
            return None
        ev = gpu_fds(pid, self.proc, min(MAX_FDS_PER_PROCESS, budget))
        looks = due.looks + 1 if due is not None else 0
        self._put(key, FD_LOOK,
                  FdLook(now + FD_BACKOFF_S[min(looks, len(FD_BACKOFF_S) - 1)], looks, ()),
                  fresh=due is None)
        if ev is None:
            return 0
        self.cost.fd_tables += 1
        self.cost.fd_entries += ev.looked
        self.cost.cut += ev.cut
        minors = self._minor_map()
        gpus = tuple(sorted(minors[m] for m in ev.minors if m in minors))
        if gpus:
            out[pid] = (gpus, FD)
            self.ledger.put(key, FD_LOOK, FdLook(now + RECHECK_S, looks, gpus))
        return ev.looked

    def _found_before(self, pid: int, out: Users) -> None:
        """``pid`` stays listed with the GPUs an earlier look found (one stat read)."""
        start = procfs.read_start_time(pid, self.proc)
        hit = self.ledger.get(pid, FD_LOOK, start=start) if start is not None else None
        if hit is not None and hit.gpus:
            out[pid] = (hit.gpus, FD)

    def _minor_map(self) -> dict[int, int]:
        """The N of /dev/nvidiaN -> GPU index (asked of NVML once)."""
        if not self._minors:
            self._minors = {m if isinstance(m := d.minor_number, int) else d.index: d.index
                            for d in nvml.devices()}
        return self._minors

    def _prune(self, kids_now: set[int]) -> None:
        """Past MAX_KNOWN spawn or fd-look verdicts: only those of children seen this
        tick are kept."""
        self._prune_slot(SPAWN, kids_now)
        self._prune_slot(FD_LOOK, kids_now)

    def _prune_slot(self, slot: Slot[T], kids_now: set[int]) -> None:
        if self._kept[slot.name] <= MAX_KNOWN:
            return
        kept = 0
        for key, _ in self.ledger.each(slot):
            if key.pid in kids_now:
                kept += 1
            else:
                self.ledger.pop(key.pid, slot)
        self._kept[slot.name] = kept

    def _children(self, pid: int) -> list[int]:
        """Children of ``pid``'s main thread (mp.spawn starts them there): one read."""
        try:
            raw = procfs.read_bytes(f"{self.proc}/{pid}/task/{pid}/children")
        except OSError:
            return []
        return [int(x) for x in raw.split()]

    def _spawn_child(self, pid: int, ppid: int) -> bool:
        """Whether ``pid``, a child of ``ppid`` (rule-bound), is a spawn child, not a
        rank's worker (read once per process)."""
        hit = self.ledger.get(pid, SPAWN)
        if hit is None:
            start = procfs.read_start_time(pid, self.proc)
            if start is None:
                return False
            try:
                argv = procfs.Process(pid, self.proc).cmdline(1024)
                hit = is_spawn_child(argv, procfs.Process(ppid, self.proc).cmdline(1024)) \
                    and not self._placed_here(ppid)
            except TunerdError:
                hit = False
            self._put(ProcKey(pid, start), SPAWN, hit)
        return hit

    def _placed_here(self, pid: int, start: int | None = None) -> bool:
        """Whether this service placed ``pid`` as a rank (its children are its workers)."""
        return self.ledger.get(pid, JOB, start=start) is not None

    # -- one process --------------------------------------------------------------
    def consider(self, pid: int, gpus: tuple[int, ...], how: str, users: Users) -> str:
        """Place ``pid`` (it uses ``gpus``, as ``how`` saw) or say why not. A rank's
        mp.spawn child that inherited its rank variable was narrowed into the rank's
        CPUs as a worker at its exec: it is placed all the same (that binding undone)."""
        rec = self.jobs.record(pid)
        if self.rules.rule_bound(pid) is not None or (rec is not None and rec.origin != "worker"):
            return "bound already"
        if pid == os.getpid():
            return "a system GPU service: never a rank"
        if self.scope is not None and not self.scope.contains(pid):
            return "outside this daemon's scope"
        try:
            ctx = self.intake.describe(pid)
        except TunerdError as err:
            log.debug("pid %d (uses GPU %s): %s", pid, gpus, err.message)
            return "gone"
        if is_system_service(ctx.comm, ctx.argv):
            return "a system GPU service: never a rank"
        why, launch = self._launch_of(ctx)
        if launch is None:
            return why
        if rec is None and self._own_cpus(ctx):
            return "it or its parent set its own CPUs (numactl, taskset)"
        ranked = self._as_rank(ctx, self._narrowed(ctx, gpus, how), how, launch, users)
        if rec is None:
            self._hand_over(ranked, launch)
        else:
            self._spawn_task(self._unnarrow_then_place(ranked, launch))
        return "placed"

    def _launch_of(self, ctx: JobContext) -> tuple[str, Launch | None]:
        """The launch ``ctx`` is placed under, or why there is none. One a rank's bind
        narrowed as its follower but that is no descendant of the rank (it has a rank
        variable of its own: Lightning's rank 1, started by rank 0) is placed all the
        same."""
        if ctx.role in (Role.LAUNCHER, Role.WRAPPER, Role.RANK):
            return f"a {ctx.role}: the rules' own", None
        launch = self.launch(ctx)
        spawn = launch is not None and launch.group.startswith("mp.spawn:")
        if ctx.role == Role.DESCENDANT and not spawn:
            return "a rank's worker: kept in its CPUs", None
        if launch is None:
            launch = self.tree_launch(ctx)
        if launch is None:
            some = any(r.gpu_use is not None for r in self.rules.rule_set().rules)
            return ("no launch tunerd knows started it"
                    + (", and no rule's gpu_use matches it" if some else "")), None
        return "", launch

    def _narrowed(self, ctx: JobContext, gpus: tuple[int, ...], how: str) -> tuple[int, ...]:
        """Open device nodes name every GPU CUDA made visible: where the process's own
        CUDA_VISIBLE_DEVICES/LOCAL_RANK picks some of them, those (NVML's lists are per
        GPU already)."""
        if how == NVML:
            return gpus
        said = self._env_gpus(ctx)
        picked = tuple(g for g in gpus if said and g in said)
        return picked or gpus

    def _env_gpus(self, ctx: JobContext) -> tuple[int, ...]:
        """The GPUs the process's environment names, through its scheduler's grant: the
        one call to the GPU resolver (tunerd.topology.visible)."""
        return gpus_from_env(self.intake.topo, ctx.env, allowed=ctx.allocation.granted) or ()

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unnarrow_then_place(self, ctx: JobContext, launch: Launch) -> None:
        """A spawn rank narrowed as a worker: its CPUs back as they were, then placed."""
        try:
            await self.jobs.unbind(ctx.pid, peer=self.rules.rules_peer())
        except TunerdError as err:
            log.debug("pid %d: worker binding not undone: %s", ctx.pid, err.message)
            return
        self._hand_over(ctx, launch)

    def launch(self, ctx: JobContext) -> Launch | None:
        """The launch tunerd knows that started ``ctx`` (module docstring), or None."""
        ppid = ctx.ppid
        pst = _stat(ppid, self.proc)
        if pst is None or ppid <= 1:
            return None
        rb = self.rules.rule_bound(ppid)
        try:
            parent = self.intake.describe(ppid)
        except TunerdError:
            return None
        spawn = is_spawn_child(ctx.argv, parent.argv)
        key = f"{ppid}.{pst.start_time}"
        if rb is not None and rb[0] == pst.start_time:
            rule = self._rule(rb[1])
            if rule is None or self._placed_here(ppid, pst.start_time) \
                    or (parent.role == Role.RANK and not spawn):
                return None  # a rank's other children are its workers
            kind = "mp.spawn parent" if spawn else f"process rule {rule.name} bound"
            return Launch(ppid, pst.start_time, rule, kind,
                          f"{'mp.spawn' if spawn else 'children'}:{key}", True)
        if self.rules.set_own_cpus(ppid):
            return None
        m = self.rules.rule_set().match(ppid)
        if parent.role == Role.LAUNCHER:
            rule = m.rule if m is not None else self._rank_rule(ctx)
            name = _launcher_name(parent)
            return None if rule is None else Launch(
                ppid, pst.start_time, rule, f"launcher {name}", f"{name}:{key}",
                self.jobs.is_bound(ppid))
        if m is None or (m.rule.rank and parent.role != Role.RANK) \
                or (parent.role == Role.RANK and not spawn):
            return None
        return Launch(ppid, pst.start_time, m.rule,
                      "mp.spawn parent" if spawn else f"process rule {m.rule.name} matched",
                      f"{'mp.spawn' if spawn else 'children'}:{key}", False)

    def tree_launch(self, ctx: JobContext) -> Launch | None:
        """``ctx``'s launch tree, under the first rule that places GPU users and whose
        keys match it (module docstring); None where none does."""
        rule = next((r for r in self.rules.rule_set().rules
                     if r.places_gpu_user(ctx.cmdline, ctx.uid, ctx.env)), None)
        if rule is None:
            return None
        pid, start, name = self._tree_root(ctx)
        group = f"{name}:{pid}.{start}"
        ray_job = ray_job_id(ctx.env)
        if ray_job is not None:  # one raylet runs the workers of every Ray job on the node
            group += f"/ray-job-{ray_job}"
        return Launch(pid, start, rule, f"launch tree {name}", group,
                      self.jobs.is_bound(ctx.ppid))

    def _tree_root(self, ctx: JobContext) -> tuple[int, int, str]:
        """(pid, start time, name) of the highest ancestor of ``ctx`` (itself included)
        below a shell, session, launcher, system service, init or another user's
        process; a notebook kernel is a root itself."""
        root = (ctx.pid, ctx.start_time, _program(ctx.argv, ctx.comm))
        if _job_root(ctx.argv):
            return root
        ppid = ctx.ppid
        for _ in range(TREE_DEPTH):
            if ppid <= 1 or ppid == os.getpid():
                break
            p = procfs.Process(ppid, self.proc)
            try:
                st, argv, uid = p.stat(), p.cmdline(1024), p.uids()[0]
            except TunerdError:
                break
            if uid != ctx.uid or _ends_tree(st.comm, argv):
                break
            root = (ppid, st.start_time, _program(argv, st.comm))
            if _job_root(argv):
                break
            ppid = st.ppid
        return root

    def _rule(self, name: str) -> JobRule | None:
        return next((r for r in self.rules.rule_set().rules if r.name == name), None)

    def _rank_rule(self, ctx: JobContext) -> JobRule | None:
        """A launcher's child under no rule of its launcher's: the first ``match.rank``
        rule whose other keys match the child."""
        for r in self.rules.rule_set().rules:
            if r.rank and r.matches(ctx.cmdline, ctx.uid, dict(ctx.env)):
                return r
        return None

    def _own_cpus(self, ctx: JobContext) -> bool:
        """``ctx`` runs on fewer CPUs than its parent: it (or a numactl/taskset it was
        started through) chose them."""
        try:
            pmask = frozenset(os.sched_getaffinity(ctx.ppid))
        except OSError:
            return True
        mask = ctx.allocation.mask
        return mask is not None and mask < pmask

    def _as_rank(self, ctx: JobContext, gpus: tuple[int, ...], how: str, launch: Launch,
                 users: Users) -> JobContext:
        """The intake's look at ``ctx`` made a rank of ``launch``'s job near ``gpus``."""
        mine = self._ranks_of(launch.group)
        near = {launch.parent, ctx.ppid}
        siblings = {p for p, (_, h) in users.items() if h and p != ctx.pid
                    and (p == launch.parent or procfs.read_ppid(p, self.proc) in near)}
        job = sorted(mine | siblings | {ctx.pid})
        visible = tuple(sorted({g for p in job for g in users.get(p, ((), ""))[0]} | set(gpus)))
        rank = RankId(len(mine), len(job), f"uses GPU {','.join(map(str, gpus))} ({how})",
                      launch.group, var="GPU use")
        why = (f"{rank.source}; started by {launch.kind} {launch.parent}, "
               f"placed as a rank of job {launch.group}")
        return seen_rank(ctx, rank, gpus=gpus, how=how, why=why, visible=visible,
                         launcher=f"{launch.kind} {launch.parent}",
                         mask_is_tunerds=launch.parent_bound)

    def _ranks_of(self, group: str) -> set[int]:
        """The live processes this service placed in job ``group`` (those gone are
        forgotten: a walk of the ledger, once per process placed)."""
        out = set()
        for key, g in self.ledger.each(JOB):
            if g != group:
                continue
            if self.ledger.alive(key.pid, key.start):
                out.add(key.pid)
            else:
                self.ledger.pop(key.pid, JOB)
        return out

    def _hand_over(self, ctx: JobContext, launch: Launch) -> None:
        """To the rules' bind: gate, place, hold, apply, record."""
        if self._kept[JOB.name] >= MAX_KNOWN:  # as many as MAX_KNOWN: this job's stay
            mine = [(k, g) for k, g in self.ledger.each(JOB) if g == launch.group]
            self._empty(JOB)
            for k, g in mine:
                self._put(k, JOB, g)
        self._put(ProcKey(ctx.pid, ctx.start_time), JOB, launch.group)
        log.info("pid %d (%s) %s: rule %s places it", ctx.pid, ctx.comm, ctx.why,
                 launch.rule.name)
        self.placed += 1
        self.last = [*self.last[-9:], {"pid": ctx.pid, "gpus": [*ctx.gpus],
                                       "rule": launch.rule.name, "job": launch.group,
                                       "why": ctx.why, "at": round(time.monotonic(), 3)}]
        self.rules.place_rank(launch.rule, ctx)


def _stat(pid: int, proc: str) -> procfs.Stat | None:
    try:
        return procfs.Process(pid, proc).stat()
    except TunerdError:
        return None


def _ends_tree(comm: str, argv: list[str]) -> bool:
    """A launch tree stops below this process: a shell, a session, a launcher, init, a
    container's shim, a system GPU service."""
    return (comm in SESSION_COMMS or comm.startswith("containerd-shim")
            or launcher_comm(comm) is not None or is_launcher(argv, comm)
            or is_system_service(comm, argv))


_RAY_JOB = re.compile(r"[0-9a-fA-F]{1,32}")


def ray_job_id(env: Mapping[str, str]) -> str | None:
    """The Ray job a worker runs for: ``RAY_JOB_ID``, which raylet sets in the
    environment of each worker it starts for a job (hex, 8 characters in Ray 2.x);
    None where it is absent or not such an id."""
    value = env.get("RAY_JOB_ID")
    return value if value is not None and _RAY_JOB.fullmatch(value) else None


def _job_root(argv: list[str] | tuple[str, ...]) -> bool:
    return any(mark in a for a in argv[1:4] for mark in JOB_ROOT_MARKS)


def _program(argv: list[str] | tuple[str, ...], comm: str) -> str:
    """A job's name from its root's command line: ``-m MODULE``, a Python script's name,
    else its program (``torchrun``, ``train.py``, ``ipykernel_launcher``)."""
    named = launcher_comm(comm)
    if named is not None:
        return named
    for i, a in enumerate(argv[1:6], 1):
        if a == "-m" and i + 1 < len(argv):
            return argv[i + 1][:48]
    prog = os.path.basename(argv[0]) if argv else comm
    if prog.startswith("python") and len(argv) > 1 and not argv[1].startswith("-"):
        return os.path.basename(argv[1])[:48]
    return prog[:48]


def _launcher_name(parent: JobContext) -> str:
    """The launcher's name as the intake keys its ranks' job (``torchrun:PID.START``):
    its comm where that names a launcher, else ``-m MODULE``, else its program."""
    named = launcher_comm(parent.comm)
    if named is not None:
        return named
    argv = parent.argv
    for i, a in enumerate(argv[1:6], 1):
        if a == "-m" and i + 1 < len(argv):
            return argv[i + 1][:48]
    return (os.path.basename(argv[0]) if argv else parent.comm)[:48]
