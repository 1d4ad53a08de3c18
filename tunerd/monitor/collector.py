"""Prometheus exposition of the latest sample: a custom Collector, no second registry.

``collect()`` runs in prometheus_client's HTTP thread (and in the ``metrics``
handler); it reads ``monitor.latest``, a dict the sampler thread replaces whole each
cycle and never mutates, and the history's size under ``monitor.lock``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tunerd.monitor.facts import FleetFacts
from tunerd.monitor.gpu import THROTTLE_REASONS
from tunerd.monitor.history import History


class MonitorView(Protocol):
    """What the collector reads of the Monitor service (and nothing else)."""

    latest: dict[str, Any] | None
    samples_total: int
    sample_cpu_seconds_total: float
    sampler_status: dict[str, dict[str, Any]]
    history: History
    lock: threading.Lock
    daemon_facts: Callable[[], Mapping[str, float | None]]
    fleet: FleetFacts

    @property
    def errors_total(self) -> int: ...

    def binds_total(self) -> int: ...

Fam = GaugeMetricFamily | CounterMetricFamily

# (sample key, metric name, help, scale): per-GPU gauges
GPU_GAUGES = [
    ("utilization_ratio", "tunerd_gpu_utilization_ratio",
     "Fraction of time a kernel ran on the GPU (nvidia-smi utilization.gpu / 100)"),
    ("memory_utilization_ratio", "tunerd_gpu_memory_utilization_ratio",
     "Fraction of time device memory was read or written"),
    ("memory_used_bytes", "tunerd_gpu_memory_used_bytes", "GPU memory in use"),
    ("memory_total_bytes", "tunerd_gpu_memory_total_bytes", "GPU memory size"),
    ("power_watts", "tunerd_gpu_power_watts", "Power draw"),
    ("power_limit_watts", "tunerd_gpu_power_limit_watts", "Enforced power limit"),
    ("temperature_celsius", "tunerd_gpu_temperature_celsius", "GPU core temperature"),
    ("sm_clock_hertz", "tunerd_gpu_sm_clock_hertz", "Current SM clock"),
    ("pcie_tx_bytes_per_second", "tunerd_gpu_pcie_transmit_bytes_per_second",
     "PCIe transmit throughput (NVML 20 ms window)"),
    ("pcie_rx_bytes_per_second", "tunerd_gpu_pcie_receive_bytes_per_second",
     "PCIe receive throughput (NVML 20 ms window)"),
    ("remapped_rows_correctable", "tunerd_gpu_remapped_rows_correctable",
     "Rows remapped for correctable errors"),
    ("remapped_rows_uncorrectable", "tunerd_gpu_remapped_rows_uncorrectable",
     "Rows remapped for uncorrectable errors"),
]
GPU_COUNTERS = [
    ("ecc_corrected_errors_total", "tunerd_gpu_ecc_corrected_errors",
     "Corrected ECC memory errors (aggregate)"),
    ("ecc_uncorrected_errors_total", "tunerd_gpu_ecc_uncorrected_errors",
     "Uncorrected ECC memory errors (aggregate)"),
    ("xid_events_total", "tunerd_gpu_xid_events", "Xid critical error events seen by tunerd"),
]
JOB_GAUGES = [
    ("cpu_ratio", "tunerd_job_cpu_saturation_ratio", "CPU use over the job's bound CPUs"),
    ("cpus_busy_ratio", "tunerd_job_cpus_busy_ratio",
     "Busy share of the job's bound CPUs (all processes on them, /proc/stat)"),
    ("threads", "tunerd_job_threads", "Threads"),
    ("runnable_threads", "tunerd_job_runnable_threads", "Threads in state R (slow cadence)"),
    ("rss_bytes", "tunerd_job_resident_memory_bytes", "Resident memory"),
    ("locality_ratio", "tunerd_job_memory_locality_ratio",
     "Fraction of resident pages on the job's bound NUMA nodes"),
    ("open_fds", "tunerd_job_open_fds", "Open file descriptors"),
    ("nofile_soft", "tunerd_job_max_fds", "RLIMIT_NOFILE soft limit"),
    ("gpu_memory_bytes", "tunerd_job_gpu_memory_used_bytes", "GPU memory used (NVML)"),
    ("workers", "tunerd_job_workers", "Child processes of the job (DataLoader workers)"),
    ("tree_cpu_ratio", "tunerd_job_tree_cpu_saturation_ratio",
     "CPU use of the job and its workers over the job's bound CPUs"),
    ("samples_per_s", "tunerd_job_samples_per_second",
     "Training throughput the job reports (tunerd.torch.StepReporter)"),
    ("step_time_s", "tunerd_job_step_seconds", "Median step time the job reports"),
    ("torch_allocated", "tunerd_job_torch_allocated_bytes",
     "CUDA memory torch has allocated, as the job reports"),
    ("torch_reserved", "tunerd_job_torch_reserved_bytes",
     "CUDA memory torch's caching allocator holds, as the job reports"),
]
JOB_COUNTERS = [
    ("cpu_seconds_total", "tunerd_job_cpu_seconds", "CPU time used (user + system)"),
    ("read_bytes_total", "tunerd_job_read_bytes", "Bytes read from storage (/proc/PID/io)"),
    ("write_bytes_total", "tunerd_job_written_bytes", "Bytes written to storage"),
    ("voluntary_ctxt_switches_total", "tunerd_job_voluntary_context_switches",
     "Voluntary context switches"),
    ("nonvoluntary_ctxt_switches_total", "tunerd_job_involuntary_context_switches",
     "Involuntary context switches"),
]
DISK_COUNTERS = [
    ("reads_total", "tunerd_disk_reads_completed", "Reads completed"),
    ("writes_total", "tunerd_disk_writes_completed", "Writes completed"),
    ("read_bytes_total", "tunerd_disk_read_bytes", "Bytes read"),
    ("written_bytes_total", "tunerd_disk_written_bytes", "Bytes written"),
    ("io_time_seconds_total", "tunerd_disk_io_time_seconds", "Time spent doing I/O"),
]
NIC_COUNTERS = [
    ("receive_bytes_total", "tunerd_network_receive_bytes", "Bytes received"),
    ("transmit_bytes_total", "tunerd_network_transmit_bytes", "Bytes sent"),
    ("receive_packets_total", "tunerd_network_receive_packets", "Packets received"),
    ("transmit_packets_total", "tunerd_network_transmit_packets", "Packets sent"),
    ("receive_errors_total", "tunerd_network_receive_errors", "Receive errors"),
    ("transmit_errors_total", "tunerd_network_transmit_errors", "Transmit errors"),
    ("receive_drop_total", "tunerd_network_receive_drop", "Received packets dropped"),
    ("transmit_drop_total", "tunerd_network_transmit_drop", "Sent packets dropped"),
]


def _emit(items: list[dict[str, Any]], table: list[tuple[str, str, str]], labels: list[str],
          label_fn: Callable[[dict[str, Any]], list[str]],
          kind: type[Fam]) -> Iterator[Metric]:
    for key, name, doc in table:
        fam = kind(name, doc, labels=labels)
        for it in items:
            v = it.get(key)
            if v is not None and not isinstance(v, bool):
                fam.add_metric(label_fn(it), float(v))
        yield fam


# (daemon_facts key, metric name, help, kind): what the fleet alerts need from the daemon
# beyond the monitor's own sample; a key absent or None means that service does not run
# in this daemon, and its series is left out
HEALTH = [
    ("policy_rejected", "tunerd_policy_rejected", "1 while the last policy reload was "
     "rejected (the previous policy stays in force)", GaugeMetricFamily),
    ("host_enforcing", "tunerd_host_enforcing", "1 while drift correction and hotplug are "
     "on (0 after tunerctl revert, until apply or reload)", GaugeMetricFamily),
    ("host_drifted", "tunerd_host_settings_drifted", "Host settings the last verify found "
     "drifted from the policy (before re-applying them)", GaugeMetricFamily),
    ("host_failed", "tunerd_host_settings_failed", "Host settings whose last write failed",
     GaugeMetricFamily),
    ("rule_bind_failures", "tunerd_rule_bind_failures",
     "[[job]] rule matches that could not be bound", CounterMetricFamily),
    ("rule_matches", "tunerd_rule_matches", "Processes matched by a [[job]] rule",
     CounterMetricFamily),
    ("irq_reapplied", "tunerd_irq_reapplied", "Managed interrupts put back on their CPUs "
     "after something else moved them ([irq])", CounterMetricFamily),
]


def _reported(torch: Any) -> dict[str, Any]:
    """What the job reported (the ``report`` command), under the gauge keys."""
    if not isinstance(torch, dict):
        return {}
    mem = torch.get("memory") or {}
    return {"samples_per_s": torch.get("samples_per_s"), "step_time_s": torch.get("step_time_s"),
            "torch_allocated": mem.get("allocated"), "torch_reserved": mem.get("reserved")}


class MonitorCollector(Collector):
    def __init__(self, monitor: MonitorView) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        m = self.monitor
        s = m.latest or {}
        yield from self._self_metrics(m, s)
        yield from self._health()
        yield from self._gpu(s.get("gpu") or {})
        yield from self._host(s.get("host") or {})
        yield from self._jobs(s.get("jobs") or [])
        yield from self._fleet(self.monitor.fleet, s.get("ranks") or [])

    def _fleet(self, f: FleetFacts, ranks: list[dict[str, Any]]) -> Iterator[Metric]:
        """What ``tunerctl fleet check`` compares between nodes (docs/fleet.md); every
        family bounded: 1 + 1 + MAX_NICS + MAX_NCCL_KEYS + 3 x MAX_RANKS + GPUs series.
        The live facts are read here, when they are older than LIVE_EVERY."""
        f.sample()
        v = f.versions
        info = GaugeMetricFamily(
            "tunerd_node_info", "1, with the node's class (matched policy names/GPU model) "
            "and versions as labels", labels=["class", "driver", "cuda", "nccl", "torch",
                                              "kernel", "version"])
        if v is not None:  # until the first version probe ends: no series, not a wrong one
            info.add_metric([f.klass, v.driver, v.cuda, v.nccl, v.torch, v.kernel, v.version],
                            1.0)
        yield info
        pol = GaugeMetricFamily("tunerd_policy_info", "1, with the hash of the effective "
                                "policy in force", labels=["hash"])
        if f.policy_hash:
            pol.add_metric([f.policy_hash], 1.0)
        yield pol
        mtu = GaugeMetricFamily("tunerd_nic_mtu", "MTU of a network interface, with its IPv4 "
                                "subnet and whether NCCL_SOCKET_IFNAME selects it",
                                labels=["nic", "subnet", "nccl"])
        for n in f.nics:
            mtu.add_metric([n.nic, n.subnet, "1" if n.nccl else "0"], float(n.mtu))
        yield mtu
        nccl = GaugeMetricFamily("tunerd_nccl_setting_info", "1 per managed /etc/nccl.conf "
                                 "key, with its value", labels=["key", "value"])
        for key, value in f.nccl_settings.items():
            nccl.add_metric([key, value], 1.0)
        yield nccl
        step = GaugeMetricFamily("tunerd_rank_step_seconds", "Step time a rank reports "
                                 "(tunerd.torch.StepReporter), by job id and global rank",
                                 labels=["job", "rank"])
        tput = GaugeMetricFamily("tunerd_rank_samples_per_second",
                                 "Throughput a rank reports", labels=["job", "rank"])
        bound = GaugeMetricFamily("tunerd_rank_bound", "1 when tunerd bound the reporting "
                                  "rank's process, 0 when it runs unbound",
                                  labels=["job", "rank"])
        for r in ranks:
            lab = [r["job"], r["rank"]]
            if r.get("step_time_s") is not None:
                step.add_metric(lab, r["step_time_s"])
            if r.get("samples_per_s") is not None:
                tput.add_metric(lab, r["samples_per_s"])
            bound.add_metric(lab, 1.0 if r.get("bound") else 0.0)
        yield step
        yield tput
        yield bound
        io = GaugeMetricFamily("tunerd_io_path_info", "1, with the state of the GPUs' I/O "
                               "path: [irq] placement, ACS-enabled bridges between GPUs and "
                               "their NICs, each GPU's NIC pairing tier",
                               labels=["irq", "acs", "pairing"])
        vals = f.io_path() if f.io_path is not None else None
        if vals:
            io.add_metric([vals["irq"], vals["acs"], vals["pairing"]], 1.0)
        yield io
        # a link trained to fewer lanes than it has (a reseat or riser fault) halves
        # host<->GPU bandwidth for good; the speed alone drops when the GPU idles (ASPM)
        link = GaugeMetricFamily("tunerd_gpu_pcie_link_degraded", "1 when the GPU's PCIe "
                                 "link runs with fewer lanes than its maximum",
                                 labels=["gpu", "width", "max_width"])
        for p in f.pcie:
            link.add_metric([str(p.gpu), str(p.width), str(p.max_width)],
                            1.0 if p.width < p.max_width else 0.0)
        yield link

    def _health(self) -> Iterator[Metric]:
        """The one place the collector reads daemon state outside the monitor's sample.

        Runs in prometheus_client's HTTP thread: ``daemon_facts`` only reads a few
        attributes that the loop replaces whole, never iterates shared state.
        """
        facts = self.monitor.daemon_facts()
        for key, name, doc, kind in HEALTH:
            value = facts.get(key)
            if value is not None:
                yield kind(name, doc, value=float(value))

    def _self_metrics(self, m: MonitorView, s: dict[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily("tunerd_up", "1 while tunerd serves", value=1)
        yield CounterMetricFamily("tunerd_samples", "Monitor sampling cycles done",
                                  value=m.samples_total)
        if s:
            yield GaugeMetricFamily("tunerd_sample_duration_seconds",
                                    "Wall time of the last sampling cycle",
                                    value=s["duration_seconds"])
            yield GaugeMetricFamily("tunerd_last_sample_cpu_seconds",
                                    "CPU time of the last sampling cycle", value=s["cpu_seconds"])
        yield CounterMetricFamily("tunerd_sample_cpu_seconds",
                                  "CPU time spent sampling since start",
                                  value=m.sample_cpu_seconds_total)
        up = GaugeMetricFamily("tunerd_sampler_up", "1 when the sampler's last run worked",
                               labels=["sampler"])
        errs = CounterMetricFamily("tunerd_sampler_errors", "Failed sampler runs",
                                   labels=["sampler"])
        for name, st in sorted(m.sampler_status.items()):
            up.add_metric([name], 1.0 if st["ok"] else 0.0)
            errs.add_metric([name], st["errors"])
        yield up
        yield errs
        yield GaugeMetricFamily("tunerd_jobs_bound", "Bound jobs", value=len(s.get("jobs") or []))
        yield CounterMetricFamily("tunerd_binds", "Jobs bound since start", value=m.binds_total())
        yield CounterMetricFamily("tunerd_errors", "Errors recorded by the daemon",
                                  value=m.errors_total)
        with m.lock:  # the sampler thread adds rings
            nbytes = m.history.nbytes()
        yield GaugeMetricFamily("tunerd_history_bytes", "Bytes held by the sample history",
                                value=nbytes)

    def _gpu(self, gpu: dict[str, Any]) -> Iterator[Metric]:
        yield GaugeMetricFamily("tunerd_gpu_monitoring_available",
                                "1 when NVML answers, 0 without a driver",
                                value=1.0 if gpu.get("available") else 0.0)
        gpus = gpu.get("gpus") or []

        def lab(g: dict[str, Any]) -> list[str]:
            return [str(g["gpu"]), g.get("uuid") or ""]

        yield from _emit(gpus, GPU_GAUGES, ["gpu", "uuid"], lab, GaugeMetricFamily)
        yield from _emit(gpus, GPU_COUNTERS, ["gpu", "uuid"], lab, CounterMetricFamily)
        thr = GaugeMetricFamily("tunerd_gpu_throttle_reasons",
                                "Bitmask of NVML clocks event (throttle) reasons",
                                labels=["gpu", "uuid"])
        for g in gpus:
            if g.get("throttle_reasons") is not None:
                thr.add_metric(lab(g), float(g["throttle_reasons"]))
        yield thr
        active = GaugeMetricFamily(
            "tunerd_gpu_throttle_reason_active",
            "1 while this clocks event (throttle) reason holds the GPU's clocks down",
            labels=["gpu", "uuid", "reason"])
        for g in gpus:
            if g.get("throttle_reasons") is not None:
                on = set(g.get("throttle_reason_names") or [])
                for reason in THROTTLE_REASONS.values():
                    active.add_metric([*lab(g), reason], 1.0 if reason in on else 0.0)
        yield active
        proc = GaugeMetricFamily("tunerd_gpu_process_memory_used_bytes",
                                 "GPU memory used per process", labels=["gpu", "pid"])
        for p in gpu.get("processes") or []:
            if p.get("used_memory_bytes") is not None:
                proc.add_metric([str(p["gpu"]), str(p["pid"])], p["used_memory_bytes"])
        yield proc

    def _host(self, host: dict[str, Any]) -> Iterator[Metric]:
        busy = GaugeMetricFamily("tunerd_cpu_busy_ratio", "Busy fraction per CPU",
                                 labels=["cpu"])
        iow = GaugeMetricFamily("tunerd_cpu_iowait_ratio", "iowait fraction per CPU",
                                labels=["cpu"])
        for c in host.get("cpus") or []:
            if c.get("busy_ratio") is not None:
                busy.add_metric([str(c["cpu"])], c["busy_ratio"])
                iow.add_metric([str(c["cpu"])], c["iowait_ratio"])
        yield busy
        yield iow
        nodes = host.get("numa") or []
        nb = GaugeMetricFamily("tunerd_numa_cpu_busy_ratio", "Busy fraction of a NUMA node's CPUs",
                               labels=["numa_node"])
        for n in nodes:
            if n.get("busy_ratio") is not None:
                nb.add_metric([str(n["node"])], n["busy_ratio"])
        yield nb
        for key, name, doc in [
            ("memory_total_bytes", "tunerd_numa_memory_total_bytes", "Memory of a NUMA node"),
            ("memory_free_bytes", "tunerd_numa_memory_free_bytes", "Free memory of a NUMA node"),
            ("memory_used_bytes", "tunerd_numa_memory_used_bytes", "Used memory of a NUMA node"),
        ]:
            fam = GaugeMetricFamily(name, doc, labels=["numa_node"])
            for n in nodes:
                if n.get(key) is not None:
                    fam.add_metric([str(n["node"])], n[key])
            yield fam
        psi = host.get("psi") or {}
        avg = GaugeMetricFamily("tunerd_pressure_avg10_ratio",
                                "PSI share of time stalled, 10 s average",
                                labels=["resource", "kind"])
        tot = CounterMetricFamily("tunerd_pressure_stalled_seconds",
                                  "PSI total time stalled", labels=["resource", "kind"])
        for res, vals in sorted(psi.items()):
            for kind in ("some", "full"):
                if f"{kind}_avg10" in vals:
                    avg.add_metric([res, kind], vals[f"{kind}_avg10"])
                if f"{kind}_total_seconds" in vals:
                    tot.add_metric([res, kind], vals[f"{kind}_total_seconds"])
        yield avg
        yield tot
        disks = host.get("disks") or []
        yield from _emit(disks, DISK_COUNTERS, ["device"], lambda d: [d["device"]],
                         CounterMetricFamily)
        yield from _emit(disks, [("busy_ratio", "tunerd_disk_busy_ratio",
                                  "Fraction of the last interval the disk was busy")],
                         ["device"], lambda d: [d["device"]], GaugeMetricFamily)
        yield from _emit(host.get("nics") or [], NIC_COUNTERS, ["interface"],
                         lambda n: [n["interface"]], CounterMetricFamily)
        un = GaugeMetricFamily("tunerd_host_source_available",
                               "0 for a host source that could not be read",
                               labels=["source"])
        missing = host.get("unavailable") or {}
        for src in ("cpu", "memory", "pressure", "disks", "network"):
            un.add_metric([src], 0.0 if src in missing else 1.0)
        yield un

    def _jobs(self, jobs: list[dict[str, Any]]) -> Iterator[Metric]:
        ok = [j for j in jobs if "error" not in j]

        def lab(j: dict[str, Any]) -> list[str]:
            return [j.get("name") or "", str(j["pid"])]

        flat = [{**j, **_reported(j.get("torch"))} for j in ok]
        yield from _emit(flat, JOB_GAUGES, ["job", "pid"], lab, GaugeMetricFamily)
        yield from _emit(ok, JOB_COUNTERS, ["job", "pid"], lab, CounterMetricFamily)
        numa = GaugeMetricFamily("tunerd_job_numa_memory_bytes",
                                 "Resident memory of the job per NUMA node",
                                 labels=["job", "pid", "numa_node"])
        for j in ok:
            for node, b in (j.get("numa_bytes") or {}).items():
                numa.add_metric([*lab(j), str(node)], b)
        yield numa
