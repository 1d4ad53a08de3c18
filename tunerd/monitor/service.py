"""The Monitor service: samples GPUs, host and bound jobs on a timer; serves metrics.

Where the sampling runs, and why: a cycle is a few dozen reads of small procfs
files (well under a millisecond of CPU) plus NVML calls, but
NVML's PCIe throughput query sleeps ~20 ms per GPU inside the driver and
numa_maps of a large process walks its page tables. So each cycle runs in ONE
dedicated sampler thread — the loop is never blocked and the samplers' own
state (previous counters) is only ever touched by that thread.

The thread keeps its own timer (``queue.get`` with a timeout): a timed cycle does
not wake the event loop at all (one ``run_in_executor`` round trip per second cost
~130 us of loop CPU, a quarter of the idle daemon's). It asks the loop for the job
list only when the registry's ``version`` changed since the last list (the loop
builds it: the registry changes on the loop only), and publishes the finished
sample itself, under ``Monitor.lock``: ``latest`` is replaced whole, the history
rings are appended. Readers of the history (advise, status, the metrics thread)
take the same lock. Only reports of ended processes go back to the loop, when there
are any. ``cycle()`` (start-up, tests) hands one cycle to the same thread and
waits for it. A cycle that overruns the interval delays the next one; cycles never
overlap or pile up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
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

HIDDEN_LABEL = "(hidden)"  # another user's process name, where /proc hides it
_JOB_PID = re.compile(r'job="((?:[^"\\]|\\.)*)",pid="(\d+)"')

# Memory, PSI, disks and NICs (the costly part of a host sample: psutil's parsers,
# ~1.5-2 ms of CPU with cold caches) are read every HOST_FULL_SECONDS, and every cycle
# for WATCH_SECONDS after someone asked for the live view (``tunerctl top``); per-CPU
# times every cycle. A scrape reads values at most HOST_FULL_SECONDS old (their rates
# over that span): PSI's own avg10 is a 10 s average, Prometheus scrapes every 15 s,
# and advise takes medians over 300 samples.
HOST_FULL_SECONDS = 10.0
WATCH_SECONDS = 10.0
BEAT_SECONDS = 5.0  # the loop's heartbeat that /healthz reads


# one cycle asked for by cycle(): the job list, the reports, where the sample goes
_Ask = tuple[list[dict[str, Any]], Mapping[int, Report], Future[dict[str, Any]]]
_TICK: _Ask = ([], {}, Future())  # start() wakes the thread with it: timed cycles begin


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
    from tunerd.adapters import procfs
    from tunerd.base.errors import TunerdError

    if not reports:  # the common case: no job reports (no loop over 620 records)
        return [], {}
    # a report with no job id (a single `python train.py`, not a launcher's rank) is
    # named by the bound job it came from, else by its pid: an empty `job` label is no
    # label, and under a default scrape the series had no exported_job for the
    # dashboard's `job` variable and job panels to find
    names = {int(r["pid"]): str(r.get("name") or "") for r in records if "pid" in r}
    bound = set(names)
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
        key = (rep.job or names.get(rep.pid) or f"pid{rep.pid}",
               str(rep.rank) if rep.rank is not None else f"pid{rep.pid}")
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
                 fleet: FleetFacts | None = None,
                 uid_sees_all: Callable[[int], bool] = lambda uid: True) -> None:
        self.settings = settings
        # hidepid: whether a local HTTP client's uid may read every process's text
        self.uid_sees_all = uid_sees_all
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
        self.last_cycle_at = time.monotonic()  # GET /healthz: the thread still samples
        self.loop_alive_at = time.monotonic()  # GET /healthz: the loop still runs
        self._beat_handle: asyncio.TimerHandle | None = None
        self.sample_cpu_seconds_total = 0.0
        self._records: list[dict[str, Any]] = []  # job_records() while the version stays
        self._records_version: int | None = None
        # called in the sampler thread after each timed cycle (e.g. the cpuset watch's
        # backstop poll: one timer of the process instead of two)
        self.cycle_hooks: list[Callable[[], None]] = []
        self.sampler_status: dict[str, dict[str, Any]] = {
            n: {"ok": True, "errors": 0, "last_error": None} for n in ("gpu", "host", "jobs")}
        # the sampler thread's inbox: (records, reports, future) for one cycle now, or
        # None to end; a get() that times out is the thread's own 1 s timer
        self._inbox: queue.SimpleQueue[_Ask | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # timed cycles once set
        self._stopped = False
        # latest, history, sampler_status and the counters change under it (sampler
        # thread); the loop and the metrics thread read the history under it
        self.lock = threading.Lock()
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
        self._loop = asyncio.get_running_loop()  # from now on the thread samples on its own
        self._inbox.put(_TICK)  # wake it: it waited without a timeout until now
        self._beat()  # /healthz also checks that the loop runs (the thread samples alone)

    def _start_http(self, host: str, port: int) -> None:
        from tunerd.monitor.http import serve_metrics

        try:
            self._http, _thread = serve_metrics(
                host, port, self.registry, health=self.health,
                view=lambda uid: self.exposition_for(uid, self.uid_sees_all))
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

    def _beat(self) -> None:
        """The event loop's heartbeat for /healthz: one timer every BEAT_SECONDS."""
        self.loop_alive_at = time.monotonic()
        if not self._stopped:
            self._beat_handle = asyncio.get_running_loop().call_later(BEAT_SECONDS,
                                                                      self._beat)

    def health(self) -> tuple[bool, str]:
        """Whether sampling and the event loop still run: a sample finished, and the
        loop's heartbeat ran, within 10 intervals (30 s at least). Asked from the HTTP
        thread (GET /healthz): reads two floats."""
        now = time.monotonic()
        limit = max(30.0, 10 * self.interval)
        age = now - self.last_cycle_at
        if age > limit:
            return False, f"no monitor sample for {age:.0f} s (limit {limit:.0f} s)"
        stuck = now - self.loop_alive_at
        if stuck > limit:
            return False, f"the event loop has not run for {stuck:.0f} s (limit {limit:.0f} s)"
        return True, "ok"

    async def policy_changed(self) -> None:
        return None

    async def stop(self) -> None:
        self._loop = None
        self._stopped = True
        if self._beat_handle is not None:
            self._beat_handle.cancel()
        self._inbox.put(None)
        if self._http is not None:
            # shutdown() waits for serve_forever to return (a pipe wakes it) and the
            # handlers may still run:
            # let a daemon thread wait for it, so that SIGTERM ends the daemon at once
            http = self._http
            self._http = None

            def close() -> None:
                http.shutdown()
                http.server_close()

            threading.Thread(target=close, name="tunerd-metrics-stop", daemon=True).start()
        if self._thread is None:
            self.jobs.close()
        # else the thread closes the job sampler's open /proc files after its last cycle

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._sampler_main, name="tunerd-sampler",
                                            daemon=True)
            self._thread.start()

    def _sampler_main(self) -> None:
        """The sampler thread: cycles asked for by ``cycle()``, and once ``start()`` is
        done, one every interval on its own timer."""
        next_at = time.monotonic() + self.interval
        try:
            while True:
                timeout = None
                if self._loop is not None:
                    timeout = next_at - time.monotonic()
                    if timeout <= 0:  # overran: skip the missed ticks, never catch up
                        next_at = time.monotonic()
                        timeout = 0.0
                try:
                    item = self._inbox.get(timeout=timeout)
                except queue.Empty:
                    next_at += self.interval
                    self._timed_cycle()
                    continue
                if item is None:
                    return
                if item is _TICK:
                    continue
                records, reports, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(self.collect(records, reports))
                except BaseException as err:
                    fut.set_exception(err)
        finally:
            self.jobs.close()

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(fn, *args)

    def _thread_records(self) -> list[dict[str, Any]]:
        """The job list for a timed cycle: the last one while the registry's version
        stays, else built on the loop (the only hand-off a timed cycle makes)."""
        version = getattr(self.bound, "version", None)
        loop = self._loop
        if (version is not None and version == self._records_version) or loop is None:
            return self._records
        fut: Future[list[dict[str, Any]]] = Future()

        def build() -> None:
            try:
                fut.set_result(self.job_records())
            except BaseException as err:
                fut.set_exception(err)

        try:
            loop.call_soon_threadsafe(build)
            return fut.result(timeout=10.0)
        except (RuntimeError, TimeoutError):  # the loop closed or stalls: the last list
            return self._records

    def _timed_cycle(self) -> None:
        try:
            sample = self.collect(self._thread_records(), self.reports.snapshot())
            ended = self._publish(sample)
            if ended:
                self._on_loop(self.reports.drop, ended)
        except Exception as err:  # never let one bad cycle end sampling
            log.exception("monitor cycle failed")
            self._on_loop(self.errors.record, "monitor", f"sampling cycle failed: {err!r}",
                          "cycle")
        for hook in self.cycle_hooks:
            try:
                hook()
            except Exception:
                log.exception("monitor cycle hook %r failed", hook)

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
        """One cycle now, in the sampler thread (start-up, tests); waits for it."""
        if self._stopped:
            raise RuntimeError("the monitor is stopped")
        records = self.job_records()
        reports = self.reports.snapshot()
        fut: Future[dict[str, Any]] = Future()
        self._ensure_thread()
        self._inbox.put((records, reports, fut))
        sample = await asyncio.wrap_future(fut)
        self.reports.drop(self._publish(sample))
        return sample

    def gpu_processes(self) -> list[tuple[int, int]] | None:
        """(GPU, pid) of every compute and graphics process in the last sample, or None
        where GPUs were not sampled within the last three intervals (tunerd.jobs.gpuuse
        then has no NVML evidence that tick: it makes no NVML call of its own)."""
        with self.lock:
            s, at = self.latest, self.last_cycle_at
        gpu = (s or {}).get("gpu") or {}
        if not gpu.get("available") or time.monotonic() - at > 3 * self.interval:
            return None
        return [*((int(p["gpu"]), int(p["pid"])) for p in gpu.get("processes") or []),
                *((int(g), int(p)) for g, p in gpu.get("graphics_processes") or [])]

    def _publish(self, sample: dict[str, Any]) -> dict[int, Report]:
        """Store a finished sample (either thread); returns the ended reports."""
        ended: dict[int, Report] = sample.pop("ended_reports", None) or {}
        with self.lock:
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
        return ended

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
        watched = time.monotonic() < self._watched_until
        full = self._host_cycles % self.host_full_every == 0 or watched
        self._host_cycles += 1
        host = guarded("host", lambda: self.host.sample(full=full),
                       {"unavailable": {"all": "sampler failed"}})
        jobs = guarded("jobs", lambda: self.jobs.sample(records, gpu, host, reports=reports,
                                                        watched=watched), [])
        ranks, ended = rank_sample(records, reports or {})
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

    def exposition_for(self, uid: int | None, sees_all: Callable[[int], bool]) -> str:
        """The exposition as ``uid`` may read it (None: a scrape from another host, the
        operator's Prometheus, sees all). Where /proc hides other users' processes from
        ``uid`` (``sees_all`` says no), the ``job`` label of another user's process
        bound by tunerctl bind/run (its comm or command: its own text) reads
        ``(hidden)``, as jobs and top hide it; a rule's name and the pid stay."""
        text = self.exposition()
        if uid is None or sees_all(uid):
            return text
        origin = {r.get("pid"): r.get("origin") for r in self.job_records()}
        hidden = {str(j["pid"]) for j in (self.latest or {}).get("jobs") or []
                  if "pid" in j and j.get("uid") != uid
                  and origin.get(j["pid"]) not in ("rule", "worker")}
        if not hidden:
            return text
        return _JOB_PID.sub(lambda m: f'job="{HIDDEN_LABEL}",pid="{m.group(2)}"'
                            if m.group(2) in hidden else m.group(0), text)

    def status(self) -> dict[str, Any]:
        s = self.latest or {}
        gpu = s.get("gpu") or {}
        gpu_txt = (f"{len(gpu.get('gpus') or [])} GPU(s)" if gpu.get("available")
                   else "GPUs not available")
        where = ("metrics off" if self.listen is None else self.metrics_error
                 or f"metrics on {self.metrics_address}")
        last_cpu = s.get("cpu_seconds")
        with self.lock:
            recent = sorted(v for v in self.history.host.columns(300)["sample_cpu_seconds"]
                            if v == v)  # NaN-free
            nbytes, bound_bytes = self.history.nbytes(), self.history.bound_bytes()
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
            "history_bytes": nbytes,
            "history_bound_bytes": bound_bytes,
            "samplers": self.sampler_status,
            "metrics_listen": self.settings.metrics_listen,
            "metrics_address": self.metrics_address,  # HOST:PORT really bound, or None
            "metrics_port": self.metrics_port,
            "metrics_error": self.metrics_error,
        }
