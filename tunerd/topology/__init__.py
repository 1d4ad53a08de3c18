"""Node topology: CPUs, cores, NUMA nodes, GPUs, links, NICs.

STUB from the foundation skeleton; the topology work item replaces it, keeping
``load_topology(snapshot: Path | None) -> Topology`` with ``.hostname`` and
``.gpus`` (each with ``.model``).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Topology:
    hostname: str = field(default_factory=socket.gethostname)
    gpus: list[Any] = field(default_factory=list)
    replayed: bool = False


def load_topology(snapshot: Path | None = None) -> Topology:
    return Topology(replayed=snapshot is not None)
