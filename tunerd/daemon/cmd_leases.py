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


def _common(req: Request) -> dict[str, Any]:
    scope = req.arg("exclusive_scope", str, None)
    return {
        "gpus": req.arg("gpus", int, 0),
        "cpus": req.arg("cpus", int, None),
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
