"""The aarch64 code paths, checked here with the Grace recordings (issue 36 item 4):
what an arm64 kernel and driver write in sysfs/procfs is read as it means."""

from __future__ import annotations

from pathlib import Path

from tests.topology_helpers import fixture, render_sysfs
from tunerd.monitor.facts import _driver_from_file
from tunerd.topology.nodemap import node_map
from tunerd.topology.sysfs import read_cpus


def test_arm64_cpus_without_a_package_id_and_with_repeated_core_ids(tmp_path: Path) -> None:
    """Some arm64 kernels (no PPTT package) say physical_package_id -1 and number
    core_id inside each socket: Grace 0's CPU 5 and Grace 1's CPU 77 are then
    (package 0, core 5) both. They are two cores (not SMT siblings), and the node map
    still gives each GPU 36 whole cores of its own Grace."""
    rec = fixture("gb200.json")
    sysd, _ = render_sysfs(rec, tmp_path)
    for c in rec.cpus:
        topo = sysd / f"devices/system/cpu/cpu{c}/topology"
        (topo / "physical_package_id").write_text("-1\n")
        (topo / "core_id").write_text(f"{c % 72}\n")
        (topo / "die_id").unlink()
    cpus = read_cpus(sysd)
    assert len({c.core_id for c in cpus.values()}) == 144
    assert cpus[5].core_id != cpus[77].core_id
    assert [(c.numa_node, c.siblings) for c in (cpus[5], cpus[77])] == [
        (0, frozenset({5})), (1, frozenset({77}))]
    from dataclasses import replace

    m = node_map(replace(rec, cpus=cpus, _cache={}))
    assert [len(m.slices[g].cpus) for g in range(4)] == [36] * 4
    assert m.slices[2].cpus == frozenset(range(72, 108))


def test_the_open_kernel_modules_driver_line_on_aarch64(tmp_path: Path) -> None:
    for line, want in (
            ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.124.06  "
             "Release Build  (dvs-builder@U16-I3-B03-4-3)  Tue Mar  4 2025", "570.124.06"),
            ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 "
             "22:23:56 UTC 2024", "550.54.15")):
        (tmp_path / "driver/nvidia").mkdir(parents=True, exist_ok=True)
        (tmp_path / "driver/nvidia/version").write_text(line + "\nGCC version: gcc 12\n")
        assert _driver_from_file(tmp_path) == want
