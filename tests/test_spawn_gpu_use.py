"""Placed at first GPU use (issue 26 item 4): `torch.multiprocessing.spawn` ranks carry no
rank variable; each is placed near the GPU it opened once the GPU lists it (the replay
backend's processes file stands for NVML), as a rank of the job its parent keys."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.binding_helpers import task_cpus
from tests.helpers import DaemonProc, wait_for
from tests.leases_helpers import (
    DGX_H100,
    autobind_status,
    kill,
    kill_tree,
    rule_policy,
    snapshot_with_gpus_here,
)
from tunerd.adapters import nvml
from tunerd.base.cpulist import parse_cpulist
from tunerd.jobs.gpuuse import is_spawn_child
from tunerd.topology import load_topology
from tunerd.topology.nvml_replay import ReplayNvml

HOST_CPUS = frozenset(os.sched_getaffinity(0))

# the training script: real torch.multiprocessing.spawn, two ranks that only sleep (no
# GPU here: the test lists them as GPU users); rank i writes its pid to DIR/rank-i
SPAWN_PARENT = r"""
import os, sys, time
import torch.multiprocessing as mp

held = []

def rank(i, out):
    node = os.environ.get(f"TEST_NVIDIA_NODE_{i}")
    if node:  # holds its GPU's device node open for reading and writing, as CUDA does
        held.append(os.open(node, os.O_RDWR))
    # a DataLoader-style worker, forked before the rank is placed: it has the rank's
    # command line (spawn-marked), and must follow the rank, never be placed itself
    mp.get_context("fork").Process(target=time.sleep, args=(120,), daemon=True).start()
    with open(os.path.join(out, f"rank-{i}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(out, f"rank-{i}.tmp"), os.path.join(out, f"rank-{i}"))
    time.sleep(120)

if __name__ == "__main__":
    import subprocess  # and a helper that chose its own CPU: left as it is
    helper = subprocess.Popen(["taskset", "-c", "0", "sleep", "120"])
    with open(os.path.join(sys.argv[1], "helper"), "w") as f:
        f.write(str(helper.pid))
    mp.spawn(rank, args=(sys.argv[1],), nprocs=2, join=True)
"""


# -- the replay backend's processes and what a spawn child looks like --------------------

def test_the_replayed_gpus_list_the_processes_file_and_read_it_again(tmp_path: Path) -> None:
    topo = load_topology(DGX_H100)
    assert all(d.compute_processes() is nvml.NA for d in ReplayNvml(topo).devices())
    f = tmp_path / "procs.json"
    replay = ReplayNvml(topo, processes=f)
    assert [d.compute_processes() for d in replay.devices()][:2] == [[], []]  # no file yet
    write_processes(f, {2: [4242], 5: [4243, 4244]})
    listed = {d.index: [p.pid for p in d.compute_processes() or []]  # type: ignore[union-attr]
              for d in replay.devices()}
    assert listed == {0: [], 1: [], 2: [4242], 3: [], 4: [], 5: [4243, 4244], 6: [], 7: []}
    write_processes(f, {2: []})  # rewritten while in use: read again
    assert all(d.compute_processes() == [] for d in replay.devices())
    assert replay.devices()[5].minor_number == 5


def test_a_processes_file_another_user_may_write_or_a_fifo_is_not_read(tmp_path: Path) -> None:
    """The file names processes the daemon places: trusted only as a policy file is."""
    topo = load_topology(DGX_H100)
    f = tmp_path / "procs.json"
    write_processes(f, {2: [4242]})
    f.chmod(0o666)  # any user could list her own processes on a GPU
    assert all(d.compute_processes() == [] for d in ReplayNvml(topo, processes=f).devices())
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # never blocks the daemon
    assert all(d.compute_processes() == [] for d in ReplayNvml(topo, processes=fifo).devices())


def test_a_spawn_child_is_told_by_its_command_line() -> None:
    assert is_spawn_child([sys.executable, "-B", "-c", "from multiprocessing.spawn import "
                           "spawn_main; spawn_main(tracker_fd=4, pipe_handle=6)",
                           "--multiprocessing-fork"])
    assert not is_spawn_child([sys.executable, "-B", "-c", "from multiprocessing."
                               "resource_tracker import main;main(3)"])
    assert not is_spawn_child(["python", "train.py", "--multiprocessing-fork-not"][:2])


# -- a real daemon, real mp.spawn ---------------------------------------------------------

def write_processes(path: Path, table: dict[int, list[int]]) -> None:
    """The processes file, swapped in whole (the daemon never reads half of it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(g): pids for g, pids in table.items()}))
    tmp.replace(path)


# the replayed GPUs' device nodes, as nodes that open without the NVIDIA driver (a real
# major-195 node cannot be opened here) and that no other process holds open (not
# /dev/null): GPU 0 as /dev/full's numbers, GPU 1 as /dev/random's
TEST_NODES = ((1, 7), (1, 8))


def _daemon(daemon_factory: Any, tmp: Path, snap: Path, token: str) -> tuple[DaemonProc, Path]:
    procs = tmp / "gpu-processes.json"
    write_processes(procs, {})
    cfg = tmp / "tunerd.toml"
    nodes = ",".join(f"{a}:{b}" for a, b in TEST_NODES)
    cfg.write_text(f'debug_gpu_processes = "{procs}"\ndebug_gpu_device_nodes = "{nodes}"\n')
    pdir = rule_policy(tmp / "policies", f'[[job]]\nname = "spawned"\n'
                                         f'match.cmdline = ["*spawn_parent_{token}*"]\n')
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(snap), "--config", str(cfg)])
    return d.start(), procs


def _spawn_job(tmp: Path, token: str, under: list[str] | None = None,
               env_extra: dict[str, str] | None = None
               ) -> tuple[subprocess.Popen[str], dict[int, int]]:
    """The parent (which the rule matches; started by ``under``, a launcher, if given)
    and its two spawn ranks: rank -> pid."""
    script = tmp / f"spawn_parent_{token}.py"
    script.write_text(SPAWN_PARENT)
    env = {**os.environ, "TUNERD_NUM_WORKERS": "0", "TUNERD_TEST_TOKEN": token,
           **(env_extra or {})}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = tmp / f"ranks-{token}"
    out.mkdir()
    parent = subprocess.Popen([*(under or []), sys.executable, str(script), str(out)],
                              env=env, text=True)
    wait_for(lambda: all((out / f"rank-{i}").exists() for i in (0, 1)) or parent.poll(), 60,
             "the two spawn ranks started")
    ranks = {i: int((out / f"rank-{i}").read_text()) for i in (0, 1)}
    ranks[-1] = int((out / "helper").read_text())  # the taskset helper
    for pid in (ranks[0], ranks[1]):  # really what mp.spawn starts
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        assert is_spawn_child(argv)
        if under is None:
            assert Path(f"/proc/{pid}/stat").read_text().split()[3] == str(parent.pid)
    return parent, ranks


ORPHAN = """
import os, subprocess
null = subprocess.DEVNULL
p = subprocess.Popen(["sleep", "120"], start_new_session=True, stdin=null, stdout=null,
                     stderr=null)
print(p.pid)
os._exit(0)
"""


def _orphan() -> int:
    """A sleeping process outside this test's process tree (its parent exits at once,
    so it is re-parented): outside the daemon's scope. Its pid."""
    out = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True,
                         check=True)
    return int(out.stdout)


def jobs_why(d: DaemonProc, pid: int) -> str:
    return str(next(j for j in d.ctl("--json", "jobs").json()["jobs"] if j["pid"] == pid)
               .get("why"))


def _gpuuse(d: DaemonProc) -> dict[str, Any]:
    out: dict[str, Any] = d.ctl("--json", "status").json()["services"]["gpuuse"]
    return out


@pytest.mark.root
def test_mp_spawn_ranks_are_placed_near_the_gpu_each_opened_on_the_dgx(daemon_factory,
                                                                       tmp_path: Path) -> None:
    """On the DGX H100 snapshot (placements computed and held, not applied here): rank 0
    listed on GPU 2 and rank 1 on GPU 5 are placed in those GPUs' slices, as ranks of the
    job their parent keys; a GPU user no launch started, and one outside the daemon's
    scope, are left alone."""
    token = f"sp{os.getpid()}"
    d, procs = _daemon(daemon_factory, tmp_path, DGX_H100, token)
    slices = {s["gpu"]: parse_cpulist(s["cpus"])
              for s in d.ctl("--json", "topology").json()["node_map"]["slices"]}
    parent, ranks = _spawn_job(tmp_path, token)
    stray = subprocess.Popen(["sleep", "120"])  # in scope, but no launch started it
    orphan = _orphan()
    try:
        a, b = ranks[0], ranks[1]
        write_processes(procs, {2: [a], 3: [stray.pid], 4: [orphan], 5: [b],
                                6: [ranks[-1]]})

        def placed() -> dict[int, dict[str, Any]] | None:
            got = {x["pid"]: x for x in autobind_status(d)["bound"] if x["pid"] in (a, b)}
            return got if len(got) == 2 else None

        got = wait_for(placed, 10, "both spawn ranks placed", detail=d.log) or {}
        assert got[a]["gpus"] == [2] and parse_cpulist(got[a]["cpus"]) <= slices[2], got[a]
        assert got[b]["gpus"] == [5] and parse_cpulist(got[b]["cpus"]) <= slices[5], got[b]
        assert parse_cpulist(got[a]["cpus"]) == slices[2]  # the job's only rank on GPU 2
        jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
        assert [(jobs[p]["applied"], jobs[p]["gpus"], jobs[p]["mems"]) for p in (a, b)] == [
            (False, [2], "0"), (False, [5], "1")], (jobs[a], jobs[b])  # memory: its node
        assert jobs[a]["why"].startswith(f"uses GPU 2 (NVML); started by mp.spawn parent "
                                         f"{parent.pid}, placed as a rank of job mp.spawn:"
                                         f"{parent.pid}."), jobs[a]
        st = wait_for(lambda: len((s := _gpuuse(d))["left_alone"]) == 3 and s, 5,
                      "the other GPU users looked at", detail=d.log)
        assert st["placed"] == 2, st
        assert st["left_alone"] == {"no launch tunerd knows started it": 1,
                                    "outside this daemon's scope": 1,
                                    "it or its parent set its own CPUs (numactl, taskset)": 1
                                    }, st
        bound = {x["pid"] for x in autobind_status(d)["bound"]}
        assert not bound & {stray.pid, orphan, ranks[-1]}, bound
    finally:
        kill_tree(parent)  # type: ignore[arg-type]
        kill(stray)
        os.kill(orphan, 9)


@pytest.mark.root
def test_mp_spawn_ranks_are_bound_near_the_gpu_each_opened(daemon_factory,
                                                           tmp_path: Path) -> None:
    """On this machine with two recorded GPUs (GPU 0 local to the first CPU, GPU 1 to
    the last), so the binds are applied: every thread of rank 0, listed on GPU 1, runs
    on GPU 1's slice, and rank 1's, which NVML does not list but which holds
    /dev/nvidia0 open, on GPU 0's; their workers follow them; a GPU user no launch
    started keeps its CPUs."""
    if len(HOST_CPUS) < 2:
        pytest.skip("needs 2 CPUs")
    snap, cpu0, cpu1 = snapshot_with_gpus_here(tmp_path / "snap.json")
    token = f"sh{os.getpid()}"
    d, procs = _daemon(daemon_factory, tmp_path, snap, token)
    node = tmp_path / "nvidia0"  # the device node of GPU 0 (TEST_NODES)
    os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(*TEST_NODES[0]))
    parent, ranks = _spawn_job(tmp_path, token, env_extra={"TEST_NVIDIA_NODE_1": str(node)})
    stray = subprocess.Popen(["sleep", "120"])
    try:
        a, b = ranks[0], ranks[1]
        before = task_cpus(stray.pid)
        write_processes(procs, {0: [stray.pid], 1: [a]})

        def on(pid: int, cpu: int) -> bool:
            return all(parse_cpulist(c) == {cpu} for c in task_cpus(pid).values())

        wait_for(lambda: on(a, cpu1) and on(b, cpu0), 10,
                 "each spawn rank bound in its GPU's slice", detail=d.log)
        for pid, cpu in ((a, cpu1), (b, cpu0)):  # its worker follows it
            worker = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
            wait_for(lambda w=worker, c=cpu: on(w, c), 5,  # type: ignore[misc]
                     "the rank's worker in its CPUs", detail=d.log)
        jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
        assert jobs[a]["why"].startswith("uses GPU 1 (NVML); started by mp.spawn parent"), \
            jobs[a]
        assert jobs[b]["why"].startswith("uses GPU 0 (an open /dev/nvidiaN); started by "
                                         "mp.spawn parent"), jobs[b]
        assert task_cpus(stray.pid) == before
    finally:
        kill_tree(parent)  # type: ignore[arg-type]
        kill(stray)


# a torchrun-like agent (its comm says launcher) that starts one rank, LOCAL_RANK=0
AGENT = r"""
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl(15, b"torchrun", 0, 0, 0)  # PR_SET_NAME: the agent's comm
env = {**os.environ, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
rank = subprocess.Popen(sys.argv[1:], env=env)
# a process the launcher starts without a rank variable (a launcher tunerd does not
# know would start every rank so): placed, under the rank rule, at its first GPU use
plain = subprocess.Popen(["sleep", "120"])
with open(os.path.join(sys.argv[-1], "plain"), "w") as f:
    f.write(str(plain.pid))
sys.exit(rank.wait())
"""


@pytest.mark.root
def test_a_ranks_mp_spawn_children_are_placed_near_their_gpus_not_kept_as_workers(
        daemon_factory, tmp_path: Path) -> None:
    """A rank (the bundled rule, under a launcher) that calls mp.spawn: its spawn children
    inherit LOCAL_RANK and are narrowed into the rank's CPUs as its workers when they
    exec; once one uses another GPU it is placed in that GPU's slice instead."""
    from tests.test_torch_ddp import bundled_rule_policy

    if len(HOST_CPUS) < 2:
        pytest.skip("needs 2 CPUs")
    snap, cpu0, cpu1 = snapshot_with_gpus_here(tmp_path / "snap.json")
    token = f"rk{os.getpid()}"
    procs = tmp_path / "gpu-processes.json"
    write_processes(procs, {})
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text(f'debug_gpu_processes = "{procs}"\n')
    bundled_rule_policy(tmp_path / "policies", token)
    d = daemon_factory(policy_dir=tmp_path / "policies",
                       args=["--topology", str(snap), "--config", str(cfg)]).start()
    agent, ranks = _spawn_job(tmp_path, token, under=[sys.executable, "-c", AGENT])
    try:
        a, b = ranks[0], ranks[1]
        rank = int(Path(f"/proc/{a}/stat").read_text().split()[3])

        def on(pid: int, cpu: int) -> bool:
            return all(parse_cpulist(c) == {cpu} for c in task_cpus(pid).values())

        wait_for(lambda: on(rank, cpu0) and on(a, cpu0), 10,
                 "the rank bound near GPU 0, its spawn child narrowed into its CPUs",
                 detail=d.log)
        plain = int((tmp_path / f"ranks-{token}" / "plain").read_text())
        write_processes(procs, {0: [b], 1: [a, plain]})
        wait_for(lambda: on(a, cpu1), 10, "the spawn child that uses GPU 1 bound there",
                 detail=d.log)
        wait_for(lambda: on(plain, cpu1), 10, "the launcher's plain child near GPU 1",
                 detail=d.log)
        assert jobs_why(d, plain).startswith("uses GPU 1 (NVML); started by launcher "
                                             "torchrun"), jobs_why(d, plain)
        jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
        assert jobs[a]["origin"] == "rule" and jobs[a]["why"].startswith("uses GPU 1"), jobs[a]
        assert on(rank, cpu0) and on(b, cpu0)
    finally:
        kill_tree(agent)  # type: ignore[arg-type]
