"""Host sampler: CPU per core and NUMA node, memory per node, PSI, disks, NICs.

Reads only the kernel's aggregate files (one open+read each, a few KiB): never a
sweep over /proc/PID. Each source is read on its own, so a kernel without PSI or
a container without /sys/devices/system/node still gives the other numbers; the
missing part is listed under ``unavailable`` with the reason.

The CPU, memory, disk and network counters come from psutil (``cpu_times``,
``virtual_memory``, ``disk_io_counters``, ``net_io_counters``), pointed at the
sampler's proc root through ``psutil.PROCFS_PATH`` while they are read (tests use
a recorded tree). What psutil has no call for stays here: memory per NUMA node
(``/sys/devices/system/node/nodeN/meminfo``) and pressure stall information.

Cost: a full sample is ~0.5-0.8 ms of CPU (psutil's parsers), most of it memory,
PSI, disks and NICs. ``sample(full=False)`` re-reads the per-CPU times only (the job
sampler needs them every cycle for each job's CPUs' busy share) and repeats the
other parts from the last full sample; the Monitor asks for a full one every few
seconds, and every cycle while someone watches (``tunerctl top``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from tunerd.adapters.procfs import CLK_TCK, read_text
from tunerd.base.cpulist import CpuListError, format_cpulist, parse_cpulist

# Devices that are not real disks: loop, RAM disks, floppies (as node_exporter skips them)
_SKIP_DISK_PREFIXES = ("loop", "ram", "zram", "fd")
PSI_RESOURCES = ("cpu", "memory", "io")
# psutil reads /proc/stat, meminfo, diskstats and net/dev; the per-node meminfo and PSI
# files are read here whole (limit None). Errors (OSError, or psutil's ValueError,
# IndexError or AssertionError on a file it cannot parse) are caught per part.
_PSUTIL_ROOT = threading.Lock()  # psutil.PROCFS_PATH is one global for the process


@contextlib.contextmanager
def _psutil_root(proc: Path) -> Iterator[None]:
    """psutil reads ``proc`` (its PROCFS_PATH) inside the block, /proc after it."""
    with _PSUTIL_ROOT:
        old = psutil.PROCFS_PATH
        psutil.PROCFS_PATH = str(proc)
        try:
            yield
        finally:
            psutil.PROCFS_PATH = old


def parse_node_meminfo(text: str) -> dict[str, int]:
    """``Node 0 MemTotal:  4810524 kB`` lines -> {"MemTotal": bytes, ...}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "Node":
            key = parts[2].rstrip(":")
            val = int(parts[3])
            out[key] = val * 1024 if len(parts) > 4 and parts[4] == "kB" else val
    return out


def parse_psi(text: str) -> dict[str, float]:
    """/proc/pressure/X -> {"some_avg10": ratio, "some_total_seconds": s, "full_...": ...}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        kind = parts[0]
        for kv in parts[1:]:
            k, _, v = kv.partition("=")
            if k == "avg10":
                out[f"{kind}_avg10"] = float(v) / 100.0
            elif k == "total":
                out[f"{kind}_total_seconds"] = int(v) / 1e6
    return out


class HostSampler:
    """Samples the host; keeps the previous counters to turn them into rates."""

    def __init__(self, proc_root: Path = Path("/proc"), sys_root: Path = Path("/sys")) -> None:
        self.proc = Path(proc_root)
        self.sys = Path(sys_root)
        self.node_cpus = self._read_node_cpus()
        self._prev_t: float | None = None
        self._online: list[int] = []  # ids of psutil's per-CPU rows (see _cpu_ids)
        self._diskstats = str(self.proc / "diskstats")
        self._prev_stat: dict[int, tuple[int, int, int]] = {}
        # (node_cpus, node -> its CPU list): formatted once, not every cycle
        self._cpulists: tuple[dict[int, frozenset[int]] | None, dict[int, str]] = (None, {})
        self._prev_disk: dict[str, tuple[int, int, int, int, int]] = {}
        self._prev_net: dict[str, tuple[int, ...]] = {}
        self._whole_disks: tuple[frozenset[str], set[str]] | None = None  # see _whole
        # the parts a light sample repeats: (out keys, unavailable entries, numa memory)
        self._kept: tuple[dict[str, Any], dict[str, str], dict[int, dict[str, Any]]] | None = None

    def _read_node_cpus(self) -> dict[int, frozenset[int]]:
        nodes: dict[int, frozenset[int]] = {}
        base = self.sys / "devices/system/node"
        try:
            names = os.listdir(base)
        except OSError:
            return nodes
        for name in names:
            if name.startswith("node") and name[4:].isdigit():
                try:
                    nodes[int(name[4:])] = parse_cpulist(read_text(base / name / "cpulist", None))
                except (OSError, ValueError):
                    continue
        return dict(sorted(nodes.items()))

    def sample(self, full: bool = True) -> dict[str, Any]:
        """One sample. ``full=False`` (after a first full one): the CPU part read anew,
        memory, pressure, disks and NICs as the last full sample had them (their rates
        are over the interval between the last two full samples)."""
        out: dict[str, Any] = {"unavailable": {}}
        self._part(out, "cpu", self._cpu, None)
        if not full and self._kept is not None:
            kept, unavailable, numa_mem = self._kept
            out.update(kept)
            out["unavailable"].update(unavailable)
            for entry in out.get("numa") or []:
                entry.update(numa_mem.get(entry["node"], {}))
            return out
        now = time.monotonic()
        dt = None if self._prev_t is None else max(now - self._prev_t, 1e-6)
        before = set(out)
        for name, fn in (("memory", self._memory), ("pressure", self._psi),
                         ("disks", self._disks), ("network", self._net)):
            self._part(out, name, fn, dt)
        self._prev_t = now
        mem_keys = ("memory_total_bytes", "memory_free_bytes", "memory_used_bytes")
        self._kept = ({k: v for k, v in out.items() if k not in before},
                      {k: v for k, v in out["unavailable"].items() if k != "cpu"},
                      {e["node"]: {k: e[k] for k in mem_keys if k in e}
                       for e in out.get("numa") or []})
        return out

    @staticmethod
    def _part(out: dict[str, Any], name: str, fn: Any, dt: float | None) -> None:
        try:
            fn(out, dt)
        except (OSError, ValueError, IndexError, AssertionError) as err:
            out["unavailable"][name] = f"{type(err).__name__}: {err}"

    # -- parts ---------------------------------------------------------------
    def _cpu_ids(self, n: int) -> list[int]:
        """The ids of psutil's per-CPU rows (they are in /proc/stat's order, online CPUs
        only): the online list where it has as many, else 0..n-1. Read again only when
        the number of rows changes (a CPU went on- or offline)."""
        if len(self._online) != n:
            try:
                online = sorted(parse_cpulist(read_text(self.sys / "devices/system/cpu/online")))
            except (OSError, CpuListError):
                online = []
            self._online = online if len(online) == n else list(range(n))
        return self._online

    def _proc_stat(self) -> dict[int, tuple[int, int, int]]:
        """cpu id -> (total, idle, iowait) clock ticks, from psutil.cpu_times(percpu=True)."""
        with _psutil_root(self.proc):
            rows = psutil.cpu_times(percpu=True)
        out: dict[int, tuple[int, int, int]] = {}
        tick = CLK_TCK
        for cpu, t in zip(self._cpu_ids(len(rows)), rows, strict=True):
            # user nice system idle iowait irq softirq steal, psutil's first eight fields
            # on Linux (guest* are in user/nice): each back to its exact ticks
            vals = [round(v * tick) for v in t[:8]]
            out[cpu] = (sum(vals), vals[3], vals[4])
        return out

    def _cpu(self, out: dict[str, Any], dt: float | None) -> None:
        cur = self._proc_stat()
        prev, self._prev_stat = self._prev_stat, cur
        cpus: list[dict[str, Any]] = []
        agg: dict[int, list[int]] = {}  # cpu -> [dtotal, dbusy, diowait]
        for cpu, (total, idle, iowait) in sorted(cur.items()):
            p = prev.get(cpu)
            if p is None or total <= p[0]:
                cpus.append({"cpu": cpu, "busy_ratio": None, "iowait_ratio": None})
                continue
            d_total = total - p[0]
            d_idle, d_io = idle - p[1], iowait - p[2]
            agg[cpu] = [d_total, d_total - d_idle - d_io, d_io]
            cpus.append({"cpu": cpu, "busy_ratio": (d_total - d_idle - d_io) / d_total,
                         "iowait_ratio": d_io / d_total})
        out["cpus"] = cpus

        def ratio(ids: Any, k: int) -> float | None:
            tot = sum(agg[c][0] for c in ids if c in agg)
            return sum(agg[c][k] for c in ids if c in agg) / tot if tot else None

        out["cpu_busy_ratio"] = ratio(agg, 1)
        out["iowait_ratio"] = ratio(agg, 2)
        nodes = self.node_cpus
        if self._cpulists[0] is not nodes:
            self._cpulists = (nodes, {n: format_cpulist(ids) for n, ids in nodes.items()})
        lists = self._cpulists[1]
        out["numa"] = [{"node": n, "cpus": lists[n], "busy_ratio": ratio(ids, 1)}
                       for n, ids in nodes.items()]

    def _memory(self, out: dict[str, Any], dt: float | None) -> None:
        with _psutil_root(self.proc):
            vm = psutil.virtual_memory()
        out["memory"] = {"total_bytes": vm.total, "available_bytes": vm.available,
                         "used_bytes": vm.used, "free_bytes": vm.free}
        base = self.sys / "devices/system/node"
        nodes = out.setdefault("numa", [{"node": n} for n in self.node_cpus])
        if not nodes:
            raise OSError(f"no NUMA nodes under {base}")
        for entry in nodes:
            mi = parse_node_meminfo(read_text(base / f"node{entry['node']}" / "meminfo", None))
            entry["memory_total_bytes"] = mi.get("MemTotal")
            entry["memory_free_bytes"] = mi.get("MemFree")
            entry["memory_used_bytes"] = mi.get("MemUsed")

    def _psi(self, out: dict[str, Any], dt: float | None) -> None:
        psi: dict[str, dict[str, float]] = {}
        errors = []
        for res in PSI_RESOURCES:
            try:
                psi[res] = parse_psi(read_text(self.proc / "pressure" / res, None))
            except OSError as err:  # kernel without CONFIG_PSI or booted with psi=0
                errors.append(f"{res}: {err.strerror or err}")
        out["psi"] = psi
        if errors:
            out["unavailable"]["pressure"] = "; ".join(errors)

    def _disks(self, out: dict[str, Any], dt: float | None) -> None:
        if not os.path.exists(self._diskstats):  # psutil would read the real /sys/block
            raise FileNotFoundError(2, "No such file or directory", self._diskstats)
        with _psutil_root(self.proc):
            counters = psutil.disk_io_counters(perdisk=True, nowrap=False) or {}
        # (reads, bytes read, writes, bytes written, io ms), as parse_diskstats has them
        cur = {dev: (c.read_count, c.read_bytes, c.write_count, c.write_bytes,
                     getattr(c, "busy_time", 0)) for dev, c in counters.items()}
        whole = self._whole(frozenset(cur))
        prev, self._prev_disk = self._prev_disk, cur
        disks = []
        for dev, (rd, rbytes, wr, wbytes, io_ms) in sorted(cur.items()):
            if dev.startswith(_SKIP_DISK_PREFIXES) or dev.replace("/", "!") not in whole:
                continue
            d: dict[str, Any] = {
                "device": dev, "reads_total": rd, "writes_total": wr,
                "read_bytes_total": rbytes, "written_bytes_total": wbytes,
                "io_time_seconds_total": io_ms / 1000.0,
                "busy_ratio": None, "read_bytes_per_second": None,
                "write_bytes_per_second": None,
            }
            p = prev.get(dev)
            if p is not None and dt is not None:
                d["busy_ratio"] = min(1.0, max(0.0, (io_ms - p[4]) / 1000.0 / dt))
                d["read_bytes_per_second"] = max(0, rbytes - p[1]) / dt
                d["write_bytes_per_second"] = max(0, wbytes - p[3]) / dt
            disks.append(d)
        out["disks"] = disks

    def _whole(self, devices: frozenset[str]) -> set[str]:
        """The whole disks (partitions are summed into their disk by the kernel), from
        SYS/block: listed again only when the devices in diskstats change."""
        if self._whole_disks is None or self._whole_disks[0] != devices:
            try:
                whole = set(os.listdir(self.sys / "block"))
            except OSError:
                whole = set(devices)
            self._whole_disks = (devices, whole)
        return self._whole_disks[1]

    def _net(self, out: dict[str, Any], dt: float | None) -> None:
        with _psutil_root(self.proc):
            counters = psutil.net_io_counters(pernic=True, nowrap=False)
        # (rx bytes, rx packets, rx errs, rx drop, tx bytes, tx packets, tx errs, tx drop)
        cur: dict[str, tuple[int, ...]] = {
            name: (c.bytes_recv, c.packets_recv, c.errin, c.dropin, c.bytes_sent,
                   c.packets_sent, c.errout, c.dropout) for name, c in counters.items()}
        prev, self._prev_net = self._prev_net, cur
        nics = []
        for name, v in sorted(cur.items()):
            n: dict[str, Any] = {
                "interface": name,
                "receive_bytes_total": v[0], "receive_packets_total": v[1],
                "receive_errors_total": v[2], "receive_drop_total": v[3],
                "transmit_bytes_total": v[4], "transmit_packets_total": v[5],
                "transmit_errors_total": v[6], "transmit_drop_total": v[7],
                "receive_bytes_per_second": None, "transmit_bytes_per_second": None,
            }
            p = prev.get(name)
            if p is not None and dt is not None:
                n["receive_bytes_per_second"] = max(0, v[0] - p[0]) / dt
                n["transmit_bytes_per_second"] = max(0, v[4] - p[4]) / dt
            nics.append(n)
        out["nics"] = nics
