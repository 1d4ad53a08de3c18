"""Which GPUs a process uses: CUDA_VISIBLE_DEVICES, LOCAL_RANK, and NVML.

``resolve_gpus`` is the one resolver every path asks (bind, rules, run, the GPU-use
service, ``tunerctl env --local-rank``, ``export_nccl_env``); the rest of this module are
its parts. In order of trust:

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
from typing import TYPE_CHECKING

from tunerd.base.errors import UsageError
from tunerd.base.text import bounded_int
from tunerd.topology.model import Topology

if TYPE_CHECKING:
    from tunerd.adapters.nvml import Device

__all__ = ["MAX_RESOLVE_VALUE", "RESOLVE_VARS", "GpuResolveError", "gpus_from_env",
           "gpus_from_nvml", "nvml_users", "parse_gpu_list", "resolve_cvd", "resolve_env",
           "resolve_gpus", "visible_gpus", "visible_list"]

MAX_GPU_INDEX = 1 << 16  # CUDA_VISIBLE_DEVICES entries beyond it name no GPU
MAX_LOCAL_RANK = 1 << 20  # LOCAL_RANK beyond it is ignored (as if unset)


class GpuResolveError(UsageError):
    """A GPU a process names that this node, or its scheduler's grant, does not have (an
    unknown or ambiguous UUID, an index past the node's GPUs, a local rank past the GPUs
    it sees). ``tunerctl`` exits 2 with the message, which names the value."""


def _entry(topo: Topology, item: str) -> tuple[int, ...]:
    """The node GPUs one CUDA_VISIBLE_DEVICES entry may name: () none, 2+ ambiguous."""
    if item.isdigit():  # bounded: a 5,000-digit entry is no GPU, not a ValueError
        n = bounded_int(item, 0, MAX_GPU_INDEX)
        return (n,) if n is not None and any(g.index == n for g in topo.gpus) else ()
    if item.startswith("MIG-GPU-"):  # the old MIG form: MIG-GPU-<parent uuid>/gi/ci
        item = item[4:].split("/", 1)[0]
    # a UUID or a unique prefix of one, with or without "GPU-" (CUDA accepts
    # abbreviations); a MIG instance (MIG-<uuid>) runs on its parent GPU
    hits = sorted({int(g.index) for g in topo.gpus
                   if str(g.uuid).startswith(item) or str(g.uuid).startswith(f"GPU-{item}")})
    if not hits and item.startswith("MIG-"):
        hits = sorted({int(g.index) for g in topo.gpus for m in g.mig_devices
                       if str(m.get("uuid", "")).startswith(item)})
    return tuple(hits)


def _name(item: str) -> str:
    return repr(item if len(item) <= 80 else item[:80] + "...")


def visible_gpus(topo: Topology, cvd: str, *, strict: bool = False) -> list[int]:
    """GPU indices named by a CUDA_VISIBLE_DEVICES-style list (indices, UUIDs, prefixes).

    Entries this node does not have are skipped (CUDA stops at the first invalid entry,
    which only ever makes the list shorter); ``strict``: they are a GpuResolveError
    naming the entry.
    """
    out: list[int] = []
    for item in cvd.split(","):
        item = item.strip()
        if not item:
            continue
        hits = _entry(topo, item)
        if len(hits) == 1:
            out.append(hits[0])
        elif strict:
            raise GpuResolveError(
                f"CUDA_VISIBLE_DEVICES entry {_name(item)}: "
                + (f"ambiguous, it names GPUs {', '.join(map(str, hits))}" if hits else
                   f"no such GPU on this node ({len(topo.gpus)} GPU(s): indices, GPU-/MIG- "
                   "UUIDs or unique prefixes of them)"))
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


def resolve_cvd(topo: Topology, cvd: str, granted: tuple[int, ...], *,
                strict: bool = False) -> tuple[int, ...]:
    """CUDA_VISIBLE_DEVICES inside a scheduler's grant ``granted`` (node GPU indices, in
    order), as node GPU indices.

    Slurm with ConstrainDevices (and a pod's device plugin) renumbers the granted GPUs
    from 0: a job given GPU 1 sees ``CUDA_VISIBLE_DEVICES=0``. Without it the variable
    holds node indices. Indices all in the grant are node indices; otherwise indices
    below the grant's size are positions in it. UUIDs and MIG UUIDs name node GPUs.
    ``strict``: an entry outside the grant is a GpuResolveError naming it.
    """
    items = [x.strip() for x in cvd.split(",") if x.strip()]
    if all(x.isdigit() and len(x) <= 6 for x in items):  # 5,000 digits: no ValueError
        ids = [int(x) for x in items]
        if all(i in granted for i in ids):
            return tuple(ids)
        if all(i < len(granted) for i in ids):
            return tuple(granted[i] for i in ids)
        out = tuple(i for i in ids if i in granted)
    else:
        out = tuple(i for i in visible_gpus(topo, cvd, strict=strict) if i in granted)
    if strict and len(out) != len(items):
        raise GpuResolveError(
            f"CUDA_VISIBLE_DEVICES={_name(cvd)}: not all in the scheduler's grant of GPU(s) "
            f"{','.join(map(str, granted)) or 'none'} (as node indices or positions in it)")
    return out


def visible_list(topo: Topology, env: Mapping[str, str],
                 allowed: Iterable[int] | None = None, *,
                 strict: bool = False) -> list[int] | None:
    """The node GPUs a process sees, in its CUDA order; None when nothing restricts it
    (no CUDA_VISIBLE_DEVICES, no grant)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    granted = tuple(allowed) if allowed is not None else None
    if cvd is not None:
        if cvd.strip() == "NoDevFiles":
            return []
        if granted is not None and cvd.strip():
            return list(resolve_cvd(topo, cvd, granted, strict=strict))
        return visible_gpus(topo, cvd, strict=strict)
    if granted is not None:
        return list(granted)
    return None


_FROM_ENV = -1  # resolve_gpus: the local rank as LOCAL_RANK says


def resolve_gpus(topo: Topology, env: Mapping[str, str], *,
                 granted: Iterable[int] | None = None, local_rank: int | None = _FROM_ENV,
                 nvml: Iterable[int] = (), strict: bool = False) -> tuple[int, ...] | None:
    """The one GPU resolver: the node GPU indices a process uses, or None if nothing says.

    Every path that asks "which GPUs is this process on" (bind, rules, ``run``, ``jobs``,
    ``advise``, the GPU-use service, ``tunerctl env --local-rank``, ``export_nccl_env``,
    the NIC and IRQ pairing) asks here. In order:

    - ``CUDA_VISIBLE_DEVICES``: indices (PCI bus order), ``GPU-`` UUIDs and unique
      prefixes of them, ``MIG-`` UUIDs (the parent GPU), resolved through the
      scheduler's grant ``granted`` (node indices, in order: Slurm's or the pod's; Slurm
      with ConstrainDevices renumbers from 0, so a job given GPU 1 sees ``0``);
    - the local rank (``local_rank``; by default ``LOCAL_RANK``; None: not a rank) picks
      one GPU of those it sees (all the node's, or the grant, when the variable is unset);
    - else ``nvml``: the GPUs whose NVML process lists hold it (``gpus_from_nvml``).

    ``()`` means "no GPU" (``CUDA_VISIBLE_DEVICES=""`` or ids this node lacks).
    ``strict`` (a rank asking for its own NIC and CPUs): what cannot be resolved is a
    GpuResolveError naming the value (an unknown or ambiguous UUID, an entry outside the
    grant, a local rank past the visible list), never a silent GPU 0. Not strict (the
    bind paths, which must not fail on a user's odd environment): unknown entries are
    skipped, as CUDA does, and a local rank past the visible list wraps around them (a
    Slurm task that sees only its own GPU has ``SLURM_LOCALID`` 1 and one GPU).
    """
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    seen = visible_list(topo, env, granted, strict=strict)
    visible = seen if seen is not None else sorted(int(g.index) for g in topo.gpus)
    rank = (bounded_int(env.get("LOCAL_RANK"), 0, MAX_LOCAL_RANK)  # out of range: ignored
            if local_rank == _FROM_ENV else local_rank)
    if rank is not None:
        if strict and not 0 <= rank < len(visible):
            raise GpuResolveError(
                f"local rank {rank}: past the GPUs it sees ({len(visible)}: "
                + (f"CUDA_VISIBLE_DEVICES={_name(cvd)}" if cvd is not None
                   else "the scheduler's grant" if granted is not None else "the node's")
                + (f", node GPU(s) {','.join(map(str, visible))}" if visible else "") + ")")
        if not visible:
            return ()
        return (visible[rank % len(visible)],)
    if cvd is not None:
        return tuple(visible)
    found = tuple(nvml)
    return found or None


def gpus_from_env(topo: Topology, env: Mapping[str, str],
                  allowed: Iterable[int] | None = None,
                  local_rank: int | None = _FROM_ENV) -> tuple[int, ...] | None:
    """``resolve_gpus`` on the environment alone, not strict (the bind paths)."""
    return resolve_gpus(topo, env, granted=allowed, local_rank=local_rank)


# what a client sends the daemon so that it resolves the client's GPUs as it resolves a
# rank's: its CUDA_VISIBLE_DEVICES and the Slurm grant (tunerctl env, export_nccl_env)
RESOLVE_VARS = ("CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
MAX_RESOLVE_VALUE = 4096  # a longer value is no list of this node's GPUs


def resolve_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` ``resolve_gpus`` reads (RESOLVE_VARS), for the wire."""
    return {k: environ[k] for k in RESOLVE_VARS if k in environ}


def gpus_from_nvml(pid: int) -> tuple[int, ...]:
    """GPU indices whose NVML compute-process list holds ``pid`` (empty without NVML)."""
    from tunerd.adapters import nvml

    if not nvml.available():
        return ()
    return tuple(sorted({g for g, p in nvml_users(nvml.devices()) if p == pid}))


def nvml_users(devs: Iterable[Device]) -> list[tuple[int, int]]:
    """(GPU index, pid) for every process NVML lists on ``devs`` (its compute and
    graphics lists; ``nvidia-smi --query-compute-apps=gpu_bus_id,pid``): the NVML
    evidence of ``resolve_gpus``, as the GPU-use service reads it from one listing."""
    from tunerd.adapters import nvml

    return [(dev.index, p.pid) for dev in devs
            for procs in (dev.compute_processes(), dev.graphics_processes())
            if procs is not nvml.NA for p in procs]
