"""The node's ``[nccl]`` settings for a training process in a container.

A pod never reads the host's /etc/nccl.conf, so ``export_nccl_env()`` asks the daemon
(the ``env`` command; the pod mounts the host's /run/tunerd) and sets each setting
that is not already in the environment, before ``init_process_group`` creates the
communicators (NCCL reads its variables then). A value the job set itself wins. No
daemon: nothing is set and training goes on.

    import tunerd.torch as tt
    tt.export_nccl_env()
    torch.distributed.init_process_group("nccl")
"""

from __future__ import annotations

import os

from tunerd.base.errors import TunerdError
from tunerd.torch.settings import log

__all__ = ["export_nccl_env"]


def export_nccl_env(socket_path: str | None = None, timeout: float = 0.5,
                    local_rank: int | None = None) -> dict[str, str]:
    """Set the daemon's [nccl] settings that the environment lacks; returns those set.

    ``local_rank`` (default: $LOCAL_RANK when set): with ``[nccl] per_rank_nic = true``
    also the rank's GPU's NIC (NCCL_IB_HCA or NCCL_SOCKET_IFNAME, UCX_NET_DEVICES)."""
    from tunerd.wire.client import Client

    if local_rank is None and os.environ.get("LOCAL_RANK", "").isdigit():
        local_rank = int(os.environ["LOCAL_RANK"])
    args: dict[str, object] = {}
    if local_rank is not None:
        from tunerd.topology.iopath import rank_gpus

        args["local_rank"] = local_rank
        gpus = rank_gpus(local_rank)
        if gpus is not None:
            args["gpus"] = gpus
    try:
        client = Client(socket_path, timeout=timeout)
        try:
            reply = client.call("env", **args)
        finally:
            client.close()
    except TunerdError as err:
        log.info("tunerd.torch: no NCCL settings from the daemon (%s)", err.message)
        return {}
    settings = reply.get("nccl") if isinstance(reply, dict) else None
    if not isinstance(settings, dict):
        return {}
    nic = reply.get("nic_env")
    if isinstance(nic, dict):
        settings = {**settings, **nic}
    done: dict[str, str] = {}
    for key, value in settings.items():
        if (isinstance(key, str) and key.startswith(("NCCL_", "UCX_")) and isinstance(value, str)
                and key not in os.environ):
            os.environ[key] = value
            done[key] = value
    return done
