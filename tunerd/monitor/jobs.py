"""Per-job sampler: only the processes tunerd bound (never a sweep of every PID).

Cheap sources are read every cycle (/proc/PID/stat — which also has the RSS —,
/proc/PID/io, the fd count); the costly or rarely changing ones every ``slow_every``
cycles, their last value carried between reads: numa_maps walks the page tables of
the whole process, per-thread task/*/stat reads grow with the thread count,
/proc/PID/status (context switches, uid) costs as much to generate as the other
per-cycle files together (measured: ~25 us a read), and the fd limit (prlimit).

The per-cycle files of up to MAX_OPEN_JOBS jobs (stat, io, the main thread's
children) stay open and are read again with pread(2) at offset 0, which makes procfs
render them anew: an open of a /proc file costs more than its read (path walk, pid
lookup), and an fd keeps naming the process it was opened for (after its exit a read
fails with ESRCH, it never reads a new process that got the pid). The children of
the job's other threads are listed on its slow reads (every ``slow_every`` cycles);
between them a worker they had is followed while it is still the job's child.

A job that has not changed is not read again: where its stat is byte for byte the one
of its last read (no CPU time to the tick, no page fault, no other state, not moved:
the process did not run for any time the kernel counts) and it has no child, the
cycle reuses its last sample with its CPU and I/O rates at zero and the host's and
GPUs' parts of this cycle (``_quiet``); /proc/PID/io, the fd count and the children
are not read. Its counters cannot move without it running, and a full read comes at
least every QUIET_EVERY cycles (and at every slow read) all the same: an idle job
costs one stat and one children read a cycle instead of the whole sample
(bench/job_sampler_cycle.py), and every other cycle (unless someone watches the live
view) not even those: its last sample stands, as for a job waiting for its turn, so
a change is seen one cycle late at most. A slow read of such a job carries what only
its threads change (their children and states, uid, context switches) and reads the
rest.

The other reads go through :class:`tunerd.adapters.procfs.Process`. psutil's ``oneshot()``
reads the same files (and statm for the RSS) but costs two to four times as
much per job (bench/procfs_readers.py), so it is not used here.

Training-side numbers (step time, throughput, torch memory) are not read from
any file: jobs send them with the control-socket command ``report``
(tunerd.torch's StepReporter) and the daemon hands the latest report per pid to
:meth:`JobSampler.sample`. A file in a user-writable directory could be a FIFO
that blocks the sampler in open(); a message cannot.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunerd.adapters.procfs import (
    CLK_TCK,
    PAGE_SIZE,
    PROC,
    SMALL_READ,
    Process,
    _read_once,
    parse_io,
    parse_stat,
)
from tunerd.base.cpulist import CpuListError, parse_cpulist
from tunerd.base.errors import Failed, NoSuchProcess, PermissionDenied, TunerdError
from tunerd.monitor.reports import Report

__all__ = ["JobSampler", "torch_from_report"]

def torch_from_report(report: Report, now: float | None = None) -> dict[str, Any]:
    """The ``torch`` part of a job sample from the latest ``report`` of its process.

    The report was validated when it arrived (:func:`tunerd.monitor.reports.parse_report`).
    ``devices`` repeats the CUDA memory in the per-device shape that the history and
    ``advise`` read.
    """
    out = report.to_json()
    out["age_seconds"] = max(0.0, (now or time.time()) - report.time)
    out["devices"] = []
    memory = out["memory"]
    if report.device == "cuda" and "reserved" in memory and "allocated" in memory:
        out["devices"] = [{"device": report.local_rank,
                           "reserved_bytes": memory["reserved"],
                           "allocated_bytes": memory["allocated"],
                           "max_allocated_bytes": memory.get("max_allocated")}]
    return out


def _cpuset(text: Any) -> frozenset[int]:
    if isinstance(text, (list, tuple, set, frozenset)):
        return frozenset(int(x) for x in text)
    if not text:
        return frozenset()
    return _parse_cached(str(text))


@functools.lru_cache(maxsize=256)
def _parse_cached(text: str) -> frozenset[int]:
    """Bound jobs keep their CPU lists: parse each once, not every cycle."""
    try:
        return parse_cpulist(text)
    except CpuListError:
        return frozenset()


MAX_CHILDREN = 256  # child processes of one job sampled per cycle (its DataLoader workers)
# Jobs read per cycle, at most: beyond that they take turns and the others keep their
# last sample, so the sampler's cost stays flat however many processes are bound
# (620 bound sleeps cost 41-58 ms/s of daemon CPU when every job was read every
# second; issue 15). A new job is read at once, the others round-robin.
JOBS_PER_CYCLE = 16
NUMA_EVERY = 3  # numa_maps at most every third slow cycle (every ~30 s at 1 s sampling)
MAX_OPEN_JOBS = 64  # jobs whose per-cycle files stay open (3 fds each)
QUIET_EVERY = 5  # an unchanged job is read in full at least every 5th cycle anyway
Key = tuple[Any, Any]  # (pid, start time) of a job record
_MISSING = object()


class _OpenFiles:
    """A job's per-cycle /proc files, opened once and read with pread(2) at offset 0."""

    __slots__ = ("base", "fds", "pid")

    def __init__(self, proc: str, pid: int) -> None:
        self.pid = pid
        self.base = f"{proc}/{pid}"
        self.fds: dict[str, int] = {}

    def read(self, name: str) -> bytes:
        """``name`` under /proc/PID (OSError as os.open and os.pread raise it)."""
        fd = self.fds.get(name)
        if fd is None:
            fd = os.open(f"{self.base}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            self.fds[name] = fd
        return os.pread(fd, SMALL_READ, 0)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


@dataclass
class _JobState:
    t: float
    ticks: int
    read_bytes: int | None
    write_bytes: int | None
    numa: dict[int, int] | None = None
    runnable: int | None = None
    uid: int | None = None
    ctx: tuple[int, int] | None = None
    slow_at: int = -1  # ``reads`` at the last slow read
    slow_count: int = 0  # slow reads so far (numa_maps on every NUMA_EVERY-th)
    reads: int = 0  # reads of this job so far (one per cycle, or per turn)
    workers: dict[int, tuple[int, int]] | None = None  # child pid -> (start time, ticks)
    kids: tuple[int, ...] = ()  # the job's own children (level 0) at the last read
    nofile: tuple[int | None, int | None] = (None, None)  # RLIMIT_NOFILE, slow cadence
    # the parts of a sample that only change with the record or a slow read, kept
    # between cycles instead of built anew: (cpus, mems, gpus) of the record ->
    # (cpu set, local nodes, sorted local nodes, gpu list); numa -> (numa_bytes, locality)
    fixed: tuple[Any, ...] | None = None
    numa_out: tuple[Any, ...] | None = None
    proc: Process | None = None
    raw: bytes = b""  # /proc/PID/stat as the last full read had it
    # /proc/PID/stat at the last slow read: what a slow read carries (the children of
    # every thread, states, uid) was listed then, not at the last full read
    slow_raw: bytes = b""
    quiet: int = 0  # cycles since then that reused the last sample (see _quiet)


class JobSampler:
    def __init__(self, proc_root: Path | str = PROC, slow_every: int = 10,
                 node_cpus: dict[int, frozenset[int]] | None = None,
                 jobs_per_cycle: int = JOBS_PER_CYCLE) -> None:
        self.proc = str(proc_root)
        # NUMA node -> its CPUs: a job bound without --mems counts as local the nodes of
        # its CPUs (the kernel allocates there first under the default policy)
        self.node_cpus = node_cpus or {}
        self.slow_every = max(1, slow_every)
        self._state: dict[tuple[Any, Any], _JobState] = {}
        self._cycle = 0
        self.jobs_per_cycle = max(1, jobs_per_cycle)
        self._last: dict[tuple[Any, Any], dict[str, Any]] = {}  # the last sample per job
        self._turn = 0  # round-robin position among the jobs read before
        self._open: dict[tuple[Any, Any], _OpenFiles] = {}  # up to MAX_OPEN_JOBS jobs
        self._records: list[dict[str, Any]] | None = None  # the list _index is of
        self._index: tuple[list[Key], dict[Key, int]] = ([], {})
        self._torch_set = False  # a sample's torch field was set from a report
        self._rest = False  # this cycle, unchanged jobs keep their last sample unread
        # this cycle's CPU busy map -> {cpu set: mean busy share}
        self._busy_cache: tuple[dict[int, float], dict[frozenset[int], float | None]] = (
            {}, {})

    def close(self) -> None:
        """Close the files kept open (the sampler's thread, or after it stopped)."""
        for f in self._open.values():
            f.close()
        self._open.clear()

    def _files(self, key: tuple[Any, Any], pid: int) -> _OpenFiles | None:
        f = self._open.get(key)
        if f is None and len(self._open) < MAX_OPEN_JOBS:
            f = self._open[key] = _OpenFiles(self.proc, pid)
        return f

    def _forget(self, key: tuple[Any, Any]) -> None:
        f = self._open.pop(key, None)
        if f is not None:
            f.close()

    def _keys(self, records: list[dict[str, Any]]) -> tuple[list[Key], dict[Key, int]]:
        """(pid, start time) of each record, and the index of each key: worked out again
        only for a new list (the Monitor hands the same one while no binding changes)."""
        if records is not self._records or len(records) != len(self._index[0]):
            keys: list[Key] = [(r.get("pid"), r.get("start_time")) for r in records]
            self._records, self._index = records, (keys, {k: i for i, k in enumerate(keys)})
        return self._index

    def _pick(self, records: list[dict[str, Any]]) -> set[int]:
        """Indexes of the records to read this cycle: all of them up to the budget;
        beyond it, every job not read yet and the next ``jobs_per_cycle`` of the
        others in turn."""
        n = len(records)
        if n <= self.jobs_per_cycle:
            return set(range(n))
        keys, index = self._keys(records)
        if len(index) == n:  # (a set difference: no Python loop over every job)
            pick = {index[k] for k in index.keys() - self._last.keys()}
        else:  # the same job twice in the list
            pick = {i for i, k in enumerate(keys) if k not in self._last}
        start = self._turn % n
        i, taken = start, 0
        while taken < self.jobs_per_cycle:
            if i not in pick:
                pick.add(i)
                taken += 1
            i = (i + 1) % n
            if i == start:
                break
        self._turn = i
        return pick

    def sample(self, records: list[dict[str, Any]], gpu: dict[str, Any],
               host: dict[str, Any] | None = None,
               reports: Mapping[int, Report] | None = None,
               watched: bool = False) -> list[dict[str, Any]]:
        """One sample per bound job record; a job that is gone is left out.

        ``gpu`` and ``host`` are this cycle's samples: GPU memory per pid, utilization
        of the job's GPUs and the busy share of the job's CPUs come from them.
        ``reports``: pid -> the latest ``report`` that process sent (one of an
        earlier process with the same pid, by its start time, is ignored). Each
        job's ``torch`` field is built from its report (:func:`torch_from_report`),
        or None without one. A job its last read found unchanged is read every other
        cycle only, unless ``watched`` (someone reads the live view: every job is read)
        or more than ``jobs_per_cycle`` are bound (they take turns instead).
        """
        self._cycle += 1
        # (not where jobs take turns already: a turn is not to be spent unread)
        self._rest = (not watched and self._cycle % 2 == 0
                      and len(records) <= self.jobs_per_cycle)
        gpu_mem: dict[int, float] = {}
        for p in gpu.get("processes") or []:
            if p.get("used_memory_bytes") is not None:
                gpu_mem[p["pid"]] = gpu_mem.get(p["pid"], 0.0) + p["used_memory_bytes"]
        gpu_util = {g["gpu"]: g.get("utilization_ratio") for g in gpu.get("gpus") or []}
        cpu_busy = {c["cpu"]: c["busy_ratio"] for c in (host or {}).get("cpus") or []
                    if c.get("busy_ratio") is not None}
        now = time.time()
        keys, _ = self._keys(records)
        last = self._last
        gone: set[Key] = set()  # read this cycle and found gone (or the pid reused)
        for i in sorted(self._pick(records)):
            rec, key = records[i], keys[i]
            try:
                s = self._one(rec, gpu_mem, gpu_util, cpu_busy)
            except NoSuchProcess:
                s = None  # exited between the registry's snapshot and this read
            except (TunerdError, ValueError, TypeError, KeyError) as err:
                msg = err.message if isinstance(err, TunerdError) else f"{err!r}"
                s = {"pid": rec.get("pid"), "name": rec.get("name"), "error": msg}
            if s is None:
                gone.add(key)
                last.pop(key, None)
            else:
                last[key] = s
        # the others: their last sample, the same dict (a copy of 620 of them each
        # cycle was a third of the sampler's time; only ``torch`` changes)
        out = [s for k in keys if (s := last.get(k)) is not None]
        if reports or self._torch_set:
            for s in out:
                if "error" not in s:
                    s["torch"] = self._torch(s, reports, now)
            self._torch_set = bool(reports)
        # jobs that ended (set differences: no Python loop over every job each cycle)
        seen = set(keys) - gone
        for key in self._state.keys() - seen:
            del self._state[key]
        for key in last.keys() - seen:
            del last[key]
        for key in self._open.keys() - seen:
            self._forget(key)
        return out

    def _alive(self, pid: int) -> bool:
        """Whether ``pid`` still runs, for a cycle that does not read it (one kill(pid, 0),
        no /proc read; a tree other than the real /proc: its directory). A job that
        exited is then read, found gone and left out, as the sampler promises."""
        if self.proc != PROC:
            return os.path.isdir(f"{self.proc}/{pid}")
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # another user's: it exists
        return True

    @staticmethod
    def _torch(s: dict[str, Any], reports: Mapping[int, Report] | None,
               now: float) -> dict[str, Any] | None:
        rep = reports.get(s["pid"]) if reports else None
        if rep is None:
            return None
        if rep.start_time is not None and rep.start_time != s["start_time"]:
            return None  # sent by an earlier process with this pid
        return torch_from_report(rep, now)

    def _one(self, rec: dict[str, Any], gpu_mem: dict[int, float],
             gpu_util: dict[int, float | None],
             cpu_busy: dict[int, float]) -> dict[str, Any] | None:
        pid = int(rec["pid"])
        want_start = rec.get("start_time")
        key = (pid, want_start)
        prev = self._state.get(key)
        if prev is not None and prev.quiet and self._rest:
            # found unchanged at its last read: every other cycle it is not read at all
            # (its last sample stands, as for jobs waiting for their turn); a skipped
            # cycle counts towards the full read due every QUIET_EVERY-th and the slow one
            last = self._last.get(key)
            fixed = prev.fixed
            if (last is not None and prev.quiet + 1 < QUIET_EVERY
                    and prev.reads + 1 - prev.slow_at < self.slow_every
                    and _same_record(fixed, rec) and self._alive(pid)):
                prev.quiet += 1
                prev.reads += 1
                return last
        proc = prev.proc if prev is not None and prev.proc is not None \
            else Process(pid, self.proc)
        files = self._files(key, pid)
        if files is None:
            raw, st = b"", proc.stat()
        else:
            raw = self._read(proc, files, "stat")
            if prev is not None and raw == prev.raw and not prev.kids:
                quiet = self._quiet(prev, key, rec, pid, files, gpu_mem, gpu_util, cpu_busy)
                if quiet is not None:
                    return quiet
            st = parse_stat(raw)
        if isinstance(want_start, int) and want_start != st.start_time:
            return None  # PID reused by another process: not our job any more
        rb: int | None
        wb: int | None
        try:
            if files is None:
                io = proc.io_counters()
                rb, wb = io.read_bytes, io.write_bytes
            else:
                rb, wb = _io_bytes(self._read(proc, files, "io"))
        except PermissionDenied:
            rb = wb = None
        now = time.monotonic()
        ticks = st.utime + st.stime
        if prev is None:
            cur = _JobState(now, ticks, rb, wb, proc=proc)
            prev_t: float | None = None
            prev_ticks = prev_rb = prev_wb = None
            prev_workers = None
        else:  # one state per job, updated in place (the last values kept first)
            cur = prev
            prev_t, prev_ticks, prev_rb, prev_wb = cur.t, cur.ticks, cur.read_bytes, \
                cur.write_bytes
            prev_workers = cur.workers
            cur.t, cur.ticks, cur.read_bytes, cur.write_bytes = now, ticks, rb, wb
            cur.reads += 1
        # unchanged since its last slow read (the same stat, no child): on a slow read,
        # its threads' children and states, uid and context switches are carried (none
        # can change while no thread of it runs); the fd limit and numa_maps are read.
        # Compared with the stat of the last *slow* read, where they were listed: a
        # worker a live non-main thread started before the last (not slow) full read is
        # seen by no full read but a slow one
        still = prev is not None and bool(raw) and raw == prev.slow_raw and not prev.kids
        cur.raw, cur.quiet = raw, 0
        slow = prev is None or cur.reads - cur.slow_at >= self.slow_every
        if slow:
            cur.slow_raw = raw
        if (slow and not still) or files is None or prev is None:
            # one listing of the threads for their children and, on a slow read, states
            kids, runnable = _threads(proc, slow)
            if slow:
                cur.runnable = runnable
        else:  # the main thread's children, and the others' seen at the last slow read
            try:
                main = _ids(files.read(f"task/{pid}/children"))
            except OSError:  # no CONFIG_PROC_CHILDREN; an exit shows at the next stat
                main = []
            kids = main + [k for k in prev.kids if k not in main]
        workers = self._workers(proc, kids, prev_workers, now, prev_t)
        cur.workers, cur.kids = workers["ticks"], workers["kids"]
        rec_cpus, rec_mems, rec_gpus = rec.get("cpus"), rec.get("mems"), rec.get("gpus")
        fixed = cur.fixed
        if fixed is None or fixed[0] != rec_cpus or fixed[1] != rec_mems \
                or fixed[2] != rec_gpus:
            cpus = _cpuset(rec_cpus)
            mems = _cpuset(rec_mems) or frozenset(
                n for n, ncpus in self.node_cpus.items() if ncpus & cpus)
            fixed = cur.fixed = (rec_cpus, rec_mems, rec_gpus, cpus, mems, sorted(mems),
                                 [int(g) for g in rec_gpus or []])
            cur.numa_out = None
        cpus, mems, local_nodes, gpus = fixed[3], fixed[4], fixed[5], fixed[6]
        if slow:
            # jobs bound together would all take their costly reads in the same cycle;
            # offsetting by pid spreads them over the slow period (the first read is
            # still immediate). Counted in reads of this job, not cycles: a job read
            # in turn (more than JOBS_PER_CYCLE bound) is not read slowly every time.
            cur.slow_at = cur.reads - (pid % self.slow_every if prev is None else 0)
            if len(self.node_cpus) > 1:
                # numa_maps walks the page tables of the whole process (1-2 ms for a
                # 32 MiB job, far more for a training job): only where there is more
                # than one node to be remote from, and only every NUMA_EVERY slow cycles
                cur.slow_count = cur.slow_count + 1 if prev is not None else 0
                if cur.slow_count % NUMA_EVERY == 0:
                    cur.numa = _optional(proc.numa_bytes)  # None without permission
            else:  # one NUMA node: every page is local, nothing to read
                cur.numa = None
            # the fd limit changes rarely (prlimit from outside): read with the slow ones
            cur.nofile = _optional(proc.nofile) or (None, None)
            if not still:
                cur.uid, cur.ctx = _uid_ctx(proc)
        if prev is None:
            self._state[key] = cur

        cores = rd_bps = wr_bps = None
        if prev_t is not None and prev_ticks is not None and now > prev_t:
            dt = now - prev_t
            cores = (ticks - prev_ticks) / CLK_TCK / dt
            if rb is not None and prev_rb is not None:
                rd_bps = max(0, rb - prev_rb) / dt
            if wb is not None and prev_wb is not None:
                wr_bps = max(0, wb - prev_wb) / dt
        numa_out = cur.numa_out
        if numa_out is None or numa_out[0] is not cur.numa:
            numa = cur.numa
            numa_total = sum(numa.values()) if numa else 0
            locality = (sum(b for n, b in numa.items() if n in mems) / numa_total
                        if numa and mems and numa_total
                        else 1.0 if len(self.node_cpus) <= 1 else None)
            numa_out = cur.numa_out = (numa, {str(n): b for n, b in sorted(
                (numa or {}).items())}, locality)
        numa_bytes, locality = numa_out[1], numa_out[2]
        soft, hard = cur.nofile
        utils = [u for g in gpus if (u := gpu_util.get(g)) is not None] if gpus else None
        return {
            "pid": pid, "start_time": st.start_time, "name": rec.get("name"),
            "local_nodes": local_nodes,
            "uid": cur.uid, "cpu_seconds_total": ticks / CLK_TCK,
            "cpus": rec_cpus, "mems": rec_mems, "gpus": gpus,
            "ncpus": len(cpus) or None,
            "cpu_cores": cores,
            "cpu_ratio": cores / len(cpus) if cores is not None and cpus else None,
            # busy share of the job's CPUs from /proc/stat: unlike cpu_ratio it includes
            # the job's children (DataLoader workers are processes, not threads)
            "cpus_busy_ratio": self._busy(cpus, cpu_busy),
            "threads": st.num_threads, "state": st.state,
            "runnable_threads": cur.runnable,
            "rss_bytes": st.rss_pages * PAGE_SIZE,
            "numa_bytes": numa_bytes,
            "locality_ratio": locality,
            "read_bytes_total": rb, "write_bytes_total": wb,
            "read_bytes_per_second": rd_bps, "write_bytes_per_second": wr_bps,
            "voluntary_ctxt_switches_total": cur.ctx[0] if cur.ctx else None,
            "nonvoluntary_ctxt_switches_total": cur.ctx[1] if cur.ctx else None,
            "open_fds": _optional(proc.num_fds), "nofile_soft": soft, "nofile_hard": hard,
            "gpu_memory_bytes": gpu_mem.get(pid),
            "gpu_utilization_ratio": sum(utils) / len(utils) if utils else None,
            "torch": None,
            # its worker processes (DataLoader workers are processes, not threads)
            "workers": workers["n"], "worker_pids": workers["pids"],
            "workers_cpu_cores": workers["cores"], "workers_rss_bytes": workers["rss"],
            "tree_cpu_cores": (None if cores is None else cores + (workers["cores"] or 0.0)),
            "tree_cpu_ratio": (None if cores is None or not cpus
                               else (cores + (workers["cores"] or 0.0)) / len(cpus)),
            # processes and threads of the job and its workers that are running or
            # waiting for a CPU now
            "tree_runnable": (cur.runnable if cur.runnable is not None
                              else int(st.state == "R")) + workers["runnable"],
        }

    def _quiet(self, cur: _JobState, key: Key, rec: dict[str, Any], pid: int,
               files: _OpenFiles, gpu_mem: dict[int, float], gpu_util: dict[int, float | None],
               cpu_busy: dict[int, float]) -> dict[str, Any] | None:
        """The sample of a job whose stat has not changed since its last full read and
        that had no child then: the last sample, with no CPU time and no I/O since and
        this cycle's host and GPU parts; None where it must be read in full (a slow read
        or the QUIET_EVERY-th cycle is due, its record changed, it has a child now)."""
        last = self._last.get(key)
        fixed = cur.fixed
        if (last is None or "error" in last or fixed is None
                or cur.quiet + 1 >= QUIET_EVERY
                or cur.reads + 1 - cur.slow_at >= self.slow_every
                or not _same_record(fixed, rec)):
            return None
        try:
            if files.read(f"task/{pid}/children").strip():
                return None  # a worker since: read in full
        except OSError:
            pass  # as the full read: no CONFIG_PROC_CHILDREN, or gone (next stat says)
        cur.t = time.monotonic()  # the ticks did not move: the next rate starts here
        cur.reads += 1
        cur.quiet += 1
        cpus, gpus = fixed[3], fixed[6]
        utils = [u for g in gpus if (u := gpu_util.get(g)) is not None] if gpus else None
        ratio = 0.0 if cpus else None
        return {**last, "cpu_cores": 0.0, "cpu_ratio": ratio,
                "cpus_busy_ratio": self._busy(cpus, cpu_busy),
                "read_bytes_per_second": None if last["read_bytes_total"] is None else 0.0,
                "write_bytes_per_second": None if last["write_bytes_total"] is None else 0.0,
                "gpu_memory_bytes": gpu_mem.get(pid),
                "gpu_utilization_ratio": sum(utils) / len(utils) if utils else None,
                "torch": None, "workers_cpu_cores": 0.0, "tree_cpu_cores": 0.0,
                "tree_cpu_ratio": ratio}

    def _busy(self, cpus: frozenset[int], cpu_busy: dict[int, float]) -> float | None:
        """Mean busy share of ``cpus``: worked out once per cycle per CPU set (jobs
        bound to the same CPUs share it)."""
        cache = self._busy_cache
        if cache[0] is not cpu_busy:
            cache = self._busy_cache = (cpu_busy, {})
        out = cache[1].get(cpus, _MISSING)
        if out is _MISSING:
            busy = [cpu_busy[c] for c in cpus if c in cpu_busy]
            out = cache[1][cpus] = sum(busy) / len(busy) if busy else None
        return out  # type: ignore[return-value]

    @staticmethod
    def _read(proc: Process, files: _OpenFiles, name: str) -> bytes:
        try:
            return files.read(name)
        except OSError as err:
            raise proc._error(err) from err

    def _workers(self, proc: Process, todo: list[int],
                 prev: dict[int, tuple[int, int]] | None, now: float,
                 prev_t: float | None) -> dict[str, Any]:
        """The job's child processes (two levels: a worker may fork its own helpers),
        from ``todo``, the job's children (a pid that is no longer its child is left out).

        One stat read per child per cycle; at most MAX_CHILDREN of them.
        """
        ticks: dict[int, tuple[int, int]] = {}
        runnable = rss = 0
        delta = 0
        kids: list[int] = []
        level = 0
        while todo and level < 2 and len(ticks) < MAX_CHILDREN:
            nxt: list[int] = []
            for pid in todo[:MAX_CHILDREN - len(ticks)]:
                child = Process(pid, self.proc)
                try:
                    cst = child.stat()
                except TunerdError:
                    continue
                if level == 0:
                    if cst.ppid != proc.pid:
                        continue  # exited and the pid reused, or re-parented
                    kids.append(pid)
                t = cst.utime + cst.stime
                ticks[pid] = (cst.start_time, t)
                old = prev.get(pid) if prev else None
                if old is not None and old[0] == cst.start_time:
                    delta += max(0, t - old[1])
                runnable += int(cst.state == "R")
                rss += cst.rss_pages * PAGE_SIZE
                if level == 0:
                    try:
                        nxt += child.children()
                    except TunerdError:
                        pass
            todo, level = nxt, level + 1
        cores = (delta / CLK_TCK / (now - prev_t)
                 if prev is not None and prev_t is not None and now > prev_t else None)
        return {"n": len(ticks), "pids": sorted(ticks)[:64], "ticks": ticks,
                "kids": tuple(kids),
                "cores": cores if ticks else (0.0 if prev is not None else None),
                "rss": rss, "runnable": runnable}


def _same_record(fixed: tuple[Any, ...] | None, rec: dict[str, Any]) -> bool:
    """The record's CPUs, nodes and GPUs are the ones ``fixed`` was built for."""
    return (fixed is not None and fixed[0] == rec.get("cpus") and fixed[1] == rec.get("mems")
            and fixed[2] == rec.get("gpus"))


def _threads(proc: Process, states: bool) -> tuple[list[int], int | None]:
    """The children of every thread of ``proc`` (DataLoader workers are children of
    the thread that started them) and, with ``states``, how many threads are in state
    R now: one listing of /proc/PID/task for both. A process that is gone raises
    NoSuchProcess; without access, ([], None). Each thread's files are read once
    (one read(2) returns them whole); a thread that exited meanwhile is skipped."""
    base = f"{proc.root}/{proc.pid}/task"
    try:
        tids = os.listdir(base)
    except OSError as err:
        mapped = proc._error(err)
        if isinstance(mapped, NoSuchProcess):
            raise mapped from err
        return [], None
    kids: list[int] = []
    n = 0
    for tid in tids:
        try:
            kids += [int(x) for x in _read_once(f"{base}/{tid}/children").split()]
        except OSError:  # exited meanwhile, or no CONFIG_PROC_CHILDREN
            pass
        if states:
            try:
                raw = _read_once(f"{base}/{tid}/stat")
            except OSError:
                continue
            close = raw.rindex(b")")
            if raw[close + 2:close + 3] == b"R":
                n += 1
    return kids, n if states else None


def _uid_ctx(proc: Process) -> tuple[int, tuple[int, int]]:
    """Real uid and (voluntary, involuntary) context switches of the main thread, from
    one read of /proc/PID/status: only those three lines are parsed (the file has ~55).
    """
    try:
        raw = _read_once(f"{proc.root}/{proc.pid}/status")
    except OSError as err:
        raise proc._error(err) from err
    try:
        i = raw.index(b"\nUid:") + 5
        uid = int(raw[i:raw.index(b"\n", i)].split()[0])
        i = raw.index(b"\nvoluntary_ctxt_switches:") + 25
        vol = int(raw[i:raw.index(b"\n", i)])
        i = raw.index(b"\nnonvoluntary_ctxt_switches:") + 28
        nonvol = int(raw[i:raw.index(b"\n", i) if raw.find(b"\n", i) >= 0 else None])
    except (ValueError, IndexError) as err:
        raise Failed(f"unexpected content in {proc.root}/{proc.pid}/status: {err}",
                     pid=proc.pid) from err
    return uid, (vol, nonvol)


def _io_bytes(raw: bytes) -> tuple[int, int]:
    """(read_bytes, write_bytes) of /proc/PID/io: at their fixed places in the file
    (proc(5): rchar, wchar, syscr, syscw, read_bytes, write_bytes, ...) without the
    dict of every field; by name where the layout differs."""
    tok = raw.split()
    if len(tok) > 11 and tok[8] == b"read_bytes:" and tok[10] == b"write_bytes:":
        return int(tok[9]), int(tok[11])
    io = parse_io(raw.decode())
    return io.read_bytes, io.write_bytes


def _ids(raw: bytes) -> list[int]:
    return [int(x) for x in raw.split()]


def _optional(getter: Any) -> Any:
    """A source that may be unavailable for this process: None instead of an error
    (a vanished process still raises NoSuchProcess: the job is left out)."""
    try:
        return getter()
    except NoSuchProcess:
        raise
    except TunerdError:
        return None
