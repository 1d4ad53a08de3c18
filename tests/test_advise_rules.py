"""advise rules as pure functions on recorded sample sequences (history columns)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tunerd.diagnose.advise import (
    advise,
    cpu_oversubscription,
    data_loading,
    fd_limit,
    gpu_fragmentation,
    io_bound,
    remote_numa,
    throttling,
    workers_crowded,
)
from tunerd.monitor.history import History

NAN = math.nan
JOB = {"pid": 4242, "name": "train", "cpus": "2-9", "mems": "0", "gpus": [0],
       "threads": 40, "numa_bytes": {"0": 1 << 30, "1": 3 << 30}}


def cols(**series: list[float]) -> dict[str, list[float]]:
    return {k: list(v) for k, v in series.items()}


# a DataLoader-starved run: GPU mostly idle, the 8 bound CPUs pegged (10 samples, 1 s apart)
STARVED = cols(gpu_utilization_ratio=[.31, .28, .35, NAN, .22, .30, .27, .33, .29, .31],
               cpu_ratio=[.97, .99, .98, .99, 1.0, .96, .98, .99, .97, .98])
# a healthy run: GPU busy, CPUs moderately used
HEALTHY = cols(gpu_utilization_ratio=[.96, .97, .95, .98, .97],
               cpu_ratio=[.55, .61, .58, .60, .57],
               psi_io_some=[0.0] * 5, iowait_ratio=[0.01] * 5, disk_busy_max=[0.1] * 5,
               locality_ratio=[0.97] * 5, open_fds=[300] * 5, nofile_soft=[1048576] * 5,
               runnable_threads=[6] * 5, ncpus=[8] * 5, gpu_throttle_reasons=[0] * 5,
               torch_reserved_bytes=[30e9] * 5, torch_allocated_bytes=[28e9] * 5)


def test_data_loading_bound() -> None:
    f = data_loading(JOB, STARVED)
    assert f is not None and f.id == "data-loading-bound"
    assert f.evidence["gpu_utilization_median"] == 0.30
    assert f.evidence["samples"] == 9  # the NaN (GPU not read) is left out
    assert "num_workers" in f.fix
    assert data_loading(JOB, HEALTHY) is None
    # CPUs not saturated: the GPU idles for another reason, not data loading
    assert data_loading(JOB, cols(gpu_utilization_ratio=[.2] * 5, cpu_ratio=[.4] * 5)) is None
    assert data_loading(JOB, cols(gpu_utilization_ratio=[.2, .2], cpu_ratio=[1, 1])) is None
    # DataLoader workers are child processes: the job's own CPU time is low, but its
    # bound CPUs are pegged -> still data-loading bound
    workers = cols(gpu_utilization_ratio=[.2] * 4, cpu_ratio=[.15] * 4,
                   cpus_busy_ratio=[.97, .99, .98, 1.0])
    f2 = data_loading(JOB, workers)
    assert f2 is not None and f2.evidence["cpu_saturation_median"] == 0.985


def test_io_bound() -> None:
    io = cols(psi_io_some=[.35, .41, .38, .44], iowait_ratio=[.30, .28, .33, .31],
              disk_busy_max=[.99, 1.0, .98, 1.0], read_bytes_per_second=[250e6] * 4,
              gpu_utilization_ratio=[.4] * 4)
    f = io_bound(JOB, io)
    assert f is not None and f.evidence["io_pressure_some_median"] == pytest.approx(0.395)
    assert f.evidence["disk_busy_max_median"] == pytest.approx(0.995)
    assert io_bound(JOB, HEALTHY) is None
    # pressure on the node, but this job neither reads nor starves: not its finding
    other = dict(io, read_bytes_per_second=[0.0] * 4, gpu_utilization_ratio=[.97] * 4)
    assert io_bound(JOB, other) is None


def test_remote_numa_memory() -> None:
    f = remote_numa(JOB, cols(locality_ratio=[NAN, .9, .62]))
    assert f is not None and f.evidence["locality_ratio"] == 0.62
    assert "--mems 0" in f.fix and "migratepages 4242" in f.fix
    assert remote_numa(JOB, cols(locality_ratio=[.5, .95])) is None  # latest value counts
    assert remote_numa(JOB, cols(locality_ratio=[NAN, NAN])) is None


def test_gpu_fragmentation() -> None:
    frag = cols(torch_reserved_bytes=[60e9, 71e9], torch_allocated_bytes=[30e9, 31e9])
    f = gpu_fragmentation(JOB, frag)
    assert f is not None and f.evidence["reserved_bytes"] == 71_000_000_000
    assert "expandable_segments" in f.fix
    assert gpu_fragmentation(JOB, HEALTHY) is None
    # big ratio but a tiny gap is not worth reporting
    assert gpu_fragmentation(JOB, cols(torch_reserved_bytes=[1e9],
                                       torch_allocated_bytes=[1e8])) is None
    assert gpu_fragmentation(JOB, cols()) is None  # job does not report torch stats


def test_throttling() -> None:
    hot = cols(gpu_throttle_reasons=[0, 0x20, 0x20 | 0x4, 0x20, 0, 0x1])
    f = throttling(JOB, hot)
    assert f is not None and f.severity == "warning"
    assert f.evidence["reasons"] == ["sw_power_cap", "sw_thermal"]
    assert f.evidence["throttled_share"] == 0.5
    hw = throttling(JOB, cols(gpu_throttle_reasons=[0x40] * 4))
    assert hw is not None and hw.severity == "critical"
    # idle (0x1) is not throttling
    assert throttling(JOB, cols(gpu_throttle_reasons=[0x1] * 10)) is None


def test_fd_limit() -> None:
    f = fd_limit(JOB, cols(open_fds=[900, 1000], nofile_soft=[1024, 1024]))
    assert f is not None and f.severity == "critical" and f.evidence["used_ratio"] == 0.977
    assert "--nofile" in f.fix
    warn = fd_limit(JOB, cols(open_fds=[850], nofile_soft=[1024]))
    assert warn is not None and warn.severity == "warning"
    assert fd_limit(JOB, HEALTHY) is None


def test_cpu_oversubscription() -> None:
    f = cpu_oversubscription(JOB, cols(runnable_threads=[30, 34, 31], ncpus=[8, 8, 8]))
    assert f is not None and f.evidence["runnable_threads_median"] == 31
    assert "OMP_NUM_THREADS" in f.fix
    assert cpu_oversubscription(JOB, HEALTHY) is None
    # one CPU, 3 runnable: over 2x but fewer than ncpus + 2 -> noise, not a finding
    assert cpu_oversubscription(JOB, cols(runnable_threads=[2], ncpus=[1])) is None


def test_advise_orders_by_severity_and_reads_history_rings() -> None:
    """Through the same History the daemon fills, from recorded job samples."""
    h = History(history_seconds=30, sample_interval=1)
    for t in range(6):
        job: dict[str, Any] = {**JOB, "start_time": 1, "cpu_ratio": 0.99,
                               "gpu_utilization_ratio": 0.2, "ncpus": 8,
                               "open_fds": 1020, "nofile_soft": 1024, "runnable_threads": 9}
        h.add({"time": float(t), "jobs": [job],
               "gpu": {"gpus": [{"gpu": 0, "throttle_reasons": 0}]}})
    ring = h.job(4242)
    assert ring is not None
    found = advise(JOB, ring.columns())
    assert [f.id for f in found] == ["fd-limit", "data-loading-bound"]
    assert found[0].to_dict()["severity"] == "critical"


def test_workers_crowding_one_cpu_is_found_with_the_job_and_its_workers() -> None:
    """The guide's example: 4 DataLoader workers and the loop bound to one busy CPU."""
    crowded = cols(workers=[4, 4, 4], ncpus=[1, 1, 1], tree_cpu_ratio=[.99, .98, .99],
                   cpu_ratio=[.57, .55, .58])
    f = workers_crowded(JOB, crowded)
    assert f is not None and f.id == "data-loading-cpu-starved"
    assert f.evidence["workers"] == 4 and f.evidence["ncpus"] == 1
    assert f.evidence["job_cpu_ratio_median"] == 0.57  # what the job alone showed
    # room for every worker: no finding; CPUs not busy: no finding
    assert workers_crowded(JOB, cols(workers=[4, 4], ncpus=[8, 8],
                                     tree_cpu_ratio=[.99, .99])) is None
    assert workers_crowded(JOB, cols(workers=[4, 4], ncpus=[1, 1],
                                     tree_cpu_ratio=[.4, .5])) is None
    # runnable workers count toward oversubscription too
    f2 = cpu_oversubscription(JOB, cols(runnable_threads=[1, 1, 1], tree_runnable=[5, 5, 6],
                                        ncpus=[1, 1, 1]))
    assert f2 is not None and f2.evidence["runnable_threads_median"] == 5
