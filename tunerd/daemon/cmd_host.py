"""Host-settings commands: plan and verify (anyone), apply and revert (root)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunerd.daemon.registry import Request, command
from tunerd.errors import Failed

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon


def _host(d: Daemon) -> Any:
    if d.host is None:
        raise Failed("the host-settings service is not running in this daemon")
    return d.host


@command("plan")
async def plan(d: Daemon, req: Request) -> dict[str, Any]:
    return _host(d).plan()


@command("verify")
async def verify(d: Daemon, req: Request) -> dict[str, Any]:
    return _host(d).verify()


@command("apply")
async def apply(d: Daemon, req: Request) -> dict[str, Any]:
    req.require_root("apply (changing host settings)")
    return await _host(d).apply("apply")


@command("revert")
async def revert(d: Daemon, req: Request) -> dict[str, Any]:
    req.require_root("revert (changing host settings)")
    return await _host(d).revert()
