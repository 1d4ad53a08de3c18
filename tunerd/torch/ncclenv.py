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

from tunerd.base.errors import TunerdError, UsageError
from tunerd.torch.settings import log

__all__ = ["export_nccl_env"]

_RANK_VARS = ("TUNERD_RANK_CPUS", "OMP_NUM_THREADS")  # the rank's slice (rank_env)


def export_nccl_env(socket_path: str | None = None, timeout: float = 0.5,
                    local_rank: int | None = None) -> dict[str, str]:
    """Set the daemon's [nccl] settings that the environment lacks; returns those set.

    ``local_rank`` (default: $LOCAL_RANK when set): also the slice the rank gets
    (TUNERD_RANK_CPUS, and OMP_NUM_THREADS sized to it: set it before torch starts its
    OpenMP pool, or call ``torch.set_num_threads``) and, with ``[nccl] per_rank_nic =
    true``, the rank's GPU's NIC (NCCL_IB_HCA or NCCL_SOCKET_IFNAME, UCX_NET_DEVICES).
    Its GPU is resolved by the daemon as a rank's is (CUDA_VISIBLE_DEVICES as indices or
    UUIDs, the Slurm grant): one it cannot resolve is logged and nothing is set."""
    from tunerd.wire.client import Client

    if local_rank is None and os.environ.get("LOCAL_RANK", "").isdigit():
        local_rank = int(os.environ["LOCAL_RANK"])
    args: dict[str, object] = {}
    if local_rank is not None:
        from tunerd.topology.visible import resolve_env

        args["local_rank"] = local_rank
        args["environ"] = resolve_env(os.environ)  # the daemon resolves the rank's GPU
    try:
        client = Client(socket_path, timeout=timeout)
        try:
            reply = client.call("env", **args)
        finally:
            client.close()
    except UsageError as err:  # a GPU it cannot resolve: say which, never guess GPU 0
        log.warning("tunerd.torch: no NCCL settings from the daemon: %s", err.message)
        return {}
    except TunerdError as err:
        log.info("tunerd.torch: no NCCL settings from the daemon (%s)", err.message)
        return {}
    settings = reply.get("nccl") if isinstance(reply, dict) else None
    if not isinstance(settings, dict):
        return {}
    for extra in ("nic_env", "rank_env"):
        more = reply.get(extra)
        if isinstance(more, dict):
            settings = {**settings, **more}
    done: dict[str, str] = {}
    for key, value in settings.items():
        if (isinstance(key, str) and (key.startswith(("NCCL_", "UCX_")) or key in _RANK_VARS)
                and isinstance(value, str) and key not in os.environ):
            os.environ[key] = value
            done[key] = value
    return done
