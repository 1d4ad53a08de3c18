"""GPUs and the links between them, read through NVML (tunerd.nvml).

Every call goes through ``nvml.call`` so one unsupported query (NVLink on a
PCIe card, MIG on a consumer GPU) degrades to "not available" instead of
failing the whole topology. Locality comes from sysfs first (what the kernel
uses for allocations), NVML's CPU affinity second.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tunerd import nvml
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
NVLINK_DEVICE_TYPE_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
FEATURE_ENABLED = 1  # NVML_FEATURE_ENABLED


def _text(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode(errors="replace").rstrip("\x00")
    return str(v)


def _bus_id(pci: Any) -> str | None:
    if pci is nvml.NA or pci is None:
        return None
    raw = getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", None)
    return normalize_bus_id(_text(raw)) if raw else None


def _affinity(handle: Any, ncpus: int) -> frozenset[int] | None:
    """CPUs from nvmlDeviceGetCpuAffinity's array of 64-bit masks."""
    words = max(1, (ncpus + 63) // 64)
    masks = nvml.call("nvmlDeviceGetCpuAffinity", handle, words)
    if masks is nvml.NA:
        return None
    out = set()
    for w, mask in enumerate(masks):
        m = int(mask)
        bit = 0
        while m:
            if m & 1:
                out.add(w * 64 + bit)
            m >>= 1
            bit += 1
    return frozenset(out)


def _mig_devices(handle: Any) -> tuple[bool, tuple[dict[str, Any], ...]]:
    mode = nvml.call("nvmlDeviceGetMigMode", handle)
    current = mode[0] if isinstance(mode, (list, tuple)) and mode else None
    if current != 1:  # NVML_DEVICE_MIG_ENABLE
        return False, ()
    out: list[dict[str, Any]] = []
    count = nvml.call("nvmlDeviceGetMaxMigDeviceCount", handle, default=0)
    for i in range(int(count)):
        mh = nvml.call("nvmlDeviceGetMigDeviceHandleByIndex", handle, i)
        if mh is nvml.NA:
            continue  # slot not populated
        mem = nvml.call("nvmlDeviceGetMemoryInfo", mh)
        out.append({
            "index": i,
            "uuid": _text(nvml.call("nvmlDeviceGetUUID", mh, default="")),
            "gpu_instance_id": nvml.call("nvmlDeviceGetGpuInstanceId", mh, default=None),
            "compute_instance_id": nvml.call("nvmlDeviceGetComputeInstanceId", mh, default=None),
            "memory_total_bytes": int(mem.total) if mem is not nvml.NA else 0,
        })
    return True, tuple(out)


def read_gpus(sys_root: Path = Path("/sys"), ncpus: int = 1024
              ) -> tuple[list[Gpu], dict[tuple[int, int], Link], str | None]:
    """(GPUs, pairwise links, note). No driver: no GPUs and a note saying why."""
    if not nvml.available():
        return [], {}, f"no GPUs: {nvml.reason()}"
    mod = nvml.module()
    count = nvml.call("nvmlDeviceGetCount", default=0)
    handles: list[Any] = []
    gpus: list[Gpu] = []
    # per GPU: remote bus id -> number of direct NVLinks; and links ending at an NVSwitch
    direct: list[dict[str, int]] = []
    for i in range(int(count)):
        h = nvml.call("nvmlDeviceGetHandleByIndex", i)
        if h is nvml.NA:
            continue  # e.g. a GPU that fell off the bus: report the rest
        bus = _bus_id(nvml.call("nvmlDeviceGetPciInfo_v3|nvmlDeviceGetPciInfo", h)) or ""
        node, local = pci_locality(bus, sys_root) if bus else (None, None)
        # (nvmlDeviceGetNumaNodeId is not a fallback for `node`: on Grace Hopper it
        # names the GPU *memory* node, which has no CPUs; load_topology derives the
        # node from the local CPUs instead)
        if not local:
            local = _affinity(h, ncpus)
        mem = nvml.call("nvmlDeviceGetMemoryInfo", h)
        mig_enabled, migs = _mig_devices(h)
        remote: dict[str, int] = {}
        switch_links = 0
        max_links = int(getattr(mod, "NVML_NVLINK_MAX_LINKS", 18))
        for link in range(max_links):
            state = nvml.call("nvmlDeviceGetNvLinkState", h, link, default=None)
            if state is None:
                break  # past the last link this GPU has (or no NVLink at all)
            if state != FEATURE_ENABLED:
                continue
            kind = nvml.call("nvmlDeviceGetNvLinkRemoteDeviceType", h, link, default=None)
            rbus = _bus_id(nvml.call("nvmlDeviceGetNvLinkRemotePciInfo_v2|"
                                     "nvmlDeviceGetNvLinkRemotePciInfo", h, link))
            if kind == NVLINK_DEVICE_TYPE_SWITCH:
                switch_links += 1
            elif rbus:
                remote[rbus] = remote.get(rbus, 0) + 1
        gpu_mem_node = nvml.call("nvmlDeviceGetNumaNodeId", h, default=None)
        handles.append(h)
        direct.append(remote)
        gpus.append(Gpu(
            index=i, uuid=_text(nvml.call("nvmlDeviceGetUUID", h, default="")),
            pci_bus_id=bus, model=_text(nvml.call("nvmlDeviceGetName", h, default="unknown")),
            memory_total_bytes=int(mem.total) if mem is not nvml.NA else 0,
            numa_node=node, local_cpus=local or frozenset(), mig_enabled=mig_enabled,
            mig_devices=migs, nvswitch_links=switch_links,
            memory_numa_nodes=(gpu_mem_node,) if isinstance(gpu_mem_node, int)
            and gpu_mem_node >= 0 and gpu_mem_node != node else (),
        ))
    # a link whose far end is no GPU of this node ends at an NVSwitch even when the
    # driver is too old to say so (nvmlDeviceGetNvLinkRemoteDeviceType is r470+)
    buses = {g.pci_bus_id for g in gpus}
    for x, g in enumerate(gpus):
        to_switch = sum(n for bus, n in direct[x].items() if bus not in buses)
        if to_switch:
            gpus[x] = replace(g, nvswitch_links=g.nvswitch_links + to_switch)
    links: dict[tuple[int, int], Link] = {}
    for x in range(len(gpus)):
        for y in range(x + 1, len(gpus)):
            a, b = gpus[x], gpus[y]
            level = nvml.call("nvmlDeviceGetTopologyCommonAncestor", handles[x], handles[y],
                              default=None)
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
