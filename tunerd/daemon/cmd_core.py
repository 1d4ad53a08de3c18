"""Core commands: ping, status, reload, policy.show."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tunerd.daemon.policyholder import PolicyHolder
from tunerd.daemon.router import Request, Router
from tunerd.daemon.visibility import HIDDEN, ProcVisibility
from tunerd.errors import Failed, UsageError
from tunerd.policy import Policy

Guard = Callable[[Policy], "str | None"]


class CoreCommands:
    def __init__(self, status: Callable[[], dict[str, Any]],
                 reload: Callable[[Guard | None, Path | None], Awaitable[dict[str, Any]]],
                 policy: PolicyHolder,
                 refuse_rebind: Callable[[Policy, int], str | None] | None = None) -> None:
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
        guard: Guard | None = None
        refuse = self._refuse_rebind
        if req.arg("no_rebind_running", bool, False) and refuse is not None:
            uid = req.peer.uid

            def guard(p: Policy) -> str | None:
                return refuse(p, uid)
        staged: Path | None = None
        if req.arg("policy_dir", str, None) is not None:
            staged = Path(req.arg("policy_dir", str))
            if not staged.is_absolute() or not staged.is_dir():
                raise UsageError(f"--policy-dir {staged}: not an absolute path of a directory")
            if self.policy.policy_dir is not None and \
                    staged.resolve() == self.policy.policy_dir.resolve():
                raise UsageError(f"--policy-dir {staged} is the policy dir itself: stage the "
                                 f"new files in another directory")
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


def _problem_hidden(seen: ProcVisibility, peer: Any, message: str) -> str:
    """"rule R, pid N: MESSAGE" with MESSAGE hidden unless pid N is ``peer``'s."""
    head, sep, _ = message.partition(": ")
    pid = head.rpartition(", pid ")[2]
    if sep and pid.isdigit() and seen.owner(int(pid)) == peer.uid:
        return message
    return f"{head}{sep}{HIDDEN}" if sep else HIDDEN
