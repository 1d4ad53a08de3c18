"""One tuner per host-setting kind; ``build_tuners`` makes them for a set of roots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunerd.topology.model import Topology
from tunerd.tuners.base import Change, SettingError, Tuner
from tunerd.tuners.block import BlockTuner
from tunerd.tuners.cpu import CpuTuner
from tunerd.tuners.gpu import GpuTuner
from tunerd.tuners.irq import IrqContext, IrqTuner
from tunerd.tuners.nccl import NcclTuner
from tunerd.tuners.nic import NicTuner
from tunerd.tuners.pcie import PcieTuner
from tunerd.tuners.sysctl import SysctlTuner
from tunerd.tuners.vm import VmTuner

__all__ = ["SECTIONS", "Change", "IrqContext", "SettingError", "Tuner", "build_tuners"]

# policy section -> key prefix, in the order settings are applied
SECTIONS = ("sysctl", "nic", "block", "vm", "cpu", "nccl", "gpu", "irq", "pcie")


def build_tuners(proc_root: Path | str = "/proc", sys_root: Path | str = "/sys",
                 etc_root: Path | str = "/etc", gpu_unavailable: str | None = None,
                 irq_context: Callable[[], IrqContext] | None = None,
                 topology: Callable[[], Topology | None] | None = None,
                 ) -> dict[str, Tuner[Any]]:
    """section name -> tuner; every section's key prefix is its section name.

    Each tuner's ``plan`` takes its section of the typed policy
    (``PolicyModel.section(name)``).

    ``gpu_unavailable``: a reason to plan no GPU setting at all (topology replay).
    ``irq_context``: the CPUs interrupts may use now (held by ranks, housekeeping).
    ``topology``: the node's (for the bridges between each GPU and its NIC).
    """
    return {
        "sysctl": SysctlTuner(proc_root),
        "nic": NicTuner(sys_root),
        "block": BlockTuner(sys_root),
        "vm": VmTuner(proc_root, sys_root),
        "cpu": CpuTuner(sys_root),
        "nccl": NcclTuner(etc_root),
        "gpu": GpuTuner(gpu_unavailable),
        "irq": IrqTuner(proc_root, sys_root, etc_root, irq_context),
        "pcie": PcieTuner(proc_root, sys_root, topology),
    }
