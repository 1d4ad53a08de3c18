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
                 topology: Callable[[], Topology] | None = None,
                 housekeeping: Callable[[], frozenset[int]] | None = None) -> None:
        self.policy = policy
        self.conf = conf
        self.topology = topology
        self.housekeeping = housekeeping

    def register(self, router: Router) -> None:
        router.add("env", self.env)

    async def env(self, req: Request) -> dict[str, Any]:
        """Anyone may ask: the same settings are in the world-readable nccl.conf.

        ``gpus`` (GPU indices), or ``local_rank`` with the caller's ``environ`` (its
        CUDA_VISIBLE_DEVICES and Slurm grant, tunerd.topology.visible.RESOLVE_VARS),
        resolved as a rank's GPU is (``resolve_gpus``, strict: an unknown UUID or a rank
        past the GPUs it sees is a usage error naming it). The reply's ``rank_env`` is
        the slice that GPU's rank gets (TUNERD_RANK_CPUS, OMP_NUM_THREADS); with ``[nccl]
        per_rank_nic = true`` its ``nic_env`` names those GPUs' NICs. Every list is
        bounded by what the node has before any work is done on it."""
        out: dict[str, Any] = {"nccl": nccl_env(self.policy.model.nccl),
                               "nccl_conf_file": str(self.conf.path) if self.conf.written
                               else None}
        rank = req.arg("local_rank", int, None)
        if rank is not None and rank < 0:
            raise UsageError(f"env: --local-rank must be 0 or more, got {rank}")
        if ("gpus" not in req.args and rank is None) or self.topology is None:
            _check_gpus(req.args.get("gpus"), None)
            return out
        topo = self.topology()
        gpus = self._gpus(req, topo, rank)
        if rank is not None:
            out["rank_env"] = self._rank_env(topo, gpus)
        out.update(_nic_reply(topo, gpus, self.policy.model.nccl_per_rank_nic))
        return out

    def _gpus(self, req: Request, topo: Topology, rank: int | None) -> list[int]:
        """The GPUs asked about: ``gpus`` as given (checked), else the rank's, resolved."""
        given = _check_gpus(req.args.get("gpus"), topo)
        if given is not None:
            return given
        environ = _check_environ(req.args.get("environ"))
        if not topo.gpus:  # a CPU-only node: no rank has a GPU (a note says so), no error
            return []
        from tunerd.jobs.allocation import scheduler_gpus
        from tunerd.topology.visible import resolve_gpus

        granted = scheduler_gpus(req.peer.pid, topo, environ)
        return list(resolve_gpus(topo, environ, granted=granted, local_rank=rank,
                                 strict=True) or ())

    def _rank_env(self, topo: Topology, gpus: list[int]) -> dict[str, str]:
        """TUNERD_RANK_CPUS (the GPUs' slices of the node map, housekeeping CPUs left
        out) and an OMP_NUM_THREADS that fits it; {} where no GPU has a slice."""
        from tunerd.base.cpulist import format_cpulist
        from tunerd.topology.nodemap import node_map

        hk = self.housekeeping() if self.housekeeping is not None else frozenset()
        cpus = node_map(topo, hk).slice_cpus(gpus)
        if not cpus:
            return {}
        return {"TUNERD_RANK_CPUS": format_cpulist(cpus), "OMP_NUM_THREADS": str(len(cpus))}


def _check_gpus(gpus: object, topo: Topology | None) -> list[int] | None:
    """``gpus`` of a request: a list of this node's GPU indices, no longer than the node
    has GPUs (checked first: a 1 MiB list is refused before it is walked), deduplicated."""
    if gpus is None:
        return None
    if not isinstance(gpus, list):
        raise UsageError(f"env: argument 'gpus' must be a list of GPU indices, got "
                         f"{type(gpus).__name__}")
    have = {g.index for g in topo.gpus} if topo is not None else set()
    if topo is not None and len(gpus) > len(have):
        raise UsageError(f"env: argument 'gpus' lists {len(gpus)} entries; this node has "
                         f"{len(have)} GPU(s)")
    out: list[int] = []
    for g in gpus:
        if not isinstance(g, int) or isinstance(g, bool) or (topo is not None and g not in have):
            raise UsageError(f"env: argument 'gpus': {g!r:.40} is no GPU index of this node")
        if g not in out:
            out.append(g)
    return out


def _check_environ(environ: object) -> dict[str, str]:
    """``environ`` of a request: at most the RESOLVE_VARS, each a bounded string."""
    from tunerd.topology.visible import MAX_RESOLVE_VALUE, RESOLVE_VARS

    if environ is None:
        return {}
    if not isinstance(environ, dict) or len(environ) > len(RESOLVE_VARS):
        raise UsageError("env: argument 'environ' must map at most "
                         f"{', '.join(RESOLVE_VARS)} to strings")
    for k, v in environ.items():
        if k not in RESOLVE_VARS or not isinstance(v, str) or len(v) > MAX_RESOLVE_VALUE:
            raise UsageError(f"env: argument 'environ': {k!r:.40} is not one of "
                             f"{', '.join(RESOLVE_VARS)} with a value of at most "
                             f"{MAX_RESOLVE_VALUE} characters")
    return dict(environ)


def _nic_reply(topo: Topology, gpus: list[int], per_rank_nic: bool) -> dict[str, Any]:
    """``nic_env``, ``nics`` and a ``nic_note`` for ``gpus`` (deduplicated node GPUs)."""
    out: dict[str, Any] = {"nic_env": {}, "nics": []}
    if not per_rank_nic:
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
    elif not gpus:
        out["nic_note"] = "no GPU on this node: no per-rank NIC"
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
