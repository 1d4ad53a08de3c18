"""What policies match on (NodeFacts), the merged result (Policy), and PolicyError."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from tunerd.base.errors import PolicyError
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

    def describe(self) -> str:
        """``hostname "dgx-01", 8 GPUs (8x NVIDIA H100 80GB HBM3)`` / ``..., no GPU``."""
        counts: dict[str, int] = {}
        for m in self.gpu_models:
            counts[m] = counts.get(m, 0) + 1
        gpus = ", ".join(f"{n}x {m}" for m, n in counts.items())
        n = self.gpu_count
        what = "no GPU" if not n else f"{n} GPU{'s' if n > 1 else ''} ({gpus})"
        return f"hostname {self.hostname!r}, {what}"


@dataclass
class Policy:
    """The merged, validated policy for one node.

    ``data`` is the merged policy as plain data (every section present, defaults
    filled in): what ``policy show`` prints. ``model`` is the same policy typed
    (tunerd.policy.typed), built by the loader after validation: what the tuners
    and services read. ``warnings`` are problems that did not stop the load (for
    the log, ``tunerctl status`` and ``policy check``).
    """

    data: dict[str, Any]
    sources: list[str]  # files merged, in merge order (extends first)
    model: PolicyModel
    skipped: list[dict[str, str]] = field(default_factory=list)  # {"file", "reason"}
    warnings: list[str] = field(default_factory=list)
    # effective key (``limits.nofile``) -> {"file", "line", "value", "policy", "overrode"}
    provenance: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.data["policy"]["name"])

    def describe(self) -> str:
        """One line for logs: ``base, h100-training (2 files)`` or why nothing applies."""
        names = self.model.info.names
        if names:
            n = len(self.sources)
            return f"{', '.join(names)} ({n} file{'s' if n != 1 else ''})"
        files = {s["file"] for s in self.skipped}
        if files:
            n = len(files)
            return f"none matched: empty policy ({n} file{'s' if n != 1 else ''} skipped)"
        return "empty policy (no policy files)"

    def to_dict(self) -> dict[str, Any]:
        return {"sources": list(self.sources), "skipped": list(self.skipped),
                "warnings": list(self.warnings), **self.data}
