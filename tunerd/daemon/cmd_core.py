"""Core commands: ping, status, reload, policy.show."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from tunerd.daemon.policyholder import PolicyHolder
from tunerd.daemon.router import Request, Router
from tunerd.errors import Failed
from tunerd.policy import Policy

Guard = Callable[[Policy], "str | None"]


class CoreCommands:
    def __init__(self, status: Callable[[], dict[str, Any]],
                 reload: Callable[[Guard | None], Awaitable[dict[str, Any]]],
                 policy: PolicyHolder,
                 refuse_rebind: Callable[[Policy, int], str | None] | None = None) -> None:
        self._status = status
        self._reload = reload
        self.policy = policy
        self._refuse_rebind = refuse_rebind

    def register(self, router: Router) -> None:
        router.add("ping", self.ping)
        router.add("status", self.status)
        router.add("reload", self.reload)
        router.add("policy.show", self.policy_show)

    async def ping(self, req: Request) -> dict[str, Any]:
        return {"pong": True, "pid": os.getpid(), "peer_uid": req.peer.uid}

    async def status(self, req: Request) -> dict[str, Any]:
        return self._status()

    async def reload(self, req: Request) -> dict[str, Any]:
        req.require_root("reload")
        guard: Guard | None = None
        refuse = self._refuse_rebind
        if req.arg("no_rebind_running", bool, False) and refuse is not None:
            uid = req.peer.uid

            def guard(p: Policy) -> str | None:
                return refuse(p, uid)
        return await self._reload(guard)

    async def policy_show(self, req: Request) -> dict[str, Any]:
        if self.policy.policy is None:
            raise Failed("no policy loaded")
        out = self.policy.policy.to_dict()
        if req.arg("explain", bool, False):
            out["provenance"] = self.policy.policy.provenance
        return out
