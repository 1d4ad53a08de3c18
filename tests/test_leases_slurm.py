"""contrib/slurm scripts, run with the environment Slurm gives them, against a real daemon."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.leases_helpers import (
    DGX_H100,
    cpus_allowed,
    kill,
    leases_of,
    snapshot_with_gpus_here,
    spawn,
)

pytestmark = pytest.mark.root

SLURM = REPO / "contrib" / "slurm"
TUNERCTL = f"{sys.executable} -m tunerd.cli.main"


def run_script(name: str, socket: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "CUDA_"))}
    return subprocess.run(["sh", str(SLURM / name)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**base, "TUNERCTL": TUNERCTL,
                                           "TUNERD_SOCKET": str(socket), **env})


def task_env(pid: int, localid: int, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_LOCALID": str(localid),
            "SLURM_TASK_PID": str(pid), "SLURM_STEP_TASKS_PER_NODE": "2(x1)", **extra}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_task_prolog_binds_each_task_near_its_gpu(tmp_path: Path, daemon_factory) -> None:
    snap, lo, hi = snapshot_with_gpus_here(tmp_path / "snap.json")
    d = daemon_factory(args=["--topology", str(snap)]).start()
    t0 = spawn(["sleep", "30"])
    t1 = spawn(["sleep", "30"])
    try:
        for pid, lid in ((t0.pid, 0), (t1.pid, 1)):
            r = run_script("tunerd-task-prolog.sh", d.socket,
                           task_env(pid, lid, CUDA_VISIBLE_DEVICES="0,1", SLURM_STEP_GPUS="0,1"))
            assert r.returncode == 0
            assert f"bound near GPU {lid}" in r.stderr, r.stderr
        assert cpus_allowed(t0.pid) == str(lo)
        assert cpus_allowed(t1.pid) == str(hi)
        jobs = {j["pid"]: j for j in d.ctl("--json", "jobs").json()["jobs"]}
        assert jobs[t0.pid]["gpus"] == [0] and jobs[t1.pid]["gpus"] == [1]
    finally:
        kill(t0)
        kill(t1)


def test_task_prolog_never_fails_the_task(tmp_path: Path, daemon_factory) -> None:
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    t = spawn(["sleep", "30"])
    try:
        before = cpus_allowed(t.pid)
        # a replayed node: nothing applied, said on stderr, exit 0
        r = run_script("tunerd-task-prolog.sh", d.socket,
                       task_env(t.pid, 0, CUDA_VISIBLE_DEVICES="3"))
        assert r.returncode == 0 and "not bound" in r.stderr and "nothing was applied" in r.stderr
        # no GPUs in the task: left to Slurm
        r = run_script("tunerd-task-prolog.sh", d.socket, task_env(t.pid, 0))
        assert r.returncode == 0 and "no GPUs" in r.stderr
        # daemon down
        r = run_script("tunerd-task-prolog.sh", tmp_path / "none.sock",
                       task_env(t.pid, 0, CUDA_VISIBLE_DEVICES="0"))
        assert r.returncode == 0 and "not reachable" in r.stderr
        assert cpus_allowed(t.pid) == before
    finally:
        kill(t)


def test_epilog_releases_the_jobs_leases(daemon_factory) -> None:
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    env = {**os.environ, "SLURM_JOB_ID": "777", "SLURM_JOB_GPUS": "2,5"}
    r = subprocess.run([sys.executable, "-m", "tunerd.cli.main", "--socket", str(d.socket),
                        "alloc", "--gpus", "2"], cwd=REPO, env=env, capture_output=True,
                       text=True, check=True)
    assert "TUNERD_LEASE=L1" in r.stdout
    # inside a job, a lease takes the job's GPUs only (SLURM_JOB_GPUS)
    assert "CUDA_VISIBLE_DEVICES=2,5" in r.stdout, r.stdout
    other = d.ctl("alloc", "--gpus", "1", "--tag", "slurm:778", "--json").json()["id"]
    r2 = run_script("tunerd-epilog.sh", d.socket, {"SLURM_JOB_ID": "777"})
    assert r2.returncode == 0, r2.stderr
    assert [x["id"] for x in leases_of(d)] == [other]
