"""Snapshots: round trip, strict reading, and the recorded node types themselves."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests.topology_helpers import FIXTURE_NAMES, TOPOLOGIES, fixture
from tunerd.base.errors import UsageError
from tunerd.topology import SCHEMA, Topology, load_topology


def test_all_node_types_are_recorded() -> None:
    assert {"dgx-h100.json", "pcie-8gpu.json", "gh200.json", "epyc-nps4.json",
            "workstation.json", "this-machine.json"} <= set(FIXTURE_NAMES)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_round_trip_and_sources(name: str) -> None:
    raw = json.loads((TOPOLOGIES / name).read_text())
    assert raw["schema"] == SCHEMA
    assert raw.get("source"), f"{name} must say where its facts come from"
    topo = load_topology(TOPOLOGIES / name)
    assert topo.replayed
    again = Topology.from_json(json.loads(json.dumps(topo.to_json())))
    assert again.to_json() == topo.to_json()
    # internal consistency: every CPU is in its node, siblings share a core
    for cpu in topo.cpus.values():
        assert cpu.id in topo.numa_nodes[cpu.numa_node].cpus
        assert all(topo.cpus[s].core_id == cpu.core_id for s in cpu.siblings)
    for g in topo.gpus:
        assert g.local_cpus <= topo.online_cpus()
    n = len(topo.gpus)
    assert len(topo.links) == n * (n - 1) // 2


def test_dgx_h100_matches_the_documented_node() -> None:
    t = fixture("dgx-h100.json")
    assert len(t.cpus) == 224 and len(t.cores()) == 112 and len(t.packages()) == 2
    assert all(t.link(a, b).label == "NV18"  # type: ignore[union-attr]
               for a, b in itertools.combinations(range(8), 2))
    assert [g.numa_node for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.gpus[0].local_cpus == t.numa_nodes[0].cpus
    assert 0 in t.gpus[0].local_cpus and 112 in t.gpus[0].local_cpus


def test_pcie_server_links() -> None:
    t = fixture("pcie-8gpu.json")
    kinds = {(a, b): lk.kind for (a, b), lk in t.links.items()}
    assert kinds[(0, 1)] == "PIX" and kinds[(6, 7)] == "PIX"
    assert kinds[(0, 2)] in ("PXB", "NODE") and kinds[(4, 6)] in ("PXB", "NODE")
    assert kinds[(0, 4)] == "SYS" and kinds[(3, 7)] == "SYS"
    assert all(lk.nvlinks == 0 for lk in t.links.values())


def test_gh200_gpu_memory_is_its_own_numa_node() -> None:
    t = fixture("gh200.json")
    assert len(t.cpus) == 72 and len(t.gpus) == 1
    g = t.gpus[0]
    assert g.numa_node == 0 and g.memory_numa_nodes == (1,)
    assert t.numa_nodes[1].cpus == frozenset() and t.numa_nodes[1].memory_total_bytes > 0


def test_epyc_nps4_has_eight_nodes_and_ccx_groups() -> None:
    t = fixture("epyc-nps4.json")
    assert len(t.numa_nodes) == 8 and len(t.gpus) == 8
    groups = t.l3_groups()
    assert len(groups) == 32 and all(len(g) == 8 for g in groups.values())
    assert sorted({g.numa_node for g in t.gpus}) == [1, 3, 5, 7]
    assert t.numa_nodes[0].distances[1] < t.numa_nodes[0].distances[4]


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(schema="tunerd.topology/99"), ["$.schema", "tunerd.topology/99"]),
    (lambda d: d["cpus"][0].update(id="zero"), ["$.cpus[0].id", "integer"]),
    (lambda d: d["numa_nodes"][0].update(cpus="0-x"), ["$.numa_nodes[0].cpus", "0-x"]),
    (lambda d: d["links"][0].update(kind="WARP"), ["$.links[0].kind", "WARP"]),
    (lambda d: d["links"][0].update(b=42), ["$.links[0]", "42"]),
    (lambda d: d["gpus"][1].update(index=0), ["$.gpus", "repeat"]),
    (lambda d: d["cpus"][0].update(numa_node=9), ["CPU 0", "node 9"]),
])
def test_bad_snapshot_names_file_and_key(tmp_path: Path, mutate, words) -> None:
    data = json.loads((TOPOLOGIES / "pcie-8gpu.json").read_text())
    mutate(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(UsageError) as err:
        load_topology(bad)
    assert str(bad) in err.value.message
    for w in words:
        assert w in err.value.message


def test_unreadable_snapshots(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read topology snapshot"):
        load_topology(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_topology(tmp_path / "junk.json")
