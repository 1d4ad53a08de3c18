"""`topology`: the node the daemon works on (real, or the --topology replay)."""

from __future__ import annotations

from typing import Any

from tunerd.daemon.router import Request, Router
from tunerd.topology.model import Topology


class TopologyCommands:
    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def register(self, router: Router) -> None:
        router.add("topology", self.topology_)

    async def topology_(self, req: Request) -> dict[str, Any]:
        # read-only and free of secrets: any local user may ask
        result: dict[str, Any] = self.topology.to_json()
        return result
