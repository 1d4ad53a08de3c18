"""``env``: the node's ``[nccl]`` settings for jobs that cannot read /etc/nccl.conf.

Pods never read the host's /etc/nccl.conf. Two ways in: ``tunerctl env`` (and the
``tunerd.torch`` helpers) ask the daemon with the ``env`` command; and the daemon keeps
``RUNTIME_DIR/nccl/nccl.conf`` up to date with the policy in force, a file a pod mounts
(the directory, read-only: a file mount would keep the old inode after each atomic
replace) and names with ``NCCL_CONF_FILE``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tunerd.base.errors import UsageError
from tunerd.base.safefs import prepare_dir, write_atomic
from tunerd.daemon.policyholder import PolicyHolder
from tunerd.daemon.router import Request, Router
from tunerd.policy import Policy
from tunerd.policy.typed import NcclValue
from tunerd.topology.model import Topology

__all__ = ["EnvCommands", "NcclConfFile", "nccl_text"]

log = logging.getLogger("tunerd")


def nccl_text(value: NcclValue) -> str:
    """A setting as NCCL reads it (booleans as 1/0)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def nccl_env(settings: Mapping[str, NcclValue]) -> dict[str, str]:
    return {k: nccl_text(v) for k, v in sorted(settings.items())}


class EnvCommands:
    def __init__(self, policy: PolicyHolder, conf: NcclConfFile,
                 topology: Callable[[], Topology] | None = None) -> None:
        self.policy = policy
        self.conf = conf
        self.topology = topology

    def register(self, router: Router) -> None:
        router.add("env", self.env)

    async def env(self, req: Request) -> dict[str, Any]:
        """Anyone may ask: the same settings are in the world-readable nccl.conf.

        ``gpus`` (GPU indices) or ``local_rank`` (the rank's GPU is that index): with
        ``[nccl] per_rank_nic = true`` the reply's ``nic_env`` names those GPUs' NICs."""
        out: dict[str, Any] = {"nccl": nccl_env(self.policy.model.nccl),
                               "nccl_conf_file": str(self.conf.path) if self.conf.written
                               else None}
        gpus = req.args.get("gpus")
        rank = req.arg("local_rank", int, None)
        if gpus is not None and (not isinstance(gpus, list) or not all(
                isinstance(g, int) and not isinstance(g, bool) for g in gpus)):
            raise UsageError(f"env: argument 'gpus' must be a list of GPU indices, got {gpus!r}")
        if rank is not None and rank < 0:
            raise UsageError(f"env: --local-rank must be 0 or more, got {rank}")
        if (gpus is None and rank is None) or self.topology is None:
            return out
        topo = self.topology()
        if gpus is None:
            idx = sorted(g.index for g in topo.gpus)
            gpus = [idx[rank]] if rank is not None and rank < len(idx) else []
        out["nic_env"], out["nics"] = {}, []
        if not self.policy.model.nccl_per_rank_nic:
            out["nic_note"] = "[nccl] per_rank_nic is not set: no per-rank NIC"
            return out
        from tunerd.topology.iopath import gpu_nics, nic_env

        pairs = gpu_nics(topo)
        mine = [p for g in gpus for p in pairs.get(g, ())]
        out["nic_env"] = nic_env(mine)
        out["nics"] = [p.to_json() for p in mine]
        far = [p for p in mine if not p.same_numa]
        if far:
            out["nic_note"] = ("GPU " + ", ".join(str(p.gpu) for p in far) + ": its NIC "
                               + ", ".join(p.nic.device for p in far) + " is on another "
                               "NUMA node (no fabric NIC on the GPU's own)")
        elif not mine:
            out["nic_note"] = f"no fabric NIC for GPU(s) {gpus}"
        return out


class NcclConfFile:
    """``RUNTIME_DIR/nccl/nccl.conf``: the ``[nccl]`` settings in force (0644, tmpfs)."""

    def __init__(self, runtime_dir: Path, *, dry_run: bool = False) -> None:
        self.dir = runtime_dir / "nccl"
        self.path = self.dir / "nccl.conf"
        self.dry_run = dry_run
        self.written = False

    async def policy_changed(self, policy: Policy) -> None:
        if self.dry_run:
            return
        body = "".join(f"{k}={v}\n" for k, v in nccl_env(policy.model.nccl).items())
        text = ("# tunerd: the [nccl] settings of the policy in force on this node; for pods:\n"
                "# mount this directory read-only and set NCCL_CONF_FILE to this file\n" + body)
        prepare_dir(self.dir, 0o755, "nccl dir")
        write_atomic(self.path, text.encode(), mode=0o644, sync=False)
        self.written = True
