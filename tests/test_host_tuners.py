"""Unit tests of each tuner on a temporary /proc, /sys and /etc tree (exact values)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pynvml
import pytest

from tunerd.policy.typed import BlockRule, CpuSection, GpuSection, NicRule, VmSection
from tunerd.tuners import SettingError, build_tuners
from tunerd.tuners.base import Change, bracketed, normalize
from tunerd.tuners.block import BlockTuner
from tunerd.tuners.cpu import CpuTuner
from tunerd.tuners.gpu import GpuTuner
from tunerd.tuners.nccl import BEGIN, END, NcclTuner
from tunerd.tuners.nic import NicTuner
from tunerd.tuners.sysctl import SysctlTuner, sysctl_path
from tunerd.tuners.vm import VmTuner


def put(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def by_key(changes: list[Change]) -> dict[str, Change]:
    return {c.key: c for c in changes}


# -- helpers ---------------------------------------------------------------------------
def test_normalize_and_bracketed() -> None:
    assert normalize("4096\t87380  268435456\n") == "4096 87380 268435456"
    assert bracketed("[mq-deadline] none") == "mq-deadline"
    assert bracketed("none [mq-deadline] kyber bfq") == "mq-deadline"
    assert bracketed("always defer defer+madvise [madvise] never") == "madvise"
    assert bracketed("none") == "none"


def test_sysctl_path_swaps_separators(tmp_path: Path) -> None:
    assert sysctl_path(tmp_path, "net.ipv4.conf.eth0/1.rp_filter") == (
        tmp_path / "net" / "ipv4" / "conf" / "eth0.1" / "rp_filter")


# -- sysctl ----------------------------------------------------------------------------
@pytest.fixture
def proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    put(root / "sys/net/core/somaxconn", "4096\n")
    put(root / "sys/net/ipv4/tcp_rmem", "4096\t131072\t6291456\n")
    return root


def test_sysctl_plan_apply_revert(proc: Path) -> None:
    t = SysctlTuner(proc)
    want = {"net.core.somaxconn": 1024, "net.ipv4.tcp_rmem": "4096 131072   6291456"}
    changes = by_key(t.plan(want))
    som, rmem = changes["sysctl:net.core.somaxconn"], changes["sysctl:net.ipv4.tcp_rmem"]
    assert (som.current, som.desired, som.needed) == ("4096", "1024", True)
    # whitespace differs, value does not: nothing to do
    assert (rmem.current, rmem.needed) == ("4096 131072 6291456", False)
    saved = t.save_original(som)
    t.apply(som)
    assert (proc / "sys/net/core/somaxconn").read_text() == "1024"
    assert t.read(["sysctl:net.core.somaxconn"]) == {"sysctl:net.core.somaxconn": "1024"}
    assert not any(c.needed for c in t.plan(want))
    t.revert("sysctl:net.core.somaxconn", saved)
    assert (proc / "sys/net/core/somaxconn").read_text() == "4096"
    assert t.mentions("sysctl:net.core.somaxconn", want)
    assert not t.mentions("sysctl:net.core.rmem_max", want)


def test_sysctl_missing_is_an_error_with_errno(proc: Path) -> None:
    t = SysctlTuner(proc)
    (c,) = t.plan({"net.ipv4.no_such_knob": 7})
    assert c.available and c.needed and c.current is None
    with pytest.raises(SettingError) as ei:
        t.apply(c)
    e = ei.value
    assert (e.errno, e.key, e.value) == (errno.ENOENT, "sysctl:net.ipv4.no_such_knob", "7")
    assert "ENOENT" in e.message and "no_such_knob" in e.message


# -- nic -------------------------------------------------------------------------------
@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    for ifname, mtu in (("lo", 65536), ("eth0", 1500), ("eth1", 1500), ("ib0", 2044)):
        put(root / "class/net" / ifname / "mtu", f"{mtu}\n")
        put(root / "class/net" / ifname / "tx_queue_len", "1000\n")
    put(root / "block/nvme0n1/queue/scheduler", "[mq-deadline] none\n")
    put(root / "block/nvme0n1/queue/read_ahead_kb", "128\n")
    put(root / "block/nvme0n1/queue/nr_requests", "255\n")
    put(root / "block/sda/queue/scheduler", "none [bfq]\n")
    put(root / "block/sda/queue/read_ahead_kb", "128\n")
    put(root / "kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n")
    put(root / "kernel/mm/transparent_hugepage/defrag",
        "always defer defer+madvise [madvise] never\n")
    return root


def test_nic_plan_by_glob_later_entry_wins(sysfs: Path) -> None:
    t = NicTuner(sysfs)
    want = [NicRule("eth*", mtu=9000, txqueuelen=10000), NicRule("eth1", mtu=4200)]
    ch = by_key(t.plan(want))
    assert sorted(ch) == ["nic:eth0:mtu", "nic:eth0:txqueuelen", "nic:eth1:mtu",
                          "nic:eth1:txqueuelen"]
    assert (ch["nic:eth0:mtu"].current, ch["nic:eth0:mtu"].desired) == ("1500", "9000")
    assert ch["nic:eth1:mtu"].desired == "4200"
    for c in ch.values():
        t.apply(c)
    assert (sysfs / "class/net/eth0/mtu").read_text() == "9000"
    assert (sysfs / "class/net/eth0/tx_queue_len").read_text() == "10000"
    assert (sysfs / "class/net/eth1/mtu").read_text() == "4200"
    assert (sysfs / "class/net/ib0/mtu").read_text() == "2044\n"  # not matched: untouched
    t.revert("nic:eth0:mtu", {"value": "1500"})
    assert (sysfs / "class/net/eth0/mtu").read_text() == "1500"


def test_nic_mentions_a_device_that_went_away(sysfs: Path) -> None:
    t = NicTuner(sysfs)
    eth = [NicRule("eth*", mtu=9000)]
    assert t.mentions("nic:eth7:mtu", eth)
    assert not t.mentions("nic:eth7:txqueuelen", eth)
    assert not t.mentions("nic:ib0:mtu", eth)
    assert [c.key for c in t.plan_device(eth, "eth1")] == ["nic:eth1:mtu"]


def test_nic_refused_write_carries_errno_key_value(sysfs: Path) -> None:
    t = NicTuner(sysfs)
    # a directory in place of the attribute: the write fails with a real errno
    mtu = sysfs / "class/net/eth0/mtu"
    mtu.unlink()
    mtu.mkdir()
    with pytest.raises(SettingError) as ei:
        t.apply(Change("nic:eth0:mtu", "1500", "9000"))
    assert (ei.value.errno, ei.value.key, ei.value.value) == (errno.EISDIR, "nic:eth0:mtu",
                                                              "9000")
    assert ei.value.to_error()["path"] == str(mtu)


# -- block -----------------------------------------------------------------------------
def test_block_scheduler_and_queue(sysfs: Path) -> None:
    t = BlockTuner(sysfs)
    want = [BlockRule("nvme*", scheduler="none", read_ahead_kb=4096, nr_requests=1023)]
    ch = by_key(t.plan(want))
    assert {k: (c.current, c.desired) for k, c in ch.items()} == {
        "block:nvme0n1:scheduler": ("mq-deadline", "none"),
        "block:nvme0n1:read_ahead_kb": ("128", "4096"),
        "block:nvme0n1:nr_requests": ("255", "1023"),
    }
    saved = {k: t.save_original(c) for k, c in ch.items()}
    for c in ch.values():
        t.apply(c)
    assert (sysfs / "block/nvme0n1/queue/scheduler").read_text() == "none"
    assert t.read(["block:nvme0n1:scheduler"]) == {"block:nvme0n1:scheduler": "none"}
    assert (sysfs / "block/nvme0n1/queue/read_ahead_kb").read_text() == "4096"
    for k, s in saved.items():
        t.revert(k, s)
    assert (sysfs / "block/nvme0n1/queue/scheduler").read_text() == "mq-deadline"
    assert (sysfs / "block/nvme0n1/queue/nr_requests").read_text() == "255"
    assert t.read(["block:sda:scheduler"]) == {"block:sda:scheduler": "bfq"}


# -- cpu -------------------------------------------------------------------------------
def test_cpu_governor_not_available_without_cpufreq(sysfs: Path) -> None:
    (sysfs / "devices/system/cpu/cpu0").mkdir(parents=True)
    (c,) = CpuTuner(sysfs).plan(CpuSection(frozenset({0, 1}), governor="performance"))
    assert not c.available and "no cpufreq" in (c.reason or "") and not c.needed
    assert CpuTuner(sysfs).plan(CpuSection(frozenset({0, 1}))) == []


def test_cpu_governor_every_cpu(sysfs: Path) -> None:
    for n, gov in ((0, "powersave"), (1, "schedutil"), (10, "powersave")):
        put(sysfs / f"devices/system/cpu/cpu{n}/cpufreq/scaling_governor", gov + "\n")
    t = CpuTuner(sysfs)
    (c,) = t.plan(CpuSection(governor="performance"))
    assert c.current == "mixed: powersave,schedutil" and c.needed
    saved = t.save_original(c)
    assert saved["per_cpu"] == {"cpu0": "powersave", "cpu1": "schedutil", "cpu10": "powersave"}
    t.apply(c)
    assert t.current() == "performance"
    t.revert("cpu:governor", saved)
    assert (sysfs / "devices/system/cpu/cpu1/cpufreq/scaling_governor").read_text() == "schedutil"
    assert (sysfs / "devices/system/cpu/cpu10/cpufreq/scaling_governor").read_text() == "powersave"


# -- vm --------------------------------------------------------------------------------
def test_vm_thp_and_numa_balancing(sysfs: Path, proc: Path) -> None:
    t = VmTuner(proc, sysfs)
    want = VmSection(transparent_hugepage="never", transparent_hugepage_defrag="madvise",
                     numa_balancing=False)
    ch = by_key(t.plan(want))
    thp = ch["vm:transparent_hugepage"]
    assert (thp.current, thp.desired, thp.needed) == ("madvise", "never", True)
    assert not ch["vm:transparent_hugepage_defrag"].needed
    nb = ch["vm:numa_balancing"]  # 1-node host: the file does not exist
    assert not nb.available and "NUMA balancing" in (nb.reason or "")
    t.apply(thp)
    assert (sysfs / "kernel/mm/transparent_hugepage/enabled").read_text() == "never"
    put(proc / "sys/kernel/numa_balancing", "1\n")
    nb = by_key(t.plan(want))["vm:numa_balancing"]
    assert (nb.current, nb.desired, nb.needed) == ("1", "0", True)
    t.apply(nb)
    assert (proc / "sys/kernel/numa_balancing").read_text() == "0"


# -- nccl ------------------------------------------------------------------------------
ODD_FILES = {
    "no-final-newline": b"# site settings\nNCCL_DEBUG=WARN",
    "crlf": b"# written on windows\r\nNCCL_DEBUG=INFO\r\n\r\n",
    "comments-and-blank": b"\n\n# a comment\n   # indented = comment\nNCCL_P2P_LEVEL=NVL\n\n",
    "not-utf8": b"# caf\xe9 \xff\xfe\nNCCL_ALGO=Ring\n",
    "empty": b"",
}


@pytest.mark.parametrize("name", sorted(ODD_FILES))
def test_nccl_preserves_the_rest_byte_for_byte(tmp_path: Path, name: str) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    conf = etc / "nccl.conf"
    original = ODD_FILES[name]
    conf.write_bytes(original)
    t = NcclTuner(etc)
    want = {"NCCL_SOCKET_IFNAME": "=ens1f0", "NCCL_IB_HCA": "mlx5", "NCCL_IB_DISABLE": False}
    changes = t.plan(want)
    assert [(c.key, c.current, c.desired) for c in changes] == [
        ("nccl:NCCL_SOCKET_IFNAME", None, "=ens1f0"), ("nccl:NCCL_IB_HCA", None, "mlx5"),
        ("nccl:NCCL_IB_DISABLE", None, "0")]
    saved = {c.key: t.save_original(c) for c in changes}
    for c in changes:
        t.apply(c)
    data = conf.read_bytes()
    assert data.startswith(original)  # everything before the block untouched
    text = data.decode("utf-8", "surrogateescape")
    assert "NCCL_SOCKET_IFNAME==ens1f0" in text and "NCCL_IB_DISABLE=0" in text
    if name == "crlf":
        assert f"{END}\r\n" in text
    assert not any(c.needed for c in NcclTuner(etc).plan(want))
    # a fresh tuner (as after a restart) removes the block and gives back the exact file
    t2 = NcclTuner(etc)
    for key, s in saved.items():
        t2.revert(key, s)
    assert conf.read_bytes() == original


def test_nccl_created_file_is_removed_and_user_lines_after_block_kept(tmp_path: Path) -> None:
    t = NcclTuner(tmp_path)
    (c,) = t.plan({"NCCL_IB_HCA": "mlx5"})
    t.apply(c)
    conf = tmp_path / "nccl.conf"
    assert conf.read_text().splitlines() == [f"{BEGIN} [created-file]", "NCCL_IB_HCA=mlx5", END]
    t.revert(c.key, {"value": None, "in_block": False})
    assert not conf.exists()

    conf.write_text("A=1\n")
    t.apply(c)
    with conf.open("a") as f:
        f.write("B=2\n")  # the operator appends after the block
    t.revert(c.key, {"value": None, "in_block": False})
    assert conf.read_text() == "A=1\nB=2\n"


def test_nccl_current_value_from_outside_the_block(tmp_path: Path) -> None:
    put(tmp_path / "nccl.conf", "NCCL_DEBUG=WARN\n")
    (c,) = NcclTuner(tmp_path).plan({"NCCL_DEBUG": "WARN"})
    assert (c.current, c.needed) == ("WARN", False)


# -- gpu (NVML replay: the only fake) --------------------------------------------------
class ReplayNvml:
    """Recorded answers of two A100s (persistence off, default compute mode, 400 W)."""

    def __init__(self) -> None:
        self.gpus: list[dict[str, int]] = [
            {"pm": 0, "cm": 0, "pl": 400000, "min": 100000, "max": 400000} for _ in range(2)]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPersistenceMode(self, h: int) -> int:
        return self.gpus[h]["pm"]

    def nvmlDeviceSetPersistenceMode(self, h: int, v: int) -> None:
        self.gpus[h]["pm"] = v

    def nvmlDeviceGetComputeMode(self, h: int) -> int:
        return self.gpus[h]["cm"]

    def nvmlDeviceSetComputeMode(self, h: int, v: int) -> None:
        self.gpus[h]["cm"] = v

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        return self.gpus[h]["pl"]

    def nvmlDeviceSetPowerManagementLimit(self, h: int, mw: int) -> None:
        g = self.gpus[h]
        if not g["min"] <= mw <= g["max"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        g["pl"] = mw


def test_gpu_plan_apply_revert_on_replay(nvml_backend: Any) -> None:
    fake = ReplayNvml()
    nvml_backend(fake)
    t = GpuTuner()
    want = GpuSection(persistence_mode=True, compute_mode="exclusive_process", power_limit_w=350)
    ch = by_key(t.plan(want))
    assert {k: (c.current, c.desired) for k, c in ch.items() if k.startswith("gpu:1")} == {
        "gpu:1:persistence_mode": ("0", "1"),
        "gpu:1:compute_mode": ("default", "exclusive_process"),
        "gpu:1:power_limit_w": ("400", "350"),
    }
    saved = {k: t.save_original(c) for k, c in ch.items()}
    for c in ch.values():
        t.apply(c)
    assert fake.gpus[0] == {"pm": 1, "cm": 3, "pl": 350000, "min": 100000, "max": 400000}
    assert not any(c.needed for c in t.plan(want))
    for k, s in saved.items():
        t.revert(k, s)
    assert [(g["pm"], g["cm"], g["pl"]) for g in fake.gpus] == [(0, 0, 400000)] * 2
    with pytest.raises(SettingError) as ei:
        t.apply(Change("gpu:0:power_limit_w", "400", "900"))
    assert ei.value.key == "gpu:0:power_limit_w" and "Invalid Argument" in ei.value.message


def test_gpu_without_driver_is_not_available_and_never_fails(nvml_backend: Any) -> None:
    nvml_backend(None, "no NVIDIA driver on this node")
    changes = GpuTuner().plan(GpuSection(persistence_mode=True, power_limit_w=300))
    assert [(c.key, c.available, c.needed) for c in changes] == [
        ("gpu:*:persistence_mode", False, False), ("gpu:*:power_limit_w", False, False)]
    assert all(c.reason == "no NVIDIA driver on this node" for c in changes)
    assert GpuTuner().read() == {}


def test_build_tuners_uses_the_given_roots(tmp_path: Path, proc: Path, sysfs: Path) -> None:
    tuners = build_tuners(proc, sysfs, tmp_path)
    assert sorted(tuners) == ["block", "cpu", "gpu", "irq", "nccl", "nic", "pcie", "sysctl", "vm"]
    assert tuners["nic"].read(["nic:eth0:mtu"]) == {"nic:eth0:mtu": "1500"}


def test_gpu_on_a_topology_replay_is_not_available(nvml_backend: Any) -> None:
    """The topology replay answers only what a snapshot records: no settings to read."""
    import json

    from tunerd.topology import Topology
    from tunerd.topology.nvml_replay import ReplayNvml as TopologyReplay

    snap = Path(__file__).parent / "fixtures/topologies/dgx-h100.json"
    nvml_backend(TopologyReplay(Topology.from_json(json.loads(snap.read_text()))))
    changes = GpuTuner().plan(GpuSection(persistence_mode=True))
    assert len(changes) == 8
    assert all(not c.available and not c.needed for c in changes)
    assert changes[7].key == "gpu:7:persistence_mode"
    (c,) = GpuTuner("topology replay").plan(GpuSection(power_limit_w=500))
    assert (c.key, c.available, c.reason) == ("gpu:*:power_limit_w", False, "topology replay")
