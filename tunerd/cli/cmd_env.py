"""tunerctl env: the node's [nccl] settings as shell exports (or JSON), from the daemon."""

from __future__ import annotations

import shlex
from typing import Any

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import Command


def _exports(r: dict[str, Any]) -> str:
    lines = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(r["nccl"].items())]
    if r.get("nccl_conf_file"):
        lines.append(f"# the same settings as a file: NCCL_CONF_FILE={r['nccl_conf_file']}")
    return "\n".join(lines) if lines else "# no [nccl] settings in the policy in force"


@click.command(cls=Command)
def env() -> int:
    """Print the node's [nccl] settings as export lines.

    For jobs in containers, which never read the host's /etc/nccl.conf:
    eval "$(tunerctl env)" before the launcher, or --json for scripts.
    """
    ctx = get_ctx()
    ctx.emit(ctx.call("env"), _exports)
    return 0
