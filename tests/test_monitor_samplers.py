"""Samplers on recorded /proc and /sys trees, on real processes, and on NVML replay."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.helpers import FIXTURES, ask_child, ready_child, wait_for
from tests.monitor_helpers import TelemetryReplay
from tunerd.adapters import nvml
from tunerd.adapters.procfs import Process, parse_numa_maps, parse_stat
from tunerd.base.errors import UsageError
from tunerd.monitor.gpu import GpuSampler
from tunerd.monitor.history import JOB_FIELDS, MAX_JOB_RINGS, History
from tunerd.monitor.host import HostSampler, parse_psi
from tunerd.monitor.jobs import JobSampler, torch_from_report
from tunerd.monitor.reports import MAX_WORKERS, parse_report
from tunerd.monitor.ring import Ring

STAT_1 = """cpu  200 0 100 1000 50 0 0 0 0 0
cpu0 100 0 50 500 25 0 0 0 0 0
cpu1 100 0 50 500 25 0 0 0 0 0
cpu2 0 0 0 0 0 0 0 0 0 0
cpu3 0 0 0 0 0 0 0 0 0 0
intr 1 2 3
"""
# +100 jiffies per CPU: cpu0 60 busy / 30 idle / 10 iowait; cpu1 idle; cpu2/3 fully busy
STAT_2 = """cpu  400 0 200 1100 70 0 0 0 0 0
cpu0 140 0 70 530 35 0 0 0 0 0
cpu1 100 0 50 600 25 0 0 0 0 0
cpu2 100 0 0 0 0 0 0 0 0 0
cpu3 50 0 50 0 0 0 0 0 0 0
"""
PSI_IO = "some avg10=25.50 avg60=1.00 avg300=0.50 total=1500000\n" \
         "full avg10=10.00 avg60=0.00 avg300=0.00 total=250000\n"
DISK_1 = "259 0 nvme0n1 100 0 2000 0 50 0 1000 0 0 300 0 0 0 0 0\n" \
         "259 1 nvme0n1p1 90 0 1800 0 40 0 800 0 0 250 0 0 0 0 0\n" \
         "7 0 loop0 5 0 10 0 0 0 0 0 0 1 0 0 0 0 0\n"
DISK_2 = "259 0 nvme0n1 200 0 4000 0 60 0 1200 0 0 800 0 0 0 0 0\n" \
         "259 1 nvme0n1p1 90 0 1800 0 40 0 800 0 0 250 0 0 0 0 0\n" \
         "7 0 loop0 5 0 10 0 0 0 0 0 0 1 0 0 0 0 0\n"
NET = (FIXTURES / "monitor/net_dev.txt").read_text()  # a recorded /proc/net/dev


def make_tree(root: Path, psi: bool = True) -> tuple[Path, Path]:
    proc, sys_ = root / "proc", root / "sys"
    (proc / "net").mkdir(parents=True)
    (proc / "stat").write_text(STAT_1)
    (proc / "diskstats").write_text(DISK_1)
    (proc / "net/dev").write_text(NET)
    (proc / "meminfo").write_text("MemTotal:  3145728 kB\nMemFree:  1048576 kB\n"
                                  "MemAvailable:  2097152 kB\nBuffers:  0 kB\n"
                                  "Cached:  524288 kB\nSReclaimable:  0 kB\n"
                                  "Shmem:  0 kB\nActive:  0 kB\nInactive:  0 kB\n")
    if psi:
        (proc / "pressure").mkdir()
        (proc / "pressure/io").write_text(PSI_IO)
        (proc / "pressure/cpu").write_text("some avg10=1.00 avg60=0 avg300=0 total=10\n")
        (proc / "pressure/memory").write_text(
            "some avg10=0.00 avg60=0 avg300=0 total=0\nfull avg10=0.00 avg60=0 avg300=0 "
            "total=0\n")
    for n, cpus, total in ((0, "0-1", 1 << 30), (1, "2-3", 2 << 30)):
        d = sys_ / f"devices/system/node/node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(
            f"Node {n} MemTotal:       {total // 1024} kB\n"
            f"Node {n} MemFree:        {total // 4096} kB\n"
            f"Node {n} MemUsed:        {3 * total // 4096} kB\n"
            f"Node {n} HugePages_Total:     0\n")
    (sys_ / "block/nvme0n1").mkdir(parents=True)
    (sys_ / "block/loop0").mkdir(parents=True)
    return proc, sys_


def test_host_sampler_on_recorded_tree(tmp_path: Path) -> None:
    proc, sys_ = make_tree(tmp_path)
    h = HostSampler(proc_root=proc, sys_root=sys_)
    assert h.node_cpus == {0: frozenset({0, 1}), 1: frozenset({2, 3})}
    first = h.sample()
    assert first["cpus"][0]["busy_ratio"] is None  # no previous counters yet
    (proc / "stat").write_text(STAT_2)
    (proc / "diskstats").write_text(DISK_2)
    s = h.sample()
    assert s["unavailable"] == {}
    by_cpu = {c["cpu"]: c for c in s["cpus"]}
    assert by_cpu[0]["busy_ratio"] == pytest.approx(0.6)
    assert by_cpu[0]["iowait_ratio"] == pytest.approx(0.1)
    assert by_cpu[1]["busy_ratio"] == 0.0
    assert by_cpu[2]["busy_ratio"] == 1.0
    assert s["cpu_busy_ratio"] == pytest.approx(260 / 400)
    numa = {n["node"]: n for n in s["numa"]}
    assert numa[0]["busy_ratio"] == pytest.approx(0.3)
    assert numa[1]["busy_ratio"] == 1.0
    assert numa[1]["cpus"] == "2-3"
    assert numa[1]["memory_total_bytes"] == 2 << 30
    assert numa[0]["memory_used_bytes"] == 3 * (1 << 30) // 4
    assert s["psi"]["io"] == {"some_avg10": 0.255, "some_total_seconds": 1.5,
                              "full_avg10": 0.1, "full_total_seconds": 0.25}
    # whole disks only: the partition and the loop device are left out
    assert [d["device"] for d in s["disks"]] == ["nvme0n1"]
    d = s["disks"][0]
    assert d["read_bytes_total"] == 4000 * 512 and d["written_bytes_total"] == 1200 * 512
    assert d["io_time_seconds_total"] == 0.8
    assert 0 < d["busy_ratio"] <= 1.0
    # host-wide memory from psutil.virtual_memory() on the same tree
    assert s["memory"]["total_bytes"] == 3 << 30
    assert s["memory"]["available_bytes"] == 2 << 30
    nic = {n["interface"]: n for n in s["nics"]}["ens1f0"]
    assert nic["receive_bytes_total"] == 68801557
    assert nic["receive_errors_total"] == 2 and nic["transmit_drop_total"] == 4


def test_light_host_sample_rereads_cpus_and_repeats_the_rest(tmp_path: Path) -> None:
    """sample(full=False): per-CPU times read anew (the job sampler needs them each
    cycle), memory, PSI, disks and NICs as the last full sample had them; the next full
    sample's rates span the time since the last full one."""
    proc, sys_ = make_tree(tmp_path)
    h = HostSampler(proc_root=proc, sys_root=sys_)
    full = h.sample()
    (proc / "stat").write_text(STAT_2)
    (proc / "diskstats").write_text(DISK_2)
    (proc / "pressure/cpu").write_text("some avg10=50.00 avg60=0 avg300=0 total=10\n")
    light = h.sample(full=False)
    assert {c["cpu"]: c for c in light["cpus"]}[0]["busy_ratio"] == pytest.approx(0.6)
    for key in ("memory", "psi", "disks", "nics"):
        assert light[key] == full[key], key
    numa = {n["node"]: n for n in light["numa"]}
    assert numa[1]["memory_total_bytes"] == 2 << 30 and numa[1]["busy_ratio"] == 1.0
    again = h.sample()  # full: the new files
    assert again["psi"]["cpu"]["some_avg10"] == 0.5
    assert again["disks"][0]["read_bytes_total"] == 4000 * 512
    assert again["disks"][0]["busy_ratio"] is not None


def test_host_sampler_missing_sources_degrade_independently(tmp_path: Path) -> None:
    proc, _ = make_tree(tmp_path, psi=False)
    (proc / "diskstats").unlink()
    s = HostSampler(proc_root=proc, sys_root=tmp_path / "nosys").sample()
    assert set(s["unavailable"]) == {"pressure", "disks", "memory"}
    assert "No such file" in s["unavailable"]["disks"]
    assert len(s["cpus"]) == 4 and s["nics"]  # the rest still came


def test_host_sampler_on_this_machine() -> None:
    h = HostSampler()
    h.sample()
    time.sleep(0.05)
    s = h.sample()
    assert len(s["cpus"]) == os.cpu_count()
    assert all(0.0 <= c["busy_ratio"] <= 1.0 for c in s["cpus"] if c["busy_ratio"] is not None)
    assert s["numa"] and s["numa"][0]["memory_total_bytes"] > 0


def test_parse_psi_and_stat_with_odd_comm() -> None:
    assert parse_psi("some avg10=0.50 avg60=0 avg300=0 total=7\n") == {
        "some_avg10": 0.005, "some_total_seconds": 7e-6}
    st = parse_stat("42 (a) b (c) R 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 7 18 999 20 5000")
    assert st.comm == "a) b (c" and st.state == "R" and st.utime == 11
    assert st.num_threads == 7 and st.start_time == 999 and st.rss_pages == 5000


def test_parse_numa_maps() -> None:
    text = ("7f00 default anon=3 dirty=3 N0=2 N1=1 kernelpagesize_kB=4\n"
            "7f10 bind:1 file=/x huge anon=1 N1=1 kernelpagesize_kB=2048\n"
            "7f20 default\n")
    assert parse_numa_maps(text) == {0: 8192, 1: 4096 + 2048 * 1024}


# -- rings and history ---------------------------------------------------------
def test_ring_wraps_keeps_order_and_bound() -> None:
    r = Ring(("t", "v"), capacity=3)
    size = r.nbytes
    assert size == 3 * 2 * 8
    for i in range(5):
        r.append((i, None if i == 4 else i * 10))
    assert len(r) == 3 and r.nbytes == size
    rows = r.rows()
    assert [row[0] for row in rows] == [2.0, 3.0, 4.0]
    assert math.isnan(rows[-1][1])
    assert r.columns(2)["t"] == [3.0, 4.0]
    with pytest.raises(ValueError, match="3 values"):
        r.append((1, 2, 3))


def _job(pid: int) -> dict[str, object]:
    return {"pid": pid, "start_time": pid * 7, "gpus": [0], "cpu_ratio": 0.5,
            "open_fds": 10, "torch": {"devices": [{"reserved_bytes": 5, "allocated_bytes": 2}]}}


def test_history_memory_is_bounded_by_construction() -> None:
    h = History(history_seconds=10, sample_interval=1)
    assert h.capacity == 10
    for t in range(25):
        h.add({"time": float(t), "host": {"iowait_ratio": 0.1},
               "gpu": {"gpus": [{"gpu": 0, "throttle_reasons": 4}]},
               "jobs": [_job(p) for p in range(MAX_JOB_RINGS + 5)]})
    assert len(h.jobs) == MAX_JOB_RINGS and h.dropped_jobs > 0
    assert h.nbytes() == h.bound_bytes() == 10 * 8 * (
        9 + 9 + MAX_JOB_RINGS * len(JOB_FIELDS))
    cols = h.job(0).columns()  # type: ignore[union-attr]
    assert cols["time"] == [float(t) for t in range(15, 25)]
    assert cols["gpu_throttle_reasons"][-1] == 4.0
    assert cols["torch_reserved_bytes"][-1] == 5.0 and cols["iowait_ratio"][-1] == 0.1
    h.add({"time": 99.0, "jobs": [_job(1)]})  # the other jobs ended: their rings go
    assert list(h.jobs) == [(1, 7)]


# -- jobs: real processes ------------------------------------------------------
CHILD = """
import os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 400))
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(50)]
buf = bytearray(64 << 20)
for i in range(0, len(buf), 4096): buf[i] = 1
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    with ready_child(CHILD) as p:
        yield p


def test_job_sampler_reads_a_bounded_number_of_jobs_per_cycle() -> None:
    """Issue 15: the sampler's cost must not grow with the bound processes. With more
    jobs than its budget it reads a new job at once, then the others in turn; the
    rest keep their last sample."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(5)]
    try:
        recs = [{"pid": p.pid, "start_time": Process(p.pid).start_time(), "name": "s",
                 "cpus": "0"} for p in procs]
        js = JobSampler(jobs_per_cycle=2)
        reads: list[int] = []
        one = js._one

        def counted(rec: dict[str, object], *args: object) -> object:
            reads.append(int(rec["pid"]))  # type: ignore[call-overload]
            return one(rec, *args)  # type: ignore[arg-type]

        js._one = counted  # type: ignore[method-assign]
        out = js.sample(recs, {})
        assert len(reads) == 5  # all new: each is read at once
        seen = []
        for _ in range(3):
            reads.clear()
            out = js.sample(recs, {})
            seen.append(set(reads))
            assert len(reads) == 2
        # then two a cycle, in turn
        assert len(set().union(*seen)) == 5
        assert [s["pid"] for s in out] == [p.pid for p in procs]
        newcomer = subprocess.Popen(["sleep", "60"])
        procs.append(newcomer)
        reads.clear()
        js.sample([*recs, {"pid": newcomer.pid, "name": "n", "cpus": "0",
                           "start_time": Process(newcomer.pid).start_time()}], {})
        assert newcomer.pid in reads  # a new job is read at once
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_job_sampler_reads_a_real_process(child: subprocess.Popen[str]) -> None:
    pid = child.pid
    start = Process(pid).start_time()
    rec = {"pid": pid, "start_time": start, "name": "child", "cpus": "0", "mems": "0",
           "gpus": [0]}
    gpu = {"gpus": [{"gpu": 0, "utilization_ratio": 0.25}],
           "processes": [{"gpu": 0, "pid": pid, "used_memory_bytes": 1e9}]}
    js = JobSampler()
    args = {"pid": pid, "steps": 10, "step_time_s": 0.25, "samples_per_s": 128.0,
            "device": "cuda", "memory": {"allocated": 4, "reserved": 9, "max_allocated": 6},
            "workers": [], "num_workers": 0, "rank": 0, "local_rank": 0, "local_world_size": 1}
    report = replace(parse_report(args, pid=pid, start_time=start), time=time.time() - 2)
    host = {"cpus": [{"cpu": 0, "busy_ratio": 0.75}, {"cpu": 1, "busy_ratio": 0.1}]}
    js.sample([rec], gpu, host)
    [s] = js.sample([rec], gpu, host, reports={pid: report})
    assert s["cpus_busy_ratio"] == 0.75  # the job is bound to cpu 0 only
    assert s["rss_bytes"] > 64 << 20
    assert s["open_fds"] == len(os.listdir(f"/proc/{pid}/fd"))
    assert (s["nofile_soft"], s["nofile_hard"]) == (300, 400)
    assert s["threads"] == 1 and s["cpu_cores"] is not None and s["cpu_cores"] >= 0
    assert s["gpu_memory_bytes"] == 1e9 and s["gpu_utilization_ratio"] == 0.25
    # one NUMA node: every page is local, and numa_maps (a page-table walk) is not read
    assert s["locality_ratio"] == 1.0 and s["numa_bytes"] == {}
    # where there are several nodes, it is read (here: all of it on node 0)
    two = JobSampler(node_cpus={0: frozenset({0}), 1: frozenset({1})})
    [m] = two.sample([rec], gpu, host)
    assert sum(m["numa_bytes"].values()) > 64 << 20 and m["locality_ratio"] == 1.0
    assert s["torch"]["devices"][0]["reserved_bytes"] == 9
    assert s["torch"]["step_time_s"] == 0.25 and s["torch"]["age_seconds"] >= 2
    assert s["uid"] == os.getuid() and s["start_time"] == start
    # no report, or one sent by an earlier process with this pid: no torch numbers
    [s] = js.sample([rec], gpu, host, reports={pid: replace(report, start_time=start - 1)})
    assert s["torch"] is None
    assert s["voluntary_ctxt_switches_total"] >= 0
    # a PID reused by another process is not the job any more; an exited one is dropped
    assert js.sample([{**rec, "start_time": start + 1}], gpu) == []
    child.kill()
    child.wait()
    assert js.sample([rec], gpu) == []



def test_job_sampler_kept_parts_follow_the_record_and_match_procfs(
        child: subprocess.Popen[str]) -> None:
    """The parts of a sample kept between cycles (CPU set, nodes, GPUs, the numa part)
    follow a rebind at the next cycle; the slow reads parsed in the sampler itself
    (uid and context switches from status, one task listing for children and thread
    states) give what tunerd.adapters.procfs's readers give."""
    pid = child.pid
    rec = {"pid": pid, "start_time": Process(pid).start_time(), "name": "c",
           "cpus": "0", "mems": "", "gpus": [0]}
    gpu = {"gpus": [{"gpu": 0, "utilization_ratio": 0.25},
                    {"gpu": 1, "utilization_ratio": 0.75}]}
    host = {"cpus": [{"cpu": 0, "busy_ratio": 0.5}, {"cpu": 1, "busy_ratio": 0.25}]}
    two = {0: frozenset({0}), 1: frozenset({1})}
    js = JobSampler(node_cpus=two, slow_every=1)
    os.kill(pid, signal.SIGSTOP)  # nothing of it changes between the two readers
    try:
        wait_for(lambda: Process(pid).state() == "T", 10, f"pid {pid} stopped")
        [a] = js.sample([rec], gpu, host)
        assert (a["ncpus"], a["local_nodes"], a["gpus"]) == (1, [0], [0])
        assert a["cpus_busy_ratio"] == 0.5 and a["gpu_utilization_ratio"] == 0.25
        assert a["locality_ratio"] == 1.0  # all its pages on node 0, its only node
        [b] = js.sample([{**rec, "cpus": "1", "gpus": [1]}], gpu, host)
        assert (b["ncpus"], b["local_nodes"], b["gpus"], b["cpus"]) == (1, [1], [1], "1")
        assert b["cpus_busy_ratio"] == 0.25 and b["gpu_utilization_ratio"] == 0.75
        assert b["locality_ratio"] == 0.0  # the same pages, now remote
        [c] = js.sample([{**rec, "cpus": "0-1", "gpus": []}], gpu, host)
        assert c["ncpus"] == 2 and c["cpus_busy_ratio"] == 0.375 and c["gpus"] == []
        p = Process(pid)
        assert c["uid"] == p.uids()[0]
        assert (c["voluntary_ctxt_switches_total"],
                c["nonvoluntary_ctxt_switches_total"]) == p.ctx_switches()
        assert c["runnable_threads"] == p.runnable_threads() == 0  # stopped
        assert c["tree_runnable"] == 0 and c["workers"] == len(p.children()) == 0
    finally:
        os.kill(pid, signal.SIGCONT)


# -- GPUs ------------------------------------------------------------------------
def test_gpu_sampler_without_driver(nvml_backend: None) -> None:
    nvml.set_backend(None, "no NVIDIA driver on this test node")
    s = GpuSampler().sample()
    assert s == {"available": False,
                 "reason": "not available: no NVIDIA driver on this test node",
                 "gpus": [], "processes": []}


def test_gpu_sampler_on_replayed_telemetry(nvml_backend: None) -> None:
    replay = TelemetryReplay()
    nvml.set_backend(replay)
    s = GpuSampler().sample()
    assert s["available"] and len(s["gpus"]) == 2
    g0, g1 = s["gpus"]
    assert g0["uuid"] == "GPU-5b3a9a1e-6f0c-2d4e-8a31-0c1f7d2e9b10"
    assert g0["utilization_ratio"] == pytest.approx(0.97)
    assert g0["power_watts"] == pytest.approx(612.345)
    assert g0["sm_clock_hertz"] == 1.98e9 and g0["temperature_celsius"] == 67
    assert g0["pcie_rx_bytes_per_second"] == 5324800 * 1024
    assert g0["ecc_corrected_errors_total"] == 3 and g0["remapped_rows_correctable"] == 1
    assert g0["throttle_reason_names"] == [] and g0["xid_events_total"] == 0
    # GPU 1: thermal + power cap, the PCIe getter unsupported, an Xid 79 pending
    assert g1["throttle_reason_names"] == ["sw_power_cap", "sw_thermal"]
    assert g1["pcie_tx_bytes_per_second"] is None
    assert g1["xid_events_total"] == 1 and g1["last_xid"] == 79
    assert g1["remapped_rows_pending"] is True
    assert replay.registered == {0, 1}
    assert s["processes"] == [
        {"gpu": 0, "pid": 4242, "used_memory_bytes": 70866960384.0},
        {"gpu": 1, "pid": 4243, "used_memory_bytes": 39728447488.0},
        {"gpu": 1, "pid": 4244, "used_memory_bytes": None}]
    assert s["graphics_processes"] == []  # the recording lists none


def test_graphics_processes_are_gpu_users_too(nvml_backend: None) -> None:
    """The GPU sample keeps NVML's graphics-process lists beside the compute ones: the
    GPU-use service (tunerd.jobs.gpuuse) takes both as evidence of GPU use."""
    replay = TelemetryReplay()
    replay.gpus[1]["graphics_pids"] = [5151]
    nvml.set_backend(replay)
    s = GpuSampler().sample()
    assert s["graphics_processes"] == [[1, 5151]]


@pytest.mark.parametrize("args, why", [
    ({"steps": "10"}, "'steps' must be a number"),
    ({"step_time_s": float("nan")}, "'step_time_s' out of range"),
    ({"samples_per_s": True}, "'samples_per_s' must be a number"),
    ({"device": "tpu"}, "'device' must be 'cuda' or 'cpu'"),
    ({"memory": {"allocated": 1.5, "rss": 7}}, "'allocated' must be an integer"),
    ({"memory": "x"}, "'memory' must be an object"),
    ({"workers": [3, "4", None, 5]}, "'workers' must be a list of process ids"),
    ({"workers": [6] * (MAX_WORKERS + 1)}, "'workers' must be a list of process ids"),
    ({"workers": "3"}, "'workers' must be a list of process ids"),
    ({"rank": -1}, "'rank' out of range"),
])
def test_a_report_is_never_trusted_to_be_well_formed(args: dict, why: str) -> None:
    """A report comes from the job's user: wrong types and ranges are refused where it
    arrives (the only check: the sampler uses the Report as it is)."""
    with pytest.raises(UsageError, match=f"report: {why}"):
        parse_report(args, pid=1, start_time=5)


def test_a_reports_unknown_keys_are_left_out() -> None:
    r = parse_report({"memory": {"rss": 7, "x": 1}, "rank": 2, "evil": "x" * 100,
                      "workers": [3, 5]}, pid=1, start_time=5)
    t = torch_from_report(r, now=r.time + 3)
    assert t["memory"] == {"rss": 7} and t["rank"] == 2 and t["workers"] == [3, 5]
    assert "evil" not in t and t["devices"] == [] and t["age_seconds"] == pytest.approx(3)
    assert torch_from_report(parse_report({}, pid=1, start_time=5))["memory"] == {}


def test_a_report_reaches_the_history_and_advise(child: subprocess.Popen[str]) -> None:
    """CUDA memory sent with `report` ends in the job's history columns, where the
    gpu-memory-fragmentation rule of advise finds it (no file involved)."""
    from tunerd.diagnose.advise import advise

    pid = child.pid
    start = Process(pid).start_time()
    rec = {"pid": pid, "start_time": start, "name": "child", "cpus": "0", "gpus": [0]}
    report = parse_report({"device": "cuda", "local_rank": 0, "memory": {
        "reserved": 60 << 30, "allocated": 20 << 30, "max_allocated": 30 << 30}},
        pid=pid, start_time=start)
    js, h = JobSampler(), History(history_seconds=10, sample_interval=1)
    for t in range(3):
        h.add({"time": float(t), "jobs": js.sample([rec], {}, reports={pid: report})})
    ring = h.job(pid)
    assert ring is not None
    cols = ring.columns()
    assert cols["torch_reserved_bytes"][-1] == 60 << 30
    [f] = [f for f in advise(rec, cols) if f.id == "gpu-memory-fragmentation"]
    assert f.evidence["reserved_over_allocated"] == 3.0


FORKER = """
import subprocess, sys, threading, time
kids = []
started, end = threading.Event(), threading.Event()
def spawn():
    kids.append(subprocess.Popen(["sleep", "60"]))
def spawn_and_stay():  # the worker stays this live thread's child until "reap"
    spawn(); started.set(); end.wait()
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("thread"):
        threading.Thread(target=spawn_and_stay, daemon=True).start(); started.wait()
    elif line.startswith("main"):
        spawn()
    elif line.startswith("reap"):
        end.set()
        for k in kids: k.kill(); k.wait()
        kids.clear()
    print("done", flush=True)
"""


def test_job_sampler_keeps_files_open_and_follows_workers_of_any_thread() -> None:
    """The per-cycle files stay open between cycles (no new fd per read) and are closed
    when the job ends; a worker that a non-main thread started is found at the job's
    next slow read and followed after it, one the main thread started at the next
    cycle; workers that exited are no longer counted.

    The thread stays alive (its worker stays its child, not the main thread's), and the
    process is idle between the reads: the stat of the reads after the worker started
    does not change, which once made a slow read carry the children listed at a
    full read that was not slow, and miss the worker under load (when the thread
    had not exited yet). A pid whose first slow read after the worker is the first
    read would list every thread anyway: another forker is started then, so each run
    takes the case that failed."""
    for _ in range(12):
        p = subprocess.Popen([sys.executable, "-c", FORKER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        if p.pid % 3 != 2:  # slow_every 3: the slow read falls on the 2nd or 3rd read
            break
        p.kill()
        p.wait()
    assert p.stdin is not None and p.stdout is not None

    def ask(what: str) -> None:
        ask_child(p, what)

    try:
        assert p.stdout.readline() == "ready\n"
        rec = {"pid": p.pid, "start_time": Process(p.pid).start_time(), "name": "f",
               "cpus": "0"}
        js = JobSampler(slow_every=3)
        fds = len(os.listdir("/proc/self/fd"))
        [s] = js.sample([rec], {})  # the first read is a slow one
        assert s["workers"] == 0
        ask("thread")
        counts = [js.sample([rec], {})[0]["workers"] for _ in range(4)]
        assert counts[-1] == 1 and counts.index(1) <= 2  # at the slow read at the latest
        opened = len(os.listdir("/proc/self/fd"))
        assert opened > fds
        ask("main")
        assert js.sample([rec], {})[0]["workers"] == 2
        ask("reap")
        for _ in range(3):
            assert js.sample([rec], {})[0]["workers"] == 0
        assert len(os.listdir("/proc/self/fd")) == opened  # read again, not opened again
        p.kill()
        p.wait()
        assert js.sample([rec], {}) == []  # gone: left out, its files closed
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        p.kill()
        p.wait()
