"""Core commands: ping, status, reload, policy.show."""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tunerd.adapters import procfs
from tunerd.base.errors import Failed, UsageError
from tunerd.daemon.policyholder import PolicyHolder
from tunerd.daemon.router import Request, Router
from tunerd.daemon.visibility import HIDDEN, ProcVisibility
from tunerd.jobs.leases import user_name
from tunerd.policy import Policy

Guard = Callable[[Policy], "str | None"]


class CoreCommands:
    def __init__(self, status: Callable[[], dict[str, Any]],
                 reload: Callable[[Guard | None, Path | None], Awaitable[dict[str, Any]]],
                 policy: PolicyHolder,
                 refuse_rebind: Callable[[Policy, int, Path | None], str | None] | None = None
                 ) -> None:
        self._status = status
        self._reload = reload
        self.policy = policy
        self._refuse_rebind = refuse_rebind

    def register(self, router: Router) -> None:
        router.add("ping", self.ping)
        router.add("status", self.status)
        router.add("reload", self.reload)
        router.add("policy.show", self.policy_show)

    async def ping(self, req: Request) -> dict[str, Any]:
        return {"pong": True, "pid": os.getpid(), "peer_uid": req.peer.uid}

    async def status(self, req: Request) -> dict[str, Any]:
        return redact_status(ProcVisibility(), req.peer, self._status())

    async def reload(self, req: Request) -> dict[str, Any]:
        req.require_root("reload")
        staged: Path | None = None
        if req.arg("policy_dir", str, None) is not None:
            staged = Path(req.arg("policy_dir", str))
            if not staged.is_absolute() or not staged.is_dir():
                raise UsageError(f"--policy-dir {staged}: not an absolute path of a directory")
            if self.policy.policy_dir is not None and \
                    staged.resolve() == self.policy.policy_dir.resolve():
                raise UsageError(f"--policy-dir {staged} is the policy dir itself: stage the "
                                 f"new files in another directory")
        guard: Guard | None = None
        refuse = self._refuse_rebind
        if req.arg("no_rebind_running", bool, False) and refuse is not None:
            uid = req.peer.uid

            def guard(p: Policy) -> str | None:
                return refuse(p, uid, staged)  # the hint names the candidate's dir
        return await self._reload(guard, staged)

    async def policy_show(self, req: Request) -> dict[str, Any]:
        if self.policy.policy is None:
            raise Failed("no policy loaded")
        out = self.policy.policy.to_dict()
        if req.arg("explain", bool, False):
            out["provenance"] = self.policy.policy.provenance
        differs = self._on_disk()
        if differs:
            out["on_disk"] = differs
        return out

    def _on_disk(self) -> dict[str, Any] | None:
        """How the policy dir differs from the policy in force (an edit the last reload
        rejected, or one not reloaded yet): files changed or gone since it was loaded,
        files added; None when it matches."""
        pol, d, since = self.policy.policy, self.policy.policy_dir, self.policy.loaded_at
        if pol is None or d is None or since is None:
            return None
        changed: list[str] = []
        for f in pol.sources:
            if not f.startswith(str(d)):
                continue  # a bundled policy pulled in by extends
            try:
                if os.stat(f).st_mtime > since:
                    changed.append(f)
            except OSError:
                changed.append(f"{f} (gone)")
        known = set(pol.sources) | {s["file"] for s in pol.skipped}
        try:
            new = sorted(str(f) for f in d.glob("*.toml")
                         if not f.name.startswith(".") and str(f) not in known)
        except OSError:
            new = []
        if not (changed or new or self.policy.error):
            return None
        return {"changed": changed, "new": new, "rejected": self.policy.error}


def redact_status(seen: ProcVisibility, peer: Any, st: dict[str, Any]) -> dict[str, Any]:
    """``st`` (Daemon.status) as ``peer`` may see it where /proc is mounted hidepid:
    the rules' bound and left-alone processes of other users without the text their
    command lines and environments put there (notes, why), and the errors about such a
    process ("rule R, pid N: ...") without their message."""
    if not peer.is_root:
        st = _others_pids_hidden(_policy_text_hidden(st), peer)
    if seen.sees_all(peer)[0]:
        return st
    st = dict(st)
    auto = (st.get("services") or {}).get("autobind")
    if isinstance(auto, dict) and ("bound" in auto or "left_alone" in auto):
        auto = dict(auto)
        auto["bound"] = seen.redact(peer, auto.get("bound") or [])
        auto["left_alone"] = seen.redact(peer, auto.get("left_alone") or [])
        if auto.get("last_error"):
            auto["last_error"] = _problem_hidden(seen, peer, str(auto["last_error"]))
        st["services"] = {**st["services"], "autobind": auto}
    for k in ("errors", "warnings", "resolved_errors"):
        st[k] = [p if p.get("source") != "autobind" else
                 {**p, "message": _problem_hidden(seen, peer, str(p.get("message", "")))}
                 for p in st.get(k) or []]
    return st


# "/etc/tunerd/policies/x.toml: line 3, column 5: ..." -> the path and the line
_POLICY_AT = re.compile(r"(/[^\s:]*\.toml)(?:: (line \d+))?")
POLICY_TEXT_HIDDEN = "(details for root: tunerctl status as root, or the daemon's log)"


def policy_error_public(message: str) -> str:
    """A policy error as a non-root user may read it: the files and lines it names,
    none of their text (a key, a value, a line quoted: a symlink to a root-only file
    would show its first line)."""
    head = message.split("/", 1)[0].rstrip()
    where = []
    for m in _POLICY_AT.finditer(message):
        w = m.group(1) + (f": {m.group(2)}" if m.group(2) else "")
        if w not in where:
            where.append(w)
    if not where:
        return message if " writable by " in message or " owned by " in message \
            else f"{head} {POLICY_TEXT_HIDDEN}".strip()
    return f"{head} {'; '.join(where)} {POLICY_TEXT_HIDDEN}".strip()


def _others_pids_hidden(st: dict[str, Any], peer: Any) -> dict[str, Any]:
    """The rules' work as a non-root ``peer`` may see it: the PIDs of processes a rule
    bound or left alone, their steps' times and the exec timeline (each exec's
    CLOCK_MONOTONIC stamps, to the nanosecond) only for her own processes; others'
    entries keep the rule, the user and the CPUs, without a PID."""
    auto = (st.get("services") or {}).get("autobind")
    if not isinstance(auto, dict):
        return st
    me = user_name(peer.uid)
    owner: dict[int, bool] = {}

    def mine(pid: Any, user: Any = None) -> bool:
        if not isinstance(pid, int):
            return False
        if user is not None:
            return bool(user == me)
        if pid not in owner:
            owner[pid] = procfs.read_uid(pid) == peer.uid
        return owner[pid]

    auto = dict(auto)
    auto["bound"] = [b if mine(b.get("pid"), b.get("user"))
                     else {**b, "pid": None, "timing": None}
                     for b in auto.get("bound") or []]
    auto["left_alone"] = [a if mine(a.get("pid")) else {**a, "pid": None}
                          for a in auto.get("left_alone") or []]
    auto["timeline_ns"] = [t for t in auto.get("timeline_ns") or []
                           if t and mine(t[0])]
    return {**st, "services": {**st["services"], "autobind": auto}}


def _policy_text_hidden(st: dict[str, Any]) -> dict[str, Any]:
    st = dict(st)
    pol = st.get("policy")
    if isinstance(pol, dict) and pol.get("error"):
        st["policy"] = {**pol, "error": policy_error_public(str(pol["error"]))}
    for k in ("errors", "warnings", "resolved_errors"):
        st[k] = [{**p, "message": policy_error_public(str(p.get("message", "")))}
                 if p.get("source") == "reload" else p for p in st.get(k) or []]
    return st


def _problem_hidden(seen: ProcVisibility, peer: Any, message: str) -> str:
    """"rule R, pid N: MESSAGE" with MESSAGE hidden unless pid N is ``peer``'s."""
    head, sep, _ = message.partition(": ")
    pid = head.rpartition(", pid ")[2]
    if sep and pid.isdigit() and seen.owner(int(pid)) == peer.uid:
        return message
    return f"{head}{sep}{HIDDEN}" if sep else HIDDEN
