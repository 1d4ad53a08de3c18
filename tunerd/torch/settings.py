"""Where a training setting comes from: computed default < daemon < environment.

Every helper of ``tunerd.torch`` resolves its settings the same way:

1. a default computed from this process (its CPUs, its ranks, CUDA or not), or the
   value the caller passed, which replaces the computed default;
2. the ``torch`` table of the ``[[job]]`` rule that bound this process, which the
   daemon returns in its reply to the ``report`` command;
3. environment overrides, so that ``tunerctl bench`` and ``tunerctl tune`` can vary a
   setting of a script from outside without editing it.

It also keeps the "warn once" state (a helper that fails logs one warning and falls
back; it never breaks training) and writes what was resolved to ``$TUNERD_BENCH_OUT``
when bench asks, so bench reports the settings a run really used.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from tunerd.base.torchkeys import AMP_MODES, BOOLS, ENV, INT_RANGES

__all__ = [
    "AMP_MODES",
    "BOOLS",
    "ENV",
    "INT_RANGES",
    "env_overrides",
    "parse_setting",
    "record",
    "valid_settings",
    "warn_once",
]

log = logging.getLogger("tunerd.torch")

BENCH_OUT = "TUNERD_BENCH_OUT"  # set by tunerctl bench: a file for JSON lines
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

_warned: set[str] = set()
_lock = threading.Lock()


def warn_once(key: str, message: str, *args: Any) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)


def parse_setting(key: str, raw: Any, origin: str) -> Any:
    """One setting's value from the environment (str) or the daemon (JSON); raises
    ValueError naming ``origin``, the key and the value."""
    if key == "amp":
        v = str(raw).strip().lower()
        if v not in AMP_MODES:
            raise ValueError(f"{origin}: amp must be one of {', '.join(AMP_MODES)}, got {raw!r}")
        return v
    if key in BOOLS:
        if isinstance(raw, bool):
            return raw
        v = str(raw).strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise ValueError(f"{origin}: {key} must be a boolean (1/0, true/false), got {raw!r}")
    lo, hi = INT_RANGES[key]
    if isinstance(raw, bool):
        raise ValueError(f"{origin}: {key} must be an integer in {lo}..{hi}, got {raw!r}")
    try:
        n = int(str(raw).strip()) if not isinstance(raw, int) else raw
    except ValueError:
        raise ValueError(f"{origin}: {key} must be an integer in {lo}..{hi}, "
                         f"got {raw!r}") from None
    if not lo <= n <= hi:
        raise ValueError(f"{origin}: {key} must be an integer in {lo}..{hi}, got {n}")
    return n


def env_overrides(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the environment overrides (``TUNERD_NUM_WORKERS=2`` ...).

    A bad value is ignored with one warning naming the variable and the value.
    """
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    for key, var in ENV.items():
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            continue
        try:
            out[key] = parse_setting(key, raw, var)
        except ValueError as err:
            warn_once(f"env:{var}={raw}", "tunerd.torch: ignoring %s", err)
    return out


def valid_settings(table: Any, origin: str = "daemon settings") -> dict[str, Any]:
    """The usable part of a ``torch`` settings table; bad or unknown keys are dropped
    with one warning each."""
    if not isinstance(table, Mapping):
        if table is not None:
            warn_once(f"settings:{origin}", "tunerd.torch: %s: expected a table, got %r",
                      origin, table)
        return {}
    out: dict[str, Any] = {}
    for key, raw in table.items():
        if key not in ENV:
            warn_once(f"settings:{origin}:{key}", "tunerd.torch: %s: unknown key %r ignored",
                      origin, key)
            continue
        try:
            out[key] = parse_setting(key, raw, f"{origin}: {key}")
        except ValueError as err:
            warn_once(f"settings:{origin}:{key}", "tunerd.torch: ignoring %s", err)
    return out


def record(kind: str, values: Mapping[str, Any]) -> None:
    """Append what a helper resolved to ``$TUNERD_BENCH_OUT`` (one JSON line), if set.

    tunerctl bench sets it for every run so that its report names the settings each run
    really used, and knows when a script does not use these helpers at all.
    """
    path = os.environ.get(BENCH_OUT)
    if not path:
        return
    line = json.dumps({"pid": os.getpid(), "kind": kind, **values}, default=str) + "\n"
    try:
        # O_APPEND: lines of several ranks and workers never interleave within a line
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as err:
        warn_once("bench-out", "tunerd.torch: cannot write %s: %s", path, err)
