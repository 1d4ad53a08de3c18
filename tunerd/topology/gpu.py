"""GPUs and the links between them, read through the typed GPU layer (tunerd.adapters.nvml).

One unsupported query (NVLink on a PCIe card, MIG on a consumer GPU) is ``NA`` there
and degrades that field only, instead of failing the whole topology. Locality comes
from sysfs first (what the kernel uses for allocations), NVML's CPU affinity second.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tunerd.adapters import nvml
from tunerd.adapters.nvml import NA
from tunerd.topology.model import Gpu, Link
from tunerd.topology.sysfs import normalize_bus_id, pci_locality

__all__ = ["PCIE_LEVELS", "read_gpus"]

# NVML_TOPOLOGY_* -> `nvidia-smi topo -m` words
PCIE_LEVELS = {
    0: "PIX",   # NVML_TOPOLOGY_INTERNAL: two GPUs on one board; nvidia-smi shows it as PIX-like
    10: "PIX",  # NVML_TOPOLOGY_SINGLE: one PCIe switch
    20: "PXB",  # NVML_TOPOLOGY_MULTIPLE: several PCIe switches, no host bridge
    30: "PHB",  # NVML_TOPOLOGY_HOSTBRIDGE: through a PCIe host bridge
    40: "NODE",  # NVML_TOPOLOGY_NODE: host bridges within one NUMA node
    50: "SYS",  # NVML_TOPOLOGY_SYSTEM: across the SMP interconnect (QPI/UPI/xGMI)
}


def _or(v: Any, default: Any) -> Any:
    return default if v is NA else v


def _mig_devices(dev: nvml.Device) -> tuple[bool, tuple[dict[str, Any], ...]]:
    if dev.mig_mode != nvml.MIG_ENABLE:
        return False, ()
    return True, tuple({
        "index": m.index,
        "uuid": _or(m.uuid, ""),
        "gpu_instance_id": _or(m.gpu_instance_id, None),
        "compute_instance_id": _or(m.compute_instance_id, None),
        "memory_total_bytes": _or(m.memory_total, 0),
    } for m in dev.mig_devices())


def read_gpus(sys_root: Path = Path("/sys"), ncpus: int = 1024
              ) -> tuple[list[Gpu], dict[tuple[int, int], Link], str | None]:
    """(GPUs, pairwise links, note). No driver: no GPUs and a note saying why."""
    if not nvml.available():
        return [], {}, f"no GPUs: {nvml.reason()}"
    devs: list[nvml.Device] = []
    gpus: list[Gpu] = []
    # per GPU: remote bus id -> number of direct NVLinks; and links ending at an NVSwitch
    direct: list[dict[str, int]] = []
    for dev in nvml.devices():  # a GPU that fell off the bus is left out: report the rest
        bus_raw = dev.pci_bus_id
        bus = normalize_bus_id(bus_raw) if bus_raw is not NA else ""
        node, local = pci_locality(bus, sys_root) if bus else (None, None)
        # (the NVML NUMA node id is not a fallback for `node`: on Grace Hopper it
        # names the GPU *memory* node, which has no CPUs; load_topology derives the
        # node from the local CPUs instead)
        if not local:
            aff = dev.cpu_affinity(ncpus)
            local = None if aff is NA else aff
        mig_enabled, migs = _mig_devices(dev)
        remote: dict[str, int] = {}
        switch_links = 0
        for link in range(dev.max_nvlinks):
            state = dev.nvlink_active(link)
            if state is NA:
                break  # past the last link this GPU has (or no NVLink at all)
            if not state:
                continue
            kind = dev.nvlink_remote_device_type(link)
            rbus = dev.nvlink_remote_bus_id(link)
            if kind == nvml.NVLINK_DEVICE_TYPE_SWITCH:
                switch_links += 1
            elif rbus is not NA:
                rb = normalize_bus_id(rbus)
                remote[rb] = remote.get(rb, 0) + 1
        gpu_mem_node = dev.numa_node_id
        devs.append(dev)
        direct.append(remote)
        gpus.append(Gpu(
            index=dev.index, uuid=_or(dev.uuid, ""), pci_bus_id=bus,
            model=_or(dev.name, "unknown"), memory_total_bytes=_or(dev.memory_total, 0),
            numa_node=node, local_cpus=local or frozenset(), mig_enabled=mig_enabled,
            mig_devices=migs, nvswitch_links=switch_links,
            memory_numa_nodes=(gpu_mem_node,) if isinstance(gpu_mem_node, int)
            and gpu_mem_node >= 0 and gpu_mem_node != node else (),
        ))
    # a link whose far end is no GPU of this node ends at an NVSwitch even when the
    # driver is too old to say so (the remote device type is r470+)
    buses = {g.pci_bus_id for g in gpus}
    for x, g in enumerate(gpus):
        to_switch = sum(n for bus, n in direct[x].items() if bus not in buses)
        if to_switch:
            gpus[x] = replace(g, nvswitch_links=g.nvswitch_links + to_switch)
    links: dict[tuple[int, int], Link] = {}
    for x in range(len(gpus)):
        for y in range(x + 1, len(gpus)):
            a, b = gpus[x], gpus[y]
            level = devs[x].common_ancestor(devs[y])
            pcie = PCIE_LEVELS.get(level) if isinstance(level, int) else None
            if pcie is None:  # NVML could not say: judge by NUMA node only
                pcie = "NODE" if a.numa_node is not None and a.numa_node == b.numa_node else "SYS"
            n = direct[x].get(b.pci_bus_id, 0)
            if a.nvswitch_links and b.nvswitch_links:
                # through NVSwitch every GPU reaches every other at its full link count,
                # which is what `nvidia-smi topo -m` prints (NV18 on DGX H100)
                n += min(a.nvswitch_links, b.nvswitch_links)
            links[(a.index, b.index)] = Link(kind="NVLINK" if n else pcie, nvlinks=n, pcie=pcie)
    note = None if gpus else "NVML is available but reports no GPUs"
    return gpus, links, note
