"""The node map (issue 26): each GPU's slice of the node, several jobs at once on the
recorded DGX H100 and 8-GPU PCIe snapshots, identity from the tree, physical GPUs, and
holds across a daemon restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DaemonProc, wait_for
from tests.launcher_helpers import spawn_rank
from tests.leases_helpers import (
    DGX_H100,
    autobind_status,
    cpus_allowed,
    kill,
    kill_tree,
    snapshot_with_gpus_here,
    spawn,
)
from tests.test_torch_ddp import bundled_rule_policy
from tunerd.base.cpulist import parse_cpulist
from tunerd.jobs.allocation import Allocation
from tunerd.jobs.intake import Intake, JobContext, RankId, request
from tunerd.jobs.placer import HostCapacity, Placer, Reservation
from tunerd.topology import load_topology
from tunerd.topology.model import Topology
from tunerd.topology.nodemap import node_map
from tunerd.topology.visible import gpus_from_env

REPO = Path(__file__).resolve().parent.parent
PCIE_8GPU = REPO / "tests" / "fixtures" / "topologies" / "pcie-8gpu.json"
EPYC = REPO / "tests" / "fixtures" / "topologies" / "epyc-nps4.json"
# issue 36's recordings (GB200 trays, DGX B200, HGX H200)
NEW = {n: REPO / "tests" / "fixtures" / "topologies" / f"{n}.json"
       for n in ("gb200", "gb200-hbm-numa", "dgx-b200", "hgx-h200")}
HOST_CPUS = frozenset(os.sched_getaffinity(0))


def _placer(topo: Topology) -> Placer:
    return Placer(topo, HostCapacity(topo.online_cpus(), frozenset(topo.numa_nodes)),
                  frozenset)


# -- the map itself --------------------------------------------------------------------

@pytest.mark.parametrize("snap", [DGX_H100, PCIE_8GPU, EPYC, *NEW.values()])
def test_each_gpu_owns_a_disjoint_slice_of_whole_cores_on_its_node(snap: Path) -> None:
    topo = load_topology(snap)
    m = node_map(topo)
    assert sorted(m.slices) == [g.index for g in topo.gpus]
    seen: set[int] = set()
    for g in topo.gpus:
        s = m.slices[g.index]
        assert s.cpus and not s.cpus & seen, (g.index, s.cpus)
        seen |= s.cpus
        assert all(s.cpus >= topo.cpus[c].siblings for c in s.cpus)  # whole cores
        assert {topo.cpus[c].numa_node for c in s.cpus} == {g.numa_node} == set(s.mems)
    # every CPU is in one slice, or in the pool of nodes without a GPU
    assert seen | m.shared == topo.online_cpus() and not seen & m.shared


def test_dgx_slices_are_the_nodes_cores_divided_among_its_gpus() -> None:
    m = node_map(load_topology(DGX_H100))
    assert [len(m.slices[g].cpus) for g in range(8)] == [28] * 8  # 56 cores / 4 GPUs
    assert m.slices[1].cpus == parse_cpulist("14-27,126-139")
    assert m.slices[4].cpus == parse_cpulist("56-69,168-181")


def test_l3_groups_are_kept_whole_and_housekeeping_belongs_to_no_slice() -> None:
    topo = load_topology(EPYC)
    m = node_map(topo)
    for s in m.slices.values():  # NPS4, 2 GPUs per node with 4 CCXs: 2 whole CCXs each
        assert len(s.l3_groups) == 2
        assert {topo.cpus[c].l3_id for c in s.cpus} == set(s.l3_groups)
    dgx = load_topology(DGX_H100)
    hk = node_map(dgx, frozenset({0}))  # grown to the core: 0 and its sibling 112
    assert hk.housekeeping == {0, 112}
    assert not hk.slice_cpus(range(8)) & {0, 112}


# -- several jobs on one node ----------------------------------------------------------

def _rank(pid: int, job: str, rank: int, world: int, gpus: tuple[int, ...],
          visible: tuple[int, ...]) -> JobContext:
    return JobContext(pid=pid, start_time=1, ppid=pid // 100, uid=0, comm="python",
                      argv=("python", "train.py"), env={}, allocation=Allocation(),
                      gpus=gpus, gpus_how="LOCAL_RANK",
                      rank=RankId(rank, world, f"LOCAL_RANK={rank}", job), role="rank",
                      why="LOCAL_RANK", visible=visible)


def _run_jobs(topo: Topology, jobs: list[list[tuple[int, ...]]], workers: int = 2
              ) -> dict[str, list[frozenset[int]]]:
    """Every rank of every job placed and held as the rule does; job -> its ranks' CPUs."""
    placer = _placer(topo)
    out: dict[str, list[frozenset[int]]] = {}
    for j, ranks in enumerate(jobs):
        visible = tuple(dict.fromkeys(g for gs in ranks for g in gs))
        key = f"torchrun:{1000 + j}.1"
        for r, gpus in enumerate(ranks):
            ctx = _rank(100_000 * (j + 1) + r, key, r, len(ranks), gpus, visible)
            req = request(ctx, gpu_ids=gpus, ignore_busy_gpus=True, workers=workers,
                          group=key)
            p = placer.place(req)
            assert p.cpus, p.explanation
            placer.reserve(Reservation(key=f"rule:{ctx.pid}", holder=f"rank {r} of {key}",
                                       gpus=p.gpus, cpus=p.cpus, group=key))
            out.setdefault(key, []).append(p.cpus)
    return out


def _no_core_shared_between_jobs(got: dict[str, list[frozenset[int]]]) -> None:
    keys = sorted(got)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            for x in got[a]:
                for y in got[b]:
                    assert not x & y, f"{a} and {b} share CPUs {sorted(x & y)}"


@pytest.mark.parametrize("snap", [DGX_H100, PCIE_8GPU, NEW["dgx-b200"]])
@pytest.mark.parametrize("shape", ["eight 1-GPU jobs", "two 4-GPU jobs", "four 2-GPU jobs",
                                   "mixed"])
def test_ranks_of_different_jobs_on_different_gpus_share_no_cpu(snap: Path,
                                                                 shape: str) -> None:
    jobs = {"eight 1-GPU jobs": [[(g,)] for g in range(8)],
            "two 4-GPU jobs": [[(g,) for g in range(4)], [(g,) for g in range(4, 8)]],
            "four 2-GPU jobs": [[(g,), (g + 1,)] for g in range(0, 8, 2)],
            "mixed": [[(0,)], [(1,), (2,)], [(3,), (4,), (5,), (6,)], [(7,)]]}[shape]
    topo = load_topology(snap)
    got = _run_jobs(topo, jobs)
    _no_core_shared_between_jobs(got)
    m = node_map(topo)
    for key, cpus in got.items():  # and each rank inside its own GPU's slice
        j = int(key.split(":")[1].split(".")[0]) - 1000
        for gpus, c in zip(jobs[j], cpus, strict=True):
            assert c <= m.slice_cpus(gpus), (key, gpus, sorted(c))


def test_ranks_of_one_job_sharing_a_gpu_split_its_slice() -> None:
    topo = load_topology(DGX_H100)
    got = _run_jobs(topo, [[(0,)] * 4])["torchrun:1000.1"]
    assert [len(c) for c in got] == [6, 6, 6, 6]  # 28 CPUs / 4, whole cores
    assert frozenset().union(*got) <= node_map(topo).slices[0].cpus
    assert len(frozenset().union(*got)) == 24


def test_a_slice_too_small_for_a_rank_and_its_workers_is_said() -> None:
    topo = load_topology(DGX_H100)
    placer = _placer(topo)
    ctx = _rank(4242, "torchrun:1.1", 0, 1, (0,), (0,))
    p = placer.place(request(ctx, gpu_ids=(0,), ignore_busy_gpus=True, workers=40))
    assert p.cpus is not None and p.cpus <= node_map(topo).slices[0].cpus
    assert "40 DataLoader worker(s)" in p.explanation


# -- identity from the tree, physical GPUs ----------------------------------------------

def _intake(topo: Topology | None = None) -> Intake:
    return Intake(topo or load_topology(None), HOST_CPUS, bound=lambda pid: None,
                  lease=lambda pid: None)


def test_local_rank_without_a_launcher_is_no_rank() -> None:
    p = spawn(["sleep", "30"], {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    try:
        wait_for(lambda: b"LOCAL_RANK" in Path(f"/proc/{p.pid}/environ").read_bytes(), 5,
                 "the exec")
        ctx = _intake().describe(p.pid)
        assert ctx.role == "process" and ctx.launcher is None, ctx.why
        assert "no launcher" in ctx.why
    finally:
        kill(p)


def test_a_job_is_keyed_by_its_launcher_not_by_a_run_id_of_none() -> None:
    """torchrun without --standalone/--rdzv-id exports TORCHELASTIC_RUN_ID=none in every
    job: two such jobs are two groups, each keyed by its agent."""
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "none"}
    a, ra = spawn_rank(["sleep", "30"], env)
    b, rb = spawn_rank(["sleep", "30"], env)
    try:
        ca, cb = (_intake().describe(pid) for pid in (ra, rb))
        assert ca.role == cb.role == "rank", (ca.why, cb.why)
        assert ca.launcher == f"torchrun {a.pid}" and cb.launcher == f"torchrun {b.pid}"
        assert ca.group != cb.group and f"torchrun:{a.pid}." in (ca.group or "")
    finally:
        kill_tree(a)  # type: ignore[arg-type]
        kill_tree(b)  # type: ignore[arg-type]


@pytest.mark.parametrize("cvd", [None, "0,1,2,3,4,5,6,7"])
def test_mpi_local_rank_i_is_placed_near_gpu_i(cvd: str | None) -> None:
    topo = load_topology(DGX_H100)
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": "5", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    if cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    agent, pid = spawn_rank(["sleep", "30"], env, name="mpirun")
    try:
        ctx = _intake(topo).describe(pid)
        assert ctx.role == "rank" and ctx.gpus == (5,), (ctx.why, ctx.gpus)
        p = _placer(topo).place(request(ctx, gpu_ids=ctx.gpus, ignore_busy_gpus=True))
        assert p.cpus is not None and p.cpus <= node_map(topo).slices[5].cpus
        assert {topo.cpus[c].numa_node for c in p.cpus} == {1}  # one NUMA node, GPU 5's
    finally:
        kill_tree(agent)  # type: ignore[arg-type]


def test_a_slurm_job_given_gpu_1_sees_cuda_device_0_and_is_placed_near_gpu_1() -> None:
    """ConstrainDevices renumbers the job's GPUs from 0."""
    topo = load_topology(DGX_H100)
    env = {"CUDA_VISIBLE_DEVICES": "0", "LOCAL_RANK": "0"}
    assert gpus_from_env(topo, env, allowed=(1,), local_rank=0) == (1,)
    assert gpus_from_env(topo, {"CUDA_VISIBLE_DEVICES": "0,1"}, allowed=(3, 4),
                         local_rank=1) == (4,)
    assert gpus_from_env(topo, {"CUDA_VISIBLE_DEVICES": "1"}, allowed=(1,),
                         local_rank=None) == (1,)  # not renumbered: node index kept
    ctx = JobContext(pid=77, start_time=1, ppid=76, uid=0, comm="python", argv=("python",),
                     env=env, allocation=Allocation(gpus=(1,), granted=(1,),
                                                    scheduler="Slurm job 2 step batch",
                                                    slurm_job="2", slurm_step="batch",
                                                    job_from_cgroup=True),
                     gpus=(1,), gpus_how="", rank=RankId(0, 1, "LOCAL_RANK=0", "s"),
                     role="rank", why="")
    p = _placer(topo).place(request(ctx, gpu_ids=(1,), ignore_busy_gpus=True))
    assert p.gpus == (1,) and p.cpus is not None
    assert p.cpus <= node_map(topo).slices[1].cpus


# -- holds survive the daemon ------------------------------------------------------------

@pytest.mark.root
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_after_a_restart_mid_job_ranks_keep_their_holds(daemon_factory, tmp_path: Path,
                                                        how: signal.Signals) -> None:
    """Rank 0 bound by the bundled rule; the daemon stops (upgrade) or is killed; the
    new daemon knows rank 0's mask as its own (not "set its own affinity"), holds it,
    and the job's next rank is placed apart from it."""
    if len(HOST_CPUS) < 2:
        pytest.skip("needs 2 CPUs")
    snap, _, _ = snapshot_with_gpus_here(tmp_path / "snap.json")
    pdir = tmp_path / "policies"
    token = f"nm{os.getpid()}"
    bundled_rule_policy(pdir, token)
    args = ["--topology", str(snap)]
    d = daemon_factory(policy_dir=pdir, args=args).start()
    env = {"TUNERD_TEST_TOKEN": token, "LOCAL_WORLD_SIZE": "2", "TUNERD_NUM_WORKERS": "0",
           "CUDA_VISIBLE_DEVICES": "0,1"}
    launcher_env = {**env}
    agent = subprocess.Popen([sys.executable, "-c", _TWO_RANKS], env={**os.environ,
                             **launcher_env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert agent.stdin is not None and agent.stdout is not None
        r0 = int(agent.stdout.readline())
        wait_for(lambda: any(b["pid"] == r0 for b in autobind_status(d)["bound"]), 20,
                 "rank 0 bound", detail=d.log)
        first = cpus_allowed(r0)
        if how == signal.SIGKILL:
            d.kill9()
        else:
            d.stop()
        d2 = d.start()  # the same runtime and state dirs: an upgrade's restart
        st = wait_for(lambda: next((b for b in autobind_status(d2)["bound"]
                                    if b["pid"] == r0), None), 20,
                      "rank 0 held again after the restart", detail=d2.log)
        assert st is not None
        assert not [x for x in autobind_status(d2).get("left_alone", [])
                    if x.get("pid") == r0], autobind_status(d2)
        assert cpus_allowed(r0) == first
        agent.stdin.write("go\n")
        agent.stdin.flush()
        r1 = int(agent.stdout.readline())
        wait_for(lambda: any(b["pid"] == r1 for b in autobind_status(d2)["bound"]), 20,
                 "rank 1 bound", detail=d2.log)
        a, b = (parse_cpulist(cpus_allowed(p) or "") for p in (r0, r1))
        assert a and b and not a & b, (a, b)
    finally:
        kill_tree(agent)  # type: ignore[arg-type]


# a torchrun-like agent (its name says launcher: the script runs as "torchrun"): starts
# rank 0, waits for a line, starts rank 1
_TWO_RANKS = r"""
import os, subprocess, sys
sys.argv[0] = "torchrun"
import ctypes
ctypes.CDLL(None).prctl(15, b"torchrun", 0, 0, 0)  # PR_SET_NAME: the agent's comm
kids = []
for r in (0, 1):
    if r == 1:
        sys.stdin.readline()
    kids.append(subprocess.Popen(["sleep", "60"], env={**os.environ, "LOCAL_RANK": str(r)}))
    print(kids[-1].pid, flush=True)
for k in kids:
    k.wait()
"""


@pytest.mark.root
def test_topology_shows_the_node_map(daemon_factory) -> None:
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    r = d.ctl("--json", "topology")
    assert r.rc == 0, r.err
    slices = r.json()["node_map"]["slices"]
    assert [(s["gpu"], s["cpus"], s["mems"]) for s in slices[:2]] == [
        (0, "0-13,112-125", "0"), (1, "14-27,126-139", "0")]
    text = d.ctl("topology").out
    assert "Node map" in text and "GPU1  14-27,126-139   28    0" in text, text


@pytest.mark.root
def test_a_helper_the_ranks_shell_started_before_exec_ends_inside_the_ranks_cpus(
        daemon_factory, tmp_path: Path) -> None:
    """`bash -c 'helper & exec train'` under a launcher: the helper was looked at before
    its rank was bound; it is narrowed into the rank's CPUs once the rank is, 20 of 20."""
    if len(HOST_CPUS) < 2:
        pytest.skip("needs 2 CPUs")
    snap, _, _ = snapshot_with_gpus_here(tmp_path / "snap.json")
    pdir = tmp_path / "policies"
    token = f"fl{os.getpid()}"
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(snap)]).start()
    train = tmp_path / f"train_follow_{token}"
    helper = tmp_path / f"helper_follow_{token}"
    for exe in (train, helper):
        exe.write_bytes(Path("/bin/sleep").read_bytes())
        exe.chmod(0o755)
    env = {"TUNERD_TEST_TOKEN": token, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "CUDA_VISIBLE_DEVICES": "0", "TUNERD_NUM_WORKERS": "0"}
    inside = sum(_helper_inside(d, env, helper, train) for _ in range(20))
    assert inside == 20


def _helper_inside(d: DaemonProc, env: dict[str, str], helper: Path, train: Path) -> bool:
    agent, rank = spawn_rank(["bash", "-c", f"{helper} 30 & exec {train} 30"], env)
    try:
        wait_for(lambda: Path(f"/proc/{rank}/comm").read_text().strip() == train.name[:15],
                 5, "the shell to exec the rank")
        mine = wait_for(lambda: next((b for b in autobind_status(d)["bound"]
                                      if b["pid"] == rank), None), 10, "rank bound",
                        detail=d.log)
        cpus = parse_cpulist(mine["cpus"])
        kids = Path(f"/proc/{rank}/task/{rank}/children").read_text().split()
        assert len(kids) == 1
        return bool(wait_for(lambda: parse_cpulist(cpus_allowed(int(kids[0])) or "") <= cpus,
                             3, "the helper inside its rank's CPUs", detail=d.log))
    finally:
        kill_tree(agent)  # type: ignore[arg-type]


@pytest.mark.root
def test_a_rule_for_a_wrapper_script_binds_the_python_it_runs(daemon_factory,
                                                              tmp_path: Path) -> None:
    """`[[job]] match.cmdline = ["*myjob.sh*"]` for `bash myjob.sh`, which runs python:
    the shell is left alone (it only starts the next process), what it runs is bound."""
    if len(HOST_CPUS) < 2:
        pytest.skip("needs 2 CPUs")
    token = f"wr{os.getpid()}"
    script = tmp_path / f"myjob_{token}.sh"
    script.write_text(f'{sys.executable} -c "import time; time.sleep(30)"\n')
    pdir = tmp_path / "policies"
    from tests.leases_helpers import rule_policy

    rule_policy(pdir, f'[[job]]\nname = "myjob"\nmatch.cmdline = ["*myjob_{token}.sh*"]\n'
                      'cpus = "1"\n')
    d = daemon_factory(policy_dir=pdir).start()
    p = subprocess.Popen(["bash", str(script)])
    try:
        py = int(wait_for(lambda: Path(f"/proc/{p.pid}/task/{p.pid}/children")
                          .read_text().split(), 10, "the script's python")[0])
        wait_for(lambda: cpus_allowed(py) == "1", 10, "the python the script runs bound",
                 detail=d.log)
        assert cpus_allowed(p.pid) != "1"  # the shell itself is left alone
        assert any(b["pid"] == py for b in autobind_status(d)["bound"])
    finally:
        kill_tree(p)  # type: ignore[arg-type]


def test_each_slice_names_the_nic_behind_its_gpus_switch() -> None:
    """Issue 27: the node map names each GPU's nearest fabric NIC (DGX H100: GPU i and
    mlx5_i share a PCIe switch)."""
    m = node_map(load_topology(DGX_H100))
    assert [(m.slices[g].nics, m.slices[g].nic_tier) for g in (0, 5)] == [
        (("mlx5_0:1",), "switch"), (("mlx5_5:1",), "switch")]
    assert m.to_json()["slices"][5]["nics"] == ["mlx5_5:1"]


@pytest.mark.root
@pytest.mark.parametrize("cvd", [None, "1,0"])
def test_real_mpirun_local_rank_i_is_bound_near_gpu_i(daemon_factory, tmp_path: Path,
                                                       cvd: str | None) -> None:
    """`mpirun --bind-to none -np 2` (Open MPI): each rank's OMPI_COMM_WORLD_LOCAL_RANK
    picks its GPU, and the bundled rule binds it in that GPU's slice (GPU 0 local to the
    first CPU, GPU 1 to the last), with and without CUDA_VISIBLE_DEVICES (listed
    backwards: local rank 0 then uses GPU 1, which splitting by rank alone would miss)."""
    import shutil

    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun (apt-get install openmpi-bin; scripts/test.sh does)")
    if len(HOST_CPUS) < 2:
        pytest.skip("needs 2 CPUs")
    snap, cpu0, cpu1 = snapshot_with_gpus_here(tmp_path / "snap.json")
    pdir = tmp_path / "policies"
    token = f"mpi{os.getpid()}"
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(snap)]).start()
    exe = tmp_path / f"mpi_rank_{token}"
    exe.write_bytes(Path("/bin/sleep").read_bytes())
    exe.chmod(0o755)
    env = {**os.environ, "TUNERD_TEST_TOKEN": token, "TUNERD_NUM_WORKERS": "0"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    mpirun = subprocess.Popen(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                               "--bind-to", "none", "-x", "TUNERD_TEST_TOKEN",
                               "-x", "TUNERD_NUM_WORKERS", str(exe), "30"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def ranks() -> dict[int, int] | None:
            out: dict[int, int] = {}
            for kid in Path(f"/proc/{mpirun.pid}/task/{mpirun.pid}/children").read_text().split():
                try:
                    environ = Path(f"/proc/{kid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                for kv in environ:
                    if kv.startswith(b"OMPI_COMM_WORLD_LOCAL_RANK="):
                        out[int(kv.split(b"=")[1])] = int(kid)
            return out if len(out) == 2 else None

        by_rank = wait_for(ranks, 15, "mpirun's two ranks")
        bound = wait_for(lambda: {b["pid"]: b for b in autobind_status(d)["bound"]
                                  if b["pid"] in by_rank.values()}
                         if len([b for b in autobind_status(d)["bound"]
                                 if b["pid"] in by_rank.values()]) == 2 else None,
                         15, "both MPI ranks bound by the rule", detail=d.log)
        assert bound
        first, second = (cpu1, cpu0) if cvd == "1,0" else (cpu0, cpu1)
        assert cpus_allowed(by_rank[0]) == str(first), d.log()
        assert cpus_allowed(by_rank[1]) == str(second), d.log()
    finally:
        kill_tree(mpirun)  # type: ignore[arg-type]
