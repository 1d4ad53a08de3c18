"""Facts about this node that the fleet compares (``tunerctl fleet check``).

Two kinds, read at two cadences:

- Static facts — node class (the matched policy names and the GPU model), the hash of
  the effective policy, driver/CUDA/NCCL/torch/kernel/tunerd versions — are computed
  at start and on every policy reload, never on the sampling path. torch (and the NCCL
  it bundles) are probed the way ``tunerctl doctor`` does, in an isolated subprocess
  (``python -I`` from cwd ``/``, no PYTHON* variables, a timeout): the daemon never
  imports torch. Driver and CUDA come from NVML, else from the driver's version file.
- Live facts — each NIC's MTU and IPv4 subnet, the managed ``/etc/nccl.conf`` keys,
  each GPU's PCIe link width against its maximum —
  change when tunerd applies a policy. Only the metrics read them, so they are re-read
  when a scrape (or ``tunerctl metrics``) asks for them and the last read is more than
  LIVE_EVERY seconds old or a policy changed since (``getifaddrs``, sysfs and one small
  file: ~0.5-1 ms on a loaded 2-core machine; read every 5 s in the sampler thread
  they were ~0.2 ms/s of the daemon, with nobody reading them between scrapes).

Label cardinality is bounded here: at most MAX_NICS NICs, MAX_NCCL_KEYS settings,
MAX_RANKS ranks (see docs/fleet.md for the per-node series count).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunerd import __version__
from tunerd.adapters import isolated, nvml
from tunerd.tuners.nccl import match_ifnames

__all__ = ["MAX_NCCL_KEYS", "MAX_NICS", "MAX_RANKS", "FleetFacts", "NicFact", "PcieLink",
           "Versions", "match_ifnames", "node_class", "policy_hash", "probe_torch_isolated",
           "read_nics", "read_pcie_links"]

log = logging.getLogger("tunerd.monitor")

MAX_NICS = 16  # interfaces exported (lo never); a node with more keeps the first by name
MAX_NCCL_KEYS = 32  # managed nccl.conf keys exported
MAX_RANKS = 32  # ranks exported per node (the most recent reports)
MAX_LABEL = 128  # characters of a label value (longer values are cut)
PROBE_TIMEOUT = 60.0
LIVE_EVERY = 5.0  # seconds between two reads of NICs and nccl.conf

# the same probe doctor runs (tunerd.diagnose.doctor.TORCH_PROBE), reduced to the versions
TORCH_PROBE = r"""
import json
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        pass
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Versions:
    """Version strings; "" where unknown (no driver, no torch, probe failed)."""

    driver: str = ""
    cuda: str = ""
    nccl: str = ""
    torch: str = ""
    kernel: str = ""
    version: str = __version__


@dataclass(frozen=True)
class NicFact:
    nic: str
    mtu: int
    subnet: str  # "10.0.0.0/24", "" without an IPv4 address
    nccl: bool  # matched by NCCL_SOCKET_IFNAME (every non-lo NIC when it is unset)


def _label(v: str) -> str:
    return v[:MAX_LABEL]


def node_class(policy_names: Sequence[str], gpu_models: Sequence[str]) -> str:
    """``"base,h100-training/NVIDIA H100 80GB HBM3"``; ``"-/no GPU"`` without either."""
    models = sorted(set(gpu_models))
    gpu = "+".join(models) if models else "no GPU"
    return _label(f"{','.join(policy_names) or '-'}/{gpu}")


def policy_hash(data: Mapping[str, Any]) -> str:
    """A short hash of the effective (merged) policy: equal policies, equal hashes."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]



def read_nics(nccl_ifname: str | None) -> list[NicFact]:
    """MTU and IPv4 subnet of every interface but lo (this network namespace's)."""
    import psutil

    addrs = psutil.net_if_addrs()
    try:
        names = sorted(n for n in os.listdir("/sys/class/net") if n != "lo")[:MAX_NICS]
    except OSError:
        names = []
    nccl = set(match_ifnames(nccl_ifname, names) if nccl_ifname else names)
    out = []
    for n in names:
        subnet = ""
        for a in addrs.get(n, []):
            if a.family.name == "AF_INET" and a.netmask:
                try:
                    subnet = str(ipaddress.ip_interface(f"{a.address}/{a.netmask}").network)
                except ValueError:
                    continue
                break
        try:
            mtu = int(Path(f"/sys/class/net/{n}/mtu").read_text())
        except (OSError, ValueError):  # gone meanwhile
            continue
        out.append(NicFact(n, mtu, subnet, n in nccl))
    return out


def probe_torch_isolated(python: str, timeout: float = PROBE_TIMEOUT) -> dict[str, str]:
    """torch and NCCL versions of ``python``, started as doctor starts it (tunerd.adapters.isolated:
    ``python -I`` from ``/``, the daemon's environment without the PYTHON* variables)."""
    try:
        p = subprocess.run(isolated.python_argv(python, "-c", TORCH_PROBE), capture_output=True,
                           text=True, timeout=timeout, cwd=isolated.CWD,
                           env=isolated.scrubbed(), stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        log.warning("torch version probe of %s did not finish in %g s", python, timeout)
        return {}
    except OSError as err:
        log.warning("cannot run %s for the torch version: %s", python, err.strerror or err)
        return {}
    try:
        data = json.loads((p.stdout.strip().splitlines() or [""])[-1])
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    if data.get("error"):
        log.info("no torch version from %s: %s", python, data["error"])
    return {k: _label(str(data[k])) for k in ("torch", "nccl") if isinstance(data.get(k), str)}


def _fmt_cuda(v: Any) -> str:
    """NVML's 12040 -> "12.4"."""
    return f"{v // 1000}.{(v % 1000) // 10}" if isinstance(v, int) and v > 0 else ""


def _driver_from_file(proc_root: Path) -> str:
    """``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15 ...`` -> "550.54.15"
    (also the open module's ``... Open Kernel Module for aarch64  570.124.06 ...``)."""
    try:
        text = (proc_root / "driver/nvidia/version").read_text(errors="replace")
    except OSError:
        return ""
    # "... Kernel Module  550.54.15 ...", "... Open Kernel Module for aarch64  570.124.06"
    m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d\S*)", text)
    return m.group(1) if m else ""


def probe_versions(python: str | None, proc_root: Path = Path("/proc"),
                   timeout: float = PROBE_TIMEOUT) -> Versions:
    """Every version label of tunerd_node_info (blocking: run it off the loop)."""
    driver = nvml.driver_version() or ""
    cuda = _fmt_cuda(nvml.cuda_driver_version() or None)
    torch = probe_torch_isolated(python, timeout) if python else {}
    return Versions(driver=_label(str(driver or _driver_from_file(proc_root))), cuda=cuda,
                    nccl=torch.get("nccl", ""), torch=torch.get("torch", ""),
                    kernel=_label(os.uname().release))


@dataclass(frozen=True)
class PcieLink:
    gpu: int
    width: int
    max_width: int
    speed: str  # "16.0 GT/s PCIe"
    max_speed: str


def read_pcie_links(gpus: Sequence[tuple[int, str]], sys_root: Path) -> list[PcieLink]:
    """Each GPU's PCIe link width and speed against its maximum (sysfs; the equivalent of
    ``nvidia-smi -q -d PCIE``'s Link Width/Generation). GPUs absent here (a replayed
    topology) are left out."""
    out = []
    for index, bdf in gpus:
        d = sys_root / "bus/pci/devices" / bdf
        try:
            width, max_width = (int((d / f).read_text()) for f in (
                "current_link_width", "max_link_width"))
            speed, max_speed = ((d / f).read_text().strip() for f in (
                "current_link_speed", "max_link_speed"))
        except (OSError, ValueError):
            continue
        out.append(PcieLink(index, width, max_width, speed, max_speed))
    return out


@dataclass
class FleetFacts:
    """What the collector exports for the fleet; fields are replaced whole, never mutated.

    ``nccl_conf`` returns the managed nccl.conf keys (name -> value) and the
    NCCL_SOCKET_IFNAME in force (or None); the daemon wires it to the nccl tuner.
    """

    nccl_conf: Callable[[], tuple[dict[str, str], str | None]] = lambda: ({}, None)
    python: str | None = None
    proc_root: Path = Path("/proc")
    klass: str = ""
    policy_hash: str = ""
    versions: Versions | None = None  # None until the first probe finished
    nics: list[NicFact] = field(default_factory=list)
    nccl_settings: dict[str, str] = field(default_factory=dict)
    gpu_pci: list[tuple[int, str]] = field(default_factory=list)  # (index, sysfs bus id)
    sys_root: Path = Path("/sys")
    pcie: list[PcieLink] = field(default_factory=list)
    # the GPUs' I/O path for tunerd_io_path_info: {"irq", "acs", "pairing"} (the daemon)
    io_path: Callable[[], dict[str, str]] | None = None
    _next_live: float = 0.0
    _again: bool = False
    _probing: threading.Lock = field(default_factory=threading.Lock)
    _reading: threading.Lock = field(default_factory=threading.Lock)  # scrapes at once
    _changes: int = 0  # policy changes so far (one during a read: read again next time)

    def policy_changed(self, names: Sequence[str], gpu_models: Sequence[str],
                       data: Mapping[str, Any]) -> None:
        """New policy in force: class and hash now, versions in a thread (the probe takes
        seconds); the node_info series appears once they are known."""
        self.klass = node_class(names, gpu_models)
        self.policy_hash = policy_hash(data)
        self._changes += 1
        self._next_live = 0.0  # the new policy's NIC and NCCL settings: next scrape
        threading.Thread(target=self._probe, name="tunerd-version-probe", daemon=True).start()

    def _probe(self) -> None:
        # reloads in a burst (a policy dir updated file by file): one probe runs, and at
        # most one more after it, never one per reload
        while True:
            if not self._probing.acquire(blocking=False):
                self._again = True
                return
            try:
                self._again = False
                try:
                    self.versions = probe_versions(self.python, self.proc_root)
                except Exception as err:  # never let a probe take the daemon down
                    log.warning("version probe failed: %r", err)
                    self.versions = self.versions or Versions(kernel=os.uname().release)
            finally:
                self._probing.release()
            if not self._again:  # no reload came while this probe ran
                return

    def sample(self) -> None:
        """Re-read NICs, nccl.conf and PCIe links where the last read is LIVE_EVERY
        seconds old or a policy changed since (the collector, before it reads them:
        a scrape's thread, or the loop for ``tunerctl metrics``; two at once read once)."""
        with self._reading:
            now = time.monotonic()
            if now < self._next_live:
                return
            changes = self._changes
            self._read_live()
            if changes == self._changes:
                self._next_live = time.monotonic() + LIVE_EVERY

    def _read_live(self) -> None:
        try:
            settings, ifname = self.nccl_conf()
        except Exception as err:
            log.debug("cannot read nccl.conf: %r", err)
            settings, ifname = {}, None
        self.nccl_settings = {_label(k): _label(v)
                              for k, v in sorted(settings.items())[:MAX_NCCL_KEYS]}
        try:
            self.nics = read_nics(ifname)
        except Exception as err:
            log.debug("cannot read NICs: %r", err)
            self.nics = []
        self.pcie = read_pcie_links(self.gpu_pci, self.sys_root)
