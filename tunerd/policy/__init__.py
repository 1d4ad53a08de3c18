"""Policy files: TOML -> validated model; match, extends, merge.

STUB from the foundation skeleton: parses TOML and merges files in name order
without validation. The policy work item replaces it, keeping this interface:

- ``NodeFacts``: what policies match on.
- ``load_policy_dir(directory, facts) -> Policy`` raising ``PolicyError``.
- ``Policy.to_dict()``, ``Policy.sources``.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunerd.protocol import TunerdError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class PolicyError(TunerdError):
    code = "policy"


@dataclass(frozen=True)
class NodeFacts:
    hostname: str = field(default_factory=socket.gethostname)
    gpu_models: tuple[str, ...] = ()

    @property
    def gpu_count(self) -> int:
        return len(self.gpu_models)


@dataclass
class Policy:
    data: dict[str, Any]
    sources: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"sources": self.sources, **self.data}


def bundled_default() -> Path:
    return Path(__file__).resolve().parent.parent / "bundled_policies" / "default.toml"


def load_policy_dir(directory: Path | None, facts: NodeFacts) -> Policy:
    paths = sorted(directory.glob("*.toml")) if directory and directory.is_dir() else []
    if not paths:
        paths = [bundled_default()]
    data: dict[str, Any] = {}
    for p in paths:
        try:
            data.update(tomllib.loads(p.read_text()))
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise PolicyError(f"{p}: {err}", file=str(p)) from err
    return Policy(data=data, sources=[str(p) for p in paths])
