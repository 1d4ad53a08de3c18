"""`topology`: the node the daemon works on (real, or the --topology replay)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunerd.daemon.registry import Request, command

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon


@command("topology")
async def topology(d: Daemon, req: Request) -> dict[str, Any]:
    # read-only and free of secrets: any local user may ask
    result: dict[str, Any] = d.topology.to_json()
    return result
