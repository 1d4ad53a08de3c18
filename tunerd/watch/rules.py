"""``[[job]]`` rules: which exec'd processes the daemon binds by itself.

A rule matches when every key it gives matches (README, "Policies"):

* ``match.cmdline`` -- any of the globs matches the whole command line, its
  NUL-separated arguments joined by single spaces (``python -u train.py --lr 3``);
* ``match.env`` -- every listed variable is set and its value matches the glob
  (``LOCAL_RANK = "*"`` means "is set");
* ``match.user`` -- the real uid is one of the named users (names or numbers).

Matching runs for every exec on the host, so the order of work is chosen by
cost: the command line (one small read, one precompiled regex for all rules)
first, environ (a larger read) only after a command line matched.
"""

from __future__ import annotations

import fnmatch
import logging
import pwd
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from tunerd.policy.typed import JobSpec, TorchSettings
from tunerd.watch import procfs

__all__ = ["JobRule", "RuleMatch", "RuleSet"]

log = logging.getLogger("tunerd.rules")


def _glob_regex(globs: tuple[str, ...]) -> re.Pattern[str] | None:
    if not globs:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in globs))


@dataclass(frozen=True)
class JobRule:
    name: str
    cmdline: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    users: tuple[str, ...] = ()
    placement: str = "gpu-local"
    cpus: frozenset[int] | None = None
    gpus: int | None = None
    nofile: int | None = None
    exclusive: bool = False
    exclusive_scope: str | None = None
    uids: frozenset[int] = field(default=frozenset(), compare=False)
    cmd_re: re.Pattern[str] | None = field(default=None, compare=False, repr=False)
    env_re: tuple[tuple[str, re.Pattern[str]], ...] = field(default=(), compare=False,
                                                             repr=False)
    workers: int | None = None  # DataLoader workers per rank: placement room
    # what tunerd.torch applies in the processes this rule bound
    torch: TorchSettings = field(default_factory=TorchSettings)

    @classmethod
    def from_policy(cls, spec: JobSpec) -> JobRule:
        """Build from one typed ``[[job]]`` rule of the policy in force."""
        uids: set[int] = set()
        for u in spec.users:
            if u.isdigit():
                uids.add(int(u))
                continue
            try:
                uids.add(pwd.getpwnam(u).pw_uid)
            except KeyError:
                log.warning("job rule %r: user %r does not exist on this node", spec.name, u)
        env = tuple(sorted(spec.env.items()))
        return cls(
            name=spec.name, cmdline=spec.cmdline, env=env, users=spec.users,
            placement=spec.placement, cpus=spec.cpus, gpus=spec.gpus, nofile=spec.nofile,
            exclusive=spec.exclusive, exclusive_scope=spec.exclusive_scope,
            workers=spec.workers, torch=spec.torch,
            uids=frozenset(uids), cmd_re=_glob_regex(spec.cmdline),
            env_re=tuple((k, re.compile(fnmatch.translate(v))) for k, v in env),
        )

    def matches(self, cmdline: str, uid: int | None, env: dict[str, str] | None) -> bool:
        if self.cmd_re is not None and not self.cmd_re.match(cmdline):
            return False
        if self.users and uid not in self.uids:
            return False
        if self.env_re:
            if env is None:
                return False
            for var, rx in self.env_re:
                val = env.get(var)
                if val is None or not rx.match(val):
                    return False
        return True


@dataclass(frozen=True)
class RuleMatch:
    rule: JobRule
    pid: int
    cmdline: str
    uid: int | None
    env: dict[str, str]


class RuleSet:
    """All rules of the policy in force, with a one-regex early reject."""

    def __init__(self, rules: list[JobRule], proc: str = procfs.PROC) -> None:
        self.rules = rules
        self.proc = proc
        # A rule without a cmdline glob must look at every exec; otherwise one
        # regex built from every rule's globs rejects unrelated commands at once.
        self._all_need_cmd = all(r.cmd_re is not None for r in self.rules)
        globs = tuple(g for r in self.rules for g in r.cmdline)
        self._any_cmd = _glob_regex(globs)
        self._need_uid = any(r.users for r in self.rules)

    @classmethod
    def from_policy(cls, jobs: Iterable[JobSpec], proc: str = procfs.PROC) -> RuleSet:
        """The rules of the policy in force (``Policy.model.jobs``), in policy order."""
        return cls([JobRule.from_policy(j) for j in jobs], proc)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def match(self, pid: int) -> RuleMatch | None:
        """The first rule matching process ``pid``, or None (also when it is gone)."""
        if not self.rules:
            return None
        cmdline = procfs.read_cmdline(pid, self.proc)
        if not cmdline:  # gone, or a kernel thread
            return None
        if self._all_need_cmd and self._any_cmd is not None and not self._any_cmd.match(cmdline):
            return None
        uid = procfs.read_uid(pid, self.proc) if self._need_uid else None
        env: dict[str, str] | None = None
        for rule in self.rules:
            if rule.cmd_re is not None and not rule.cmd_re.match(cmdline):
                continue
            if rule.env_re and env is None:
                env = procfs.read_environ(pid, self.proc)
            if rule.matches(cmdline, uid, env):
                if env is None:  # binding needs LOCAL_RANK / CUDA_VISIBLE_DEVICES
                    env = procfs.read_environ(pid, self.proc)
                if uid is None:
                    uid = procfs.read_uid(pid, self.proc)
                return RuleMatch(rule, pid, cmdline, uid, env or {})
        return None
