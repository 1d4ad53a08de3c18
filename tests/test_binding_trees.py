"""Binder and cpuset resolution on temporary /proc and /sys trees (no privileges needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.adapters.cpuset import CpusetCgroup, find_cpuset
from tunerd.adapters.procfs import Process
from tunerd.base.cpulist import parse_cpulist
from tunerd.base.errors import NoSuchProcess, UsageError
from tunerd.jobs.actuate import Binder
from tunerd.jobs.binding import Originals


def write(root: Path, rel: str, text: str) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "proc", tmp_path / "sys"


# /proc/PID/cgroup of a Slurm step on a hybrid (v1 + unified) node
SLURM_V1 = """\
12:cpuset:/slurm/uid_1000/job_77/step_0
11:memory:/slurm/uid_1000/job_77/step_0
3:cpu,cpuacct:/slurm/uid_1000/job_77
1:name=systemd:/system.slice/slurmd.service
0::/system.slice/slurmd.service
"""


def test_v1_cpuset_of_a_slurm_step(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "4242/cgroup", SLURM_V1)
    write(sys, "fs/cgroup/cpuset/cpuset.cpus", "0-63\n")
    step = "fs/cgroup/cpuset/slurm/uid_1000/job_77/step_0"
    write(sys, f"{step}/cpuset.cpus", "8-15\n")
    write(sys, f"{step}/cpuset.effective_cpus", "8-15\n")
    write(sys, f"{step}/cpuset.effective_mems", "1\n")
    write(sys, "fs/cgroup/unified/cgroup.controllers", "")
    cg = find_cpuset(4242, proc, sys)
    assert cg == CpusetCgroup(1, sys / "fs/cgroup/cpuset", "/slurm/uid_1000/job_77/step_0")
    assert cg.dir == sys / step
    assert cg.effective_cpus() == parse_cpulist("8-15")
    assert cg.effective_mems() == frozenset({1})
    assert cg.can_nest()
    child = cg.child("tunerd-4242-99")
    assert child.path == "/slurm/uid_1000/job_77/step_0/tunerd-4242-99"
    assert CpusetCgroup.from_json(child.to_json()) == child


def test_v1_old_kernel_without_effective_files(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "7/cgroup", "4:cpuset:/job\n")
    write(sys, "fs/cgroup/cpuset/cpuset.cpus", "0-7")
    write(sys, "fs/cgroup/cpuset/job/cpuset.cpus", "2-3")
    write(sys, "fs/cgroup/cpuset/job/cpuset.mems", "0")
    cg = find_cpuset(7, proc, sys)
    assert cg is not None
    assert cg.effective_cpus() == frozenset({2, 3})
    assert cg.effective_mems() == frozenset({0})


def test_v1_combined_cpu_cpuset_hierarchy(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "7/cgroup", "5:cpu,cpuset:/\n")
    write(sys, "fs/cgroup/cpu,cpuset/cpuset.cpus", "0-3")
    write(sys, "fs/cgroup/cpu,cpuset/cpuset.effective_cpus", "0-3")
    cg = find_cpuset(7, proc, sys)
    assert cg is not None and cg.mount == sys / "fs/cgroup/cpu,cpuset" and cg.path == "/"
    assert cg.dir == sys / "fs/cgroup/cpu,cpuset"


def test_v2_kubernetes_container_walks_up_to_the_effective_files(
        roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    ctr = "/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope"
    write(proc, "9/cgroup", f"0::{ctr}\n")
    write(sys, "fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
    # cpuset enabled down to the pod; the container cgroup itself has no cpuset files
    write(sys, "fs/cgroup/kubepods.slice/kubepods-pod1.slice/cpuset.cpus.effective", "4-7\n")
    write(sys, "fs/cgroup/kubepods.slice/kubepods-pod1.slice/cpuset.mems.effective", "0\n")
    write(sys, f"fs/cgroup{ctr}/cgroup.subtree_control", "")
    cg = find_cpuset(9, proc, sys)
    assert cg is not None and cg.version == 2 and cg.path == ctr
    assert cg.effective_cpus() == parse_cpulist("4-7")
    assert cg.effective_mems() == frozenset({0})
    assert not cg.can_nest()  # "no internal processes": cannot enable cpuset below a job
    write(sys, f"fs/cgroup{ctr}/cgroup.subtree_control", "cpuset\n")
    # the kubelet's cgroup: never nested, even where the controller would allow it
    # (a child under kubepods makes the kubelet's own cpuset updates fail: EBUSY)
    assert not cg.can_nest()
    job = "/system.slice/job.scope"
    write(proc, "9/cgroup", f"0::{job}\n")
    write(sys, "fs/cgroup/system.slice/cpuset.cpus.effective", "0-3\n")
    write(sys, f"fs/cgroup{job}/cgroup.subtree_control", "cpuset\n")
    other = find_cpuset(9, proc, sys)
    assert other is not None and other.path == job and other.can_nest()


def test_v2_without_the_cpuset_controller_is_none(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "9/cgroup", "0::/user.slice\n")
    write(sys, "fs/cgroup/cgroup.controllers", "cpu io memory pids\n")
    assert find_cpuset(9, proc, sys) is None


def test_hybrid_with_cpuset_nowhere_is_none(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "9/cgroup", "4:memory:/\n0::/\n")
    write(sys, "fs/cgroup/unified/cgroup.controllers", "hugetlb\n")
    assert find_cpuset(9, proc, sys) is None


def test_a_cgroup_outside_our_view_is_unknown(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "7/cgroup", "4:cpuset:/other-namespace/job\n")
    write(sys, "fs/cgroup/cpuset/cpuset.cpus", "0-7")
    assert find_cpuset(7, proc, sys) is None


def test_gone_process_raises(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    with pytest.raises(FileNotFoundError):
        find_cpuset(12345, proc, sys)


# a comm with spaces and parentheses: fields are counted after the *last* ")"
STAT = ("4242 (my (odd) proc) S 1 4242 4242 0 -1 4194560 1000 0 0 0 5 3 0 0 20 0 65 0 "
        "987654 123456789 2000 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0\n")


def test_start_time_is_field_22(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "4242/stat", STAT)
    assert Binder(proc, sys).start_time(4242) == 987654


def test_kernel_threads_are_recognised(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "4242/stat", STAT)
    # kthreadd: flags 0x208040 include PF_KTHREAD (0x200000)
    write(proc, "2/stat", "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 "
                          "1 0 0 18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 0 "
                          "1 0 0 0 0 0\n")
    assert not Process(4242, proc).is_kernel_thread()
    assert Process(2, proc).is_kernel_thread()
    b = Binder(proc, sys)
    with pytest.raises(UsageError, match="pid 2 is a kernel thread"):
        b.pin(2)  # refused before any pidfd is opened


def test_zombie_and_missing_are_no_such_process(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "4242/stat", STAT.replace(") S ", ") Z "))
    b = Binder(proc, sys)
    with pytest.raises(NoSuchProcess, match="process 4242 has exited"):
        b.start_time(4242)
    with pytest.raises(NoSuchProcess, match="no process with pid 4243"):
        b.start_time(4243)
    with pytest.raises(NoSuchProcess, match="no process with pid 4243"):
        b.owner(4243)


def test_owner_reads_real_and_effective_uid(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "5/status", "Name:\tx\nUid:\t1000\t0\t0\t0\nGid:\t100\t100\t100\t100\n")
    assert Binder(proc, sys).owner(5) == (1000, 0)


def test_pages_per_node_from_numa_maps(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "5/numa_maps",
          "55e0 default file=/usr/bin/python3 mapped=2 N0=2 kernelpagesize_kB=4\n"
          "7f00 interleave:0-1 anon=300 dirty=300 active=0 N0=120 N1=180 kernelpagesize_kB=4\n"
          "7f10 bind:1 anon=5 dirty=5 N1=5 kernelpagesize_kB=2048\n"
          "7f20 default\n")
    assert Binder(proc, sys).pages_per_node(5) == {0: 122, 1: 185}
    assert Binder(proc, sys).pages_per_node(6) == {}


def test_online_sets_and_nr_open(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    b = Binder(proc, sys)
    write(sys, "devices/system/cpu/online", "0-3,8\n")
    write(proc, "sys/fs/nr_open", "1048576\n")
    assert b.online_cpus() == frozenset({0, 1, 2, 3, 8})
    assert b.online_nodes() == frozenset({0})  # no node directory: a non-NUMA kernel
    write(sys, "devices/system/node/online", "0-1\n")
    assert b.online_nodes() == frozenset({0, 1})
    assert b.nr_open() == 1048576


def test_originals_survive_json() -> None:
    o = Originals(pid=7, start_time=99, process_cpus=frozenset(range(8)),
                  threads={7: frozenset({1}), 8: frozenset(range(8))}, nofile=(1024, 4096),
                  cpuset_base=CpusetCgroup(1, Path("/sys/fs/cgroup/cpuset"), "/job"),
                  cpuset_child=CpusetCgroup(1, Path("/sys/fs/cgroup/cpuset"), "/job/t"),
                  affinity_set=True)
    d = o.to_json()
    assert d["process_cpus"] == "0-7" and d["threads"] == {"1": [7], "0-7": [8]}
    assert Originals.from_json(d) == o


def test_sweep_removes_only_stale_child_cpusets(roots: tuple[Path, Path]) -> None:
    proc, sys = roots
    write(proc, "4242/stat", STAT)  # alive, start time 987654
    cg = sys / "fs/cgroup/cpuset"
    write(sys, "fs/cgroup/cpuset/cpuset.cpus", "0-7")
    write(sys, "fs/cgroup/cpuset/cgroup.procs", "")
    live = cg / "slurm/job_1/tunerd-4242-987654"
    dead = cg / "slurm/job_1/tunerd-4243-5"  # no such process
    reused = cg / "tunerd-4242-1"  # same pid, another start time: a stale one
    other = cg / "tunerd-notes"
    for d in (live, dead, reused, other):
        d.mkdir(parents=True)
    removed = Binder(proc, sys).sweep_stale_cpusets()
    assert sorted(removed) == sorted([dead, reused])
    assert live.exists() and other.exists() and not dead.exists() and not reused.exists()
