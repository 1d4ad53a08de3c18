"""Placement: unit cases on recorded node types, and property tests on every fixture."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.topology_helpers import FIXTURE_NAMES, fixture
from tunerd.base.cpulist import parse_cpulist
from tunerd.base.errors import Failed, UsageError
from tunerd.jobs.placement import (
    MODES,
    PlacementError,
    PlacementRequest,
    gpu_set_score,
    place,
)
from tunerd.topology import Topology
from tunerd.topology.nodemap import node_map
from tunerd.wire.protocol import ExitCode, exit_code

R = PlacementRequest
GPU_FIXTURES = [n for n in FIXTURE_NAMES if fixture(n).gpus]
TOPOS = {n: fixture(n) for n in FIXTURE_NAMES}


# -- GPUs ------------------------------------------------------------------------------
def test_pcie_pairs_behind_one_switch_come_first() -> None:
    t = TOPOS["pcie-8gpu.json"]
    assert place(t, R(gpus=2)).gpus == (0, 1)
    assert place(t, R(gpus=2), busy_gpus={1: "lease A"}).gpus == (2, 3)
    four = place(t, R(gpus=4), busy_gpus={0: "lease A"})
    assert four.gpus == (4, 5, 6, 7)  # one socket; socket 0 has only 3 free
    # one GPU goes next to the busy one, keeping whole free pairs for later jobs
    assert place(t, R(gpus=1), busy_gpus={2: "lease A"}).gpus == (3,)


def test_nvswitch_node_prefers_gpus_of_one_numa_node() -> None:
    t = TOPOS["dgx-h100.json"]
    p = place(t, R(gpus=4), busy_gpus={0: "lease A"})
    assert p.gpus == (4, 5, 6, 7)
    assert p.mems == frozenset({1})
    assert "NV18" in p.explanation


def test_named_gpus_and_who_holds_them() -> None:
    t = TOPOS["dgx-h100.json"]
    p = place(t, R(gpu_ids=(5, 2)))
    assert p.gpus == (2, 5) and p.gpu_uuids == (t.gpus[2].uuid, t.gpus[5].uuid)
    with pytest.raises(PlacementError) as err:
        place(t, R(gpu_ids=(2, 3)), busy_gpus={3: "lease L3 (pid 412)"})
    assert "GPU 3 held by lease L3 (pid 412)" in err.value.message
    assert isinstance(err.value, Failed) and exit_code(err.value) == ExitCode.FAILED
    with pytest.raises(UsageError, match="no GPU 9"):
        place(t, R(gpu_ids=(9,)))


def test_not_enough_gpus_says_what_is_free_and_who_holds_the_rest() -> None:
    t = TOPOS["pcie-8gpu.json"]
    busy = {i: f"lease L{i // 4} (pid {100 + i // 4})" for i in range(6)}
    with pytest.raises(PlacementError) as err:
        place(t, R(gpus=3), busy_gpus=busy)
    msg = err.value.message
    assert "need 3 GPU(s), 2 free" in msg and "GPU 6-7" in msg
    assert "GPU 0-3 held by lease L0 (pid 100)" in msg
    assert "GPU 4-5 held by lease L1 (pid 101)" in msg
    assert err.value.details["free_gpus"] == [6, 7]


# -- CPUs ------------------------------------------------------------------------------
def test_gpu_local_cpus_whole_cores_first() -> None:
    t = TOPOS["dgx-h100.json"]
    p = place(t, R(gpus=1, cpus=6), busy_gpus={i: "x" for i in range(4)})
    assert p.gpus == (4,)
    assert p.cpus == frozenset({56, 57, 58, 168, 169, 170})  # 3 whole cores on node 1
    assert p.mems == frozenset({1})
    shared_all = place(t, R(gpus=1))  # GPU 0's slice of the node map, not its whole node
    assert shared_all.cpus == node_map(t).slices[0].cpus == parse_cpulist("0-13,112-125")


def test_housekeeping_and_exclusive_cpus_are_never_given() -> None:
    t = TOPOS["dgx-h100.json"]
    hk = frozenset({0, 1, 112, 113})
    held = {c: "lease L1 (pid 7)" for c in range(2, 10)}
    p = place(t, R(gpus=1), housekeeping=hk, exclusive_cpus=held)
    assert not p.cpus & hk and not p.cpus & set(held)
    assert p.cpus == node_map(t, hk).slices[0].cpus - set(held)
    # a 3-CPU shared request takes a whole core, then the odd thread from a core that is
    # already split (cpu 2, whose sibling 114 is held) rather than breaking a whole one
    q = place(t, R(gpus=1, cpus=3), exclusive_cpus={114: "x"})
    assert q.cpus == frozenset({0, 112, 2})


def test_exclusive_default_is_a_fair_share_of_the_node() -> None:
    """Like torch's `exclusive` affinity: the node's cores divided among its GPUs."""
    t = TOPOS["dgx-h100.json"]
    held: dict[int, str] = {}
    busy: dict[int, str] = {}
    for n in range(4):
        p = place(t, R(gpus=1, exclusive=True), busy_gpus=busy, exclusive_cpus=held)
        assert len(p.cpus) == 28 and p.mems == frozenset({0})  # 56 cores / 4 GPUs
        assert all(p.cpus >= t.cpus[c].siblings for c in p.cpus)  # whole cores only
        held.update({c: f"job {n}" for c in p.cpus})
        busy.update({g: f"job {n}" for g in p.gpus})
    assert set(held) == t.numa_nodes[0].cpus


def test_exclusive_rounds_up_to_whole_cores() -> None:
    t = TOPOS["pcie-8gpu.json"]
    p = place(t, R(gpus=1, cpus=3, mode="exclusive"))
    assert len(p.cpus) == 4 and "rounded up" in p.explanation


def test_spill_to_nearest_node_is_explained() -> None:
    t = TOPOS["epyc-nps4.json"]  # node 3 (GPU 0) has 32 CPUs; nodes 0-2 are 12 away
    p = place(t, R(gpu_ids=(0,), cpus=40))
    assert len(p.cpus) == 40
    assert t.numa_nodes[3].cpus <= p.cpus
    assert p.mems == frozenset({0, 3})  # nearest (distance 12), lowest id: node 0
    assert "spilled 8 CPU(s) to NUMA node 0" in p.explanation


def test_not_enough_cpus_names_holders_and_housekeeping() -> None:
    t = TOPOS["workstation.json"]
    held = {c: "lease L9 (pid 99)" for c in range(2, 32)}
    with pytest.raises(PlacementError) as err:
        place(t, R(gpus=1, cpus=4), exclusive_cpus=held, housekeeping=frozenset({0}))
    msg = err.value.message
    assert "need 4 CPU(s)" in msg and "1 free (1)" in msg
    assert "CPU 2-31 held by lease L9 (pid 99)" in msg and "housekeeping" in msg


def test_modes_node_socket_core_complex_none() -> None:
    t = TOPOS["epyc-nps4.json"]
    node = place(t, R(gpu_ids=(0,), mode="node"))
    assert node.cpus == t.numa_nodes[3].cpus
    sock = place(t, R(gpu_ids=(0,), mode="socket"))
    assert sock.cpus == frozenset().union(*(t.numa_nodes[n].cpus for n in range(4)))
    assert sock.mems == frozenset({0, 1, 2, 3})
    groups = t.l3_groups()
    cc0 = place(t, R(gpu_ids=(0,), mode="core-complex"))
    cc1 = place(t, R(gpu_ids=(1,), mode="core-complex"))
    assert cc0.cpus in groups.values() and cc1.cpus in groups.values()
    assert cc0.cpus != cc1.cpus  # two GPUs of one node: different core complexes
    assert cc0.cpus <= t.numa_nodes[3].cpus
    none = place(t, R(gpus=1, mode="none"), housekeeping=frozenset({0}))
    assert none.cpus == t.online_cpus() - {0}


def test_grace_hopper_memory_stays_on_the_cpu_node() -> None:
    t = TOPOS["gh200.json"]
    p = place(t, R(gpus=1))
    assert p.cpus == t.online_cpus() and p.mems == frozenset({0})


def test_cpu_only_requests_pack_into_one_node() -> None:
    t = TOPOS["epyc-nps4.json"]
    held = {c: "x" for c in t.numa_nodes[0].cpus}
    p = place(t, R(cpus=8), exclusive_cpus=held)
    assert len(p.mems) == 1 and len(p.cpus) == 8
    assert place(t, R()).cpus == t.online_cpus()


def test_bad_requests_are_usage_errors() -> None:
    t = TOPOS["workstation.json"]
    with pytest.raises(UsageError, match="unknown placement mode 'fastest'"):
        place(t, R(gpus=1, mode="fastest"))
    with pytest.raises(UsageError):
        place(t, R(gpus=-1))
    with pytest.raises(UsageError):
        place(t, R(cpus=0))


def test_no_gpus_on_this_machine_still_places_cpus() -> None:
    t = TOPOS["this-machine.json"]
    p = place(t, R(cpus=1))
    assert len(p.cpus) == 1 and p.gpus == ()
    with pytest.raises(PlacementError, match="need 1 GPU"):
        place(t, R(gpus=1))


# -- properties ----------------------------------------------------------------------------
PROPS = settings(max_examples=40, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", GPU_FIXTURES)
@PROPS
@given(data=st.data())
def test_gpu_choice_is_optimal_by_brute_force(name: str, data: st.DataObject) -> None:
    t = TOPOS[name]
    ids = [g.index for g in t.gpus]
    busy = data.draw(st.sets(st.sampled_from(ids)), label="busy")
    k = data.draw(st.integers(1, len(ids)), label="k")
    free = [i for i in ids if i not in busy]
    req = R(gpus=k, mode=data.draw(st.sampled_from(MODES)))
    if k > len(free):
        with pytest.raises(PlacementError):
            place(t, req, busy_gpus={b: "busy" for b in busy})
        return
    p = place(t, req, busy_gpus={b: "busy" for b in busy})
    assert len(p.gpus) == k and not set(p.gpus) & busy
    best = min(gpu_set_score(t, c) for c in itertools.combinations(free, k))
    assert p.score == gpu_set_score(t, p.gpus) == best
    # deterministic
    assert place(t, req, busy_gpus={b: "busy" for b in busy}) == p


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@PROPS
@given(data=st.data())
def test_exclusive_allocations_never_overlap(name: str, data: st.DataObject) -> None:
    t = TOPOS[name]
    held: dict[int, str] = {}
    busy: dict[int, str] = {}
    n = data.draw(st.integers(1, 8), label="jobs")
    for job in range(n):
        gpus = data.draw(st.integers(0, min(2, len(t.gpus))), label="gpus")
        cpus = data.draw(st.none() | st.integers(1, 24), label="cpus")
        mode = data.draw(st.sampled_from(["gpu-local", "exclusive", "core-complex", "node"]))
        try:
            p = place(t, R(gpus=gpus, cpus=cpus, mode=mode, exclusive=True),
                      busy_gpus=busy, exclusive_cpus=held)
        except PlacementError as err:
            assert "free" in err.message
            continue
        assert not p.cpus & set(held), f"job {job} overlaps {sorted(p.cpus & set(held))}"
        assert not set(p.gpus) & set(busy)
        assert all(p.cpus >= (t.cpus[c].siblings & t.online_cpus()) for c in p.cpus)
        held.update({c: f"job {job}" for c in p.cpus})
        busy.update({g: f"job {job}" for g in p.gpus})


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@PROPS
@given(data=st.data())
def test_everything_stays_inside_allowed_minus_housekeeping(name: str,
                                                            data: st.DataObject) -> None:
    t = TOPOS[name]
    online = sorted(t.online_cpus())
    allowed = frozenset(data.draw(st.sets(st.sampled_from(online), min_size=1), label="allowed"))
    hk = frozenset(data.draw(st.sets(st.sampled_from(online), max_size=4), label="hk"))
    req = R(gpus=data.draw(st.integers(0, min(2, len(t.gpus)))),
            cpus=data.draw(st.none() | st.integers(1, 16)),
            mode=data.draw(st.sampled_from(MODES)), exclusive=data.draw(st.booleans()))
    try:
        p = place(t, req, housekeeping=hk, allowed_cpus=allowed)
    except PlacementError:
        return
    assert p.cpus and p.cpus <= allowed - hk
    assert p.mems == frozenset(t.cpus[c].numa_node for c in p.cpus)
    if req.cpus is not None:
        assert len(p.cpus) >= req.cpus


def _islands(n_islands: int, per: int) -> Topology:
    """A synthetic big node: NVSwitch islands of ``per`` GPUs, SYS between islands."""
    from tunerd.topology import Cpu, Gpu, Link, NumaNode

    cpus = {i: Cpu(id=i, core_id=i, package=i // 4, numa_node=i // 4, l3_id=i // 4,
                   siblings=frozenset({i})) for i in range(4 * n_islands)}
    nodes = {n: NumaNode(id=n, cpus=frozenset(range(4 * n, 4 * n + 4)),
                         memory_total_bytes=1 << 30,
                         distances={m: 10 if m == n else 20 for m in range(n_islands)})
             for n in range(n_islands)}
    gpus = [Gpu(index=i, uuid=f"GPU-{i}", pci_bus_id=f"0000:{i:02x}:00.0", model="X",
                memory_total_bytes=1, numa_node=i // per, local_cpus=nodes[i // per].cpus)
            for i in range(n_islands * per)]
    links = {(a, b): (Link("NVLINK", 18, "NODE") if a // per == b // per else Link("SYS", 0, "SYS"))
             for a, b in itertools.combinations(range(n_islands * per), 2)}
    return Topology(hostname="islands", cpus=cpus, numa_nodes=nodes, gpus=gpus, links=links)


def test_large_nodes_use_the_greedy_search_and_still_find_an_island() -> None:
    import math

    from tunerd.jobs.placement import EXACT_LIMIT

    t = _islands(3, 8)
    assert math.comb(24, 8) > EXACT_LIMIT  # the greedy path
    p = place(t, R(gpus=8), busy_gpus={0: "lease A"})
    assert p.gpus == tuple(range(8, 16))
    assert p.score == gpu_set_score(t, range(8, 16))
    q = place(t, R(gpus=6), busy_gpus={i: "x" for i in (0, 1, 8, 9, 10)})
    assert {g // 8 for g in q.gpus} in ({0}, {1}, {2})
    assert q.gpus[0] // 8 == 0  # next to the busy ones: island 0 has exactly 6 free


def test_gpus_on_two_nodes_get_cpus_on_both() -> None:
    t = TOPOS["epyc-nps4.json"]
    p = place(t, R(gpu_ids=(0, 2), exclusive=True))  # nodes 3 and 1, 2 GPUs each
    per_node = {n: len(p.cpus & t.numa_nodes[n].cpus) for n in (1, 3)}
    assert per_node == {1: 16, 3: 16}  # 16 cores / 2 GPUs = 8 cores = 16 CPUs per GPU
    assert p.mems == frozenset({1, 3})
