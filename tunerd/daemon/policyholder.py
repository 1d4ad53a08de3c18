"""The policy in force: loaded for this node, replaced on reload, read through typed views.

Services never read the policy's raw tables: they get the few typed values
they need from here (housekeeping CPUs, the default fd limit, the lease limits,
the job rules), each computed in one place.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tunerd.cpulist import CpuListError, parse_cpulist
from tunerd.daemon.leases import LeaseLimits
from tunerd.policy import NodeFacts, Policy, load_policy_dir
from tunerd.watch.rules import RuleSet

__all__ = ["PolicyHolder"]


class PolicyHolder:
    def __init__(self, policy_dir: Path | None, facts: NodeFacts) -> None:
        self.policy_dir = policy_dir
        self.facts = facts
        self.policy: Policy | None = None
        self.loaded_at: float | None = None
        self.error: str | None = None  # the last rejected reload, until one succeeds

    def load(self) -> Policy:
        """Read the policy directory for this node (PolicyError when a file is bad)."""
        return load_policy_dir(self.policy_dir, self.facts)

    def put(self, policy: Policy) -> None:
        self.policy, self.error, self.loaded_at = policy, None, time.time()

    @property
    def data(self) -> dict[str, Any]:
        return self.policy.data if self.policy is not None else {}

    # -- typed views ---------------------------------------------------------------
    def housekeeping(self) -> frozenset[int]:
        hk = (self.data.get("cpu") or {}).get("housekeeping")
        if not hk:
            return frozenset()
        try:
            return parse_cpulist(str(hk))
        except CpuListError:  # validated by the loader: cannot happen
            return frozenset()

    def default_nofile(self) -> int | None:
        """``[limits] nofile``: the fd limit of rule and lease binds."""
        value = (self.data.get("limits") or {}).get("nofile")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def lease_limits(self) -> LeaseLimits:
        raw = self.data.get("leases") or {}
        d = LeaseLimits()
        return LeaseLimits(
            user_exclusive=bool(raw.get("user_exclusive", d.user_exclusive)),
            max_per_user=int(raw.get("max_per_user", d.max_per_user)),
            alloc_ttl=float(raw.get("alloc_ttl", d.alloc_ttl)))

    def rules(self) -> RuleSet:
        return RuleSet.from_policy(self.data)

    def summary(self) -> str:
        if self.policy is None:
            return "no policy"
        return ", ".join(self.policy.sources) or "no policy file applies: empty policy"
