"""Ranks that pinned themselves are held in the node's ledger (issue 33 item 3).

A rank started as torchrun ``--numa-binding`` starts it (``torchrun --no-python numactl
--physcpubind=1 python ...``) is left as it is by the bundled rule, and held as an
external owner of the CPUs it runs on: a job started later avoids them (or, where it
cannot, its explanation names the rank), ``tunerctl jobs`` lists the holder, and the
hold goes when the rank exits. Real torchrun, real numactl, a real daemon; the GPUs
are recordings (this VM with two recorded GPUs, and the DGX H100 snapshot).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProc, wait_for
from tests.launcher_helpers import spawn_rank
from tests.leases_helpers import DGX_H100, descendants, kill_tree
from tests.test_torch_ddp import bundled_rule_policy
from tunerd.base.cpulist import parse_cpulist
from tunerd.jobs.placer import HostCapacity, Placer, Reservation, ReservationKey
from tunerd.topology import load_topology

FIXTURES = Path(__file__).parent / "fixtures" / "topologies"
TWO_GPUS = FIXTURES / "this-machine-2gpus.json"
HOST_CPUS = frozenset(os.sched_getaffinity(0))
needs = pytest.mark.skipif(
    not {0, 1} <= HOST_CPUS or shutil.which("numactl") is None or os.geteuid() != 0,
    reason="needs root, CPUs 0-1 and numactl")
SLEEP = "import time, sys; time.sleep(120)  # {tag}"


def _torchrun(tag: str, *wrap: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """A real torchrun job of one rank (``wrap``: what the rank is exec'd through)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "1", "--no-python", *wrap, sys.executable, "-c",
            SLEEP.format(tag=tag)]
    return subprocess.Popen(argv, env={**os.environ, **env}, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _rank(agent: subprocess.Popen[str], tag: str) -> int:
    """The pid of the rank of ``agent`` running SLEEP with ``tag``."""
    def find() -> int | None:
        for pid in descendants(agent.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            except OSError:
                continue
            if f"# {tag}" in cmd and not cmd.startswith("numactl"):
                return pid
        return None
    return wait_for(find, 60, f"torchrun's rank {tag}")


def _jobs(d: DaemonProc) -> dict[str, Any]:
    r = d.ctl("--json", "jobs")
    assert r.rc == 0, r.err
    out: dict[str, Any] = r.json()
    return out


def _external(d: DaemonProc, pid: int) -> dict[str, Any] | None:
    return next((x for x in _jobs(d).get("external") or [] if x["pid"] == pid), None)


def held_by(held: dict[str, Any], pid: int) -> str:
    return next(h for h in held if h.startswith(f"pid {pid} "))


def _job(d: DaemonProc, pid: int) -> dict[str, Any] | None:
    return next((j for j in _jobs(d)["jobs"] if j["pid"] == pid), None)


@needs
def test_a_later_job_on_gpu1_avoids_the_cpu_a_numactl_rank_took(daemon_factory,
                                                                tmp_path: Path) -> None:
    """This VM with two recorded GPUs (GPU 0's slice CPU 0, GPU 1's CPU 1): a rank
    torchrun started through ``numactl --physcpubind=1`` is held as external on CPU 1;
    a job started on GPU 1 afterwards does not get CPU 1, or its explanation names the
    pid holding it. The hold is listed by ``jobs`` and released when the rank exits."""
    pdir = tmp_path / "policies"
    token = secrets.token_hex(6)
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(TWO_GPUS)]).start()
    env = {"TUNERD_TEST_TOKEN": token, "CUDA_VISIBLE_DEVICES": "0"}
    pinned_job = _torchrun("pinned", "numactl", "--physcpubind=1", env=env)
    later: subprocess.Popen[str] | None = None
    try:
        pinned = _rank(pinned_job, "pinned")
        held = wait_for(lambda: _external(d, pinned), 30, "the numactl rank held as "
                        "external", detail=d.log)
        assert os.sched_getaffinity(pinned) == {1}  # left as it pinned itself
        assert held["cpus"] == "1" and held["placed_by"] == "numactl", held
        assert f"pid {pinned}" in held["why"] and held["job"], held
        assert _job(d, pinned) is None  # never bound by tunerd
        assert "external holders" in d.ctl("jobs").out
        held = {h["holder"]: h for h in _jobs(d)["held"]}  # the ledger's held_cpus
        assert held[held_text := held_by(held, pinned)]["cpus"] == "1", held
        assert held[held_text]["steers_irq"] is True

        later = _torchrun("later", env={**env, "CUDA_VISIBLE_DEVICES": "1"})
        rank = _rank(later, "later")
        job = wait_for(lambda: _job(d, rank), 30, "the later job's rank bound",
                       detail=d.log)
        cpus = parse_cpulist(job["cpus"])
        text = " ".join([job.get("explanation") or "", *job.get("notes", [])])
        assert 1 not in cpus or f"pid {pinned}" in text, job
        assert os.sched_getaffinity(rank) == cpus  # really applied here
        if 1 in cpus:
            print("shared, named:", text)
    finally:
        kill_tree(pinned_job)  # type: ignore[arg-type]
    # the pinned rank exited: its hold goes (pidfd), the CPU is free again
    wait_for(lambda: _external(d, pinned) is None, 10, "the external hold released",
             detail=d.log)
    if later is not None:
        kill_tree(later)  # type: ignore[arg-type]


@needs
def test_dgx_numactl_rank_on_gpu6_is_held_beside_other_jobs(daemon_factory,
                                                            tmp_path: Path) -> None:
    """The DGX H100 snapshot: a rank on GPU 6 that pinned itself with numactl (to CPU 1,
    the one CPU this VM can give it: inside GPU 0's slice) is held as external beside a
    2-rank job on GPUs 0-1 placed after it: no CPU is shared, and ``jobs`` shows both
    (the ranks placed on the replayed topology, the pinned one as external)."""
    pdir = tmp_path / "policies"
    token = secrets.token_hex(6)
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(DGX_H100)]).start()
    env = {"TUNERD_TEST_TOKEN": token}
    agents = []
    try:
        agent, pinned = spawn_rank(["numactl", "--physcpubind=1", "sleep", "120"],
                                   {**env, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                                    "CUDA_VISIBLE_DEVICES": "6"})
        agents.append(agent)
        wait_for(lambda: _external(d, pinned), 30, "the GPU 6 rank held", detail=d.log)
        ranks = []
        # a 2-rank job on GPUs 0-1 (GPU 0's slice holds CPU 1), and a job on GPU 6 itself
        for r, world, cvd in ((0, "2", "0,1"), (1, "2", "0,1"), (0, "1", "6")):
            a, pid = spawn_rank(["sleep", "120"], {**env, "LOCAL_RANK": str(r),
                                                   "LOCAL_WORLD_SIZE": world,
                                                   "CUDA_VISIBLE_DEVICES": cvd},
                                name="torchrun")
            agents.append(a)
            ranks.append(pid)
        placed = [wait_for(lambda p=p: _job(d, p), 30, f"rank {p} placed", detail=d.log)
                  for p in ranks]
        cpus = [parse_cpulist(j["cpus"]) for j in placed]
        assert all(cpus) and not cpus[0] & cpus[1] and not (cpus[0] | cpus[1]) & cpus[2], \
            [j["cpus"] + j["explanation"] for j in placed]
        assert all(1 not in c for c in cpus), placed  # the pinned rank's CPU avoided
        assert cpus[2] <= parse_cpulist("84-97,196-209")  # GPU 6's slice
        ext = _jobs(d)["external"]
        assert [x["pid"] for x in ext] == [pinned] and ext[0]["cpus"] == "1", ext
        # advise: the self-pinned rank on GPU 6 runs outside its GPU's slice
        adv = d.ctl("--json", "advise", str(pinned))
        assert adv.rc == 1, adv.err  # a warning: advise exits 1, as for any problem found
        found = {f["id"]: f for j in adv.json()["jobs"] for f in j["findings"]}
        assert "self-pinned-outside-slice" in found, found
        f = found["self-pinned-outside-slice"]
        assert "GPU 6" in f["title"] and f["evidence"]["outside"] == "1", f
        assert f["evidence"]["slice"] == "84-97,196-209", f
    finally:
        for a in agents:
            kill_tree(a)  # type: ignore[arg-type]


def test_placer_avoids_external_holds_and_names_them_when_it_cannot() -> None:
    """The ledger on the two-GPU recording: an external hold on CPU 1 is avoided by a
    rank of GPU 1 while another CPU is free; with CPU 0 taken exclusively too, the
    placement shares CPU 1 and says so, naming the holder; ``held_cpus`` answers for
    every hold, and for [irq] only what ranks and root hold."""
    topo = load_topology(TWO_GPUS)
    placer = Placer(topo, HostCapacity(frozenset({0, 1})), frozenset)
    from tunerd.jobs.placer import PlaceRequest

    ask = PlaceRequest(gpu_ids=(1,), what="rank")
    assert placer.place(ask).cpus == {1}  # GPU 1's slice
    placer.reserve(Reservation(key=ReservationKey.external(4242),
                               holder="pid 4242 (python, job torch:ppid 7, pinned itself "
                                      "via numactl)", gpus=(), cpus=frozenset({1}),
                               pid=4242, ranked=True, placed_by="numactl"))
    p = placer.place(ask)
    assert p.cpus == {0}, p
    placer.reserve(Reservation(key=ReservationKey.bind(77), holder="pid 77 (tunerctl "
                               "bind --exclusive)", gpus=(), cpus=frozenset({0}),
                               exclusive=True, uid=1000))
    p = placer.place(ask)
    assert p.cpus == {1} and "pid 4242" in p.explanation and "shared" in p.explanation, p
    assert placer.held_cpus() == {0: "pid 77 (tunerctl bind --exclusive)",
                                  1: placer.external_holds()[0].holder}
    assert set(placer.held_cpus(steering=True)) == {1}  # a user's bind steers nothing


def test_a_self_pinned_ranks_memory_goes_to_its_cpus_node_unless_the_rule_says_leave(
        ) -> None:
    """``[[job]] self_pinned_memory``: "bind" (the default) binds a self-pinned rank's
    memory to its CPUs' NUMA node -- on the DGX H100 topology as a host of two memory
    nodes, CPU 1 -> node 0; "leave" binds nothing; a host of one node has nothing to bind."""
    import dataclasses

    from tunerd.jobs.external import ExternalHolds
    from tunerd.jobs.intake import Intake
    from tunerd.jobs.ledger import Ledger

    dgx = dataclasses.replace(load_topology(DGX_H100), replayed=False)
    here = Intake(load_topology(TWO_GPUS), HOST_CPUS, bound=lambda pid: None,
                  lease=lambda pid: None).describe(os.getpid())
    ctx = dataclasses.replace(here, role="rank", self_affined=True, allocation=dataclasses
                              .replace(here.allocation, mask=frozenset({1})))
    two = ExternalHolds(Placer(dgx, HostCapacity(frozenset(dgx.cpus), frozenset({0, 1})),
                               frozenset), Ledger())
    assert two.memory_to_bind(ctx, "bind")[0] == {0}
    assert two.memory_to_bind(ctx, "leave")[0] is None
    one = ExternalHolds(Placer(load_topology(TWO_GPUS), HostCapacity(HOST_CPUS), frozenset),
                        Ledger())
    mems, why = one.memory_to_bind(ctx, "bind")
    assert mems is None and "replayed" in why  # a loaded snapshot is a replay
    dgx_replayed = ExternalHolds(Placer(load_topology(DGX_H100), HostCapacity(
        frozenset(range(224)), frozenset({0, 1})), frozenset), Ledger())
    assert dgx_replayed.memory_to_bind(ctx, "bind")[0] is None


def test_self_pinned_memory_is_validated(tmp_path: Path) -> None:
    from tests.helpers import run_ctl, write_policy

    write_policy(tmp_path, "00.toml", '[policy]\nname = "x"\n\n[[job]]\nname = "r"\n'
                 'match.rank = true\nself_pinned_memory = "maybe"\n')
    r = run_ctl("policy", "check", str(tmp_path))
    assert r.rc != 0 and "self_pinned_memory" in r.out + r.err and "bind, leave" in \
        r.out + r.err, r.out + r.err
    write_policy(tmp_path, "00.toml", '[policy]\nname = "x"\n\n[[job]]\nname = "r"\n'
                 'match.rank = true\nself_pinned_memory = "leave"\n')
    assert run_ctl("policy", "check", str(tmp_path)).rc == 0


@needs
def test_the_external_hold_survives_a_daemon_restart(daemon_factory, tmp_path: Path) -> None:
    """SIGKILL the daemon while a numactl-pinned rank runs: the next daemon holds its CPU
    again as soon as it answers (from the runtime state, before any rescan), with who
    pinned it as the first daemon saw it, and drops the hold when the rank exits."""
    pdir = tmp_path / "policies"
    token = secrets.token_hex(6)
    bundled_rule_policy(pdir, token)
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(TWO_GPUS)]).start()
    job = _torchrun("kept", "numactl", "--physcpubind=1",
                    env={"TUNERD_TEST_TOKEN": token, "CUDA_VISIBLE_DEVICES": "0"})
    try:
        pinned = _rank(job, "kept")
        first = wait_for(lambda: _external(d, pinned), 30, "held", detail=d.log)
        assert first["placed_by"] == "numactl", first
        d.kill9()
        d.start()
        again = _external(d, pinned)  # the first answer already has it
        assert again is not None, _jobs(d)
        assert {k: again[k] for k in ("cpus", "placed_by", "job", "start_time")} == \
            {k: first[k] for k in ("cpus", "placed_by", "job", "start_time")}
    finally:
        kill_tree(job)  # type: ignore[arg-type]
    wait_for(lambda: _external(d, pinned) is None, 10, "released after the restart",
             detail=d.log)


def test_restore_holds_live_ranks_again_and_drops_the_rest() -> None:
    """The runtime state's external holds at start: a live rank (same pid and start time)
    is held again; an exited one, a reused pid and a malformed entry are dropped and the
    state saved."""
    import asyncio

    from tunerd.adapters import procfs
    from tunerd.jobs.external import ExternalHolds
    from tunerd.jobs.ledger import Ledger

    me, start = os.getpid(), procfs.read_start_time(os.getpid())
    gone = subprocess.Popen(["true"])
    gone.wait()
    entry = {"cpus": "1", "holder": "pid X (rank, pinned itself via numactl)", "group": "g",
             "job": None, "uid": 0, "placed_by": "numactl", "gpus": [0]}
    state: dict[str, Any] = {
        str(me): {**entry, "pid": me, "start_time": start},
        str(gone.pid): {**entry, "pid": gone.pid, "start_time": 1},
        "77": {**entry, "pid": me, "start_time": start},  # keyed by another pid
        "78": {"pid": 78},
    }
    saves: list[int] = []
    placer = Placer(load_topology(TWO_GPUS), HostCapacity(frozenset({0, 1})), frozenset)

    async def run() -> int:
        holds = ExternalHolds(placer, Ledger(), state, lambda: saves.append(1))
        n = holds.restore()
        holds.ledger.unwatch(me, "external")
        return n

    assert asyncio.run(run()) == 1
    assert list(state) == [str(me)] and saves == [1]
    [r] = placer.external_holds()
    assert (r.pid, r.cpus, r.placed_by, r.uses_gpus) == (me, {1}, "numactl", (0,))
