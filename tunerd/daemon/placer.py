"""Where a process goes: GPUs it uses, CPUs near them, and whether that can be applied here.

Shared by leases (``alloc``/``run``), automatic binding of ``[[job]]`` matches
and ``tunerctl bind PID`` without placement flags (JobRegistry.placer).

Which GPUs a process uses, in order of trust:

1. ``LOCAL_RANK`` (torchrun, Slurm via the launcher) picks one GPU out of the
   visible ones: ``CUDA_VISIBLE_DEVICES[LOCAL_RANK]``, or GPU ``LOCAL_RANK``
   when the variable is unset (every rank sees every GPU and uses cuda:LOCAL_RANK);
2. ``CUDA_VISIBLE_DEVICES`` alone: all the GPUs it lists (indices or ``GPU-``
   UUIDs; indices are taken in PCI bus order, i.e. ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
   which is also NVML's and nvidia-smi's order);
3. NVML: the GPUs whose compute-process list has the PID
   (``nvmlDeviceGetComputeRunningProcesses``; ``nvidia-smi --query-compute-apps``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunerd.cpulist import CpuListError, format_cpulist, parse_cpulist

__all__ = [
    "HostCapacity",
    "PlacedJob",
    "applicability",
    "gpus_from_env",
    "gpus_from_nvml",
    "per_gpu_cpu_share",
]


@dataclass(frozen=True)
class PlacedJob:
    gpus: tuple[int, ...]
    gpu_uuids: tuple[str, ...]
    cpus: frozenset[int]
    mems: frozenset[int]
    explanation: str = ""
    notes: tuple[str, ...] = ()
    applicable: bool = True  # False: replayed topology names CPUs/nodes this host lacks

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": list(self.gpus), "gpu_uuids": list(self.gpu_uuids),
                "cpus": format_cpulist(self.cpus), "mems": format_cpulist(self.mems),
                "explanation": self.explanation}


@dataclass(frozen=True)
class HostCapacity:
    """CPUs and NUMA nodes this machine really has (not the replayed snapshot's)."""

    cpus: frozenset[int]
    mems: frozenset[int] = field(default=frozenset({0}))

    @classmethod
    def read(cls, sys_root: str = "/sys") -> HostCapacity:
        def one(path: str, default: frozenset[int]) -> frozenset[int]:
            try:
                return parse_cpulist(Path(sys_root, path).read_text())
            except (OSError, CpuListError):
                return default

        cpus = one("devices/system/cpu/online", frozenset(os.sched_getaffinity(0)))
        mems = one("devices/system/node/online", frozenset({0}))
        return cls(cpus, mems)


def applicability(topo: Any, cpus: frozenset[int], mems: frozenset[int],
                  host: HostCapacity | None = None) -> tuple[bool, list[str]]:
    """May this placement be applied on this machine? (False + notes in replay mode).

    Under ``tunerd --topology SNAPSHOT`` the placement is computed on the
    snapshot; CPUs and memory nodes it names that this machine lacks are never
    applied, and the reply says so instead.
    """
    if not getattr(topo, "replayed", False):
        return True, []
    host = host or HostCapacity.read()
    missing_c = cpus - host.cpus
    missing_m = mems - host.mems
    if not missing_c and not missing_m:
        return True, [f"topology replay ({topo.hostname}): this machine has every CPU and "
                      "memory node of the placement; applied here"]
    parts = []
    if missing_c:
        parts.append(f"CPUs {format_cpulist(missing_c)}")
    if missing_m:
        parts.append(f"memory nodes {format_cpulist(missing_m)}")
    return False, [
        f"topology replay ({topo.hostname}): placement computed on the snapshot; this "
        f"machine lacks {' and '.join(parts)} (it has CPUs {format_cpulist(host.cpus)}), "
        "so nothing was applied to CPUs or memory"
    ]


def _visible_gpus(topo: Any, cvd: str) -> list[int]:
    by_uuid = {str(g.uuid): int(g.index) for g in topo.gpus}
    indices = {int(g.index) for g in topo.gpus}
    out: list[int] = []
    for item in cvd.split(","):
        item = item.strip()
        if not item:
            continue
        if item.isdigit():
            if int(item) in indices:
                out.append(int(item))
            continue
        # a UUID or a unique prefix of one (CUDA accepts "GPU-8a3f" style prefixes)
        hits = [i for u, i in by_uuid.items() if u.startswith(item) or u == f"GPU-{item}"]
        if len(hits) == 1:
            out.append(hits[0])
    return out


def gpus_from_env(topo: Any, env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The GPU indices a process uses according to its environment, or None if it says nothing.

    ``()`` means "no GPU" (``CUDA_VISIBLE_DEVICES=""`` or ids this node lacks).
    """
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    visible = _visible_gpus(topo, cvd) if cvd is not None else [int(g.index) for g in topo.gpus]
    rank_s = env.get("LOCAL_RANK")
    if rank_s is not None and rank_s.strip().isdigit():
        if not visible:
            return ()
        return (visible[int(rank_s) % len(visible)],)
    if cvd is not None:
        return tuple(visible)
    return None


def gpus_from_nvml(pid: int) -> tuple[int, ...]:
    """GPU indices whose NVML compute-process list holds ``pid`` (empty without NVML)."""
    from tunerd import nvml

    if not nvml.available():
        return ()
    count = nvml.call("nvmlDeviceGetCount", default=0)
    found: list[int] = []
    for i in range(int(count or 0)):
        h = nvml.call("nvmlDeviceGetHandleByIndex", i)
        if not h:
            continue
        procs = nvml.call("nvmlDeviceGetComputeRunningProcesses_v3|"
                          "nvmlDeviceGetComputeRunningProcesses", h, default=[]) or []
        if any(getattr(p, "pid", None) == pid for p in procs):
            found.append(i)
    return tuple(found)


def per_gpu_cpu_share(topo: Any, gpu: int, housekeeping: frozenset[int] = frozenset()) -> int:
    """CPUs one GPU's process should get so that all GPUs sharing its CPUs fit side by side.

    E.g. a DGX H100: 4 GPUs per socket, 112 CPUs per socket -> 28 CPUs per GPU.
    """
    gpus = {int(g.index): g for g in topo.gpus}
    g = gpus.get(gpu)
    if g is None:
        return max(1, len(topo.online_cpus() - housekeeping))
    local = frozenset(g.local_cpus) or frozenset(topo.online_cpus())
    local = local - housekeeping or local
    sharing = sum(1 for o in topo.gpus if (frozenset(o.local_cpus) or local) & local)
    return max(1, len(local) // max(1, sharing))


def mems_of(topo: Any, cpus: frozenset[int]) -> frozenset[int]:
    """NUMA nodes holding ``cpus`` (for an explicit CPU list from a rule)."""
    out = {topo.cpus[c].numa_node for c in cpus if c in topo.cpus}
    return frozenset(n for n in out if n is not None and n >= 0)
