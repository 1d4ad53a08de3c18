"""tunerctl env: the node's [nccl] settings as shell exports (or JSON), from the daemon."""

from __future__ import annotations

import os
import shlex
from typing import Any

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import Command


def _exports(r: dict[str, Any]) -> str:
    settings = {**r["nccl"], **(r.get("nic_env") or {}), **(r.get("rank_env") or {})}
    lines = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(settings.items())]
    if r.get("nic_note"):
        lines.append(f"# {r['nic_note']}")
    if r.get("nccl_conf_file"):
        lines.append(f"# the same settings as a file: NCCL_CONF_FILE={r['nccl_conf_file']}")
    return "\n".join(lines) if lines else "# no [nccl] settings in the policy in force"


@click.command(cls=Command)
@click.option("--local-rank", "local_rank", type=click.IntRange(min=0), default=None,
              help="Also the rank's slice (TUNERD_RANK_CPUS, OMP_NUM_THREADS) and, with "
                   "[nccl] per_rank_nic, its GPU's NIC (NCCL_IB_HCA or NCCL_SOCKET_IFNAME, "
                   "UCX_NET_DEVICES). Its GPU: the Nth of CUDA_VISIBLE_DEVICES (indices, "
                   "GPU-/MIG- UUIDs) inside the Slurm grant; one it cannot resolve: exit 2.")
def env(local_rank: int | None) -> int:
    """Print the node's [nccl] settings as export lines.

    For jobs in containers, which never read the host's /etc/nccl.conf:
    eval "$(tunerctl env)" before the launcher, or --json for scripts. With
    --local-rank N also TUNERD_RANK_CPUS (the slice of the node its GPU owns) and an
    OMP_NUM_THREADS that fits it.
    """
    ctx = get_ctx()
    args: dict[str, Any] = {}
    if local_rank is not None:
        from tunerd.topology.visible import resolve_env

        args["local_rank"] = local_rank
        args["environ"] = resolve_env(os.environ)  # the daemon resolves the rank's GPU
    ctx.emit(ctx.call("env", **args), _exports)
    return 0
