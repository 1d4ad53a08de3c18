"""Shared by the [irq] tests: this machine's real eth0 interrupts (their masks restored
whatever happens), and a HostSettings with an IrqTuner on the recorded DGX H100 tree."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers import DaemonProc
from tests.iotree import build
from tunerd.base.errorlog import ErrorLog
from tunerd.daemon.host import HostSettings
from tunerd.policy.typed import IrqSection, PolicyModel
from tunerd.topology import read_snapshot
from tunerd.tuners.irq import IrqContext, IrqTuner, parse_mask

PCI = Path("/sys/class/net/eth0/device")
DGX = Path(__file__).parent / "fixtures" / "topologies" / "dgx-h100.json"
# [irq] on eth0, checked every 250 ms, irqbalance left alone
POLICY = '[policy]\nname = "irq"\n\n[irq]\ndevices = ["eth0"]\nirqbalance = "leave"\n' \
         'check_interval_ms = 250\n'


def _eth0_irqs() -> list[int]:
    try:
        pci = PCI.resolve(strict=True)
    except OSError:
        return []
    for d in (pci, *pci.parents):
        if (d / "msi_irqs").is_dir():
            return sorted(int(x) for x in os.listdir(d / "msi_irqs"))
    return []


def mask(irq: int) -> str:
    return Path(f"/proc/irq/{irq}/smp_affinity").read_text()


def irq_cpus(irq: int) -> frozenset[int]:
    return parse_mask(mask(irq))


IRQS = _eth0_irqs()
needs_real_irqs = pytest.mark.skipif(
    os.geteuid() != 0 or not IRQS or len(os.sched_getaffinity(0)) < 2
    or not os.access(f"/proc/irq/{IRQS[0] if IRQS else 0}/smp_affinity", os.W_OK),
    reason="needs root, eth0 with MSI-X interrupts and 2 CPUs")


def masks() -> dict[int, str]:
    """eth0's interrupt masks now, by IRQ."""
    return {i: mask(i) for i in IRQS}


def restore_masks(originals: dict[int, str]) -> None:
    """Write back each mask of ``originals`` that something changed (in a ``finally``)."""
    for i, m in originals.items():
        if mask(i) != m:
            Path(f"/proc/irq/{i}/smp_affinity").write_text(m.strip())


def irq_status(d: DaemonProc) -> dict[str, Any]:
    """The daemon's [irq] status (services.host.irq of `status --json`)."""
    out: dict[str, Any] = json.loads(d.ctl("--json", "status").out)["services"]["host"]["irq"]
    return out


@dataclass
class DgxIrqs:
    """HostSettings with only an IrqTuner on the DGX H100 tree built under ``tmp``, its
    ``[irq]`` policy on mlx5_0; ``ctx["held"]`` is the CPUs ranks hold."""

    host: HostSettings
    tuner: IrqTuner
    irqs: dict[str, list[int]]
    proc: Path  # tmp/proc/irq
    ctx: dict[str, Any]


def dgx_irqs(tmp: Path, housekeeping: frozenset[int],
             save: Callable[[], None] = lambda: None) -> DgxIrqs:
    topo = read_snapshot(DGX)
    irqs = build(tmp, topo)
    ctx: dict[str, Any] = {"held": {}}
    tuner = IrqTuner(tmp / "proc", tmp / "sys", tmp / "etc",
                     lambda: IrqContext(online=frozenset(topo.cpus), held=ctx["held"],
                                        housekeeping=housekeeping))
    host = HostSettings({"irq": tuner}, {}, save, ErrorLog(),
                        state_path=tmp / "state.json")
    host._policy = SimpleNamespace(  # type: ignore[assignment]
        model=PolicyModel(irq=IrqSection(devices=("mlx5_0",))))
    return DgxIrqs(host=host, tuner=tuner, irqs=irqs, proc=tmp / "proc/irq", ctx=ctx)
