"""Core commands: ping, status, reload, policy."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tunerd.daemon.registry import Request, command

if TYPE_CHECKING:
    from tunerd.daemon.app import Daemon


@command("ping")
async def ping(d: Daemon, req: Request) -> dict[str, Any]:
    return {"pong": True, "pid": __import__("os").getpid(), "peer_uid": req.peer.uid}


@command("status")
async def status(d: Daemon, req: Request) -> dict[str, Any]:
    return d.status()


@command("reload")
async def reload(d: Daemon, req: Request) -> dict[str, Any]:
    req.require_root("reload")
    ok = await d.reload()
    return {"reloaded": ok, "error": d.policy_error}


@command("policy.show")
async def policy_show(d: Daemon, req: Request) -> dict[str, Any]:
    assert d.policy is not None
    return d.policy.to_dict()
