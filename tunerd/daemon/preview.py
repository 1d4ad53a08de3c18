"""What a candidate policy directory would do, before it is put in force.

``tunerctl plan --policy-dir DIR`` asks the running daemon to load DIR for this
node (as a reload would, with the same checks), plan its host settings against
the host as it is now, and match its ``[[job]]`` rules against the processes
running now: a reload binds those at once. Nothing is changed: the policy in
force, the bindings and the host stay as they are. ``tunerctl reload
--no-rebind-running`` uses the same preview to refuse a policy that would bind
other users' running processes.

Rule matching goes through the watcher's own entry point (``RuleSet.match``) and
placement through ``AutoBinder.preview``, so the preview cannot disagree with
what a reload does.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from tunerd.adapters import procfs
from tunerd.base.cpulist import format_cpulist
from tunerd.base.errors import TunerdError, UsageError
from tunerd.base.safefs import trusted_uids
from tunerd.daemon.host import HostSettings
from tunerd.daemon.policyholder import PolicyHolder
from tunerd.daemon.router import Request, Router
from tunerd.jobs.autobind import AutoBinder
from tunerd.jobs.leases import user_name
from tunerd.policy import Policy, load_policy_dir
from tunerd.watch.rules import RuleSet

__all__ = ["PolicyPreview", "would_bind"]

_CMDLINE_SHOWN = 120


def would_bind(policy: Policy, autobind: AutoBinder,
               proc: str = procfs.PROC) -> list[dict[str, Any]]:
    """The running processes ``policy``'s rules would bind once in force (not those
    the rules in force bound already), with user and placement."""
    rules = RuleSet.from_policy(policy.model.jobs, proc)
    if not rules:
        return []
    me = os.getpid()
    out: list[dict[str, Any]] = []
    for pid in procfs.list_pids(proc):
        if pid == me or autobind.rule_bound(pid) is not None:
            continue
        m = rules.match(pid)
        if m is None:
            continue
        uid = m.uid if m.uid is not None else procfs.read_uid(pid, proc)
        cmd = m.cmdline if len(m.cmdline) <= _CMDLINE_SHOWN else \
            m.cmdline[:_CMDLINE_SHOWN - 1] + "\u2026"
        row: dict[str, Any] = {"pid": pid, "uid": uid, "user": user_name(uid),
                               "rule": m.rule.name, "cmdline": cmd, "error": None}
        try:
            placed = autobind.preview(m)
        except TunerdError as err:
            row["error"] = str(err)
        else:
            row.update(cpus=format_cpulist(placed.cpus or frozenset()),
                       mems=format_cpulist(placed.mems or frozenset()),
                       gpus=list(placed.gpus), notes=list(placed.notes))
        out.append(row)
    return out


def foreign(rows: list[dict[str, Any]], uid: int) -> list[dict[str, Any]]:
    """The rows of processes that belong to someone other than ``uid``."""
    return [r for r in rows if r["uid"] != uid]


class PolicyPreview:
    def __init__(self, policy: PolicyHolder, host: HostSettings, autobind: AutoBinder) -> None:
        self.policy = policy
        self.host = host
        self.autobind = autobind

    def register(self, router: Router) -> None:
        router.add("plan.preview", self.preview)

    async def preview(self, req: Request) -> dict[str, Any]:
        req.require_root("plan --policy-dir")
        directory = Path(req.arg("policy_dir", str))
        if not directory.is_dir():
            raise UsageError(f"--policy-dir {directory}: not a directory")
        loop = asyncio.get_running_loop()
        candidate = await loop.run_in_executor(
            None, load_policy_dir, directory, self.policy.facts,
            trusted_uids())  # PolicyError: exit 1
        return {"policy_dir": str(directory), "sources": candidate.sources,
                "skipped": candidate.skipped, "warnings": candidate.warnings,
                "host": self.host.plan(candidate),
                "would_bind": would_bind(candidate, self.autobind)}

    def refuse_rebind(self, candidate: Policy, uid: int,
                      directory: Path | None = None) -> str | None:
        """Why ``reload --no-rebind-running`` refuses ``candidate``, or None.
        ``directory``: where the candidate was read (``reload --policy-dir DIR``), which
        the hint's `tunerctl plan --policy-dir` must name; else the policy dir."""
        rows = foreign(would_bind(candidate, self.autobind), uid)
        if not rows:
            return None
        shown = ", ".join(f"pid {r['pid']} ({r['user']}, rule {r['rule']})" for r in rows[:5])
        more = f" and {len(rows) - 5} more" if len(rows) > 5 else ""
        return (f"refused (no rebinding of running processes: --no-rebind-running or config "
                f"reload_rebinds_running = false): the new policy would bind "
                f"{len(rows)} running process(es) of other users: {shown}{more}; "
                f"`tunerctl plan --policy-dir {directory or self.policy.policy_dir}` "
                f"lists them")
