"""The policy in force: loaded for this node, replaced on reload, read through typed views.

Services never read the policy's raw tables: they get the few typed values
they need from here (housekeeping CPUs, the default fd limit, the lease limits,
the job rules), each computed in one place.
"""

from __future__ import annotations

import time
from pathlib import Path

from tunerd.daemon.leases import LeaseLimits
from tunerd.policy import NodeFacts, Policy, load_policy_dir
from tunerd.policy.typed import PolicyModel
from tunerd.safefs import trusted_uids
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
        """Read the policy directory for this node (PolicyError when a file is bad, or
        the directory or a file is not trusted: owned by root and writable by no one
        else, tunerd.safefs.read_trusted)."""
        return load_policy_dir(self.policy_dir, self.facts, trusted_uids())

    def put(self, policy: Policy) -> None:
        self.policy, self.error, self.loaded_at = policy, None, time.time()

    @property
    def model(self) -> PolicyModel:
        return self.policy.model if self.policy is not None else PolicyModel()

    # -- typed views ---------------------------------------------------------------
    def housekeeping(self) -> frozenset[int]:
        return self.model.cpu.housekeeping

    def default_nofile(self) -> int | None:
        """``[limits] nofile``: the fd limit of rule and lease binds."""
        return self.model.limits.nofile

    def lease_limits(self) -> LeaseLimits:
        lp = self.model.leases
        return LeaseLimits(user_exclusive=lp.user_exclusive, max_per_user=lp.max_per_user,
                           alloc_ttl=float(lp.alloc_ttl))

    def rules(self) -> RuleSet:
        return RuleSet.from_policy(self.model.jobs)

    def summary(self) -> str:
        return self.policy.describe() if self.policy is not None else "no policy"
