"""The one GPU resolver (tunerd.topology.visible.resolve_gpus) on the recorded DGX H100:
indices, GPU UUIDs and their prefixes, MIG UUIDs, the scheduler's renumbering, NVML; what
it cannot resolve is an error naming the value when asked strictly (issue 33 item 2)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tunerd.topology import load_topology
from tunerd.topology.model import Topology
from tunerd.topology.visible import GpuResolveError, resolve_gpus

DGX = Path(__file__).parent / "fixtures" / "topologies" / "dgx-h100.json"


@pytest.fixture(scope="module")
def topo() -> Topology:
    t = load_topology(DGX)
    mig = [{"uuid": "MIG-11111111-2222-3333-4444-555555555555"}]
    gpus = [replace(g, mig_devices=mig) if g.index == 3 else g for g in t.gpus]
    return replace(t, gpus=gpus)


def test_every_spelling_of_a_gpu_resolves_to_its_node_index(topo: Topology) -> None:
    u5 = topo.gpus[5].uuid
    assert resolve_gpus(topo, {"CUDA_VISIBLE_DEVICES": u5}, local_rank=0, strict=True) == (5,)
    assert resolve_gpus(topo, {"CUDA_VISIBLE_DEVICES": u5[:12]}, strict=True) == (5,)
    assert resolve_gpus(topo, {"CUDA_VISIBLE_DEVICES": u5[4:17]}, strict=True) == (5,)
    assert resolve_gpus(topo, {"CUDA_VISIBLE_DEVICES": "MIG-11111111"}, strict=True) == (3,)
    assert resolve_gpus(topo, {"CUDA_VISIBLE_DEVICES": f"MIG-{topo.gpus[6].uuid}/1/0"},
                        strict=True) == (6,)
    assert resolve_gpus(topo, {"CUDA_VISIBLE_DEVICES": f"7,{u5}", "LOCAL_RANK": "1"},
                        strict=True) == (5,)
    assert resolve_gpus(topo, {}, local_rank=None) is None
    assert resolve_gpus(topo, {}, local_rank=None, nvml=(2, 7)) == (2, 7)
    assert resolve_gpus(topo, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, local_rank=None) == ()


def test_a_renumbered_grant_maps_positions_to_the_granted_gpus(topo: Topology) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    assert resolve_gpus(topo, env, granted=(1,), local_rank=0, strict=True) == (1,)
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert resolve_gpus(topo, env, granted=(6, 7), local_rank=1, strict=True) == (7,)
    # node indices all inside the grant (no ConstrainDevices) stay node indices
    env = {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert resolve_gpus(topo, env, granted=(6, 7), local_rank=0, strict=True) == (6,)
    # no variable: the rank counts inside the grant
    assert resolve_gpus(topo, {}, granted=(4, 5), local_rank=1, strict=True) == (5,)


@pytest.mark.parametrize(("env", "granted", "rank", "named"), [
    ({"CUDA_VISIBLE_DEVICES": "GPU-deadbeef"}, None, 0, "'GPU-deadbeef'"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-0000"}, None, 0, "ambiguous"),
    ({"CUDA_VISIBLE_DEVICES": "9"}, None, 0, "'9'"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, None, 3, "local rank 3"),
    ({"CUDA_VISIBLE_DEVICES": ""}, None, 0, "local rank 0"),
    ({}, None, 8, "local rank 8"),
    ({}, (2,), 1, "local rank 1"),
    ({"CUDA_VISIBLE_DEVICES": "MIG-99"}, None, 0, "'MIG-99'"),
    ({"CUDA_VISIBLE_DEVICES": "5"}, (1,), 0, "grant"),
])
def test_strict_names_what_it_cannot_resolve(topo: Topology, env: dict[str, str],
                                             granted: tuple[int, ...] | None, rank: int,
                                             named: str) -> None:
    with pytest.raises(GpuResolveError) as err:
        resolve_gpus(topo, env, granted=granted, local_rank=rank, strict=True)
    assert named in err.value.message
    # the bind paths are not strict: they skip what CUDA would skip, never raise
    resolve_gpus(topo, env, granted=granted, local_rank=rank)
