"""The policy in force: loaded for this node, replaced on reload, read through typed views.

Services never read the policy's raw tables: they get the few typed values
they need from here (housekeeping CPUs, the default fd limit, the lease limits,
the job rules), each computed in one place.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tunerd.base.errors import Failed
from tunerd.base.safefs import trusted_uids
from tunerd.jobs.leases import LeaseLimits
from tunerd.policy import NodeFacts, Policy, load_policy_dir
from tunerd.policy.typed import PolicyModel
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
        else, tunerd.base.safefs.read_trusted)."""
        return load_policy_dir(self.policy_dir, self.facts, trusted_uids())

    def load_staged(self, staged: Path) -> Policy:
        """Read a staged policy directory (the same checks as the policy dir's)."""
        return load_policy_dir(staged, self.facts)

    def install(self, staged: Path) -> list[str]:
        """Make the policy dir hold exactly the ``*.toml`` of ``staged``: every new file is
        written beside its place first (temporary name, fsync), then each is renamed into
        place and the files ``staged`` lacks are removed. A failed write removes what it
        wrote and changes nothing. The caller holds the reload lock, so the watcher's
        reload waits and then reads the whole new set. Returns the names installed."""
        if self.policy_dir is None:
            raise Failed("this daemon has no policy dir (it runs the bundled default): "
                         "start it with --policy-dir to install a staged one")
        names = sorted(f.name for f in staged.glob("*.toml") if not f.name.startswith("."))
        tmps: list[tuple[Path, Path]] = []
        try:
            for n in names:
                data = (staged / n).read_bytes()
                tmp = self.policy_dir / f".{n}.tunerd-staged"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644)
                tmps.append((tmp, self.policy_dir / n))
                try:
                    os.fchmod(fd, 0o644)
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as err:
            for tmp, _ in tmps:
                tmp.unlink(missing_ok=True)
            raise Failed(f"installing {staged} into {self.policy_dir}: {err.strerror} "
                         f"({err.filename}); nothing installed") from err
        for tmp, dest in tmps:
            os.replace(tmp, dest)
        for old in self.policy_dir.glob("*.toml"):
            if old.name not in names:
                old.unlink(missing_ok=True)
        return names

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
