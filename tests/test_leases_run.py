"""`tunerctl run` on this machine's real topology: CMD runs bound, the lease ends with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, run_ctl, wait_for
from tests.leases_helpers import (
    DGX_H100,
    cpus_allowed,
    kill,
    kill_tree,
    leases_of,
    spawn,
)
from tunerd.base.cpulist import parse_cpulist

pytestmark = pytest.mark.root

HOST_CPUS = frozenset(os.sched_getaffinity(0))
SHOW = ("grep Cpus_allowed_list /proc/self/status; echo \"cvd=$CUDA_VISIBLE_DEVICES\"; "
        "echo \"lease=$TUNERD_LEASE\"; grep -c bind: /proc/self/numa_maps || true")


def test_run_execs_cmd_bound(module_daemon) -> None:
    # the module's daemon: this test and the others given it end with no lease left
    daemon = module_daemon
    assert leases_of(daemon) == []
    r = daemon.ctl("run", "--ncpus", "1", "--", "sh", "-c", SHOW)
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    bound = parse_cpulist(lines[0].split(":", 1)[1])
    assert len(bound) == 1 and bound <= HOST_CPUS
    assert lines[1] == "cvd="  # a CPU-only lease hides every GPU
    assert lines[2].startswith("lease=L")
    assert int(lines[3]) > 0  # MPOL_BIND inherited across exec (numa_maps says bind:N)
    wait_for(lambda: leases_of(daemon) == [], 10, "the lease to end with CMD")


def test_exit_status_and_command_not_found(module_daemon) -> None:
    daemon = module_daemon
    assert leases_of(daemon) == []
    assert daemon.ctl("run", "--", "sh", "-c", "exit 7").rc == 7
    r = daemon.ctl("run", "--", "no-such-command-tunerd-test")
    assert r.rc == 127 and "command not found" in r.err
    wait_for(lambda: leases_of(daemon) == [], 10, "the leases to end")


def test_daemon_unreachable_is_exit_3(tmp_path: Path) -> None:
    r = run_ctl("--socket", str(tmp_path / "none.sock"), "run", "--", "true")
    assert r.rc == 3 and "not reachable" in r.err


def test_lease_released_when_tunerctl_is_killed(module_daemon) -> None:
    daemon = module_daemon
    assert leases_of(daemon) == []
    p = subprocess.Popen([sys.executable, "-m", "tunerd.cli.main", "--socket",
                          str(daemon.socket), "run", "--ncpus", "1", "--", "sleep", "30"],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        got = wait_for(lambda: leases_of(daemon), 15, "a lease")
        assert got[0]["pid"] == p.pid  # SO_PEERCRED pid: tunerctl, which became CMD
        wait_for(lambda: len(parse_cpulist(cpus_allowed(p.pid) or "")) == 1, 10,
                 "the command to be bound to one CPU")
        jobs = daemon.ctl("--json", "jobs").json()["jobs"]
        assert [j["lease"] for j in jobs if j["pid"] == p.pid] == [got[0]["id"]]
    finally:
        p.kill()
        p.wait()
    wait_for(lambda: leases_of(daemon) == [], 10, "the killed tunerctl's lease to be released")


@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs")
def test_run_exclusive_moves_scope_off_and_back(daemon) -> None:
    bystander = spawn(["sh", "-c", "sleep 60 & wait"])
    try:
        wait_for(lambda: os.path.exists(f"/proc/{bystander.pid}"), 5, "the bystander")
        r = daemon.ctl("run", "--ncpus", "1", "--exclusive", "--exclusive-scope",
                       f"pid:{bystander.pid}", "--", "sh", "-c",
                       f"grep Cpus_allowed_list /proc/{bystander.pid}/status; "
                       "grep Cpus_allowed_list /proc/self/status")
        assert r.rc == 0, r.err
        theirs, mine = (parse_cpulist(ln.split(":", 1)[1]) for ln in r.out.splitlines())
        assert len(mine) == 1 and theirs == HOST_CPUS - mine
        # restored when the lease ended with CMD
        wait_for(lambda: parse_cpulist(cpus_allowed(bystander.pid) or "") == HOST_CPUS, 10,
                 "the bystander to get every CPU back", detail=daemon.log)
    finally:
        kill_tree(bystander)


def test_run_on_replay_sets_env_but_applies_nothing(daemon_factory) -> None:
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    r = d.ctl("run", "--gpus", "2", "--", "sh", "-c", SHOW)
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert parse_cpulist(lines[0].split(":", 1)[1]) == HOST_CPUS  # not bound
    assert lines[1] == "cvd=0,1"
    assert lines[3] == "0"  # no memory policy either
    assert "nothing was applied" in r.err


def test_run_without_gpus_on_a_gpu_node_says_so_in_one_line(daemon_factory) -> None:
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    r = d.ctl("run", "--", "sh", "-c", SHOW)
    assert r.rc == 0, r.err
    assert r.out.splitlines()[1] == "cvd="
    said = [ln for ln in r.err.splitlines() if "gets no GPU" in ln]
    assert said == ["tunerctl: note: the job gets no GPU (CUDA_VISIBLE_DEVICES is empty) "
                    "though 8 GPU(s) are here; ask with --gpus N"], r.err
    r = d.ctl("run", "--gpus", "1", "--", "true")
    assert r.rc == 0 and "gets no GPU" not in r.err, r.err


def test_exclusive_scope_that_does_not_exist_leaves_no_lease(module_daemon,
                                                            tmp_path: Path) -> None:
    daemon = module_daemon
    assert leases_of(daemon) == []
    gone = subprocess.Popen(["true"])
    gone.wait()
    r = daemon.ctl("alloc", "--ncpus", "1", "--exclusive", "--exclusive-scope",
                   f"pid:{gone.pid}")
    assert r.rc == 2 and f"no process {gone.pid}" in r.err
    r = daemon.ctl("alloc", "--ncpus", "1", "--exclusive", "--exclusive-scope",
                   f"cgroup:/tunerd-test-none-{os.getpid()}")
    assert r.rc == 2 and "no such cgroup" in r.err
    assert leases_of(daemon) == []


CPUSET = Path("/sys/fs/cgroup/cpuset")


@pytest.mark.skipif(not (CPUSET / "cpuset.cpus").exists() or len(HOST_CPUS) < 2,
                    reason="needs a cgroup v1 cpuset hierarchy and 2 CPUs")
def test_run_exclusive_with_a_cgroup_scope(daemon) -> None:
    cg = CPUSET / f"tunerd-test-excl-{os.getpid()}"
    cg.mkdir()
    bystander = None
    try:
        for f in ("cpuset.cpus", "cpuset.mems"):
            (cg / f).write_text((CPUSET / f).read_text())
        bystander = spawn(["sleep", "60"])
        (cg / "cgroup.procs").write_text(str(bystander.pid))
        r = daemon.ctl("run", "--ncpus", "1", "--exclusive", "--exclusive-scope",
                       f"cgroup:/{cg.name}", "--", "sh", "-c",
                       f"grep Cpus_allowed_list /proc/{bystander.pid}/status; "
                       "grep Cpus_allowed_list /proc/self/status")
        assert r.rc == 0, r.err
        theirs, mine = (parse_cpulist(ln.split(":", 1)[1]) for ln in r.out.splitlines())
        assert theirs == HOST_CPUS - mine
        wait_for(lambda: parse_cpulist(cpus_allowed(bystander.pid) or "") == HOST_CPUS, 10,
                 "the cgroup's process to get every CPU back", detail=daemon.log)
    finally:
        if bystander is not None:
            kill(bystander)
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:  # busy until the killed process is fully gone
                time.sleep(0.05)


@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs")
def test_moves_are_put_back_after_a_daemon_crash(daemon) -> None:
    bystander = spawn(["sleep", "60"])
    job = subprocess.Popen([sys.executable, "-m", "tunerd.cli.main", "--socket",
                            str(daemon.socket), "run", "--ncpus", "1", "--exclusive",
                            "--exclusive-scope", f"pid:{bystander.pid}", "--", "sleep", "60"],
                           cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(parse_cpulist(cpus_allowed(bystander.pid) or "")) == 1, 15,
                 "the bystander to be moved off the job's CPU", detail=daemon.log)
        daemon.kill9()
        job.kill()  # the job ends while no daemon is watching
        job.wait()
        daemon.start()
        wait_for(lambda: parse_cpulist(cpus_allowed(bystander.pid) or "") == HOST_CPUS, 10,
                 "the restarted daemon to put the bystander back", detail=daemon.log)
        assert leases_of(daemon) == []
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        kill(bystander)
