"""Placed at first GPU use: processes a launch started that carry no rank variable.

``torch.multiprocessing.spawn`` gives each rank its number as an argument, not in its
environment, and a launcher tunerd does not know sets none of the variables the
intake reads (``LOCAL_RANK`` ...): such processes are no ranks to the exec watcher. They
are placed here instead, once they use a GPU, as ranks of the job their parent keys
(its pid and start time), in the slice of the GPU they use (ranks of one job that share
a GPU split it), with their memory on the slice's node.

Every ``TICK_S`` on the daemon's loop, while ``[[job]]`` rules are in force and a rule
has bound or left alone a process (else there is no launch to follow and nothing is
read), the service asks who uses a GPU:

* NVML's compute-process list of every GPU (``Device.compute_processes``), as the
  monitor's last GPU sample has it (``listing``: it reads every GPU's list each cycle
  anyway), or read here where that sample is missing or stale;
* for mp.spawn children of processes a rule bound, their open ``/dev/nvidiaN`` (read
  for at most ``MAX_FD_SCANS`` processes a tick: a process NVML cannot see, as from
  inside another PID namespace).

A process found is placed when it is unbound, inside the daemon's scope, has no rank
variable of its own (those are the rules'), did not narrow its own CPUs (nor did its
parent: numactl, taskset), and a launch tunerd knows started it:

* a child of a process a rule bound or matched (any child; of a rank, only an mp.spawn
  child: a rank's other children are its workers, kept in its CPUs);
* a child of a launcher (torchrun, mpirun ... ``tunerd.watch.launchers``);

under that rule (for a launcher's child, the launcher's own match, else the first
``match.rank`` rule whose other keys match the child). It is handed to the rule's
bind (``AutoBinder.on_match``, with the intake's look made a rank): the same gate,
placer, ledger and registry as every rule bind, recorded with why ("uses GPU 2
(NVML) ..."); its DataLoader workers are narrowed into its CPUs as a rank's are.
A verdict is kept per pid while the process stays listed (a left-alone one is looked
at again after ``RECHECK_S``), so a tick over known processes reads nothing of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from tunerd.adapters import nvml, procfs
from tunerd.base.errors import TunerdError
from tunerd.jobs.autobind import AutoBinder
from tunerd.jobs.gate import device_gpus
from tunerd.jobs.intake import Intake, JobContext, RankId
from tunerd.jobs.registry import JobRegistry
from tunerd.jobs.scope import ProcessScope
from tunerd.topology.visible import nvml_users
from tunerd.watch.launchers import launcher_comm
from tunerd.watch.rules import JobRule, RuleMatch

__all__ = ["GpuUse", "Launch", "is_spawn_child"]

log = logging.getLogger("tunerd.gpuuse")

TICK_S = 1.0  # how often GPU users are looked for
RECHECK_S = 30.0  # a process left alone is looked at again after this
MAX_LISTED = 1024  # GPU users taken per tick (NVML's lists together)
MAX_NEW = 32  # processes not seen before looked at per tick
MAX_FD_PARENTS = 16  # rule-bound processes whose children are looked at per tick
MAX_FD_SCANS = 8  # ... and of those children, whose open fds are read
MAX_KNOWN = 4096  # verdicts kept (dropped whole when full)
SPAWN_MARKS = ("--multiprocessing-fork", "multiprocessing.spawn")


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


@dataclass(frozen=True)
class Launch:
    """What started a GPU user: its parent, the rule it is placed under, the job key."""

    parent: int
    parent_start: int
    rule: JobRule
    kind: str  # "mp.spawn parent", "launcher torchrun", "process rule x bound" ...
    group: str  # the job: "mp.spawn:4242.1234"
    parent_bound: bool  # the parent's CPUs are tunerd's (its children inherited them)


Users = dict[int, tuple[tuple[int, ...], str]]  # pid -> (GPU indices, how seen)
# (GPU index, pid) of every compute process, as another reader of NVML last saw them
# (the monitor's sample), or None where it has no fresh list
Listing = Callable[[], "list[tuple[int, int]] | None"]


class GpuUse:
    """The service (module docstring)."""

    name = "gpuuse"

    def __init__(self, autobind: AutoBinder, intake: Intake, jobs: JobRegistry, *,
                 scope: ProcessScope | None = None, tick_s: float = TICK_S,
                 listing: Listing | None = None, proc_root: str = procfs.PROC) -> None:
        self.autobind = autobind
        self.intake = intake
        self.jobs = jobs
        self.scope = scope
        self.tick_s = tick_s
        self.listing = listing
        self.proc = proc_root
        self.placed = 0
        self.ticks = 0  # ticks that looked (armed)
        self.left_alone: dict[str, int] = {}  # why -> how many (first verdicts)
        self.last: list[dict[str, object]] = []  # the last placements handed over
        self._known: dict[int, tuple[str, float]] = {}  # pid -> (verdict, when)
        self._spawn: dict[int, bool] = {}  # child of a rule-bound process -> spawn child?
        self._fd_cursor = 0
        self._minors: dict[int, int] = {}
        self._ranks: dict[str, set[int]] = {}  # job group -> pids placed in it
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

    def status(self) -> dict[str, object]:
        return {"summary": f"placed at first GPU use: {self.placed} process(es)",
                "placed": self.placed, "ticks": self.ticks,
                "left_alone": dict(self.left_alone), "last": list(self.last)}

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self.tick()
            except Exception:  # one bad tick must not end the service
                log.exception("placing GPU users failed")

    # -- one tick ---------------------------------------------------------------
    def armed(self) -> bool:
        """Whether there is a launch to follow: rules in force that bound or left alone
        a process (a dict's truth: nothing read)."""
        ab = self.autobind
        return bool(ab.rules) and bool(ab.bound or ab.memory.left_alone)

    def tick(self) -> None:
        if not self.armed():
            if self._known:
                self._known.clear()
            return
        self.ticks += 1
        users = self.gpu_users()
        now = time.monotonic()
        new = 0
        for pid in sorted(users):
            seen = self._known.get(pid)
            if seen is not None and (seen[0] == "placed" or now - seen[1] < RECHECK_S):
                continue
            if new >= MAX_NEW:
                break
            new += 1
            verdict = self.consider(pid, *users[pid], users)
            if seen is None and verdict != "placed":
                self.left_alone[verdict] = self.left_alone.get(verdict, 0) + 1
            if len(self._known) >= MAX_KNOWN:
                self._known.clear()
            self._known[pid] = (verdict, now)
        for pid in [p for p in self._known if p not in users]:
            del self._known[pid]  # gone from the lists: a reused pid is looked at afresh

    def gpu_users(self) -> Users:
        """pid -> (GPUs, how seen): NVML's lists, then open device nodes (bounded)."""
        out: Users = {}
        seen = self.listing() if self.listing is not None else None
        devs = nvml.devices() if seen is None or self.autobind.bound else []
        if seen is None:
            seen = nvml_users(devs)
        for gpu, pid in seen:
            if len(out) >= MAX_LISTED and pid not in out:
                continue
            gpus = out.get(pid, ((), ""))[0]
            out[pid] = ((*gpus, gpu), "NVML")
        out.update(self._fd_users(out, devs))
        return out

    def _fd_users(self, listed: Users, devs: list[nvml.Device]) -> Users:
        """mp.spawn children of rule-bound processes holding ``/dev/nvidiaN`` open that
        NVML did not list: ``MAX_FD_PARENTS`` parents a tick, in turn, and at most
        ``MAX_FD_SCANS`` children's fds read."""
        parents = list(self.autobind.bound)
        if not parents:
            self._spawn.clear()
            return {}
        if not self._minors:  # the N of /dev/nvidiaN -> GPU index, asked once
            self._minors = {m if isinstance(m := d.minor_number, int) else d.index: d.index
                            for d in devs}
        minors = self._minors
        start = self._fd_cursor % len(parents)
        turn = (parents[start:] + parents[:start])[:MAX_FD_PARENTS]
        self._fd_cursor = start + len(turn)
        out: Users = {}
        scans = 0
        kids_now: set[int] = set()
        for ppid in turn:
            for kid in self._children(ppid):
                kids_now.add(kid)
                if kid in listed or kid in self._known or scans >= MAX_FD_SCANS \
                        or not self._spawn_child(kid, ppid):
                    continue
                scans += 1
                held = device_gpus(kid, self.proc) or frozenset()
                gpus = tuple(sorted(minors[m] for m in held if m in minors))
                if gpus:
                    out[kid] = (gpus, "an open /dev/nvidiaN")
        if len(self._spawn) > MAX_KNOWN:
            self._spawn = {k: v for k, v in self._spawn.items() if k in kids_now}
        return out

    def _children(self, pid: int) -> list[int]:
        """Children of ``pid``'s main thread (mp.spawn starts them there): one read."""
        try:
            raw = procfs.read_bytes(f"{self.proc}/{pid}/task/{pid}/children")
        except OSError:
            return []
        return [int(x) for x in raw.split()]

    def _spawn_child(self, pid: int, ppid: int) -> bool:
        """Whether ``pid``, a child of ``ppid`` (rule-bound), is a spawn child, not a
        rank's worker (read once per pid)."""
        hit = self._spawn.get(pid)
        if hit is None:
            try:
                argv = procfs.Process(pid, self.proc).cmdline(1024)
                hit = is_spawn_child(argv, procfs.Process(ppid, self.proc).cmdline(1024)) \
                    and not self._placed_here(ppid)
            except TunerdError:
                hit = False
            self._spawn[pid] = hit
        return hit

    def _placed_here(self, pid: int) -> bool:
        """Whether this service placed ``pid`` as a rank (its children are its workers)."""
        return any(pid in ranks for ranks in self._ranks.values())

    # -- one process --------------------------------------------------------------
    def consider(self, pid: int, gpus: tuple[int, ...], how: str, users: Users) -> str:
        """Place ``pid`` (it uses ``gpus``, as ``how`` saw) or say why not. A rank's
        mp.spawn child that inherited its rank variable was narrowed into the rank's
        CPUs as a worker at its exec: it is placed all the same (that binding undone)."""
        rec = self.jobs.record(pid)
        if pid in self.autobind.bound or (rec is not None and rec.origin != "worker"):
            return "bound already"
        if self.scope is not None and not self.scope.contains(pid):
            return "outside this daemon's scope"
        try:
            ctx = self.intake.describe(pid)
        except TunerdError as err:
            log.debug("pid %d (uses GPU %s): %s", pid, gpus, err.message)
            return "gone"
        inherited = ctx.rank is not None and ctx.role == "descendant"
        if ctx.role in ("launcher", "wrapper") or (ctx.rank is not None and not inherited):
            return f"a {ctx.role}: the rules' own"
        launch = self.launch(ctx)
        if (inherited or rec is not None) and \
                (launch is None or not launch.group.startswith("mp.spawn:")):
            return "a rank's worker: kept in its CPUs"
        if launch is None:
            return "no launch tunerd knows started it"
        if rec is None and self._own_cpus(ctx, launch):
            return "it or its parent set its own CPUs (numactl, taskset)"
        siblings = sorted(p for p, (_, h) in users.items() if h and p != pid
                          and procfs.read_ppid(p, self.proc) == launch.parent)
        ranked = self._as_rank(ctx, gpus, how, launch, siblings, users)
        if rec is None:
            self._hand_over(ranked, launch)
        else:
            self._spawn_task(self._unnarrow_then_place(ranked, launch))
        return "placed"

    def _spawn_task(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unnarrow_then_place(self, ctx: JobContext, launch: Launch) -> None:
        """A spawn rank narrowed as a worker: its CPUs back as they were, then placed."""
        try:
            await self.jobs.unbind(ctx.pid, peer=self.autobind.peer)
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
        rb = self.autobind.bound.get(ppid)
        try:
            parent = self.intake.describe(ppid)
        except TunerdError:
            return None
        spawn = is_spawn_child(ctx.argv, parent.argv)
        key = f"{ppid}.{pst.start_time}"
        if rb is not None and rb.start_time == pst.start_time:
            rule = self._rule(rb.rule)
            if rule is None or self._placed_here(ppid) or (parent.role == "rank" and not spawn):
                return None  # a rank's other children are its workers
            kind = "mp.spawn parent" if spawn else f"process rule {rule.name} bound"
            return Launch(ppid, pst.start_time, rule, kind,
                          f"{'mp.spawn' if spawn else 'children'}:{key}", True)
        if self.autobind.set_own_cpus(ppid):
            return None
        m = self.autobind.rules.match(ppid)
        if parent.role == "launcher":
            rule = m.rule if m is not None else self._rank_rule(ctx)
            name = _launcher_name(parent)
            return None if rule is None else Launch(
                ppid, pst.start_time, rule, f"launcher {name}", f"{name}:{key}",
                self.jobs.is_bound(ppid))
        if m is None or (m.rule.rank and parent.role != "rank") \
                or (parent.role == "rank" and not spawn):
            return None
        return Launch(ppid, pst.start_time, m.rule,
                      "mp.spawn parent" if spawn else f"process rule {m.rule.name} matched",
                      f"{'mp.spawn' if spawn else 'children'}:{key}", False)

    def _rule(self, name: str) -> JobRule | None:
        return next((r for r in self.autobind.rules.rules if r.name == name), None)

    def _rank_rule(self, ctx: JobContext) -> JobRule | None:
        """A launcher's child under no rule of its launcher's: the first ``match.rank``
        rule whose other keys match the child."""
        for r in self.autobind.rules.rules:
            if r.rank and r.matches(ctx.cmdline, ctx.uid, dict(ctx.env)):
                return r
        return None

    def _own_cpus(self, ctx: JobContext, launch: Launch) -> bool:
        """``ctx`` runs on fewer CPUs than its parent: it (or a numactl/taskset it was
        started through) chose them."""
        try:
            pmask = frozenset(os.sched_getaffinity(launch.parent))
        except OSError:
            return True
        mask = ctx.allocation.mask
        return mask is not None and mask < pmask

    def _as_rank(self, ctx: JobContext, gpus: tuple[int, ...], how: str, launch: Launch,
                 siblings: list[int], users: Users) -> JobContext:
        """The intake's look at ``ctx`` made a rank of ``launch``'s job near ``gpus``."""
        mine = self._ranks.setdefault(launch.group, set())
        mine.intersection_update(p for p in mine if procfs.read_start_time(p, self.proc))
        job = sorted(mine | set(siblings) | {ctx.pid})
        visible = tuple(sorted({g for p in job for g in users.get(p, ((), ""))[0]} | set(gpus)))
        rank = RankId(len(mine), len(job), f"uses GPU {','.join(map(str, gpus))} ({how})",
                      launch.group, var="GPU use")
        alloc = ctx.allocation
        if launch.parent_bound:  # its mask is the one tunerd gave its parent
            alloc = replace(alloc, current=None)
        why = (f"{rank.source}; started by {launch.kind} {launch.parent}, "
               f"placed as a rank of job {launch.group}")
        return replace(ctx, role="rank", rank=rank, gpus=gpus, gpus_how=how, why=why,
                       visible=visible, allocation=alloc, parent_rank=None,
                       parent_cpus=None, self_affined=False,
                       launcher=f"{launch.kind} {launch.parent}")

    def _hand_over(self, ctx: JobContext, launch: Launch) -> None:
        """To the rule's bind: gate, place, hold, apply, record (``AutoBinder``)."""
        assert ctx.rank is not None
        self._ranks[launch.group].add(ctx.pid)
        if len(self._ranks) > MAX_KNOWN:
            self._ranks = {launch.group: self._ranks[launch.group]}
        m = RuleMatch(rule=launch.rule, pid=ctx.pid, cmdline=ctx.cmdline, uid=ctx.uid,
                      env=ctx.env)
        log.info("pid %d (%s) %s: rule %s places it", ctx.pid, ctx.comm, ctx.why,
                 launch.rule.name)
        self.placed += 1
        self.last = [*self.last[-9:], {"pid": ctx.pid, "gpus": list(ctx.gpus),
                                       "rule": launch.rule.name, "why": ctx.why}]
        self.autobind.on_match(m, time.monotonic(), ctx)


def _stat(pid: int, proc: str) -> procfs.Stat | None:
    try:
        return procfs.Process(pid, proc).stat()
    except TunerdError:
        return None


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
