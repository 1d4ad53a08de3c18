"""Training-side helper: publish torch CUDA memory stats for `tunerctl advise`.

In the training script::

    import tunerd.torch
    tunerd.torch.report_memory()          # starts a daemon thread, every 10 s

It writes ``{"pid", "time", "devices": [{"device", "reserved_bytes",
"allocated_bytes", "max_reserved_bytes", "max_allocated_bytes"}]}`` atomically
to ``$TUNERD_TORCH_STATS`` or ``RUNTIME_DIR/jobs/PID.json`` (RUNTIME_DIR from
``$TUNERD_RUNTIME_DIR``, default /run/tunerd). The daemon reads that file for
bound jobs only, and only if the job's user owns it. torch is imported lazily
(this module imports without it); ``write_stats`` takes the numbers directly
so a job that measures memory its own way can report too.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["report_memory", "stats_path", "torch_memory_stats", "write_stats"]


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


def report_memory(interval: float = 10.0, path: Path | None = None) -> threading.Thread:
    """Report torch memory every ``interval`` s from a daemon thread (errors are ignored:
    monitoring must never break training)."""

    def loop() -> None:
        while True:
            try:
                write_stats(torch_memory_stats(), path)
            except Exception:
                pass
            time.sleep(interval)

    t = threading.Thread(target=loop, name="tunerd-torch-stats", daemon=True)
    t.start()
    return t
