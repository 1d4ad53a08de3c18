"""What policies match on (NodeFacts), the merged result (Policy), and PolicyError."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from tunerd.errors import PolicyError
from tunerd.policy.typed import PolicyModel

__all__ = ["NodeFacts", "Policy", "PolicyError"]


@dataclass(frozen=True)
class NodeFacts:
    """The node properties a ``[policy.match]`` table is tested against."""

    hostname: str = field(default_factory=socket.gethostname)
    gpu_models: tuple[str, ...] = ()

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_models)

    @classmethod
    def from_topology(cls, topo: Any) -> NodeFacts:
        return cls(hostname=topo.hostname, gpu_models=tuple(g.model for g in topo.gpus))


@dataclass
class Policy:
    """The merged, validated policy for one node.

    ``data`` is the merged policy as plain data (every section present, defaults
    filled in): what ``policy show`` prints. ``model`` is the same policy typed
    (tunerd.policy.typed), built by the loader after validation: what the tuners
    and services read.
    """

    data: dict[str, Any]
    sources: list[str]  # files merged, in merge order (extends first)
    model: PolicyModel
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"file", "reason"}

    @property
    def name(self) -> str:
        return str(self.data["policy"]["name"])

    def to_dict(self) -> dict[str, Any]:
        return {"sources": list(self.sources), "skipped": list(self.skipped), **self.data}
