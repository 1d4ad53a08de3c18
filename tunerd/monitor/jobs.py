"""Per-job sampler: only the processes tunerd bound (never a sweep of every PID).

Cheap sources are read every cycle (/proc/PID/stat — which also has the RSS —,
/proc/PID/io, the fd count, prlimit); the costly ones every ``slow_every`` cycles,
their last value carried between reads: numa_maps walks the page tables of the
whole process, per-thread task/*/stat reads grow with the thread count, and
/proc/PID/status (context switches, uid) costs as much to generate as the other
per-cycle files together (measured: ~25 us a read).
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunerd.cpulist import CpuListError, parse_cpulist

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
TORCH_STATS_MAX = 64 * 1024  # a torch stats file larger than this is not ours: ignore it


def parse_stat(text: str) -> dict[str, Any]:
    """The fields of /proc/PID/stat we use (the comm may contain spaces and ')')."""
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state); field N is rest[N - 3]
    return {"state": rest[0], "utime": int(rest[11]), "stime": int(rest[12]),
            "threads": int(rest[17]), "start_time": int(rest[19]),
            "rss_pages": int(rest[21])}


def parse_status(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            parts = val.split()
            out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
        elif key == "Uid":
            out["uid"] = int(val.split()[0])
    return out


def parse_io(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if v.strip():
            out[k.strip()] = int(v)
    return out


def parse_numa_maps(text: str) -> dict[int, int]:
    """numa node -> resident bytes, summed over every mapping in /proc/PID/numa_maps."""
    nodes: dict[int, int] = {}
    for line in text.splitlines():
        page_kb = 4
        counts: list[tuple[int, int]] = []
        for tok in line.split()[2:]:
            if tok[0] == "N" and "=" in tok:
                node, _, pages = tok[1:].partition("=")
                if node.isdigit():
                    counts.append((int(node), int(pages)))
            elif tok.startswith("kernelpagesize_kB="):
                page_kb = int(tok[18:])
        for nid, npages in counts:
            nodes[nid] = nodes.get(nid, 0) + npages * page_kb * 1024
    return nodes


def parse_limits_nofile(text: str) -> tuple[int | None, int | None]:
    for line in text.splitlines():
        if line.startswith("Max open files"):
            soft, hard = line[26:].split()[:2]
            return (None if soft == "unlimited" else int(soft),
                    None if hard == "unlimited" else int(hard))
    return None, None


def _cpuset(text: Any) -> frozenset[int]:
    if isinstance(text, (list, tuple, set, frozenset)):
        return frozenset(int(x) for x in text)
    if not text:
        return frozenset()
    try:
        return parse_cpulist(str(text))
    except CpuListError:
        return frozenset()


@dataclass
class _JobState:
    t: float
    ticks: int
    read_bytes: int | None
    write_bytes: int | None
    numa: dict[int, int] | None = None
    runnable: int | None = None
    status: dict[str, int] | None = None
    torch: dict[str, Any] | None = None
    slow_at: int = -1


class JobSampler:
    def __init__(self, proc_root: Path = Path("/proc"), runtime_dir: Path | None = None,
                 slow_every: int = 10, node_cpus: dict[int, frozenset[int]] | None = None
                 ) -> None:
        self.proc = Path(proc_root)
        # NUMA node -> its CPUs: a job bound without --mems counts as local the nodes of
        # its CPUs (the kernel allocates there first under the default policy)
        self.node_cpus = node_cpus or {}
        self.runtime_dir = runtime_dir
        self.slow_every = max(1, slow_every)
        self._state: dict[tuple[Any, Any], _JobState] = {}
        self._cycle = 0

    def sample(self, records: list[dict[str, Any]], gpu: dict[str, Any],
               host: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """One sample per bound job record; a job that is gone is left out.

        ``gpu`` and ``host`` are this cycle's samples: GPU memory per pid, utilization
        of the job's GPUs and the busy share of the job's CPUs come from them.
        """
        self._cycle += 1
        gpu_mem: dict[int, float] = {}
        for p in gpu.get("processes") or []:
            if p.get("used_memory_bytes") is not None:
                gpu_mem[p["pid"]] = gpu_mem.get(p["pid"], 0.0) + p["used_memory_bytes"]
        gpu_util = {g["gpu"]: g.get("utilization_ratio") for g in gpu.get("gpus") or []}
        cpu_busy = {c["cpu"]: c["busy_ratio"] for c in (host or {}).get("cpus") or []
                    if c.get("busy_ratio") is not None}
        out = []
        seen = set()
        for rec in records:
            try:
                s = self._one(rec, gpu_mem, gpu_util, cpu_busy)
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited between the registry's snapshot and this read
            except (OSError, ValueError, IndexError) as err:
                s = {"pid": rec.get("pid"), "name": rec.get("name"),
                     "error": f"{type(err).__name__}: {err}"}
            if s is not None:
                out.append(s)
                seen.add((rec.get("pid"), rec.get("start_time")))
        for key in list(self._state):
            if key not in seen:
                del self._state[key]
        return out

    def _one(self, rec: dict[str, Any], gpu_mem: dict[int, float],
             gpu_util: dict[int, float | None],
             cpu_busy: dict[int, float]) -> dict[str, Any] | None:
        pid = int(rec["pid"])
        base = f"{self.proc}/{pid}"  # str paths: pathlib joins were ~15% of a cycle
        st = parse_stat(_read(f"{base}/stat"))
        want_start = rec.get("start_time")
        if isinstance(want_start, int) and want_start != st["start_time"]:
            return None  # PID reused by another process: not our job any more
        try:
            io: dict[str, int] | None = parse_io(_read(f"{base}/io"))
        except PermissionError:
            io = None
        now = time.monotonic()
        ticks = st["utime"] + st["stime"]
        key = (pid, rec.get("start_time"))
        prev = self._state.get(key)
        rb = io.get("read_bytes") if io else None
        wb = io.get("write_bytes") if io else None
        cur = _JobState(now, ticks, rb, wb)
        if prev is not None:
            cur.numa, cur.runnable, cur.torch = prev.numa, prev.runnable, prev.torch
            cur.status = prev.status
            cur.slow_at = prev.slow_at
        cpus = _cpuset(rec.get("cpus"))
        mems = _cpuset(rec.get("mems")) or frozenset(
            n for n, ncpus in self.node_cpus.items() if ncpus & cpus)
        if prev is None or self._cycle - cur.slow_at >= self.slow_every:
            # jobs bound together would all take their costly reads in the same cycle;
            # offsetting by pid spreads them over the slow period (the first read is
            # still immediate)
            cur.slow_at = self._cycle - (pid % self.slow_every if prev is None else 0)
            cur.numa = self._numa(base)
            cur.runnable = self._runnable(base)
            cur.status = parse_status(_read(f"{base}/status"))
            cur.torch = self._torch(pid, cur.status.get("uid"))
        self._state[key] = cur

        cores = rd_bps = wr_bps = None
        if prev is not None and now > prev.t:
            dt = now - prev.t
            cores = (ticks - prev.ticks) / CLK_TCK / dt
            if rb is not None and prev.read_bytes is not None:
                rd_bps = max(0, rb - prev.read_bytes) / dt
            if wb is not None and prev.write_bytes is not None:
                wr_bps = max(0, wb - prev.write_bytes) / dt
        status = cur.status or {}
        numa_total = sum(cur.numa.values()) if cur.numa else 0
        locality = (sum(b for n, b in cur.numa.items() if n in mems) / numa_total
                    if cur.numa and mems and numa_total else None)
        soft, hard = self._nofile(pid, base)
        gpus = [int(g) for g in rec.get("gpus") or []]
        utils = [u for g in gpus if (u := gpu_util.get(g)) is not None]
        return {
            "pid": pid, "start_time": rec.get("start_time"), "name": rec.get("name"),
            "local_nodes": sorted(mems),
            "uid": status.get("uid"), "cpu_seconds_total": ticks / CLK_TCK,
            "cpus": rec.get("cpus"), "mems": rec.get("mems"), "gpus": gpus,
            "ncpus": len(cpus) or None,
            "cpu_cores": cores,
            "cpu_ratio": cores / len(cpus) if cores is not None and cpus else None,
            # busy share of the job's CPUs from /proc/stat: unlike cpu_ratio it includes
            # the job's children (DataLoader workers are processes, not threads)
            "cpus_busy_ratio": sum(busy) / len(busy) if (busy := [
                cpu_busy[c] for c in cpus if c in cpu_busy]) else None,
            "threads": st["threads"], "state": st["state"],
            "runnable_threads": cur.runnable,
            "rss_bytes": st["rss_pages"] * PAGE_SIZE,
            "numa_bytes": {str(n): b for n, b in sorted((cur.numa or {}).items())},
            "locality_ratio": locality,
            "read_bytes_total": rb, "write_bytes_total": wb,
            "read_bytes_per_second": rd_bps, "write_bytes_per_second": wr_bps,
            "voluntary_ctxt_switches_total": status.get("voluntary_ctxt_switches"),
            "nonvoluntary_ctxt_switches_total": status.get("nonvoluntary_ctxt_switches"),
            "open_fds": self._fds(base), "nofile_soft": soft, "nofile_hard": hard,
            "gpu_memory_bytes": gpu_mem.get(pid),
            "gpu_utilization_ratio": sum(utils) / len(utils) if utils else None,
            "torch": cur.torch,
        }

    # -- sources -------------------------------------------------------------
    @staticmethod
    def _fds(base: str) -> int | None:
        try:
            # Linux >= 6.2 reports the number of open fds as the size of /proc/PID/fd
            # (commit f1f1f2569901), which is one stat() instead of a directory listing.
            n = os.stat(f"{base}/fd").st_size
            return n if n > 0 else len(os.listdir(f"{base}/fd"))
        except OSError:
            return None

    @staticmethod
    def _nofile(pid: int, base: str) -> tuple[int | None, int | None]:
        try:
            soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
            inf = resource.RLIM_INFINITY
            return (None if soft == inf else soft, None if hard == inf else hard)
        except (OSError, ValueError):
            try:
                return parse_limits_nofile(_read(f"{base}/limits"))
            except OSError:
                return None, None

    @staticmethod
    def _numa(base: str) -> dict[int, int] | None:
        try:
            return parse_numa_maps(_read(f"{base}/numa_maps"))
        except (OSError, ValueError):
            return None  # kernel without CONFIG_NUMA, or no permission

    @staticmethod
    def _runnable(base: str) -> int | None:
        try:
            tids = os.listdir(f"{base}/task")
        except OSError:
            return None
        n = 0
        for tid in tids:
            try:
                text = _read(f"{base}/task/{tid}/stat")
            except OSError:
                continue
            if text[text.rindex(")") + 2] == "R":
                n += 1
        return n

    def _torch(self, pid: int, uid: int | None) -> dict[str, Any] | None:
        """Memory stats a job publishes with ``tunerd.torch`` (see that module)."""
        if self.runtime_dir is None:
            return None
        path = self.runtime_dir / "jobs" / f"{pid}.json"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            # the jobs dir is world-writable (sticky): trust only the job owner's file
            if st.st_uid not in (uid, 0) or st.st_size > TORCH_STATS_MAX:
                return None
            data = json.loads(os.read(fd, TORCH_STATS_MAX))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        return data if isinstance(data, dict) else None


def _read(path: str | Path) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")
