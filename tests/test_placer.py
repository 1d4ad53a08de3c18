"""The placing service on recorded topologies: allocations, ranks, workers, housekeeping.

In-process: the real Placer (tunerd.jobs.placer) on snapshots of real node types,
with allocations built as tunerd.jobs.allocation builds them from a process.
"""

from __future__ import annotations

import pytest

from tests.helpers import FIXTURES
from tunerd.base.cpulist import format_cpulist
from tunerd.base.errors import PlacementError, UsageError
from tunerd.base.modes import Mode
from tunerd.jobs.allocation import Allocation
from tunerd.jobs.placer import HostCapacity, Placer, PlaceRequest, Reservation
from tunerd.topology import load_topology

TOPO = FIXTURES / "topologies"
HOST = HostCapacity(frozenset(range(256)), frozenset(range(8)))


def placer(name: str, housekeeping: frozenset[int] = frozenset()) -> Placer:
    return Placer(load_topology(TOPO / f"{name}.json"), HOST, lambda: housekeeping)


def test_housekeeping_takes_whole_cores_on_the_dgx() -> None:
    """Issue 10: housekeeping "0-1" left CPU 112 (CPU 0's SMT sibling) to GPU 0's rank."""
    pl = placer("dgx-h100", frozenset({0, 1}))
    assert pl.housekeeping() == frozenset({0, 1, 112, 113})
    p = pl.place(PlaceRequest(gpu_ids=(0,)))
    assert p.cpus is not None and not p.cpus & {0, 1, 112, 113}
    # a whole socket for one job still never gets them
    p = pl.place(PlaceRequest(gpu_ids=(0,), mode="socket"))
    assert p.cpus is not None and not p.cpus & {0, 1, 112, 113}


def test_dgx_ranks_get_their_gpus_cpus_with_room_for_their_workers() -> None:
    """8 torchrun ranks with 4 DataLoader workers each on a DGX H100 (issue 11)."""
    pl = placer("dgx-h100")
    seen: set[int] = set()
    for rank in range(8):
        p = pl.place(PlaceRequest(gpu_ids=(rank,), rank=rank, ranks=8, workers=4,
                                  group="job/1", ignore_busy_gpus=True))
        assert p.cpus is not None
        gpu = pl.topo.gpu(rank)
        assert p.cpus <= gpu.local_cpus, (rank, format_cpulist(p.cpus))
        assert len(p.cpus) >= 1 + 4 and len(p.cpus) % 2 == 0  # whole cores, room for 5
        assert not p.cpus & seen  # ranks never share a CPU
        assert f"rank {rank} of 8" in p.explanation and "4 DataLoader worker(s)" in p.explanation
        seen |= p.cpus
        pl.reserve(Reservation(key=f"rule:{rank}", holder=f"rank {rank}", gpus=p.gpus,
                               cpus=p.cpus, group="job/1"))
    assert len(seen) == 8 * 28  # 28 CPUs per GPU on a DGX H100: every CPU, none twice


def test_ranks_whose_share_cannot_hold_their_workers_share_cpus() -> None:
    """Issue 11: 2 ranks with 1 worker each on a 2-CPU machine were crowded onto one
    CPU each (1.41x slower); they now share both CPUs, and the explanation says so."""
    pl = placer("this-machine-2gpus")
    for rank in (0, 1):
        p = pl.place(PlaceRequest(gpu_ids=(rank,), rank=rank, ranks=2, workers=1,
                                  group="ddp", ignore_busy_gpus=True, gpu_peers=(0, 1)))
        assert p.cpus == frozenset({0, 1}), p.explanation
        assert ("share CPUs 0-1 (the slices of GPU 0-1) instead of crowding onto one core"
                in p.explanation)
        pl.reserve(Reservation(key=f"rule:{rank}", holder="r", gpus=p.gpus, cpus=p.cpus,
                               group="ddp"))


def test_cpu_only_ranks_split_the_node_by_local_world_size() -> None:
    pl = placer("epyc-nps4")
    parts = []
    for rank in range(4):
        p = pl.place(PlaceRequest(rank=rank, ranks=4, group="cpu-job"))
        assert p.cpus is not None and len(p.cpus) == 64, p.explanation
        parts.append(p.cpus)
        pl.reserve(Reservation(key=f"rule:{rank}", holder="r", gpus=(), cpus=p.cpus,
                               group="cpu-job"))
    assert len(frozenset().union(*parts)) == 256  # disjoint, every CPU used once


def test_a_slurm_task_keeps_the_cpu_count_it_was_granted() -> None:
    """Issue 10: srun -c2 --gres=gpu:1 was shrunk to 1 CPU by the per-GPU share."""
    pl = placer("this-machine-2gpus")
    alloc = Allocation(mask=frozenset({0, 1}), scheduler="Slurm job 12 step 0")
    p = pl.place(PlaceRequest(gpu_ids=(0,), allocation=alloc, ignore_busy_gpus=True))
    assert p.cpus == frozenset({0, 1})
    assert "as Slurm job 12 step 0 granted the task" in p.explanation
    # SLURM_CPUS_PER_TASK says the same where the environment has it
    alloc = Allocation(ncpus=2, scheduler="Slurm job 12")
    assert pl.place(PlaceRequest(gpu_ids=(1,), allocation=alloc,
                                 ignore_busy_gpus=True)).cpus == frozenset({0, 1})


def test_placement_stays_inside_the_allocation_and_never_fails_for_size() -> None:
    pl = placer("dgx-h100")
    step = frozenset(range(56, 60))  # a 4-CPU step far from GPU 0's CPUs
    alloc = Allocation(cpus=step, scheduler="Slurm job 7 step 0")
    p = pl.place(PlaceRequest(gpu_ids=(0,), ncpus=8, allocation=alloc, ignore_busy_gpus=True))
    assert p.cpus == step
    assert "asked for 8 CPUs, the allocation has 4" in p.explanation
    # an exact list partly outside: what is inside, with a note; all outside: an error
    p = pl.place(PlaceRequest(cpus=frozenset({56, 57, 100}), allocation=alloc))
    assert p.cpus == frozenset({56, 57}) and "CPUs 100 left out" in p.explanation
    with pytest.raises(PlacementError, match="all outside Slurm job 7 step 0"):
        pl.place(PlaceRequest(cpus=frozenset({100}), allocation=alloc))


def test_gpus_come_only_from_the_jobs_own() -> None:
    """Issue 10: alloc inside a job with GPU 3 got another GPU; a job without gres got one."""
    pl = placer("dgx-h100")
    job = Allocation(gpus=(3,), scheduler="Slurm job 9")
    assert pl.place(PlaceRequest(gpus=1, allocation=job)).gpus == (3,)
    with pytest.raises(PlacementError, match="has 1 GPU"):
        pl.place(PlaceRequest(gpus=2, allocation=job))
    with pytest.raises(PlacementError, match="ask the scheduler for GPUs"):
        pl.place(PlaceRequest(gpus=1, allocation=Allocation(gpus=(), scheduler="Slurm job 8")))
    with pytest.raises(PlacementError, match="GPU 5 not in"):
        pl.place(PlaceRequest(gpu_ids=(5,), allocation=job))


def test_exclusive_cpus_and_busy_gpus_are_held_across_callers() -> None:
    pl = placer("dgx-h100")
    first = pl.place(PlaceRequest(gpus=1, ncpus=4, exclusive=True))
    assert first.cpus is not None
    pl.reserve(Reservation(key="lease:L1", holder="lease L1 (alice)", gpus=first.gpus,
                           cpus=first.cpus, exclusive=True, soft=True))
    second = pl.place(PlaceRequest(gpus=1, ncpus=4))
    assert second.gpus != first.gpus and not (second.cpus or frozenset()) & first.cpus
    with pytest.raises(PlacementError, match="held exclusively by lease L1"):
        pl.place(PlaceRequest(cpus=first.cpus))
    pl.release("lease:L1")
    assert pl.place(PlaceRequest(cpus=first.cpus)).cpus == first.cpus


def test_bad_requests_are_usage_errors() -> None:
    pl = placer("workstation")
    with pytest.raises(UsageError, match="unknown placement mode 'fast'"):
        pl.place(PlaceRequest(mode="fast"))
    # text is parsed into the enum where the request is made, once
    assert PlaceRequest(mode="socket").mode is Mode.SOCKET
    with pytest.raises(UsageError, match="CPU 99 is not on"):
        pl.place(PlaceRequest(cpus=frozenset({99})))


def test_a_replayed_node_unlike_this_one_is_not_applicable() -> None:
    pl = Placer(load_topology(TOPO / "dgx-h100.json"),
                HostCapacity(frozenset({0, 1}), frozenset({0})), frozenset)
    p = pl.place(PlaceRequest(gpu_ids=(7,), ignore_busy_gpus=True))
    assert p.applicable is False
    assert any("nothing was applied" in n for n in p.notes)


def test_memory_on_every_node_of_this_machine_is_no_binding() -> None:
    pl = placer("dgx-h100")  # this "machine" has nodes 0-7
    assert pl.bindable_mems(None) is None
    assert pl.bindable_mems(frozenset(range(8))) is None
    assert pl.bindable_mems(frozenset(range(9))) is None
    assert pl.bindable_mems(frozenset({1})) == frozenset({1})
    assert pl.bindable_mems(frozenset()) == frozenset()  # kept as given: the callers decide


def test_a_repeated_placement_is_the_same_and_follows_every_reservation_change() -> None:
    """``place`` keeps what it computed for a request while the reservations stay the
    same: each reserve, release or housekeeping change is seen at once."""
    hk: set[int] = set()
    pl = Placer(load_topology(TOPO / "dgx-h100.json"), HOST, lambda: frozenset(hk))
    req = PlaceRequest(gpu_ids=(0,), rank=0, ranks=2, group="job/1", ignore_busy_gpus=True)
    first = pl.place(req)
    assert first.cpus and pl.place(req) == first
    pl.reserve(Reservation(key="rule:1", holder="rank 1", gpus=(0,), cpus=first.cpus,
                           group="job/1"))
    moved = pl.place(req)
    assert moved.cpus and not moved.cpus & first.cpus  # its sibling holds those now
    pl.reserve(Reservation(key="rule:1", holder="rank 1", gpus=(0,), cpus=moved.cpus,
                           group="job/1"))  # the same key, other CPUs
    assert not (pl.place(req).cpus or frozenset()) & moved.cpus
    pl.release("rule:1")
    assert pl.place(req) == first
    hk.update({0, 1})
    assert not (pl.place(req).cpus or frozenset()) & {0, 1, 112, 113}
