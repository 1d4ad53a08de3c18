"""tunerctl status."""

from __future__ import annotations

from typing import Any

import click

from tunerd.cli.context import get_ctx


def _human_status(st: dict[str, Any]) -> str:
    lines = [f"tunerd pid {st['pid']}, up {st['uptime_s']:.0f} s"
             + (" (dry run)" if st.get("dry_run") else "")
             + (" (topology replay)" if st.get("replay") else "")]
    pol = st.get("policy", {})
    lines.append("policies: " + (", ".join(pol.get("sources") or []) or "none"))
    if pol.get("error"):
        lines.append(f"policy error (old policy kept): {pol['error']}")
    for name, svc in sorted((st.get("services") or {}).items()):
        summary = svc.get("summary") if isinstance(svc, dict) else None
        if summary:
            lines.append(f"{name}: {summary}")
    for e in st.get("errors") or []:
        lines.append(f"error [{e['source']}]: {e['message']}")
    return "\n".join(lines)


@click.command()
def status() -> int:
    """Daemon health, policies in force, errors, jobs, host summary."""
    ctx = get_ctx()
    st = ctx.call("status")
    ctx.emit(st, _human_status)
    return 1 if st.get("policy", {}).get("error") else 0
