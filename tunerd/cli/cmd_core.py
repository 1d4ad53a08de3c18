"""tunerctl status and reload."""

from __future__ import annotations

import time
from typing import Any

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import Command


def _ago(t: float | None) -> str:
    if not t:
        return "?"
    s = max(0, int(time.time() - t))
    if s < 120:
        return f"{s} s ago"
    if s < 7200:
        return f"{s // 60} min ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _problem(kind: str, e: dict[str, Any]) -> str:
    times = f" (x{e['count']})" if e.get("count", 1) > 1 else ""
    return f"{kind} [{e['source']}] {_ago(e.get('time'))}{times}: {e['message']}"


def _human_status(st: dict[str, Any]) -> str:
    lines = [f"tunerd {st.get('version', '')} pid {st['pid']}, up {st['uptime_s']:.0f} s"
             + (" (dry run)" if st.get("dry_run") else "")
             + (f" (topology replay: {st['replay']})" if st.get("replay") else "")]
    pol = st.get("policy", {})
    lines.append("policies: " + (", ".join(pol.get("names") or []) or "none") + " (files: "
                 + (", ".join(pol.get("sources") or []) or "none") + ")")
    if pol.get("error"):
        lines.append(f"policy error (old policy kept): {pol['error']}")
    for name, svc in sorted((st.get("services") or {}).items()):
        summary = svc.get("summary") if isinstance(svc, dict) else None
        if summary:
            lines.append(f"{name}: {summary}")
    lines += [_problem("error", e) for e in st.get("errors") or []]
    lines += [_problem("warning", e) for e in st.get("warnings") or []]
    recent = [e for e in st.get("resolved_errors") or []
              if time.time() - (e.get("resolved_at") or 0) < 3600]
    lines += [f"resolved {_ago(e.get('resolved_at'))}: [{e['source']}] {e['message']}"
              for e in recent[-3:]]
    return "\n".join(lines)


@click.command(cls=Command)
def status() -> int:
    """Daemon health, policies in force, errors, jobs, host summary.

    Exits 1 while the daemon has unresolved errors (a rejected policy, a rule that
    failed to bind, a setting it could not apply).
    """
    ctx = get_ctx()
    st = ctx.call("status")
    ctx.emit(st, _human_status)
    healthy = st.get("healthy", not st.get("policy", {}).get("error"))
    return 0 if healthy else 1


def _human_reload(r: dict[str, Any]) -> str:
    if r.get("reloaded"):
        lines = []
        if r.get("staged"):
            lines.append(f"installed from {r['staged']}: "
                         + (", ".join(r.get("installed") or []) or "no file"))
        lines.append("reloaded; in force: " + (", ".join(r.get("in_force") or [])
                                               or "no file (empty policy)"))
        lines += [f"warning: {w}" for w in r.get("warnings") or []]
        return "\n".join(lines)
    since = r.get("in_force_since")
    when = f", loaded {_ago(since)}" if since else ""
    files = ", ".join(r.get("in_force") or []) or "the bundled default"
    head = "refused" if r.get("refused") else "rejected"
    if r.get("staged"):
        return (f"{head}: nothing installed from {r['staged']}; still in force: {files}"
                f"{when}\n{r.get('error')}")
    return f"{head}; still in force: {files}{when}\n{r.get('error')}"


@click.command(cls=Command)
@click.option("--policy-dir", "staged", type=click.Path(file_okay=False),
              default=None, metavar="DIR",
              help="Check the staged policy files in DIR and, only if they are accepted, "
                   "install them as the policy dir's whole content and put them in force, "
                   "in one step (the watcher does not see a half-copied set).")
@click.option("--no-rebind-running", "no_rebind", is_flag=True,
              help="Refuse the new policy if its [[job]] rules would bind running processes "
                   "of other users (default: they are bound at once; see `tunerctl plan "
                   "--policy-dir`).")
def reload(staged: str | None, no_rebind: bool) -> int:
    """Re-read the policy files (root): the files in force, or the error (old policy kept).

    By default the new rules also bind the matching processes that already run, of
    every user; --no-rebind-running refuses such a policy instead (exit 1). With
    --policy-dir DIR the candidate is checked first and installed only when accepted.
    """
    ctx = get_ctx()
    args: dict[str, Any] = {}
    if no_rebind:
        args["no_rebind_running"] = True
    if staged is not None:
        import os

        args["policy_dir"] = os.path.abspath(staged)
    r = ctx.call("reload", **args)
    ctx.emit(r, _human_reload)
    return 0 if r.get("reloaded") else 1
