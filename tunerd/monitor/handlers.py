"""Control-socket commands of the monitor: metrics, top, advise (read-only, any user)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunerd.daemon.registry import Request, command
from tunerd.errors import Failed, NoSuchProcess

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon
    from tunerd.monitor.service import Monitor

ADVISE_WINDOW = 300  # newest samples the rules look at (5 min at the default 1 s)


def _monitor(d: Daemon) -> Monitor:
    if d.monitor is None:
        raise Failed("the monitor service is not running in this daemon")
    m: Monitor = d.monitor
    return m


@command("metrics")
async def metrics(d: Daemon, req: Request) -> dict[str, Any]:
    """The Prometheus exposition text, as /metrics would serve it."""
    return {"text": _monitor(d).exposition()}


@command("top")
async def top(d: Daemon, req: Request) -> dict[str, Any]:
    """The latest sample and the bound jobs, for `tunerctl top`."""
    m = _monitor(d)
    return {"sample": m.latest, "jobs": m.job_records(), "interval": m.interval}


@command("advise")
async def advise(d: Daemon, req: Request) -> dict[str, Any]:
    from tunerd.advise import advise as run_rules

    m = _monitor(d)
    pid = req.arg("pid", int, None)
    latest = {j["pid"]: j for j in (m.latest or {}).get("jobs") or [] if "error" not in j}
    if pid is not None and pid not in latest:
        bound = ", ".join(str(p) for p in sorted(latest)) or "none"
        raise NoSuchProcess(f"process {pid} is not a bound job (bound jobs: {bound}); "
                            f"advise reads the history of jobs bound with tunerctl bind/run",
                            pid=pid)
    out = []
    for p, job in sorted(latest.items()):
        if pid is not None and p != pid:
            continue
        ring = m.history.job(p)
        cols = ring.columns(ADVISE_WINDOW) if ring is not None else {}
        findings = run_rules(job, cols)
        out.append({"pid": p, "name": job.get("name"), "samples": len(cols.get("time", [])),
                    "findings": [f.to_dict() for f in findings]})
    return {"jobs": out, "interval": m.interval}
