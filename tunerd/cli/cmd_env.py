"""tunerctl env: the node's [nccl] settings as shell exports (or JSON), from the daemon."""

from __future__ import annotations

import shlex
from typing import Any

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import Command


def _exports(r: dict[str, Any]) -> str:
    settings = {**r["nccl"], **(r.get("nic_env") or {})}
    lines = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(settings.items())]
    if r.get("nic_note"):
        lines.append(f"# {r['nic_note']}")
    if r.get("nccl_conf_file"):
        lines.append(f"# the same settings as a file: NCCL_CONF_FILE={r['nccl_conf_file']}")
    return "\n".join(lines) if lines else "# no [nccl] settings in the policy in force"


@click.command(cls=Command)
@click.option("--local-rank", "local_rank", type=click.IntRange(min=0), default=None,
              help="Also the rank's own NIC ([nccl] per_rank_nic): NCCL_IB_HCA or "
                   "NCCL_SOCKET_IFNAME and UCX_NET_DEVICES for its GPU's NIC.")
def env(local_rank: int | None) -> int:
    """Print the node's [nccl] settings as export lines.

    For jobs in containers, which never read the host's /etc/nccl.conf:
    eval "$(tunerctl env)" before the launcher, or --json for scripts.
    """
    ctx = get_ctx()
    args: dict[str, Any] = {}
    if local_rank is not None:
        args["local_rank"] = local_rank
        from tunerd.topology.iopath import rank_gpus

        gpus = rank_gpus(local_rank)
        if gpus is not None:
            args["gpus"] = gpus
    ctx.emit(ctx.call("env", **args), _exports)
    return 0
