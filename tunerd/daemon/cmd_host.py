"""Host-settings commands: plan and verify (anyone), apply and revert (root)."""

from __future__ import annotations

from typing import Any

from tunerd.daemon.host import HostSettings
from tunerd.daemon.router import Request, Router


class HostCommands:
    def __init__(self, host: HostSettings) -> None:
        self.host = host

    def register(self, router: Router) -> None:
        router.add("plan", self.plan)
        router.add("verify", self.verify)
        router.add("apply", self.apply)
        router.add("revert", self.revert)

    async def plan(self, req: Request) -> dict[str, Any]:
        return self.host.plan()

    async def verify(self, req: Request) -> dict[str, Any]:
        return self.host.verify()

    async def apply(self, req: Request) -> dict[str, Any]:
        req.require_root("apply (changing host settings)")
        return await self.host.apply("apply")

    async def revert(self, req: Request) -> dict[str, Any]:
        req.require_root("revert (changing host settings)")
        return await self.host.revert()
