"""The kubelet's PodResources API: a fake kubelet (a real gRPC server on a unix socket)
replays recorded answers: whole GPUs, MIG devices, exclusive CPUs, the shared pool.

The processes are real and look like containers: in a kubepods cgroup, chrooted into
a root with the pod's hostname and namespace, running as an unprivileged user.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProc
from tests.kubepods_helpers import KubepodsTree, kubepods_tree
from tests.podresources_helpers import FakeKubelet, container, container_root, recorded
from tunerd.jobs.podresources import (
    ALLOCATABLE,
    LIST,
    PodResourcesSource,
    decode_allocatable,
    decode_list,
    pod_allocation,
    pod_cgroup,
)
from tunerd.topology import read_snapshot

pytestmark = pytest.mark.root

TOPOLOGIES = Path(__file__).parent / "fixtures" / "topologies"
MIG_UUID = "MIG-7c1f2d4e-0000-5000-8000-000000000001"


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[FakeKubelet]:
    with FakeKubelet(tmp_path / "kubelet.sock", recorded("list.json")) as k:
        yield k


@pytest.fixture
def tree() -> Iterator[KubepodsTree]:
    with kubepods_tree(cpus="0-1") as t:
        yield t


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_recorded_answers_decode_through_a_real_grpc_call(kubelet: FakeKubelet) -> None:
    src = PodResourcesSource(kubelet.socket_path)
    pods = {(p.namespace, p.name): p for p in decode_list(src._call(LIST))}
    assert set(pods) == {("ml", "train-0"), ("ml", "mig-job"), ("ml", "exclusive"),
                         ("default", "web")}
    trainer, shipper = pods["ml", "train-0"].containers
    assert (trainer.name, shipper.name, shipper.devices) == ("trainer", "log-shipper", ())
    assert trainer.devices[0].device_ids[1] == "GPU-00000006-0000-4000-8000-0000d1000"
    assert trainer.devices[0].numa_nodes == (1,)
    assert pods["ml", "exclusive"].containers[0].cpu_ids == {2, 3, 114, 115}
    assert pods["default", "web"].containers[0].cpu_ids == frozenset()  # shared pool
    devs, cpus = decode_allocatable(src._call(ALLOCATABLE))
    assert [len(d.device_ids) for d in devs] == [7, 2] and len(cpus) == 220
    assert src.allocatable()[1] == cpus
    src.close()


def test_pod_allocation_whole_gpus_mig_and_exclusive_cpus(tmp_path: Path) -> None:
    snap = json.loads((TOPOLOGIES / "dgx-h100.json").read_text())
    snap["gpus"][3]["mig_enabled"] = True
    snap["gpus"][3]["mig_devices"] = [{"uuid": MIG_UUID, "profile": "1g.10gb"}]
    (tmp_path / "mig.json").write_text(json.dumps(snap))
    topo = read_snapshot(tmp_path / "mig.json")
    from tests.podresources_helpers import encode_list

    pods = {p.name: p for p in decode_list(encode_list(recorded("list.json")))}
    a = pod_allocation(pods["train-0"], topo)
    assert (a.container, a.gpus, a.cpu_ids) == ("trainer", (5, 6), frozenset())
    a = pod_allocation(pods["mig-job"], topo)
    assert (a.gpus, a.gpu_uuids) == ((3,), (MIG_UUID,))  # a MIG device: its GPU
    a = pod_allocation(pods["exclusive"], topo)
    assert (a.gpus, a.cpu_ids) == ((0,), frozenset({2, 3, 114, 115}))
    a = pod_allocation(pods["web"], topo)
    assert (a.gpus, a.container) == ((), None)  # no GPU at all: none may be leased
    # a device this node's topology lacks is left out, with a note
    a = pod_allocation(pods["mig-job"], read_snapshot(TOPOLOGIES / "dgx-h100.json"))
    assert a.gpus == () and "not on this node's topology" in a.notes[0]


def test_join_lists_once_per_kubelet_change_and_backs_off(
        kubelet: FakeKubelet, tree: KubepodsTree, tmp_path: Path,
        unpriv_user: tuple[int, int]) -> None:
    topo = read_snapshot(TOPOLOGIES / "dgx-h100.json")
    clock = Clock()
    src = PodResourcesSource(kubelet.socket_path, clock=clock)
    uid, gid = unpriv_user
    with container(tree.ctr, container_root(tmp_path, "train-0", "ml"), uid, gid) as p:
        cg = pod_cgroup(p.pid)
        assert cg is not None and tree.pod.name == f"pod{cg.uid}"
        for _ in range(3):
            a = src.lookup(p.pid, topo)
            assert a is not None and (a.namespace, a.pod, a.gpus) == ("ml", "train-0", (5, 6))
        assert kubelet.calls["List"] == 1  # cached: no List per lookup
        src.invalidate()  # the kubelet changed a cpuset
        assert src.lookup(p.pid, topo) is not None and kubelet.calls["List"] == 2
        # the kubelet fails: the last answer stays, calls back off 1 s, 2 s, ...
        kubelet.fail = True
        src.invalidate()
        for _ in range(5):
            assert src.lookup(p.pid, topo) is not None
        assert kubelet.calls["List"] == 3 and "UNAVAILABLE" in str(src.last_error)
        clock.t += 1.1
        src.lookup(p.pid, topo)
        src.lookup(p.pid, topo)
        assert kubelet.calls["List"] == 4 and "next try in 2 s" in str(src.last_error)
        kubelet.fail = False
        clock.t += 2.1
        assert src.lookup(p.pid, topo) is not None and kubelet.calls["List"] == 5
        assert src.last_error is None
    src.close()


def test_join_refuses_what_the_pod_could_forge(kubelet: FakeKubelet, tree: KubepodsTree,
                                               tmp_path: Path) -> None:
    """A container running as root could rewrite its /etc/hostname: not joined."""
    topo = read_snapshot(TOPOLOGIES / "dgx-h100.json")
    src = PodResourcesSource(kubelet.socket_path)
    with container(tree.ctr, container_root(tmp_path, "train-0", "ml"), 0, 0) as p:
        assert src.lookup(p.pid, topo) is None
    assert kubelet.calls["List"] == 0
    src.close()


def test_fake_kubelets_list_decides_the_gpu_a_pod_rank_is_placed_near(
        kubelet: FakeKubelet, tree: KubepodsTree, tmp_path: Path, daemon_factory: Any,
        unpriv_user: tuple[int, int]) -> None:
    """Done when: the recorded List decides which GPUs the pod's rank is placed near
    (LOCAL_RANK=1 of a pod given GPUs 5 and 6 is GPU 6; without the pod, GPU 1)."""
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text(f'pod_resources_socket = "{kubelet.socket_path}"\n')
    d: DaemonProc = daemon_factory(args=["--config", str(cfg), "--topology",
                                         str(TOPOLOGIES / "dgx-h100.json")]).start()
    uid, gid = unpriv_user
    with container(tree.ctr, container_root(tmp_path, "train-0", "ml"), uid, gid,
                   env={"LOCAL_RANK": "1"}) as p:
        r = d.ctl("--json", "bind", str(p.pid))
        # replayed DGX topology: placed on the snapshot, nothing applied here (exit 1)
        err = r.json()["error"]
        assert r.rc == 1 and err["details"]["applied"] is False, r.out + d.log()
        # GPU 6 (the pod's second GPU), its slice of NUMA node 1 (tunerd.topology.nodemap)
        assert "LOCAL_RANK: 6;" in err["message"], err
        assert "would bind CPUs 84-97,196-209" in err["message"], err
    assert kubelet.calls["List"] == 1
    st = d.ctl("--json", "status").json()["services"]["podresources"]
    assert st["lists_total"] == 1 and st["pods"] == 4 and st["last_error"] is None


def test_a_lease_in_a_pod_gets_only_the_pods_gpus(
        kubelet: FakeKubelet, tree: KubepodsTree, tmp_path: Path,
        unpriv_user: tuple[int, int]) -> None:
    """The allocation intake with the pod source registered as the daemon registers it:
    a 1-GPU and a 2-GPU request from the pod's process are placed on GPUs 5 and 6 only,
    and a 3-GPU one is refused (no GPU outside the pod's set)."""
    from tunerd.base.errors import TunerdError
    from tunerd.jobs import allocation
    from tunerd.jobs.placer import HostCapacity, Placer, PlaceRequest

    topo = read_snapshot(TOPOLOGIES / "dgx-h100.json")
    src = PodResourcesSource(kubelet.socket_path)

    def source(pid: int, t: Any) -> tuple[tuple[int, ...], str] | None:
        a = src.lookup(pid, t)
        return None if a is None else (a.gpus, f"Kubernetes pod {a.namespace}/{a.pod}")

    allocation.add_gpu_source(source)
    pl = Placer(topo, HostCapacity(frozenset(range(224)), frozenset(range(2))),
                lambda: frozenset())
    uid, gid = unpriv_user
    try:
        with container(tree.ctr, container_root(tmp_path, "train-0", "ml"), uid, gid) as p:
            alloc = allocation.read_allocation(p.pid, {}, topo)
            assert alloc.gpus == (5, 6) and alloc.scheduler == "Kubernetes pod ml/train-0"
            one = pl.place(PlaceRequest(gpus=1, allocation=alloc, what="lease"))
            two = pl.place(PlaceRequest(gpus=2, allocation=alloc, what="lease"))
            assert set(one.gpus) <= {5, 6} and set(two.gpus) == {5, 6}
            with pytest.raises(TunerdError):
                pl.place(PlaceRequest(gpus=3, allocation=alloc, what="lease"))
    finally:
        allocation._gpu_sources.remove(source)
        src.close()
