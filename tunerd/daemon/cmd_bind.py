"""Handlers: bind, unbind, jobs (the JobRegistry does the work)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunerd.cpulist import CpuListError, parse_cpulist
from tunerd.daemon.registry import Request, command
from tunerd.errors import Failed, UsageError

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon
    from tunerd.daemon.jobs import JobRegistry

NO_PLACEMENT = "no --cpus/--mems given and GPU placement is not available"


def _registry(d: Daemon) -> JobRegistry:
    if d.jobs is None:
        raise Failed("the job registry is not running")
    reg: JobRegistry = d.jobs
    return reg


def _ids(req: Request, name: str) -> frozenset[int] | None:
    """A cpulist argument: "2-5" or a list of ints; None when absent."""
    v = req.args.get(name)
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                   for x in v):
        return frozenset(v)
    if not isinstance(v, str):
        raise UsageError(f"{req.cmd}: argument {name!r} must be a cpulist string, got {v!r}")
    try:
        return parse_cpulist(v)
    except CpuListError as err:
        raise UsageError(f"--{name}: {err}") from err


@command("bind")
async def bind(d: Daemon, req: Request) -> dict[str, Any]:
    jobs = _registry(d)
    pid = req.arg("pid", int)
    cpus, mems, gpus = _ids(req, "cpus"), _ids(req, "mems"), _ids(req, "gpus")
    nofile = req.arg("nofile", int, None)
    exclusive = req.arg("exclusive", bool, False)
    notes: list[str] = []
    gpu_ids: tuple[int, ...] = tuple(sorted(gpus)) if gpus else ()
    if (cpus is None and mems is None) or gpus is not None:
        if jobs.placer is not None:
            jobs.authorize(pid, req.peer)  # before the placer reserves anything
            placed = await jobs.placer(pid=pid, peer=req.peer,
                                       gpus=gpu_ids if gpus is not None else None,
                                       exclusive=exclusive)
            if placed is None:  # the process uses no GPU (or is bound already)
                if nofile is None or gpus is not None:
                    raise UsageError(NO_PLACEMENT)
                notes.append("CPUs and memory nodes unchanged: " + NO_PLACEMENT)
            else:
                if cpus is None:
                    cpus = frozenset(placed.get("cpus") or ())
                    if not cpus:
                        raise UsageError(f"GPU placement gave no CPUs for pid {pid}")
                if mems is None and placed.get("mems"):  # none known (e.g. replay): leave memory
                    mems = frozenset(placed["mems"])
                gpu_ids = tuple(placed.get("gpus") or gpu_ids)
        elif nofile is None or gpus is not None:
            raise UsageError(NO_PLACEMENT)
        else:
            notes.append("CPUs and memory nodes unchanged: " + NO_PLACEMENT)
    elif exclusive:
        notes.append("--exclusive ignored: exclusive CPUs need GPU placement (leases)")
    result = await jobs.bind(pid, peer=req.peer, cpus=cpus, mems=mems, nofile=nofile,
                             gpus=gpu_ids, origin="cli")
    result["notes"] = [*notes, *result.get("notes", [])]
    return result


@command("unbind")
async def unbind(d: Daemon, req: Request) -> dict[str, Any]:
    return await _registry(d).unbind(req.arg("pid", int), peer=req.peer)


@command("jobs")
async def jobs(d: Daemon, req: Request) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs": _registry(d).jobs()}
    # the leases area may add its view here without touching this handler
    list_leases = getattr(d.leases, "list_leases", None)
    if callable(list_leases):
        out["leases"] = list_leases()
    return out
