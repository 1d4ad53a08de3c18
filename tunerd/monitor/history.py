"""Recent samples as fixed rings: one for the host, one per GPU, one per bound job.

Memory is bounded by construction: every ring is preallocated with
``capacity = history_seconds / sample_interval`` rows, and at most
``MAX_JOB_RINGS`` jobs have a ring (a job beyond that is sampled and exported
but keeps no history). ``bound_bytes()`` is the exact ceiling of row storage.

A job row also carries the host and GPU signals the advise rules weigh against
it (I/O pressure, throttling of the job's GPUs), so a rule reads one ring.
"""

from __future__ import annotations

import math
from typing import Any

from tunerd.monitor.ring import Ring

MAX_JOB_RINGS = 64
MAX_CAPACITY = 86400

HOST_FIELDS = ("time", "cpu_busy_ratio", "iowait_ratio", "psi_cpu_some", "psi_memory_some",
               "psi_io_some", "psi_io_full", "disk_busy_max", "sample_cpu_seconds")
GPU_FIELDS = ("time", "utilization_ratio", "memory_used_bytes", "power_watts",
              "temperature_celsius", "sm_clock_hertz", "throttle_reasons",
              "pcie_tx_bytes_per_second", "pcie_rx_bytes_per_second")
JOB_FIELDS = ("time", "cpu_cores", "cpu_ratio", "cpus_busy_ratio", "ncpus", "threads",
              "runnable_threads", "rss_bytes", "locality_ratio", "open_fds", "nofile_soft",
              "read_bytes_per_second", "write_bytes_per_second", "gpu_memory_bytes",
              "gpu_utilization_ratio", "gpu_throttle_reasons", "torch_reserved_bytes",
              "torch_allocated_bytes", "iowait_ratio", "psi_io_some", "disk_busy_max",
              "workers", "tree_cpu_ratio", "tree_runnable")


def _get(d: dict[str, Any] | None, *path: Any) -> Any:
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def torch_totals(stats: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """(reserved, allocated) bytes summed over the devices in a tunerd.torch report."""
    devs = _get(stats, "devices")
    if not isinstance(devs, list) or not devs:
        return None, None
    try:
        return (float(sum(d["reserved_bytes"] for d in devs)),
                float(sum(d["allocated_bytes"] for d in devs)))
    except (KeyError, TypeError, ValueError):
        return None, None


class History:
    def __init__(self, history_seconds: float, sample_interval: float) -> None:
        self.capacity = max(1, min(MAX_CAPACITY, math.ceil(history_seconds / sample_interval)))
        self.host = Ring(HOST_FIELDS, self.capacity)
        self.gpus: dict[int, Ring] = {}
        self.jobs: dict[tuple[int, Any], Ring] = {}
        self.dropped_jobs = 0  # jobs seen while MAX_JOB_RINGS were in use

    def bound_bytes(self, gpus: int | None = None) -> int:
        """Most bytes the row storage can ever hold for this many GPUs."""
        n_gpu = len(self.gpus) if gpus is None else gpus
        per_row = 8 * (len(HOST_FIELDS) + n_gpu * len(GPU_FIELDS)
                       + MAX_JOB_RINGS * len(JOB_FIELDS))
        return self.capacity * per_row

    def nbytes(self) -> int:
        rings = [self.host, *self.gpus.values(), *self.jobs.values()]
        return sum(r.nbytes for r in rings)

    def job(self, pid: int) -> Ring | None:
        for (p, _), ring in self.jobs.items():
            if p == pid:
                return ring
        return None

    def add(self, sample: dict[str, Any]) -> None:
        t = sample["time"]
        host = sample.get("host") or {}
        disks = [d["busy_ratio"] for d in host.get("disks") or [] if d.get("busy_ratio")
                 is not None]
        disk_busy = max(disks) if disks else None
        psi = host.get("psi") or {}
        iowait = host.get("iowait_ratio")
        self.host.append((
            t, host.get("cpu_busy_ratio"), iowait, _get(psi, "cpu", "some_avg10"),
            _get(psi, "memory", "some_avg10"), _get(psi, "io", "some_avg10"),
            _get(psi, "io", "full_avg10"), disk_busy, sample.get("cpu_seconds")))

        throttle: dict[int, int] = {}
        for g in _get(sample, "gpu", "gpus") or []:
            ring = self.gpus.get(g["gpu"])
            if ring is None:
                ring = self.gpus[g["gpu"]] = Ring(GPU_FIELDS, self.capacity)
            ring.append((t, *(g.get(f) for f in GPU_FIELDS[1:])))
            if g.get("throttle_reasons") is not None:
                throttle[g["gpu"]] = int(g["throttle_reasons"])

        live = set()
        rings = self.jobs
        psi_io = _get(psi, "io", "some_avg10")
        for j in sample.get("jobs") or []:
            if "error" in j:
                continue
            key = (j["pid"], j.get("start_time"))
            live.add(key)
            ring = rings.get(key)
            if ring is None:
                if len(rings) >= MAX_JOB_RINGS:
                    self.dropped_jobs += 1
                    continue
                ring = rings[key] = Ring(JOB_FIELDS, self.capacity)
            bits = [throttle[g] for g in j.get("gpus") or [] if g in throttle] \
                if throttle else None
            reserved, allocated = torch_totals(j.get("torch")) if j.get("torch") \
                else (None, None)
            ring.append((
                t, j.get("cpu_cores"), j.get("cpu_ratio"), j.get("cpus_busy_ratio"),
                j.get("ncpus"), j.get("threads"),
                j.get("runnable_threads"), j.get("rss_bytes"), j.get("locality_ratio"),
                j.get("open_fds"), j.get("nofile_soft"), j.get("read_bytes_per_second"),
                j.get("write_bytes_per_second"), j.get("gpu_memory_bytes"),
                j.get("gpu_utilization_ratio"),
                _or_bits(bits), reserved, allocated, iowait,
                psi_io, disk_busy, j.get("workers"),
                j.get("tree_cpu_ratio"), j.get("tree_runnable")))
        for key in rings.keys() - live:  # jobs that ended
            del rings[key]


def _or_bits(bits: list[int] | None) -> int | None:
    if not bits:
        return None
    out = 0
    for b in bits:
        out |= b
    return out
