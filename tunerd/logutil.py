"""Logging helpers for the daemon: a filter that rate-limits repeated identical messages.

A local user can make the daemon fail the same way thousands of times a second
(a connection flood, a stream of malformed requests). Each failure is worth one
line, not one line per occurrence: the log (journald, a file) is a shared
resource too, and 30 MB of identical tracebacks hide the one line that matters.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["RepeatFilter"]


class RepeatFilter(logging.Filter):
    """Let through ``burst`` identical records per ``window`` seconds, drop the rest.

    Records are identical when logger, level, rendered message and exception type
    are. The first record let through after some were dropped says how many.
    At most ``max_keys`` distinct messages are tracked (least recently seen first
    out), so the filter's memory is bounded whatever is logged.
    """

    def __init__(self, burst: int = 5, window: float = 60.0, max_keys: int = 2048,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self.max_keys = max_keys
        self.clock = clock
        # key -> [window start, records let through in it, records dropped]
        self._seen: OrderedDict[tuple[object, ...], list[float]] = OrderedDict()
        self.dropped_total = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0] if record.exc_info else None
        try:
            text = record.getMessage()
        except Exception:  # a bad format string is the handler's problem, not ours
            return True
        key = (record.name, record.levelno, text, exc)
        now = self.clock()
        ent = self._seen.get(key)
        if ent is None or now - ent[0] >= self.window:
            dropped = int(ent[2]) if ent is not None else 0
            self._seen[key] = [now, 1, 0]
            self._seen.move_to_end(key)
            if len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
            if dropped:
                self._note(record, dropped)
            return True
        self._seen.move_to_end(key)
        if ent[1] < self.burst:
            ent[1] += 1
            return True
        ent[2] += 1
        self.dropped_total += 1
        return False

    def _note(self, record: logging.LogRecord, dropped: int) -> None:
        record.msg = (f"{record.getMessage()} [{dropped} identical message(s) suppressed "
                      f"in the previous {self.window:g} s]")
        record.args = None
