"""Errors the daemon shows in ``tunerctl status``: when, where, and whether still true.

An error is recorded under a ``source`` ("reload", "autobind", "host", ...) and an
optional ``key`` (a pid, a setting) so that the code that fixes its cause can mark
it resolved: a policy that loads again resolves the reload error, a process that
exits resolves its bind failure, a setting that applies resolves its write error.
Status shows the unresolved ones (with their time) and the recently resolved ones.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tunerd.base.text import bounded_message

__all__ = ["ErrorLog", "Problem"]

log = logging.getLogger("tunerd")

MAX_OPEN = 200  # unresolved problems kept (oldest dropped, and counted)
MAX_RESOLVED = 20  # resolved ones still shown


@dataclass
class Problem:
    source: str
    key: str | None
    message: str
    first: float
    last: float
    count: int = 1
    resolved_at: float | None = None
    level: str = "error"  # "error" | "warning"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"source": self.source, "message": self.message,
                             "time": self.last, "first": self.first, "count": self.count,
                             "level": self.level, "resolved": self.resolved_at is not None}
        if self.key is not None:
            d["key"] = self.key
        if self.resolved_at is not None:
            d["resolved_at"] = self.resolved_at
        return d


class ErrorLog:
    def __init__(self) -> None:
        self._open: OrderedDict[tuple[str, str | None], Problem] = OrderedDict()
        self._resolved: list[Problem] = []
        self.total = 0  # every record() since start (tunerd_errors_total)
        self.dropped = 0

    def record(self, source: str, message: str, key: str | int | None = None, *,
               level: str = "error") -> None:
        k = (source, None if key is None else str(key))
        message = bounded_message(message)  # 200 of them in every `tunerctl status`
        now = time.time()
        self.total += 1
        log.log(logging.WARNING if level == "warning" else logging.ERROR,
                "%s: %s", source, message)
        p = self._open.get(k)
        if p is not None:
            p.message, p.last, p.count, p.level = message, now, p.count + 1, level
            self._open.move_to_end(k)
            return
        self._open[k] = Problem(source, k[1], message, now, now, level=level)
        while len(self._open) > MAX_OPEN:
            self._open.popitem(last=False)
            self.dropped += 1

    def resolve(self, source: str, key: str | int | None = None) -> bool:
        """Mark the problem of ``source``/``key`` resolved (True if there was one)."""
        p = self._open.pop((source, None if key is None else str(key)), None)
        if p is None:
            return False
        p.resolved_at = time.time()
        self._resolved.append(p)
        del self._resolved[:-MAX_RESOLVED]
        return True

    def resolve_source(self, source: str) -> int:
        keys = [k for k in self._open if k[0] == source]
        for k in keys:
            self.resolve(*k)
        return len(keys)

    def to_json(self, recent: int = 10) -> dict[str, Any]:
        return {"open": [p.to_json() for p in list(self._open.values())[-recent:]],
                "open_count": len(self._open),
                "errors": sum(1 for p in self._open.values() if p.level == "error"),
                "warnings": sum(1 for p in self._open.values() if p.level == "warning"),
                "resolved": [p.to_json() for p in self._resolved[-recent:]],
                "total": self.total, "dropped": self.dropped}
