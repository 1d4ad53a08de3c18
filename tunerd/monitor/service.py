"""The Monitor service: samples GPUs, host and bound jobs on a timer; serves metrics.

Where the sampling runs, and why: a cycle is a few dozen reads of small procfs
files (well under a millisecond of CPU) plus NVML calls, but
NVML's PCIe throughput query sleeps ~20 ms per GPU inside the driver and
numa_maps of a large process walks its page tables. So each cycle runs in ONE
dedicated executor thread — the loop is never blocked and the samplers' own
state (previous counters) is only ever touched by that thread. The job list is
snapshotted on the loop before, and the finished sample is stored on the loop
after, so the daemon's state still changes on the loop only. A cycle that
overruns the interval delays the next one; cycles never overlap or pile up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from tunerd.monitor.facts import MAX_RANKS, FleetFacts
from tunerd.monitor.gpu import GpuSampler
from tunerd.monitor.history import History
from tunerd.monitor.host import HostSampler
from tunerd.monitor.jobs import JobSampler
from tunerd.monitor.listen import parse_listen
from tunerd.monitor.reports import Report, ReportStore

log = logging.getLogger("tunerd.monitor")

# Memory, PSI, disks and NICs (the costly part of a host sample: psutil's parsers) are
# read every HOST_FULL_SECONDS, and every cycle for WATCH_SECONDS after someone asked
# for the live view (``tunerctl top``); per-CPU times every cycle. A scrape reads
# values at most HOST_FULL_SECONDS old (their rates over that span).
HOST_FULL_SECONDS = 5.0
WATCH_SECONDS = 10.0


class BoundJobs(Protocol):
    """What the monitor needs of the job registry."""

    binds_total: int

    def jobs(self, live: bool = True) -> list[dict[str, Any]]: ...


class ErrorSink(Protocol):
    total: int

    def record(self, source: str, message: str, key: str | int | None = None, *,
               level: str = "error") -> None: ...


@dataclass(frozen=True)
class MonitorSettings:
    interval: float = 1.0  # seconds between samples
    history_seconds: float = 3600.0
    metrics_listen: str = "127.0.0.1:9464"  # or "off"


def rank_sample(records: list[dict[str, Any]], reports: Mapping[int, Report]
                ) -> tuple[list[dict[str, Any]], dict[int, Report]]:
    """Step time and throughput per rank from the StepReporter's reports (at most
    MAX_RANKS, the newest), and the reports of processes that ended (to forget)."""
    from tunerd import procfs
    from tunerd.errors import TunerdError

    if not reports:  # the common case: no job reports (no loop over 620 records)
        return [], {}
    bound = {int(r["pid"]) for r in records if "pid" in r}
    ended: dict[int, Report] = {}
    live: list[Report] = []
    for pid, rep in reports.items():
        try:
            alive = procfs.Process(pid).stat().start_time == rep.start_time \
                or rep.start_time is None
        except TunerdError:
            alive = False
        if not alive:
            ended[pid] = rep
        elif rep.step_time_s is not None or rep.samples_per_s is not None:
            live.append(rep)
    seen: set[tuple[str, str]] = set()
    out = []
    for rep in sorted(live, key=lambda r: -r.time):
        key = (rep.job or "", str(rep.rank) if rep.rank is not None else f"pid{rep.pid}")
        if key in seen:
            continue
        seen.add(key)
        out.append({"job": key[0], "rank": key[1], "pid": rep.pid,
                    "step_time_s": rep.step_time_s, "samples_per_s": rep.samples_per_s,
                    "bound": rep.pid in bound})
        if len(out) >= MAX_RANKS:
            break
    return out, ended


class Monitor:
    name = "monitor"

    def __init__(self, settings: MonitorSettings, jobs: BoundJobs, errors: ErrorSink, *,
                 reports: ReportStore | None = None,
                 daemon_facts: Callable[[], Mapping[str, float | None]] | None = None,
                 fleet: FleetFacts | None = None) -> None:
        self.settings = settings
        self.bound = jobs
        self.errors = errors
        self.reports = reports if reports is not None else ReportStore()
        # daemon-level numbers for the metrics (policy ok, rule failures, drift, ...)
        self.daemon_facts = daemon_facts or (lambda: {})
        # node class, versions, policy hash, NICs, nccl.conf: what the fleet compares
        self.fleet = fleet if fleet is not None else FleetFacts()
        self.interval = settings.interval
        self.listen: tuple[str, int] | None = None
        self.gpu = GpuSampler()
        self.host = HostSampler()
        self.host_full_every = max(1, round(HOST_FULL_SECONDS / self.interval))
        self._host_cycles = 0  # host samples taken (the sampler thread's)
        self._watched_until = 0.0  # monotonic: full host samples every cycle until then
        # numa_maps and per-thread states every ~10 s whatever the interval
        self.jobs = JobSampler(slow_every=max(1, round(10.0 / self.interval)),
                               node_cpus=self.host.node_cpus)
        self.history = History(settings.history_seconds, self.interval)
        self.latest: dict[str, Any] | None = None
        self.samples_total = 0
        self.last_cycle_at = time.monotonic()  # GET /healthz: the loop still samples
        self.sample_cpu_seconds_total = 0.0
        self._records: list[dict[str, Any]] = []  # job_records() while the version stays
        self._records_version: int | None = None
        self.sampler_status: dict[str, dict[str, Any]] = {
            n: {"ok": True, "errors": 0, "last_error": None} for n in ("gpu", "host", "jobs")}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tunerd-sampler")
        self._task: asyncio.Task[None] | None = None
        self._http: Any = None
        self.registry: Any = None
        self.metrics_error: str | None = None
        self.metrics_port: int | None = None
        self.metrics_address: str | None = None

    @property
    def errors_total(self) -> int:
        """Errors the daemon recorded since start (read by the metrics thread: one int)."""
        return self.errors.total

    # -- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client.process_collector import ProcessCollector

        from tunerd.monitor.collector import MonitorCollector

        # a bad value is a UsageError here, inside the daemon's start-up error handling
        self.listen = parse_listen(self.settings.metrics_listen)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(MonitorCollector(self))
        # tunerd_process_cpu_seconds_total, tunerd_process_resident_memory_bytes, ...
        ProcessCollector(namespace="tunerd", registry=self.registry)
        if self.listen is not None:
            self._start_http(*self.listen)
        await self.cycle()  # a first sample before anyone asks
        self._task = asyncio.ensure_future(self._run())

    def _start_http(self, host: str, port: int) -> None:
        from tunerd.monitor.http import serve_metrics

        try:
            self._http, _thread = serve_metrics(host, port, self.registry,
                                               health=self.health)
        except OSError as err:
            # monitoring is not worth refusing to tune the node for: report and go on
            self.metrics_error = f"cannot listen on {host}:{port}: {err.strerror or err}"
            self.errors.record("monitor", self.metrics_error, key="metrics", level="warning")
            return
        # the port the kernel gave, which differs from the one asked for when that was 0
        self.metrics_port = int(self._http.server_address[1])
        self.metrics_address = (f"[{host}]:{self.metrics_port}" if ":" in host
                                else f"{host}:{self.metrics_port}")
        log.info("Prometheus metrics on http://%s/metrics", self.metrics_address)

    def health(self) -> tuple[bool, str]:
        """Whether the loop still runs: a sample finished within 10 intervals (30 s at
        least). Asked from the HTTP thread (GET /healthz): reads one float."""
        age = time.monotonic() - self.last_cycle_at
        limit = max(30.0, 10 * self.interval)
        if age > limit:
            return False, f"no monitor sample for {age:.0f} s (limit {limit:.0f} s)"
        return True, "ok"

    async def policy_changed(self) -> None:
        return None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._http is not None:
            # BaseServer.shutdown() waits for serve_forever's next poll (up to 0.5 s):
            # let a daemon thread wait for it, so that SIGTERM ends the daemon at once
            http = self._http
            self._http = None

            def close() -> None:
                http.shutdown()
                http.server_close()

            threading.Thread(target=close, name="tunerd-metrics-stop", daemon=True).start()
        self._pool.shutdown(wait=False, cancel_futures=True)
        # the job sampler's open /proc files, once the thread's last cycle is done
        threading.Thread(target=self._close_sampler, name="tunerd-sampler-close",
                         daemon=True).start()

    def _close_sampler(self) -> None:
        self._pool.shutdown(wait=True)
        self.jobs.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.interval
            delay = next_at - loop.time()
            if delay < 0:  # overran: skip the missed ticks instead of catching up
                next_at = loop.time()
                delay = 0.0
            await asyncio.sleep(delay)
            try:
                await self.cycle()
            except Exception as err:  # never let one bad cycle end sampling
                log.exception("monitor cycle failed")
                self.errors.record("monitor", f"sampling cycle failed: {err!r}", key="cycle")

    # -- one cycle -----------------------------------------------------------
    def job_records(self) -> list[dict[str, Any]]:
        """The applied bound jobs; the same list (read only) while the registry's
        ``version`` stays (620 records rebuilt every cycle were a fifth of idle CPU)."""
        version = getattr(self.bound, "version", None)
        if version is not None and version == self._records_version:
            return self._records
        try:
            # jobs() builds new dicts: no copy needed
            records = [r for r in self.bound.jobs(live=False) if r.get("applied", True)]
        except Exception as err:
            log.warning("cannot list bound jobs: %r", err)
            return []
        self._records, self._records_version = records, version
        return records

    async def cycle(self) -> dict[str, Any]:
        records = self.job_records()
        loop = asyncio.get_running_loop()
        reports = self.reports.snapshot()
        sample = await loop.run_in_executor(self._pool, self.collect, records, reports)
        ended = sample.pop("ended_reports", None) or {}
        # back on the loop: publish and remember
        self.latest = sample
        self.last_cycle_at = time.monotonic()
        self.samples_total += 1
        self.sample_cpu_seconds_total += sample["cpu_seconds"]
        for name, st in sample["samplers"].items():
            s = self.sampler_status[name]
            s["ok"] = st is None
            if st is not None:
                s["errors"] += 1
                s["last_error"] = st
        self.history.add(sample)
        self.reports.drop(ended)
        return sample

    def collect(self, records: list[dict[str, Any]],
                reports: Mapping[int, Report] | None = None) -> dict[str, Any]:
        """One sample of everything (runs in the sampler thread)."""
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        failed: dict[str, str | None] = {}

        def guarded(name: str, fn: Callable[[], Any], fallback: Any) -> Any:
            try:
                out = fn()
                failed[name] = None
                return out
            except Exception as err:  # one sampler failing must not stop the others
                log.warning("%s sampler failed: %r", name, err)
                failed[name] = f"{type(err).__name__}: {err}"
                return fallback

        gpu = guarded("gpu", self.gpu.sample, {
            "available": False, "reason": "not available: sampler failed", "gpus": [],
            "processes": []})
        full = (self._host_cycles % self.host_full_every == 0
                or time.monotonic() < self._watched_until)
        self._host_cycles += 1
        host = guarded("host", lambda: self.host.sample(full=full),
                       {"unavailable": {"all": "sampler failed"}})
        jobs = guarded("jobs", lambda: self.jobs.sample(records, gpu, host, reports=reports), [])
        ranks, ended = rank_sample(records, reports or {})
        self.fleet.sample()
        return {
            "time": time.time(), "interval": self.interval,
            "duration_seconds": time.perf_counter() - wall0,
            "cpu_seconds": time.thread_time() - cpu0,
            "gpu": gpu, "host": host, "jobs": jobs, "samplers": failed,
            "ranks": ranks, "ended_reports": ended,
        }

    # -- reporting -----------------------------------------------------------
    def watched(self) -> None:
        """Someone reads the live view (``top``): full host samples every cycle for the
        next WATCH_SECONDS (on the loop; the sampler thread reads one float)."""
        self._watched_until = time.monotonic() + WATCH_SECONDS

    def binds_total(self) -> int:
        return int(self.bound.binds_total)

    def exposition(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def status(self) -> dict[str, Any]:
        s = self.latest or {}
        gpu = s.get("gpu") or {}
        gpu_txt = (f"{len(gpu.get('gpus') or [])} GPU(s)" if gpu.get("available")
                   else "GPUs not available")
        where = ("metrics off" if self.listen is None else self.metrics_error
                 or f"metrics on {self.metrics_address}")
        last_cpu = s.get("cpu_seconds")
        recent = sorted(v for v in self.history.host.columns(300)["sample_cpu_seconds"]
                        if v == v)  # NaN-free
        return {
            "summary": f"sampling every {self.interval:g} s; {gpu_txt}; "
                       f"{len(s.get('jobs') or [])} job(s); {where}",
            "samples_total": self.samples_total,
            "last_sample_cpu_seconds": last_cpu,
            "last_sample_duration_seconds": s.get("duration_seconds"),
            "sample_cpu_seconds_total": self.sample_cpu_seconds_total,
            # CPU per cycle over the newest (up to 300) cycles: the overhead budget
            "sample_cpu_seconds_median": recent[len(recent) // 2] if recent else None,
            "sample_cpu_seconds_p95": recent[int(len(recent) * 0.95)] if recent else None,
            "history_capacity": self.history.capacity,
            "history_bytes": self.history.nbytes(),
            "history_bound_bytes": self.history.bound_bytes(),
            "samplers": self.sampler_status,
            "metrics_listen": self.settings.metrics_listen,
            "metrics_address": self.metrics_address,  # HOST:PORT really bound, or None
            "metrics_port": self.metrics_port,
            "metrics_error": self.metrics_error,
        }
