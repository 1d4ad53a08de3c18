"""The job model (issue 15): one intake tells ranks, their descendants, wrappers and
launchers apart on real process trees, and ranks split their allocation.

The first tests run the intake on processes started here (no daemon); the placement
tests use the recorded DGX H100 topology; the last ones run real torchrun jobs under
the real daemon with the bundled rule (narrowed to this test's processes by a token).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.binding_helpers import task_cpus
from tests.helpers import REPO, DaemonProc, wait_for
from tests.launcher_helpers import spawn_rank
from tests.leases_helpers import (
    DGX_H100,
    autobind_status,
    descendants,
    kill,
    kill_pids,
    kill_tree,
    spawn,
)
from tests.test_torch_ddp import bundled_rule_policy
from tunerd.base.cpulist import parse_cpulist
from tunerd.jobs.allocation import Allocation
from tunerd.jobs.intake import Intake, JobContext, RankId, request
from tunerd.jobs.placer import HostCapacity, Placer, Reservation
from tunerd.topology import load_topology
from tunerd.watch.launchers import is_launcher, wrapper_name

HOST_CPUS = frozenset(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs")


def intake(bound: dict[int, tuple[int, frozenset[int]]] | None = None) -> Intake:
    table = bound or {}
    return Intake(load_topology(None), HOST_CPUS, bound=table.get, lease=lambda pid: None)


def start_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


# -- the intake on real process trees --------------------------------------------------

def test_launchers_and_wrappers_are_told_by_their_command_line() -> None:
    for argv in (["torchrun", "--nproc-per-node", "2", "finetune.py"],
                 ["/usr/bin/python3", "-m", "torch.distributed.run", "x.py"],
                 ["python3", "/venv/bin/torchrun", "x.py"],
                 ["python", "-u", "-m", "deepspeed.launcher.launch", "x.py"],
                 ["accelerate", "launch", "x.py"], ["mpirun", "-np", "2", "x"], ["srun"]):
        assert is_launcher(argv), argv
    assert is_launcher([], "slurmstepd")  # a task before its exec
    for argv in (["python", "finetune.py"], ["python", "-m", "mypkg.train"], ["./train"]):
        assert not is_launcher(argv), argv
    assert wrapper_name(["numactl", "--physcpubind=0", "python"]) == "numactl"
    assert wrapper_name(["/usr/bin/env", "python"]) == "env"
    assert wrapper_name(["/bin/sh", "./wrap.sh"]) == "sh"
    assert wrapper_name(["python", "x.py"]) is None


RANK_TREE = r"""
import multiprocessing as mp, os, subprocess, sys, time
if __name__ == "__main__":
    worker = os.fork()
    if worker == 0:
        time.sleep(60)
        os._exit(0)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(worker, helper.pid, flush=True)
    time.sleep(60)
"""


@pytest.fixture
def rank_tree() -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """A process with a rank identity, its forked worker and a helper it started."""
    agent, rank = spawn_rank([sys.executable, "-c", RANK_TREE],
                             {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
                             stdout=subprocess.PIPE)
    assert agent.stdout is not None
    worker, helper = map(int, agent.stdout.readline().split())
    p = _Rank(rank)
    try:
        yield p, worker, helper  # type: ignore[misc]
    finally:
        kids = descendants(agent.pid)
        agent.kill()
        agent.wait()
        kill_pids(kids)


class _Rank:
    """The rank under the launcher, as much of a Popen as the tests use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid


def test_a_ranks_workers_and_helpers_are_its_descendants(
        rank_tree: tuple[subprocess.Popen[str], int, int]) -> None:
    p, worker, helper = rank_tree
    rank = intake().describe(p.pid)
    assert rank.role == "rank" and rank.rank is not None
    assert (rank.rank.local_rank, rank.rank.local_world) == (1, 2)
    assert "LOCAL_RANK=1" in rank.why
    for pid in (worker, helper):  # they inherited LOCAL_RANK: still not ranks
        ctx = intake().describe(pid)
        assert ctx.role == "descendant", (pid, ctx.why)
    # once the rank is bound, its descendants know its CPUs (a /proc rescan narrows them)
    bound = {p.pid: (start_time(p.pid), frozenset({min(HOST_CPUS)}))}
    for pid in (worker, helper):
        ctx = intake(bound).describe(pid)
        assert (ctx.role, ctx.parent_rank, ctx.parent_cpus) == (
            "descendant", p.pid, frozenset({min(HOST_CPUS)}))


def test_rank_numbers_are_bounded() -> None:
    p = spawn(["sleep", "30"], {"LOCAL_RANK": "9" * 5000, "LOCAL_WORLD_SIZE": "-1"})
    try:
        wait_for(lambda: b"LOCAL_RANK" in Path(f"/proc/{p.pid}/environ").read_bytes(), 5,
                 "the exec")
        ctx = intake().describe(p.pid)
        assert ctx.rank is None and ctx.role == "process"
        assert any("LOCAL_RANK=" in n and "5000 characters" in n for n in ctx.notes), ctx.notes
    finally:
        kill(p)


@needs_two_cpus
def test_a_rank_that_set_its_own_affinity_is_left_as_it_is() -> None:
    cpu = max(HOST_CPUS)
    agent, pid = spawn_rank(["numactl", f"--physcpubind={cpu}", "sleep", "30"],
                            {"LOCAL_RANK": "0"})
    try:
        wait_for(lambda: Path(f"/proc/{pid}/comm").read_text().strip() == "sleep", 5,
                 "numactl to exec sleep")
        ctx = intake().describe(pid)
        assert ctx.role == "rank" and ctx.self_affined, ctx.why
        # the message names the parent and both masks, and guesses no tool (issue 29:
        # "numactl/taskset" was said when mpirun had set it)
        parent = agent.pid
        assert f"its CPU mask {cpu} was set narrower than its parent's (" in ctx.why, ctx.why
        assert f" pid {parent}: " in ctx.why and "left as it is" in ctx.why
        assert "(numactl/taskset)" not in ctx.why
    finally:
        kill_tree(agent)


# -- ranks split their allocation (the recorded DGX H100) --------------------------------

def _task(i: int, alloc: Allocation, ntasks: int) -> JobContext:
    """Slurm task ``i`` of one step, as the intake describes it."""
    return JobContext(
        pid=1000 + i, start_time=1, ppid=999, uid=0, comm="python", argv=("python",),
        env={}, allocation=alloc, gpus=(i,), gpus_how="SLURM_STEP_GPUS",
        rank=RankId(i, ntasks, f"Slurm task {i} of {ntasks}", "slurm:7.0", slurm_task=True,
                    var="SLURM_LOCALID"), role="rank", why="a Slurm task")


@pytest.mark.parametrize("per_task", [None, 8])
def test_eight_tasks_of_one_step_get_disjoint_gpu_local_cpus(per_task: int | None) -> None:
    topo = load_topology(DGX_H100)
    placer = Placer(topo, HostCapacity(topo.online_cpus(), frozenset({0, 1})), frozenset)
    step = Allocation(gpus=tuple(range(8)), ncpus=per_task, scheduler="Slurm job 7 step 0",
                      slurm_job="7", slurm_step="0", job_from_cgroup=True)
    got: list[frozenset[int]] = []
    for i in range(8):
        ctx = _task(i, step, 8)
        p = placer.place(request(ctx, gpu_ids=(i,), ignore_busy_gpus=True))
        assert p.cpus and p.gpus == (i,)
        local = next(g for g in topo.gpus if g.index == i).local_cpus
        assert p.cpus <= frozenset(local), (i, p.cpus)  # near the task's GPU
        if per_task:
            assert len(p.cpus) == per_task  # what Slurm granted each task
        placer.reserve(Reservation(key=f"bind:{1000 + i}", holder=f"task {i}", gpus=p.gpus,
                                   cpus=p.cpus, group=request(ctx).group, job=ctx.job_key))
        got.append(p.cpus)
    for i, s in enumerate(got):
        for t in got[i + 1:]:
            assert not s & t, f"tasks share CPUs: {got}"


def test_torchrun_ranks_inside_a_two_cpu_task_get_one_cpu_each() -> None:
    """sbatch -c2 (SLURM_CPUS_PER_TASK=2) starting two LOCAL_RANK ranks: the grant is
    the task's, split by its ranks (not 2 CPUs for each rank)."""
    topo = load_topology(DGX_H100)
    placer = Placer(topo, HostCapacity(topo.online_cpus(), frozenset({0, 1})), frozenset)
    task = Allocation(cpus=frozenset({0, 112}), ncpus=2, gpus=(0, 1),
                      scheduler="Slurm job 8 step batch", slurm_job="8", slurm_step="batch",
                      job_from_cgroup=True)
    got = []
    for r in range(2):
        ctx = JobContext(pid=2000 + r, start_time=1, ppid=1999, uid=0, comm="python",
                         argv=("python", "finetune.py"), env={}, allocation=task,
                         gpus=(r,), gpus_how="LOCAL_RANK",
                         rank=RankId(r, 2, f"LOCAL_RANK={r}", "slurm:8.batch/torchrun:x"),
                         role="rank", why="LOCAL_RANK")
        p = placer.place(request(ctx, gpu_ids=(r,), ignore_busy_gpus=True, workers=0))
        placer.reserve(Reservation(key=f"rule:{2000 + r}", holder=f"rank {r}", gpus=p.gpus,
                                   cpus=p.cpus or frozenset(), group=request(ctx).group,
                                   job=ctx.job_key))
        got.append(p.cpus)
    assert all(c is not None and len(c) == 1 and c <= {0, 112} for c in got), got
    assert got[0] != got[1]


def test_a_jobs_own_exclusive_lease_never_blocks_its_own_ranks() -> None:
    topo = load_topology(DGX_H100)
    placer = Placer(topo, HostCapacity(topo.online_cpus(), frozenset({0, 1})), frozenset)
    cpus = frozenset(next(g for g in topo.gpus if g.index == 0).local_cpus)
    placer.reserve(Reservation(key="lease:L1", holder="lease L1 (slurm:9)", gpus=(0,),
                               cpus=cpus, exclusive=True, soft=True, job="slurm:9"))
    alloc = Allocation(gpus=(0,), scheduler="Slurm job 9 step 0", slurm_job="9",
                       slurm_step="0", job_from_cgroup=True)
    ctx = _task(0, alloc, 1)
    own = placer.place(request(ctx, gpu_ids=(0,), ignore_busy_gpus=True))
    assert own.cpus and own.cpus <= cpus  # the job's step uses what its lease holds
    other = _task(0, replace(alloc, slurm_job="10", scheduler="Slurm job 10 step 0"), 1)
    theirs = placer.place(request(other, gpu_ids=(0,), ignore_busy_gpus=True))
    assert theirs.cpus and not theirs.cpus & cpus  # another job's does not
    assert placer.busy_gpus() == {0: "lease L1 (slurm:9)"}  # a new lease sees GPU 0 held


# -- real torchrun jobs under the real daemon -------------------------------------------

FINETUNE = r"""
import json, multiprocessing as mp, os, sys, time
from pathlib import Path

def work():
    time.sleep(600)

if __name__ == "__main__":
    hold = Path(sys.argv[1])
    kids = []
    for how in ("fork", "spawn", "forkserver"):  # DataLoader-style workers of each kind
        p = mp.get_context(how).Process(target=work, daemon=True)
        p.start()
        kids.append(p.pid)
    rank = os.environ["LOCAL_RANK"]
    tmp = hold / f".rank{rank}.json"  # written whole, then renamed: the test reads it
    tmp.write_text(json.dumps({"pid": os.getpid(), "workers": kids}))
    tmp.rename(hold / f"rank{rank}.json")
    while not (hold / "release").exists():
        time.sleep(0.05)
"""


def _tree_cpus(pid: int) -> dict[int, set[frozenset[int]]]:
    """Every process below ``pid`` -> the CPU masks of its threads."""
    out = {}
    for k in descendants(pid):
        try:
            out[k] = {parse_cpulist(c) for c in task_cpus(k).values()}
        except (OSError, ValueError):
            pass
    return out


@needs_two_cpus
def test_torchrun_finetune_ranks_are_bound_and_workers_stay_inside_their_rank(
        daemon_factory, tmp_path: Path) -> None:
    """`torchrun finetune.py` (no "train" in the name) started before the daemon, so
    its fork/spawn/forkserver workers run on every CPU; a daemon without the proc
    connector (watch_execs = false) binds both ranks, one CPU each, and narrows every
    worker into its own rank's CPU; after a restart it is all still so."""
    pdir = tmp_path / "policies"
    token = secrets.token_hex(6)
    bundled_rule_policy(pdir, token)
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text("watch_execs = false\n")
    hold = tmp_path / "hold"
    hold.mkdir()
    script = tmp_path / "finetune.py"
    script.write_text(FINETUNE)
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(script), str(hold)],
        # no room asked for the workers: each rank gets its own CPU, its workers share it
        env={**os.environ, "TUNERD_TEST_TOKEN": token, "PYTHONPATH": str(REPO),
             "TUNERD_NUM_WORKERS": "0"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
    try:
        wait_for(lambda: len(list(hold.glob("rank*.json"))) == 2 or job.poll() is not None,
                 120, "both ranks to start their workers")
        assert job.poll() is None, job.communicate()[1][-2000:]
        ranks = [json.loads((hold / f"rank{r}.json").read_text()) for r in (0, 1)]
        d = daemon_factory(policy_dir=pdir, args=["--config", str(cfg)]).start()
        for restart in (False, True):
            if restart:
                d.stop()
                d.start()
            _check_job(d, ranks)
        (hold / "release").touch()
        job.wait(60)
    finally:
        kill_tree(job)


def _check_job(d: DaemonProc, ranks: list[dict[str, Any]]) -> None:
    def bound() -> dict[int, frozenset[int]]:
        jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
        got = {r["pid"]: parse_cpulist(jobs[r["pid"]]["cpus"]) for r in ranks
               if jobs.get(r["pid"], {}).get("origin") == "rule"}
        return got if len(got) == 2 else {}

    cpus = wait_for(bound, 20, "both ranks rule-bound", detail=d.log)
    a, b = (cpus[r["pid"]] for r in ranks)
    assert len(a) == len(b) == 1 and a != b, cpus  # the ranks split the 2 CPUs

    def inside() -> bool:
        return all(masks and all(m <= cpus[r["pid"]] for m in masks)
                   for r in ranks for masks in _tree_cpus(r["pid"]).values())

    wait_for(inside, 20, "every worker inside its own rank's CPUs",
             detail=lambda: str({r["pid"]: _tree_cpus(r["pid"]) for r in ranks}) + d.log())
    for r in ranks:
        assert set(r["workers"]) <= set(_tree_cpus(r["pid"])), r


HOG = "while True: pass"
WRAP = 'exec numactl --physcpubind=$(( LOCAL_RANK % {n} )) sleep 0.2\n'


@needs_two_cpus
def test_numactl_wrapped_ranks_never_die(daemon_factory, tmp_path: Path) -> None:
    """torchrun --numa-binding starts each rank as `numactl --physcpubind=... CMD`: 30
    such ranks, on a node kept busy by a CPU hog, all run (numactl is never bound, and
    the rank it exec'd, having set its own affinity, is left as it is)."""
    pdir = tmp_path / "policies"
    token = secrets.token_hex(6)
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir).start()
    wrap = tmp_path / "wrap.sh"
    wrap.write_text(WRAP.format(n=len(HOST_CPUS)))
    hogs = [subprocess.Popen([sys.executable, "-c", HOG])]  # one CPU kept busy
    try:
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "30", "--no-python", "sh", str(wrap)],
            env={**os.environ, "TUNERD_TEST_TOKEN": token}, capture_output=True, text=True,
            timeout=150, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "out of range" not in r.stderr
        assert time.monotonic() - t0 < 150
    finally:
        for h in hogs:
            kill(h)
    st = autobind_status(d)
    assert st["failed"] == 0, st["last_error"]
    assert not [b for b in st["bound"] if b["rule"] == "torch-training"], st["bound"]
    # the ranks exec'd by numactl were seen, and left as they are; no wrapper was bound
    assert "was set narrower than its parent's" in d.log() \
        and "rule torch-training: bound" not in d.log()


@needs_two_cpus
def test_advise_says_a_rank_set_its_own_affinity(daemon_factory, tmp_path: Path) -> None:
    """A rank started through taskset (as torchrun --numa-binding starts them through
    numactl) is left as it is by the bundled rule, and `advise` says so: an info
    finding `self-affined` naming its CPUs, for `advise` and `advise PID` (exit 0)."""
    pdir = tmp_path / "policies"
    token = secrets.token_hex(6)
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir).start()
    cpu = max(HOST_CPUS)
    agent, pid = spawn_rank(["taskset", "-c", str(cpu), "sleep", "60"],
                            {"TUNERD_TEST_TOKEN": token, "LOCAL_RANK": "0",
                             "LOCAL_WORLD_SIZE": "1"})
    p = _Rank(pid)
    try:
        def listed() -> dict[str, Any] | None:
            jobs = d.ctl("--json", "advise").json()["jobs"]
            return next((j for j in jobs if j["pid"] == p.pid), None)

        job = wait_for(listed, 20, "the self-affined rank in advise", detail=d.log)
        assert [f["id"] for f in job["findings"]] == ["self-affined"], job
        assert job["findings"][0]["evidence"]["cpus"] == str(cpu)
        assert "was set narrower than its parent's" in job["findings"][0]["evidence"]["why"]
        r = d.ctl("--json", "advise", str(p.pid))
        assert r.rc == 0, r.err
        assert [j["pid"] for j in r.json()["jobs"]] == [p.pid]
        assert "self-affined" in d.ctl("advise", str(p.pid)).out
        assert os.sched_getaffinity(p.pid) == {cpu}  # left as it is
        assert not [b for b in autobind_status(d)["bound"] if b["pid"] == p.pid]
    finally:
        kill_tree(agent)  # type: ignore[arg-type]


# -- bind from inside a PID namespace ----------------------------------------------------

@needs_two_cpus
def test_bind_from_a_pid_namespace_maps_the_callers_pids(daemon_factory,
                                                         tmp_path: Path) -> None:
    """A caller in its own PID namespace names its processes by its PIDs: bind maps
    them to the daemon's, and refuses a PID no process of that namespace has (it is
    never read as a host PID)."""
    d = daemon_factory().start()
    cpu = max(HOST_CPUS)
    ctl = f"{Path(sys.executable).parent / 'tunerctl'} --socket {d.socket}"
    script = (f'sleep 30 & echo "INNER=$!"; {ctl} bind $! --cpus {cpu} >/dev/null; '
              f'echo "RC=$?"; {ctl} bind {os.getpid()} --cpus {cpu} 2>/dev/null; '
              'echo "RC2=$?"; echo DONE; wait\n')
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
                         stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert p.stdout is not None
        lines: dict[str, str] = {}
        for line in p.stdout:
            if line.strip() == "DONE":
                break
            k, _, v = line.strip().partition("=")
            lines[k] = v
        assert lines.get("RC") == "0" and lines.get("RC2") not in (None, "0"), lines
        inner = int(lines["INNER"])
        sleeper = next(k for k in descendants(p.pid)
                       if Path(f"/proc/{k}/comm").read_text().strip() == "sleep")
        assert sleeper != inner  # a PID of the namespace, not the host's ...
        assert task_cpus(sleeper) and all(parse_cpulist(c) == {cpu}  # ... mapped to it
                                          for c in task_cpus(sleeper).values())
        assert parse_cpulist(task_cpus(os.getpid())[os.getpid()]) == HOST_CPUS  # not us
    finally:
        kill_tree(p)  # type: ignore[arg-type]


def test_a_narrowed_allocation_calls_a_cpu_mask_a_cpu_mask() -> None:
    """Messages name the cgroup's CPUs a cpuset, and CPUs narrowed by a mask (a lease, a
    launcher, the process's own affinity) a CPU mask, never a cpuset (issue 29)."""
    cg = Allocation(cpus=frozenset(range(8)), scheduler="cgroup /job")
    ctx = JobContext(pid=3000, start_time=1, ppid=2999, uid=0, comm="python",
                     argv=("python", "train.py"), env={}, allocation=cg, gpus=(),
                     gpus_how="", rank=None, role="process", why="")
    assert request(ctx).allocation.describe() == "cgroup /job (cpuset 0-7)"
    under_lease = replace(ctx, enclosing=frozenset({2, 3}), lease="L1")
    assert request(under_lease).allocation.describe() == "cgroup /job (CPU mask 2-3)"
    masked = replace(ctx, allocation=replace(cg, cpus=None, current=frozenset({5})),
                     rank=RankId(0, 1, "LOCAL_RANK=0", "torchrun:x"))
    assert request(masked).allocation.describe() == "cgroup /job (CPU mask 5)"
