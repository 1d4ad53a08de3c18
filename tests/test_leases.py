"""Leases on a replayed DGX H100: alloc, release, over-allocation, users, restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO, run_as, wait_for
from tests.leases_helpers import DGX_H100, leases_of, open_path_for_others
from tunerd.base.cpulist import parse_cpulist
from tunerd.base.errors import PermissionDenied
from tunerd.wire.client import Client

TOPO = json.loads(DGX_H100.read_text())
NODE_CPUS = {n["id"]: parse_cpulist(n["cpus"]) if isinstance(n["cpus"], str)
             else frozenset(n["cpus"]) for n in TOPO["numa_nodes"]}
GPU_NODE = {g["index"]: g["numa_node"] for g in TOPO["gpus"]}
LINKS = {(lk["a"], lk["b"]): lk for lk in TOPO["links"]}


@pytest.fixture
def replay(daemon_factory):  # type: ignore[no-untyped-def]
    return daemon_factory(args=["--topology", str(DGX_H100)]).start()


def test_alloc_two_gpus_gets_an_nvlink_pair_and_local_cpus(replay) -> None:
    r = replay.ctl("alloc", "--gpus", "2", "--json")
    assert r.rc == 0, r.err
    lease = r.json()
    a, b = lease["gpus"]
    assert LINKS[(a, b)]["kind"] == "NVLINK"
    node = GPU_NODE[a]
    assert GPU_NODE[b] == node
    cpus = parse_cpulist(lease["cpus"])
    assert cpus and cpus <= NODE_CPUS[node]
    assert lease["mems"] == str(node)
    # this machine lacks those CPUs: nothing applied, and the reply says so
    assert lease["applied"] is False
    assert any("nothing was applied" in n for n in lease["notes"])
    env = lease["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == f"{a},{b}"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["TUNERD_LEASE"] == lease["id"]
    assert parse_cpulist(env["TUNERD_CPUS"]) == cpus
    assert int(env["OMP_NUM_THREADS"]) == len(cpus) // 2

    # human form: shell export lines that eval cleanly
    r2 = replay.ctl("alloc", "--gpus", "1")
    assert r2.rc == 0, r2.err
    exports = [ln for ln in r2.out.splitlines() if ln.startswith("export ")]
    assert any(ln.startswith("export CUDA_VISIBLE_DEVICES=") for ln in exports)
    sh = subprocess.run(["sh", "-c", r2.out + '\necho "$TUNERD_LEASE $CUDA_VISIBLE_DEVICES"'],
                        capture_output=True, text=True, check=True)
    lid, gpu = sh.stdout.split()
    assert lid == "L2" and int(gpu) not in (a, b)
    assert "nothing was applied" in r2.err


def test_over_allocation_says_what_is_free_and_who_holds_the_rest(replay) -> None:
    assert replay.ctl("alloc", "--gpus", "6").rc == 0
    r = replay.ctl("alloc", "--gpus", "4")
    assert r.rc == 1
    assert "need 4 GPU(s), 2 free" in r.err
    assert "held by lease L1 (root)" in r.err
    assert [x["id"] for x in leases_of(replay)] == ["L1"]  # nothing half-made
    # a run's lease is named by id, user and pid, never by its command (hidepid may
    # hide that from whoever gets the error; `tunerctl leases` shows it where it may)
    holder = _ctl_popen(replay, "run", "--gpus", "1", "--", "sleep", "30")
    try:
        wait_for(lambda: len(leases_of(replay)) == 2, 15, "the run's lease",
                 detail=replay.log)
        r = replay.ctl("alloc", "--gpus", "2")
        assert r.rc == 1 and "held by lease L2 (root, pid " in r.err, r.err
        assert "sleep" not in r.err, r.err
    finally:
        holder.kill()
        holder.wait()


def test_release(replay) -> None:
    lid = replay.ctl("alloc", "--gpus", "8", "--json").json()["id"]
    assert replay.ctl("alloc", "--gpus", "1").rc == 1
    r = replay.ctl("release", lid)
    assert r.rc == 0 and f"released lease {lid}" in r.out
    assert leases_of(replay) == []
    assert replay.ctl("alloc", "--gpus", "1").rc == 0
    r = replay.ctl("release", "L99")
    assert r.rc == 1 and "no lease 'L99'" in r.err


def test_bad_requests_are_usage_errors(replay) -> None:
    r = replay.ctl("alloc", "--gpus", "-1")
    assert r.rc == 2
    r = replay.ctl("alloc", "--gpus", "1", "--exclusive-scope", "pid:1")
    assert r.rc == 2 and "needs --exclusive" in r.err
    r = replay.ctl("alloc", "--gpus", "1", "--exclusive", "--exclusive-scope", "host")
    assert r.rc == 2 and "pid:N" in r.err
    r = replay.ctl("alloc", "--gpus", "1", "--exclusive", "--exclusive-scope", "cgroup:/../x")
    assert r.rc == 2 and "'..'" in r.err
    assert leases_of(replay) == []


def test_exclusive_lease_cpus_are_not_given_to_others(replay) -> None:
    first = replay.ctl("alloc", "--gpus", "1", "--exclusive", "--json").json()
    second = replay.ctl("alloc", "--gpus", "1", "--json").json()
    assert not parse_cpulist(first["cpus"]) & parse_cpulist(second["cpus"])


@pytest.mark.root
def test_non_root_may_alloc_and_release_only_its_own(replay, unpriv_user) -> None:
    uid, gid = unpriv_user
    open_path_for_others(replay.socket)
    root_lease = replay.ctl("alloc", "--gpus", "1", "--json").json()["id"]
    sock = str(replay.socket)

    def as_user() -> tuple[dict, str]:
        with Client(sock) as c:
            mine = c.call("alloc", gpus=1)
            try:
                c.call("release", lease=root_lease)
                denied = "no"
            except PermissionDenied as err:
                denied = err.message
            c.call("release", lease=mine["id"])
            return mine, denied

    mine, denied = run_as(uid, gid, as_user)
    assert mine["uid"] == uid and mine["user"] == "tunerd-test"
    assert "belongs to root" in denied
    assert [x["id"] for x in leases_of(replay)] == [root_lease]
    # a non-root `run` binds the caller itself, and the lease dies with it
    def run_self() -> dict:
        with Client(sock) as c:
            return c.call("run", gpus=1, command=["true"])  # type: ignore[no-any-return]

    ran = run_as(uid, gid, run_self)
    assert ran["uid"] == uid and ran["pid"] != os.getpid()
    wait_for(lambda: [x["id"] for x in leases_of(replay)] == [root_lease], 10,
             "the run lease to end with its command", detail=replay.log)


def _ctl_popen(d, *args: str) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    return subprocess.Popen([sys.executable, "-m", "tunerd.cli.main", "--socket",
                             str(d.socket), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_restart_keeps_leases_and_drops_those_whose_holder_died(replay) -> None:
    alloc_id = replay.ctl("alloc", "--gpus", "2", "--json").json()["id"]
    keep = _ctl_popen(replay, "run", "--gpus", "1", "--", "sleep", "30")
    die = _ctl_popen(replay, "run", "--gpus", "1", "--", "sleep", "30")
    try:
        wait_for(lambda: len(leases_of(replay)) == 3, 15, "three leases", detail=replay.log)
        by_pid = {x["pid"]: x["id"] for x in leases_of(replay)}
        replay.kill9()
        die.kill()
        die.wait()
        replay.start()
        ids = [x["id"] for x in leases_of(replay)]
        assert alloc_id in ids and by_pid[keep.pid] in ids
        assert by_pid[die.pid] not in ids
        # the holder still watched after the restart: its exit releases the lease
        keep.kill()
        keep.wait()
        wait_for(lambda: [x["id"] for x in leases_of(replay)] == [alloc_id], 10,
                 "the killed holder's lease to be released", detail=replay.log)
        # ids are never reused
        assert replay.ctl("alloc", "--gpus", "1", "--json").json()["id"] == "L4"
    finally:
        for p in (keep, die):
            if p.poll() is None:
                p.kill()
                p.wait()
    time.sleep(0)
