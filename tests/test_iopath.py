"""Each GPU's NIC: PCIe paths in the topology, and the pairing (tunerd.topology.iopath)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.iotree import build
from tunerd.topology import read_snapshot
from tunerd.topology.iopath import gpu_nics, nic_env, pairing_json
from tunerd.topology.model import Topology
from tunerd.topology.sysfs import pcie_path, read_nics, read_rdma

TOPOLOGIES = Path(__file__).parent / "fixtures" / "topologies"


def test_dgx_h100_each_gpu_gets_the_nic_behind_its_own_switch() -> None:
    topo = read_snapshot(TOPOLOGIES / "dgx-h100.json")
    pairs = gpu_nics(topo)
    assert len(topo.rdma) == 9
    for g in topo.gpus:
        (p,) = pairs[g.index]
        assert p.nic.device == f"mlx5_{g.index}:1"
        assert p.tier == "switch" and p.nic.numa_node == g.numa_node
        assert len(p.shared_path) == 3  # host bridge, root port, the switch
    assert nic_env(pairs[3]) == {"NCCL_IB_HCA": "=mlx5_3:1", "UCX_NET_DEVICES": "mlx5_3:1"}


def test_pcie_8gpu_switch_then_cascade_then_numa() -> None:
    pairs = gpu_nics(read_snapshot(TOPOLOGIES / "pcie-8gpu.json"))
    tiers = {g: (ps[0].nic.name, ps[0].tier, len(ps[0].shared_path)) for g, ps in pairs.items()}
    assert tiers[0] == tiers[1] == ("mlx5_0", "switch", 5)  # PIX
    assert tiers[2] == tiers[3] == ("mlx5_0", "switch", 3)  # PXB (the cascade switch)
    assert tiers[4] == tiers[5] == ("mlx5_1", "switch", 3)
    assert tiers[6] == tiers[7] == ("mlx5_1", "numa", 0)  # NODE
    js = pairing_json(pairs)
    assert js["6"][0]["topo"] == "NODE" and js["0"][0]["topo"] == "PIX/PXB"


def test_old_snapshots_load_and_pair_by_numa_node() -> None:
    data = json.loads((TOPOLOGIES / "dgx-h100.json").read_text())
    data.pop("rdma")
    for x in data["gpus"] + data["nics"]:
        x.pop("pcie_path", None)
    topo = Topology.from_json(data)
    assert not topo.rdma and not topo.gpus[0].pcie_path
    pairs = gpu_nics(topo)
    # the 400 Gb/s IPoIB interfaces, spread over the GPUs of each node; not eno3 (1 Gb/s)
    names = [pairs[g][0].nic.name for g in range(8)]
    assert names == ["ibp24s0", "ibp64s0", "ibp79s0", "ibp94s0",
                     "ibp154s0", "ibp192s0", "ibp206s0", "ibp220s0"]
    assert all(pairs[g][0].tier == "numa" for g in range(8))
    assert nic_env(pairs[0]) == {"NCCL_SOCKET_IFNAME": "=ibp24s0", "UCX_NET_DEVICES": "ibp24s0"}


def test_snapshot_round_trip_keeps_paths_and_rdma() -> None:
    topo = read_snapshot(TOPOLOGIES / "dgx-h100.json")
    again = Topology.from_json(json.loads(json.dumps(topo.to_json())))
    assert again.rdma == topo.rdma and again.gpus == topo.gpus and again.nics == topo.nics


def test_no_fabric_nic_gives_empty_pairs() -> None:
    topo = read_snapshot(TOPOLOGIES / "this-machine.json")
    assert all(ps == () for ps in gpu_nics(topo).values())
    assert nic_env(()) == {}


def test_sysfs_reads_paths_rdma_ports_and_netdevs(tmp_path: Path) -> None:
    topo = read_snapshot(TOPOLOGIES / "dgx-h100.json")
    build(tmp_path, topo)
    sysr = tmp_path / "sys"
    assert pcie_path("0000:1b:00.0", sysr) == ("pci0000:15", "0000:15:01.0", "0000:16:00.0",
                                               "0000:17:01.0")
    assert pcie_path("0000:ff:00.0", sysr) == ()
    ports = read_rdma(sysr)
    assert [(r.name, r.netdev, r.rate_gbps, r.link_layer) for r in ports][:2] == [
        ("mlx5_0", "ibp24s0", 400, "InfiniBand"), ("mlx5_1", "ibp64s0", 400, "InfiniBand")]
    assert ports[0].pcie_path == topo.rdma[0].pcie_path and ports[0].numa_node == 0
    nics = {n.name: n for n in read_nics(sysr)}
    assert nics["ibp24s0"].pcie_path == topo.rdma[0].pcie_path
    assert nics["ibp24s0"].pci_bus_id == "0000:18:00.0"


def test_tunerctl_topology_shows_each_gpus_nic(daemon_factory) -> None:
    d = daemon_factory(args=["--topology", str(TOPOLOGIES / "dgx-h100.json")]).start()
    r = d.ctl("topology")
    assert r.rc == 0, r.err
    nic_table = r.out[r.out.index("Each GPU's NIC"):]  # after the node map's table
    row = next(line.split() for line in nic_table.splitlines() if line.startswith("  GPU5 "))
    assert row[1:3] == ["mlx5_5:1", "ibp192s0"] and "switch" in row
    r = d.ctl("--json", "topology")
    data = json.loads(r.out)
    assert data["gpu_nics"]["5"][0]["device"] == "mlx5_5:1"
    assert data["gpu_nics"]["5"][0]["tier"] == "switch"


def test_advise_names_a_gpu_whose_nic_is_on_another_numa_node() -> None:
    from tunerd.diagnose.advise import advise

    topo = read_snapshot(TOPOLOGIES / "workstation.json")  # its NIC has no NUMA node
    nics = pairing_json(gpu_nics(topo))
    (f,) = [f for f in advise({"gpus": [0], "gpu_nics": nics}, {}) if f.id == "nic-far"]
    assert f.evidence["pairs"][0]["nic"] == "enp5s0"
    dgx = pairing_json(gpu_nics(read_snapshot(TOPOLOGIES / "dgx-h100.json")))
    assert not [f for f in advise({"gpus": [3], "gpu_nics": dgx}, {}) if f.id == "nic-far"]
