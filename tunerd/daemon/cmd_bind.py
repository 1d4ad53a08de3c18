"""Handlers: bind, unbind, jobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tunerd.base.cpulist import MAX_ID, CpuListError, format_cpulist, parse_cpulist
from tunerd.base.errors import UsageError
from tunerd.base.jsontypes import JSONObject
from tunerd.daemon.router import Request, Router
from tunerd.daemon.visibility import ProcVisibility
from tunerd.jobs.leases import LeaseService
from tunerd.jobs.peer import PidNamespaces
from tunerd.jobs.pipeline import NO_PLACEMENT, BindOutcome, BindPipeline, BindRequest, BindSource

__all__ = ["NO_PLACEMENT", "BindCommands", "bind_reply", "ids_arg"]


def ids_arg(req: Request, name: str) -> frozenset[int] | None:
    """A cpulist argument: "2-5" or a list of ints; None when absent."""
    v = req.args.get(name)
    if v is None:
        return None
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                   and 0 <= x < MAX_ID for x in v):
        return frozenset(v)
    if not isinstance(v, str):
        raise UsageError(f"{req.cmd}: argument {name!r} must be a cpulist string or a list "
                         f"of ids 0 to {MAX_ID - 1}, got {str(v)[:100]}")
    try:
        return parse_cpulist(v)
    except CpuListError as err:
        raise UsageError(f"--{name}: {err}") from err


class BindCommands:
    """The wire side of bind, unbind, jobs: a Request becomes a BindRequest, a
    BindOutcome the reply (the binding itself is tunerd.jobs.pipeline's)."""

    def __init__(self, pipeline: BindPipeline, leases: LeaseService,
                 left_alone: Callable[[], list[dict[str, Any]]] = list,
                 external: Callable[[], list[JSONObject]] = list) -> None:
        self.pipeline = pipeline
        self.jobs = pipeline.jobs
        self.leases = leases
        self._left_alone = left_alone
        self._external = external  # self-pinned ranks held as outside owners of CPUs
        self.namespaces = PidNamespaces()  # a caller in its own PID namespace

    def register(self, router: Router) -> None:
        router.add("bind", self.bind)
        router.add("unbind", self.unbind)
        router.add("jobs", self.list_jobs)

    async def bind(self, req: Request) -> dict[str, Any]:
        pid = await self.namespaces.host_pid(req.peer, req.arg("pid", int))
        cpus, mems, gpus = ids_arg(req, "cpus"), ids_arg(req, "mems"), ids_arg(req, "gpus")
        ask = BindRequest(pid=pid, peer=req.peer, source=BindSource.CLI, cpus=cpus, mems=mems,
                          gpus=tuple(sorted(gpus)) if gpus is not None else None,
                          nofile=req.arg("nofile", int, None),
                          exclusive=req.arg("exclusive", bool, False),
                          ncpus=req.arg("ncpus", int, None))
        return bind_reply(await self.pipeline.bind(ask))

    async def unbind(self, req: Request) -> dict[str, Any]:
        pid = await self.namespaces.host_pid(req.peer, req.arg("pid", int))
        out = dict(await self.jobs.unbind(pid, peer=req.peer))
        self.pipeline.unheld(pid)
        return out

    async def list_jobs(self, req: Request) -> dict[str, Any]:
        seen = ProcVisibility()  # hidepid: others' command lines stay hidden
        return {"jobs": seen.redact(req.peer, self.jobs.jobs()),
                "leases": seen.redact(req.peer, self.leases.list_leases()),
                "left_alone": seen.redact(req.peer, self._left_alone()),
                "external": seen.redact(req.peer, [dict(x) for x in self._external()]),
                # every CPU the ledger holds, by holder (the placer's held_cpus)
                "held": self.pipeline.placer.held_listing()}


def bind_reply(out: BindOutcome) -> dict[str, Any]:
    """The reply of ``bind``: the job record, what the change did, its timing."""
    plan = out.dry_run
    if plan is not None:
        return {"pid": out.pid, "dry_run": True, "cpus": _fmt(plan.cpus),
                "mems": _fmt(plan.mems), "nofile": plan.nofile[0] if plan.nofile else None,
                "notes": [*out.notes, "dry run: nothing was changed"],
                "elapsed_ms": out.elapsed_ms}
    rec, result = out.record, out.result
    if rec is None or result is None:  # nothing bound, nothing to say but why
        return {"pid": out.pid, "notes": out.notes, "bound": False, "why": out.reason}
    reply = rec.public()
    reply.update(result.to_json())
    reply.update(gpus=list(rec.gpus), rebind=out.rebind, apply_ms=reply.pop("elapsed_ms"),
                 save_ms=round(out.save_ms, 3), elapsed_ms=round(out.elapsed_ms, 3),
                 notes=out.notes)
    return reply


def _fmt(ids: frozenset[int] | None) -> str | None:
    return format_cpulist(ids) if ids is not None else None
