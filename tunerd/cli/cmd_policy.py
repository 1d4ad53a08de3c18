"""tunerctl policy check|show."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from tunerd.cli.context import get_ctx


@click.group()
def policy() -> None:
    """Validate policy files, or show the policy in force."""


@policy.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
def check(paths: tuple[Path, ...]) -> int:
    """Validate policy files offline (no daemon needed). Exit 1 on any error."""
    from tunerd.policy import check_paths

    ctx = get_ctx()
    targets = list(paths) or [Path("/etc/tunerd/policies")]
    report = check_paths(targets)
    if ctx.as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for f in report["files"]:
            if f["errors"]:
                for e in f["errors"]:
                    click.echo(f"FAIL {e}")
            else:
                click.echo(f"ok   {f['file']} (policy {f.get('name')!r})")
    return 1 if any(f["errors"] for f in report["files"]) or not report["files"] else 0


@policy.command()
def show() -> None:
    """The effective merged policy for this node (from the daemon)."""
    ctx = get_ctx()
    result = ctx.call("policy.show")

    def human(r: dict[str, Any]) -> str:
        from tunerd.policy.render import render_toml

        return render_toml(r)

    ctx.emit(result, human)
