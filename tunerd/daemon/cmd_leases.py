"""Control-socket handlers: alloc, release, run, leases."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunerd.daemon.registry import Request, command
from tunerd.errors import Failed, UsageError

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon
    from tunerd.daemon.leases import LeaseService


def _svc(d: Daemon) -> LeaseService:
    if d.leases is None:
        raise Failed("the leases service is not running in this daemon")
    svc: LeaseService = d.leases
    return svc


def _cpu_count(req: Request) -> int | None:
    """``ncpus`` (a count); ``cpus`` is a cpulist string, or a count from an older tunerctl."""
    ncpus = req.arg("ncpus", int, None)
    cpus = req.args.get("cpus")
    if cpus is None:
        return ncpus
    if isinstance(cpus, int) and not isinstance(cpus, bool):  # legacy: one more release
        if ncpus is not None:
            raise UsageError(f"{req.cmd}: give 'ncpus' or a count in 'cpus', not both")
        return cpus
    req.arg("cpus", str)  # anything but a string or a count: a UsageError naming it
    raise UsageError(f"{req.cmd}: exact CPU lists (--cpus {cpus}) are not supported by this "
                     f"tunerd yet; ask for a count with --ncpus N")


def _common(req: Request) -> dict[str, Any]:
    scope = req.arg("exclusive_scope", str, None)
    return {
        "gpus": req.arg("gpus", int, 0),
        "cpus": _cpu_count(req),
        "exclusive": req.arg("exclusive", bool, False),
        "scope": scope,
        "tag": req.arg("tag", str, None),
    }


@command("alloc")
async def alloc(d: Daemon, req: Request) -> dict[str, Any]:
    """Reserve GPUs and CPUs for the caller's uid; returns the lease and its env."""
    return await _svc(d).alloc(req.peer, **_common(req))


@command("run")
async def run(d: Daemon, req: Request) -> dict[str, Any]:
    """Lease for the calling process itself (SO_PEERCRED pid), bound before it execs."""
    cmd = req.arg("command", list, [])
    if not all(isinstance(c, str) for c in cmd):
        raise UsageError("run: 'command' must be a list of strings")
    return await _svc(d).run(req.peer, cmd=cmd, **_common(req))


@command("release")
async def release(d: Daemon, req: Request) -> dict[str, Any]:
    """Release one lease (``lease``) or every lease with ``tag`` the caller may release."""
    tag = req.arg("tag", str, None)
    if tag is not None:
        released = await _svc(d).release_tagged(req.peer, tag)
        return {"tag": tag, "released": released}
    return await _svc(d).release(req.peer, req.arg("lease", str))


@command("leases")
async def leases(d: Daemon, req: Request) -> list[dict[str, Any]]:
    return _svc(d).list_leases()
