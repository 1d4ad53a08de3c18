"""Step timing, throughput and memory of a training loop, reported to tunerd.

``StepReporter`` measures step time, samples/s and memory (CUDA allocated/reserved/
max allocated, or RSS with CPU-only torch) and sends them to the daemon with the
``report`` command at most once per ``interval``; it works without a daemon too
(``summary()``). It runs inside ``step()``, not in a thread: a thread alive while
DataLoader forks its workers is a hazard (and a DeprecationWarning on Python >=
3.12), and the work is ~1 ms once a second; a daemon that does not answer within
``timeout`` is left alone for a while, so a step is never held for long.

``report_memory()`` (the older interface) still works: it sends the CUDA memory
(or RSS) with the same ``report`` command from a thread. Nothing is written to
files: the daemon reads reports from its socket only, where it checks who sends them.
"""

from __future__ import annotations

import atexit
import statistics
import threading
import time
from collections import deque
from typing import Any

from tunerd.torch.link import DaemonLink, current_report, memory, uses_cuda
from tunerd.torch.settings import record, warn_once

__all__ = [
    "StepReporter",
    "report_memory",
    "torch_memory_stats",
]

MIN_INTERVAL_S = 0.1


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

    def summary(self) -> dict[str, Any]:
        """What was measured so far (also without a daemon)."""
        try:
            times = sorted(self._times)
            span = (self._last or 0.0) - (self._first or 0.0)
            counted = self.samples - self._first_samples
            cuda = uses_cuda()
            return {
                "steps": self.steps,
                "samples": self.samples,
                "elapsed_s": span,
                "step_time_s": statistics.median(times) if times else None,
                "step_time_p90_s": times[int(0.9 * (len(times) - 1))] if times else None,
                "samples_per_s": counted / span if span > 0 and counted > 0 else None,
                "last_interval": self._last_interval,
                "device": "cuda" if cuda else "cpu",
                "memory": memory(cuda),
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


# -- report_memory: memory alone, from a thread ---------------------------------------

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


def report_memory(interval: float = 10.0, socket_path: str | None = None) -> threading.Thread:
    """Send this process's memory (CUDA, or RSS on CPU) to the daemon every ``interval``
    s from a daemon thread, for ``tunerctl advise``/``top``. Never raises; a daemon that
    does not answer is left alone for a while (see DaemonLink)."""
    link = DaemonLink(socket_path)

    def loop() -> None:
        while True:
            try:
                link.send(current_report())
            except Exception as err:
                warn_once("report_memory", "tunerd.torch: report_memory failed: %r", err)
            time.sleep(interval)

    t = threading.Thread(target=loop, name="tunerd-torch-stats", daemon=True)
    t.start()
    return t
