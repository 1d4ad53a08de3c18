"""Which GPUs a process uses: CUDA_VISIBLE_DEVICES, LOCAL_RANK, and NVML.

In order of trust:

1. ``LOCAL_RANK`` (torchrun, Slurm via the launcher) picks one GPU out of the
   visible ones: ``CUDA_VISIBLE_DEVICES[LOCAL_RANK]``, or GPU ``LOCAL_RANK`` when
   the variable is unset (every rank sees every GPU and uses cuda:LOCAL_RANK);
2. ``CUDA_VISIBLE_DEVICES`` alone: all the GPUs it lists (indices or ``GPU-``
   UUIDs; indices are taken in PCI bus order, i.e. ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
   which is also NVML's and nvidia-smi's order);
3. NVML: the GPUs whose compute-process list has the PID
   (``Device.compute_processes()`` of tunerd.adapters.nvml; ``nvidia-smi --query-compute-apps``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tunerd.base.text import bounded_int
from tunerd.topology.model import Topology

__all__ = ["gpus_from_env", "gpus_from_nvml", "parse_gpu_list", "resolve_cvd", "visible_gpus",
           "visible_list"]

MAX_GPU_INDEX = 1 << 16  # CUDA_VISIBLE_DEVICES entries beyond it name no GPU
MAX_LOCAL_RANK = 1 << 20  # LOCAL_RANK beyond it is ignored (as if unset)


def visible_gpus(topo: Topology, cvd: str) -> list[int]:
    """GPU indices named by a CUDA_VISIBLE_DEVICES-style list (indices, UUIDs, prefixes).

    Entries this node does not have are skipped; CUDA stops at the first invalid
    entry, which only ever makes the list shorter.
    """
    by_uuid = {str(g.uuid): int(g.index) for g in topo.gpus}
    indices = {int(g.index) for g in topo.gpus}
    out: list[int] = []
    for item in cvd.split(","):
        item = item.strip()
        if not item:
            continue
        if item.isdigit():  # bounded: a 5,000-digit entry is no GPU, not a ValueError
            n = bounded_int(item, 0, MAX_GPU_INDEX)
            if n is not None and n in indices:
                out.append(n)
            continue
        # a UUID or a unique prefix of one (CUDA accepts "GPU-8a3f" style prefixes); a
        # MIG instance (MIG-<uuid>) runs on its parent GPU
        hits = [i for u, i in by_uuid.items() if u.startswith(item) or u == f"GPU-{item}"]
        if not hits and item.startswith("MIG-"):
            hits = sorted({int(g.index) for g in topo.gpus for m in g.mig_devices
                           if str(m.get("uuid", "")).startswith(item)})
        if len(hits) == 1:
            out.append(hits[0])
    return out


def parse_gpu_list(text: str) -> list[int] | None:
    """Slurm's SLURM_JOB_GPUS / SLURM_STEP_GPUS ("0,1", "0-1"); None if unparsable."""
    from tunerd.base.cpulist import CpuListError, parse_cpulist

    text = text.strip()
    if not text or text == "NoDevFiles":
        return []
    try:
        return sorted(parse_cpulist(text))
    except CpuListError:
        return None


def resolve_cvd(topo: Topology, cvd: str, granted: tuple[int, ...]) -> tuple[int, ...]:
    """CUDA_VISIBLE_DEVICES inside a scheduler's grant ``granted`` (node GPU indices, in
    order), as node GPU indices.

    Slurm with ConstrainDevices (and a pod's device plugin) renumbers the granted GPUs
    from 0: a job given GPU 1 sees ``CUDA_VISIBLE_DEVICES=0``. Without it the variable
    holds node indices. Indices all in the grant are node indices; otherwise indices
    below the grant's size are positions in it. UUIDs and MIG UUIDs name node GPUs.
    """
    items = [x.strip() for x in cvd.split(",") if x.strip()]
    if all(x.isdigit() and len(x) <= 6 for x in items):  # 5,000 digits: no ValueError
        ids = [int(x) for x in items]
        if all(i in granted for i in ids):
            return tuple(ids)
        if all(i < len(granted) for i in ids):
            return tuple(granted[i] for i in ids)
        return tuple(i for i in ids if i in granted)
    return tuple(i for i in visible_gpus(topo, cvd) if i in granted)


def visible_list(topo: Topology, env: Mapping[str, str],
                 allowed: Iterable[int] | None = None) -> list[int] | None:
    """The node GPUs a process sees, in its CUDA order; None when nothing restricts it
    (no CUDA_VISIBLE_DEVICES, no grant)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    granted = tuple(allowed) if allowed is not None else None
    if cvd is not None:
        if granted is not None and cvd.strip() not in ("", "NoDevFiles"):
            return list(resolve_cvd(topo, cvd, granted))
        return visible_gpus(topo, cvd)
    if granted is not None:
        return list(granted)
    return None


_FROM_ENV = -1  # gpus_from_env: the local rank as LOCAL_RANK says


def gpus_from_env(topo: Topology, env: Mapping[str, str],
                  allowed: Iterable[int] | None = None,
                  local_rank: int | None = _FROM_ENV) -> tuple[int, ...] | None:
    """The GPU indices a process uses according to its environment, or None if it says nothing.

    ``()`` means "no GPU" (``CUDA_VISIBLE_DEVICES=""`` or ids this node lacks).
    ``allowed``: the GPUs of the process's allocation (Slurm, a pod), in order:
    CUDA_VISIBLE_DEVICES is resolved through it (``resolve_cvd``), and without the
    variable a rank's local rank counts inside them. ``local_rank``: the rank's local
    rank as its launcher told it (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, ...; None: not
    a rank); by default LOCAL_RANK.
    """
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    seen = visible_list(topo, env, allowed)
    visible = seen if seen is not None else [int(g.index) for g in topo.gpus]
    rank = (bounded_int(env.get("LOCAL_RANK"), 0, MAX_LOCAL_RANK)  # out of range: ignored
            if local_rank == _FROM_ENV else local_rank)
    if rank is not None:
        if not visible:
            return ()
        return (visible[rank % len(visible)],)
    if cvd is not None:
        return tuple(visible)
    return None


def gpus_from_nvml(pid: int) -> tuple[int, ...]:
    """GPU indices whose NVML compute-process list holds ``pid`` (empty without NVML)."""
    from tunerd.adapters import nvml

    if not nvml.available():
        return ()
    found: list[int] = []
    for dev in nvml.devices():
        procs = dev.compute_processes()
        if procs is not nvml.NA and any(p.pid == pid for p in procs):
            found.append(dev.index)
    return tuple(found)
