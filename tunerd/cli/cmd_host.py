"""tunerctl plan | apply | verify | revert: the policy's host settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import Command, plural


def _v(value: Any) -> str:
    return "(unset)" if value is None else str(value)


def _unavailable(res: dict[str, Any]) -> list[str]:
    return [f"{c['key']}: not available: {c.get('reason')}" for c in res.get("unavailable", [])]


def _errors(res: dict[str, Any]) -> list[str]:
    out = []
    for e in res.get("errors", []):
        num = f" [errno {e['errno']}]" if e.get("errno") else ""
        out.append(f"error: {e['message']}{num}")
    return out


def _skipped(res: dict[str, Any]) -> list[str]:
    return [f"{k}: apply_once, already applied (operator owns it)"
            for k in res.get("apply_once_skipped", [])]


def _plan_only(res: dict[str, Any]) -> list[str]:
    why = res.get("plan_only")
    return [f"note: planned only, nothing is written to this machine ({why})"] if why else []


def _human_plan(res: dict[str, Any]) -> str:
    lines = [f"{c['key']}: {_v(c['current'])} -> {c['desired']}" for c in res["changes"]]
    if not lines:
        lines.append("nothing to change")
    return "\n".join(lines + _skipped(res) + _unavailable(res) + _plan_only(res)
                     + _rejected(res))


def _rejected(res: dict[str, Any]) -> list[str]:
    err = res.get("policy_error")
    if not err:
        return []
    return [f"error: the policy files were rejected, this plan is of the last good policy "
            f"still in force: {err}", "  (`tunerctl policy check` lists the problems)"]


def _human_apply(res: dict[str, Any]) -> str:
    lines = [f"reverted {r['key']} (no longer in the policy): {_v(r['from'])} -> {_v(r['to'])}"
             for r in res.get("reverted", [])]
    if res.get("dry_run"):
        lines += [f"dry run: would set {c['key']}: {_v(c['current'])} -> {c['desired']}"
                  for c in res.get("would_change", [])]
    lines += [f"{c['key']}: {_v(c['from'])} -> {_v(c['to'])}" for c in res["changed"]]
    if not res["changed"] and not res["errors"] and not res.get("would_change"):
        lines.append("nothing to change")
    return "\n".join(lines + _errors(res) + _skipped(res) + _unavailable(res)
                     + _plan_only(res))


def _human_verify(res: dict[str, Any]) -> str:
    lines = [f"drift: {c['key']}: current {_v(c['current'])}, policy wants {c['desired']}"
             for c in res["drift"]]
    if not lines:
        lines.append(f"no drift ({plural(res['checked'], 'setting')} checked)")
    if not res.get("enforcing", True):
        lines.append("note: settings were reverted; `tunerctl apply` enforces them again")
    return "\n".join(lines + _skipped(res) + _unavailable(res))


def _human_revert(res: dict[str, Any]) -> str:
    if res.get("dry_run"):
        lines = [f"dry run: would restore {r['key']} to {_v(r['to'])}"
                 for r in res.get("would_restore", [])]
    else:
        lines = [f"restored {r['key']}: {_v(r['from'])} -> {_v(r['to'])}" for r in res["restored"]]
    if not lines and not res["errors"]:
        lines.append("nothing to restore")
    return "\n".join(lines + _errors(res))


def _human_preview(res: dict[str, Any]) -> str:
    lines = [f"# candidate {res['policy_dir']}: files that apply, in merge order:"]
    lines += [f"#   {s}" for s in res["sources"]] or ["#   (none)"]
    lines += [f"# not applied: {s['file']}: {s['reason']}" for s in res.get("skipped") or []]
    lines += [f"# WARNING: {w}" for w in res.get("warnings") or []]
    lines += ["host settings a reload would change:"]
    lines += ["  " + ln for ln in _human_plan(res["host"]).splitlines()]
    rows = res["would_bind"]
    lines.append(f"running processes its [[job]] rules would bind at reload: {len(rows) or 'none'}")
    for r in rows:
        where = (f"error: {r['error']}" if r.get("error") else
                 f"cpus {r['cpus'] or '-'}, mems {r['mems'] or '-'}, "
                 f"gpus {','.join(map(str, r['gpus'])) or '-'}")
        lines.append(f"  pid {r['pid']} user {r['user']} rule {r['rule']}: {where}")
        lines.append(f"      {r['cmdline']}")
    return "\n".join(lines)


@click.command(cls=Command)
@click.option("--policy-dir", "policy_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Preview a candidate policy directory (root): its host changes and the "
                   "running processes its rules would bind. Nothing is changed.")
def plan(policy_dir: Path | None) -> int:
    """Show the host settings the policy would change (current -> desired).

    Exit 1 when the policy files on disk were rejected (a bad edit): the plan is then of
    the last good policy, which is still in force, and the error is shown."""
    ctx = get_ctx()
    if policy_dir is not None:
        ctx.emit(ctx.call("plan.preview", policy_dir=str(policy_dir.resolve())), _human_preview)
        return 0
    res = ctx.call("plan")
    ctx.emit(res, _human_plan)
    return 1 if res.get("policy_error") else 0


@click.command(cls=Command)
def apply() -> int:
    """Apply the policy's host settings now (root); exit 1 if any setting failed."""
    ctx = get_ctx()
    res = ctx.call("apply")
    ctx.emit(res, _human_apply)
    return 1 if res["errors"] else 0


@click.command(cls=Command)
def verify() -> int:
    """Report drift from the policy; exit 1 if any setting drifted."""
    ctx = get_ctx()
    res = ctx.call("verify")
    ctx.emit(res, _human_verify)
    return 1 if res["drift"] else 0


@click.command(cls=Command)
def revert() -> int:
    """Restore the saved original of every setting tunerd changed (root)."""
    ctx = get_ctx()
    res = ctx.call("revert")
    ctx.emit(res, _human_revert)
    return 1 if res["errors"] else 0
