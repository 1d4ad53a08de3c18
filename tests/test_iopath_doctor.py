"""doctor's GPU/NIC path checks on the recorded DGX H100 tree (every root an argument)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.iotree import build, config_space
from tunerd.diagnose.doctor import PASS, WARN, Env, check_io_paths
from tunerd.topology import read_snapshot

DGX = Path(__file__).parent / "fixtures" / "topologies" / "dgx-h100.json"


def _checks(root: Path, topo=None):  # type: ignore[no-untyped-def]
    topo = topo or read_snapshot(DGX)
    env = Env(proc_root=root / "proc", sys_root=root / "sys", etc_root=root / "etc",
              topology=topo)
    return {c.id: c for c in check_io_paths(env)}


def test_clean_tree_passes(tmp_path: Path) -> None:
    build(tmp_path, read_snapshot(DGX))
    checks = _checks(tmp_path)
    assert {c.status for c in checks.values()} == {PASS}, checks


def test_doctor_names_the_acs_bridge_between_a_gpu_and_its_nic(tmp_path: Path) -> None:
    # GPU 2 (0000:52:00.0) and mlx5_2 sit behind switch 0000:4d:00.0; its downstream
    # port to the NIC has ACS source validation on
    build(tmp_path, read_snapshot(DGX), acs_on=frozenset({"0000:4e:00.0"}))
    c = _checks(tmp_path)["io-acs"]
    assert c.status == WARN
    assert "GPU2-mlx5_2:1: 0000:4e:00.0" in c.evidence
    assert c.data["pairs"]["2"]["acs_bridges"] == ["0000:4e:00.0"]
    assert "setpci" in c.fix


def test_numa_mismatch_iommu_relaxed_ordering_and_narrow_link(tmp_path: Path) -> None:
    topo = read_snapshot(DGX)
    build(tmp_path, topo)
    nic = tmp_path / "sys/bus/pci/devices/0000:18:00.0"
    (nic / "config").write_bytes(config_space(relaxed_ordering=False))
    (nic / "current_link_width").write_text("8\n")
    grp = tmp_path / "sys/kernel/iommu_groups/7"
    grp.mkdir(parents=True)
    (grp / "type").write_text("DMA-FQ\n")
    (nic / "iommu_group").symlink_to(grp)
    # GPU 0 moved to node 1 and off its switch: its NIC is on another NUMA node
    gpus = [replace(g, numa_node=1, pcie_path=()) if g.index == 0 else g for g in topo.gpus]
    rdma = [r for r in topo.rdma if r.name not in {"mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7",
                                                   "mlx5_8"}]
    topo2 = replace(topo, gpus=gpus, rdma=rdma)
    checks = _checks(tmp_path, topo2)
    assert checks["io-numa"].status == WARN and "GPU0 (node 1)" in checks["io-numa"].evidence
    assert checks["io-iommu"].status == WARN and "DMA-FQ" in checks["io-iommu"].evidence
    assert checks["io-relaxed-ordering"].status == WARN
    assert "mlx5_" in checks["io-relaxed-ordering"].evidence
    assert checks["io-link"].status == WARN and "x8 of x16" in checks["io-link"].evidence


def test_opt_in_acs_clearing_planned_applied_verified_reverted(tmp_path: Path) -> None:
    from tunerd.policy.typed import PcieSection
    from tunerd.tuners.pcie import PcieTuner

    topo = read_snapshot(DGX)
    build(tmp_path, topo, acs_on=frozenset({"0000:4e:00.0", "0000:4e:01.0"}))
    cfg = tmp_path / "sys/bus/pci/devices/0000:4e:00.0/config"
    before = cfg.read_bytes()
    t = PcieTuner(tmp_path / "proc", tmp_path / "sys", lambda: topo)
    assert t.plan(PcieSection()) == []  # opt-in
    plan = {c.key: c for c in t.plan(PcieSection(clear_acs=True))}
    needed = sorted(k for k, c in plan.items() if c.needed)
    assert needed == ["pcie:0000:4e:00.0:acs", "pcie:0000:4e:01.0:acs"]
    c = plan["pcie:0000:4e:00.0:acs"]
    assert (c.current, c.desired) == ("001d", "001c")
    saved = {k: t.save_original(plan[k]) for k in needed}
    for k in needed:
        t.apply(plan[k])
    assert not [c for c in t.plan(PcieSection(clear_acs=True)) if c.needed]  # verify
    assert _checks(tmp_path, topo)["io-acs"].status == PASS
    for k in needed:
        t.revert(k, saved[k])
    assert cfg.read_bytes() == before
    assert _checks(tmp_path, topo)["io-acs"].status == WARN


def test_acs_is_never_cleared_inside_a_vm(tmp_path: Path) -> None:
    from tunerd.policy.typed import PcieSection
    from tunerd.tuners.pcie import PcieTuner

    topo = read_snapshot(DGX)
    build(tmp_path, topo, acs_on=frozenset({"0000:4e:00.0"}))
    (tmp_path / "proc/cpuinfo").write_text("flags\t\t: fpu vme hypervisor lahf_lm\n")
    t = PcieTuner(tmp_path / "proc", tmp_path / "sys", lambda: topo)
    (c,) = [c for c in t.plan(PcieSection(clear_acs=True)) if c.key == "pcie:0000:4e:00.0:acs"]
    assert not c.available and "virtual machine" in (c.reason or "")


def test_tunerctl_doctor_checks_a_recorded_tree(tmp_path: Path) -> None:
    """`tunerctl doctor --sysfs-root DIR --topology SNAPSHOT`: the ACS finding on a
    recording, from the command line (it was reachable only through the Python API)."""
    from tests.helpers import run_ctl

    build(tmp_path, read_snapshot(DGX), acs_on=frozenset({"0000:4e:00.0"}))
    r = run_ctl("--json", "doctor", "--sysfs-root", str(tmp_path / "sys"),
                "--topology", str(DGX), "--python", "/nonexistent/python3")
    assert r.rc in (0, 1), r
    checks = {c["id"]: c for c in r.json()["checks"]}
    assert checks["io-acs"]["status"] == WARN, checks["io-acs"]
    assert "GPU2-mlx5_2:1: 0000:4e:00.0" in checks["io-acs"]["evidence"]
    human = run_ctl("doctor", "--sysfs-root", str(tmp_path / "sys"), "--topology", str(DGX),
                    "--python", "/nonexistent/python3")
    assert "0000:4e:00.0" in human.out, human
