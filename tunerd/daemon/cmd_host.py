"""Host-settings commands: plan and verify (anyone), apply and revert (root)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tunerd.daemon.cmd_core import policy_error_public
from tunerd.daemon.host import HostSettings
from tunerd.daemon.router import Request, Router


class HostCommands:
    def __init__(self, host: HostSettings,
                 policy_error: Callable[[], str | None] = lambda: None) -> None:
        self.host = host
        self.policy_error = policy_error  # the last rejected reload's, until one succeeds

    def register(self, router: Router) -> None:
        router.add("plan", self.plan)
        router.add("verify", self.verify)
        router.add("apply", self.apply)
        router.add("revert", self.revert)

    async def plan(self, req: Request) -> dict[str, Any]:
        out = self.host.plan()
        err = self.policy_error()
        if err is not None:  # the plan is of the last good policy, not of the files
            out["policy_error"] = err if req.peer.uid == 0 else policy_error_public(err)
        return out

    async def verify(self, req: Request) -> dict[str, Any]:
        return self.host.verify()

    async def apply(self, req: Request) -> dict[str, Any]:
        req.require_root("apply (changing host settings)")
        return await self.host.apply("apply")

    async def revert(self, req: Request) -> dict[str, Any]:
        req.require_root("revert (changing host settings)")
        return await self.host.revert()
