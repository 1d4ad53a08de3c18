"""Step timing, throughput and memory of a training loop, reported to tunerd.

``StepReporter`` measures step time, samples/s and memory (CUDA allocated/reserved/
max allocated, or RSS with CPU-only torch) and sends them to the daemon with the
``report`` command at most once per ``interval``; it works without a daemon too
(``summary()``). It runs inside ``step()``, not in a thread: a thread alive while
DataLoader forks its workers is a hazard (and a DeprecationWarning on Python >=
3.12), and the work is ~1 ms once a second; a daemon that does not answer within
``timeout`` is left alone for a while, so a step is never held for long.

``report_memory()`` (the older interface) still works: it writes CUDA memory stats
to ``RUNTIME_DIR/jobs/PID.json`` from a thread, where the daemon's job sampler reads
them. ``StepReporter`` writes that file as well when the daemon does not know the
``report`` command, so ``advise`` keeps its memory findings with an older daemon.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from tunerd.torch.settings import log, record, valid_settings, warn_once

__all__ = [
    "DaemonLink",
    "StepReporter",
    "current_report",
    "dataloader_workers",
    "report_memory",
    "stats_path",
    "torch_memory_stats",
    "write_stats",
]

WORKER_COMM = "pt_data_worker"  # torch names its DataLoader worker processes so
UNREACHABLE_BACKOFF_S = 10.0
FAILED_BACKOFF_S = 30.0
MIN_INTERVAL_S = 0.1


# -- what this process looks like ------------------------------------------------

def _torch_if_loaded() -> Any:
    """torch if the training script imported it; never imports it ourselves."""
    return sys.modules.get("torch")


def _uses_cuda() -> bool:
    torch = _torch_if_loaded()
    try:
        # is_initialized: this process made a CUDA context; is_available alone would
        # also be true for a CPU job on a GPU node
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:
        return False


def _rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory(cuda: bool) -> dict[str, int]:
    if cuda:
        torch = _torch_if_loaded()
        return {"allocated": int(torch.cuda.memory_allocated()),
                "reserved": int(torch.cuda.memory_reserved()),
                "max_allocated": int(torch.cuda.max_memory_allocated())}
    return {"rss": _rss_bytes()}


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")


def dataloader_workers(pid: int | None = None) -> list[int]:
    """PIDs of the DataLoader worker processes of ``pid`` (default: this process).

    Its children named ``pt_data_worker`` (torch names workers so) or, for torch
    versions that do not, forked children running the same command line.
    """
    pid = pid or os.getpid()
    base = f"/proc/{pid}"
    try:
        own_cmdline = _read(f"{base}/cmdline")
        tids = os.listdir(f"{base}/task")
    except OSError:
        return []
    children: set[int] = set()
    for tid in tids:
        try:
            children.update(int(c) for c in _read(f"{base}/task/{tid}/children").split())
        except (OSError, ValueError):
            continue
    out = []
    for c in sorted(children):
        try:
            if (_read(f"/proc/{c}/comm").strip() == WORKER_COMM
                    or _read(f"/proc/{c}/cmdline") == own_cmdline):
                out.append(c)
        except OSError:
            continue
    return out


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "")
    return int(v) if v.strip().isdigit() else None


def current_report(steps: int = 0, step_time_s: float = 0.0, samples_per_s: float = 0.0,
                   workers: list[int] | None = None,
                   num_workers: int | None = None) -> dict[str, Any]:
    """The ``report`` command's arguments for this process (see the wire spec)."""
    cuda = _uses_cuda()
    if workers is None:
        workers = dataloader_workers()
    return {"pid": os.getpid(), "steps": int(steps), "step_time_s": float(step_time_s),
            "samples_per_s": float(samples_per_s), "device": "cuda" if cuda else "cpu",
            "memory": _memory(cuda), "workers": workers,
            "num_workers": len(workers) if num_workers is None else int(num_workers),
            "rank": _env_int("RANK"), "local_rank": _env_int("LOCAL_RANK"),
            "local_world_size": _env_int("LOCAL_WORLD_SIZE")}


# -- the daemon ---------------------------------------------------------------------

class DaemonLink:
    """Sends ``report`` to the daemon; never raises, never waits longer than ``timeout``.

    ``status`` says what happened last, for ``summary()``: "not tried", "accepted",
    "unreachable: ...", "daemon has no 'report' command", "refused: ...".
    """

    def __init__(self, socket_path: str | None = None, timeout: float = 0.5) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.status = "not tried"
        self.supported: bool | None = None
        self.settings: dict[str, Any] = {}
        self.sent = 0
        self._client: Any = None
        self._quiet_until = 0.0

    def send(self, args: dict[str, Any]) -> dict[str, Any] | None:
        if self.supported is False or time.monotonic() < self._quiet_until:
            return None
        from tunerd.client import Client
        from tunerd.errors import DaemonUnreachable, PermissionDenied, TunerdError, UsageError

        try:
            if self._client is None:
                self._client = Client(self.socket_path, timeout=self.timeout)
            reply = self._client.call("report", **args)
        except UsageError as err:
            self.close()
            if "unknown command 'report'" in err.message:
                self.supported = False
                self.status = "daemon has no 'report' command"
                log.info("tunerd.torch: the daemon does not know the 'report' command; "
                         "reporting memory through RUNTIME_DIR/jobs instead")
                return None
            self._failed(f"refused: {err.message}")
            return None
        except DaemonUnreachable as err:
            self.close()
            self.status = f"unreachable: {err.message}"
            self._quiet_until = time.monotonic() + UNREACHABLE_BACKOFF_S
            return None
        except PermissionDenied as err:
            self.close()
            self.supported = False
            self.status = f"refused: {err.message}"
            return None
        except (TunerdError, OSError, ValueError) as err:
            self.close()
            self._failed(f"refused: {getattr(err, 'message', err)}")
            return None
        if not isinstance(reply, dict) or reply.get("accepted") is not True:
            self._failed(f"refused: unexpected reply {reply!r:.200}")
            return None
        self.supported = True
        self.status = "accepted"
        self.sent += 1
        self.settings = valid_settings(reply.get("settings"))
        return reply

    def _failed(self, status: str) -> None:
        self.status = status
        self._quiet_until = time.monotonic() + FAILED_BACKOFF_S
        warn_once(f"report:{status}", "tunerd.torch: report to tunerd failed: %s", status)

    def close(self) -> None:
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None


# -- the reporter ---------------------------------------------------------------------

class StepReporter:
    """Measures a training loop; call ``step()`` once per optimizer step (or iteration).

    ::

        rep = tunerd.torch.StepReporter(batch_size=256)
        for x, y in loader:
            ...
            rep.step()
        print(rep.summary())

    ``daemon=False`` keeps the numbers local. Every public method swallows its own
    errors (one warning each): measuring must never break training.
    """

    def __init__(self, batch_size: int | None = None, *, interval: float = 1.0,
                 loader: Any = None, daemon: bool = True, socket_path: str | None = None,
                 timeout: float = 0.5) -> None:
        self.batch_size = batch_size
        self.interval = max(MIN_INTERVAL_S, float(interval))
        self.loader = loader
        self.link: DaemonLink | None = DaemonLink(socket_path, timeout) if daemon else None
        self.steps = 0
        self.samples = 0
        self._first: float | None = None
        self._first_samples = 0
        self._last: float | None = None
        self._times: deque[float] = deque(maxlen=100_000)
        self._iv_start = 0.0
        self._iv_times: list[float] = []
        self._iv_samples = 0
        self._last_interval: dict[str, Any] | None = None
        self._closed = False
        atexit.register(self._at_exit)

    # the hot path: two clock reads and a few additions per step
    def step(self, samples: int | None = None) -> None:
        try:
            now = time.perf_counter()
            n = self.batch_size if samples is None else samples
            self.steps += 1
            self.samples += n or 0
            if self._last is None:
                # the first call only starts the clock: its step has no start time
                self._first = self._last = self._iv_start = now
                self._first_samples = n or 0
                return
            self._times.append(now - self._last)
            self._iv_times.append(now - self._last)
            self._iv_samples += n or 0
            self._last = now
            if now - self._iv_start >= self.interval:
                self._flush(now)
        except Exception as err:
            warn_once("reporter:step", "tunerd.torch: StepReporter.step failed: %r", err)

    def _flush(self, now: float) -> None:
        elapsed = now - self._iv_start
        if not self._iv_times or elapsed <= 0:
            return
        rate = self._iv_samples / elapsed if self._iv_samples else 0.0
        step_time = statistics.median(self._iv_times)
        self._last_interval = {"steps": len(self._iv_times), "seconds": elapsed,
                               "step_time_s": step_time, "samples_per_s": rate}
        self._iv_start, self._iv_times, self._iv_samples = now, [], 0
        if self.link is None:
            return
        num_workers = getattr(self.loader, "num_workers", None)
        args = current_report(self.steps, step_time, rate, num_workers=num_workers)
        self.link.send(args)
        if self.link.supported is False and args["device"] == "cuda":
            _write_stats_quietly()

    def summary(self) -> dict[str, Any]:
        """What was measured so far (also without a daemon)."""
        try:
            times = sorted(self._times)
            span = (self._last or 0.0) - (self._first or 0.0)
            counted = self.samples - self._first_samples
            cuda = _uses_cuda()
            return {
                "steps": self.steps,
                "samples": self.samples,
                "elapsed_s": span,
                "step_time_s": statistics.median(times) if times else None,
                "step_time_p90_s": times[int(0.9 * (len(times) - 1))] if times else None,
                "samples_per_s": counted / span if span > 0 and counted > 0 else None,
                "last_interval": self._last_interval,
                "device": "cuda" if cuda else "cpu",
                "memory": _memory(cuda),
                "daemon": self.link.status if self.link else "off",
                "reports_sent": self.link.sent if self.link else 0,
                "settings": dict(self.link.settings) if self.link else {},
            }
        except Exception as err:
            warn_once("reporter:summary", "tunerd.torch: StepReporter.summary failed: %r", err)
            return {"steps": self.steps, "samples": self.samples}

    def close(self) -> dict[str, Any]:
        """Send what is left, write the summary for tunerctl bench; returns the summary."""
        if self._closed:
            return self.summary()
        self._closed = True
        atexit.unregister(self._at_exit)
        try:
            if self._last is not None and self._iv_times:
                self._flush(self._last)
        except Exception as err:
            warn_once("reporter:close", "tunerd.torch: StepReporter.close failed: %r", err)
        out = self.summary()
        record("reporter", {k: out.get(k) for k in ("steps", "samples", "samples_per_s",
                                                     "step_time_s", "device")})
        if self.link is not None:
            self.link.close()
        return out

    def _at_exit(self) -> None:
        self.close()

    def __enter__(self) -> StepReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- memory stats file (report_memory, and the fallback for an older daemon) ----------

def stats_path(pid: int | None = None) -> Path:
    explicit = os.environ.get("TUNERD_TORCH_STATS")
    if explicit:
        return Path(explicit)
    runtime = Path(os.environ.get("TUNERD_RUNTIME_DIR", "/run/tunerd"))
    return runtime / "jobs" / f"{pid or os.getpid()}.json"


def torch_memory_stats() -> list[dict[str, Any]]:
    import torch  # lazily: tunerd never needs torch itself

    if not torch.cuda.is_available():
        return []
    return [{"device": i,
             "reserved_bytes": int(torch.cuda.memory_reserved(i)),
             "allocated_bytes": int(torch.cuda.memory_allocated(i)),
             "max_reserved_bytes": int(torch.cuda.max_memory_reserved(i)),
             "max_allocated_bytes": int(torch.cuda.max_memory_allocated(i))}
            for i in range(torch.cuda.device_count())]


def write_stats(devices: list[dict[str, Any]], path: Path | None = None) -> Path:
    """Write one report atomically (temp file + rename); returns the path."""
    p = path or stats_path()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "time": time.time(), "devices": devices}))
    os.replace(tmp, p)
    return p


def _write_stats_quietly() -> None:
    p = stats_path()
    if not p.parent.is_dir():
        return
    try:
        write_stats(torch_memory_stats(), p)
    except Exception as err:
        warn_once("stats-file", "tunerd.torch: cannot write %s: %r", p, err)


def report_memory(interval: float = 10.0, path: Path | None = None) -> threading.Thread:
    """Write torch CUDA memory stats every ``interval`` s from a daemon thread, for the
    daemon's job sampler (``tunerctl advise``). Failures are logged once, never raised."""

    def loop() -> None:
        while True:
            try:
                write_stats(torch_memory_stats(), path)
            except Exception as err:
                warn_once("report_memory", "tunerd.torch: report_memory failed: %r", err)
            time.sleep(interval)

    t = threading.Thread(target=loop, name="tunerd-torch-stats", daemon=True)
    t.start()
    return t
