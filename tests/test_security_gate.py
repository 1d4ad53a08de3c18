"""One policy gate for every exclusive or GPU reservation (issue 16, found 2, 4, 12, 13).

Each attack is replayed by the real test user against the real daemon: `bind
--exclusive` past `[leases] user_exclusive`/`max_per_user`, GPUs claimed with a forged
environment, an admin's exclusive rule fired by a user's fake job, fd limits above
the user's own.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for, write_policy
from tests.leases_helpers import (
    DGX_H100,
    autobind_status,
    cpus_allowed,
    kill,
    open_path_for_others,
    unique_sleeper,
)
from tests.security_helpers import ctl_as, spawn_as
from tunerd.base.cpulist import format_cpulist, parse_cpulist
from tunerd.jobs.gate import LeaseLimits, ReservationGate, device_gpus

pytestmark = pytest.mark.root

ONLINE = sorted(parse_cpulist(Path("/sys/devices/system/cpu/online").read_text()))
ALL = format_cpulist(ONLINE)
REFUSED = "the policy's [leases] user_exclusive is false"


def _sleep_as(user: tuple[int, int]) -> subprocess.Popen[bytes]:
    return spawn_as(user, ["sleep", "300"])


def test_bind_exclusive_passes_the_same_gate_as_alloc(daemon_factory, tmp_path: Path,
                                                      unpriv_user: tuple[int, int]) -> None:
    d = daemon_factory(args=["--topology", str(DGX_H100)]).start()
    s = _sleep_as(unpriv_user)
    try:
        by_cpus = ctl_as(unpriv_user, d.socket, "bind", str(s.pid), "--cpus", ALL, "--exclusive")
        by_gpus = ctl_as(unpriv_user, d.socket, "bind", str(s.pid), "--gpus", "0", "--exclusive")
        by_alloc = ctl_as(unpriv_user, d.socket, "alloc", "--ncpus", "1", "--exclusive")
        for r in (by_cpus, by_gpus, by_alloc):
            assert r.returncode == 4 and REFUSED in r.stderr, (r.returncode, r.stdout, r.stderr)
            assert "--exclusive ignored" not in r.stdout + r.stderr
        # one message, whatever the command
        assert len({r.stderr for r in (by_cpus, by_gpus, by_alloc)}) == 1
        assert d.ctl("alloc", "--gpus", "8", "--exclusive").rc == 0  # root got everything
    finally:
        kill(s)


def test_bind_exclusive_counts_toward_max_per_user(daemon_factory, tmp_path: Path,
                                                   unpriv_user: tuple[int, int]) -> None:
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", '[policy]\nname = "t"\n[leases]\nuser_exclusive = true\n'
                                 'max_per_user = 1\n')
    d = daemon_factory(policy_dir=pol).start()
    s = _sleep_as(unpriv_user)
    try:
        assert ctl_as(unpriv_user, d.socket, "alloc", "--ncpus", "1").returncode == 0
        r = ctl_as(unpriv_user, d.socket, "bind", str(s.pid), "--cpus", str(ONLINE[-1]),
                   "--exclusive")
        assert r.returncode == 4 and "max_per_user = 1" in r.stderr, r.stderr
    finally:
        kill(s)


def test_forged_environment_holds_no_gpu(daemon_factory, tmp_path: Path,
                                         unpriv_user: tuple[int, int]) -> None:
    exe = unique_sleeper(tmp_path, f"train_gate_{os.getpid()}.py")
    open_path_for_others(tmp_path)
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", f'[policy]\nname = "t"\n[[job]]\nname = "torch"\n'
                                 f'match.cmdline = ["*{exe.name}*"]\n'
                                 'match.env = { LOCAL_RANK = "*" }\n')
    d = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()
    fakes = [spawn_as(unpriv_user, [str(exe), "300"],
                      {"CUDA_VISIBLE_DEVICES": "0,1", "LOCAL_RANK": str(r)}) for r in (0, 1)]
    try:
        wait_for(lambda: len(autobind_status(d)["bound"]) == 2, 15, "both fakes bound",
                 detail=d.log)
        r = d.ctl("--json", "alloc", "--gpus", "8")
        assert r.rc == 0, r.err  # the fakes hold no GPU: nothing seen from outside
        assert sorted(r.json()["gpus"]) == list(range(8))
    finally:
        for p in fakes:
            kill(p)


@pytest.mark.skipif(len(ONLINE) < 2, reason="needs 2 CPUs")
def test_exclusive_rule_does_not_fire_for_other_users(daemon_factory, tmp_path: Path,
                                                      unpriv_user: tuple[int, int]) -> None:
    exe = unique_sleeper(tmp_path, f"fake_job_{os.getpid()}")
    open_path_for_others(tmp_path)
    victim = subprocess.Popen(["sleep", "300"])  # root's
    pol = tmp_path / "pol"
    rule = (f'[policy]\nname = "t"\n[[job]]\nname = "excl"\nmatch.cmdline = ["*{exe.name}*"]\n'
            f'cpus = "{ONLINE[-1]}"\nexclusive = true\nexclusive_scope = "pid:{victim.pid}"\n')
    write_policy(pol, "00.toml", rule)
    d = daemon_factory(policy_dir=pol).start()
    fake = spawn_as(unpriv_user, [str(exe), "300"])
    try:
        before = cpus_allowed(victim.pid)
        wait_for(lambda: autobind_status(d)["matched"] >= 1, 15, "the rule to see the fake",
                 detail=d.log)
        assert cpus_allowed(victim.pid) == before, "a user's fake job moved root's process"
        assert not autobind_status(d)["bound"]
        d_check = d.ctl("policy", "check", str(pol / "00.toml"))
        check = d_check.out + d_check.err
        assert d_check.rc == 0 and "names no match.user" in check, check
    finally:
        kill(fake)
        kill(victim)


def _nofile(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no Max open files line")


def test_user_nofile_is_capped_at_the_hard_limit_or_the_policy(
        daemon_factory, unpriv_user: tuple[int, int]) -> None:
    d = daemon_factory().start()  # the policy's [limits] nofile = 65536
    s = _sleep_as(unpriv_user)
    try:
        cap = max(_nofile(s.pid)[1], 65536)
        r = ctl_as(unpriv_user, d.socket, "--json", "bind", str(s.pid), "--nofile", "1048576")
        got = _nofile(s.pid)
        assert got[1] <= cap, (got, cap, r.stdout, r.stderr)
        # without CAP_SYS_RESOURCE (this sandbox) the daemon cannot change another
        # uid's limit at all and says so; with it, the reply notes the cap
        assert (r.returncode == 4 and "CAP_SYS_RESOURCE" in r.stderr) or (
            r.returncode in (0, 1) and (cap >= 1048576 or "capped at" in r.stdout)), r
        # the cap itself, on the same real process
        notes: list[str] = []
        gate = ReservationGate(LeaseLimits, lambda: 65536)
        assert gate.cap_nofile(unpriv_user[0], s.pid, 1 << 30, notes) == max(got[1], 65536)
        assert "capped at" in notes[0]
        assert gate.cap_nofile(0, s.pid, 1 << 30, []) == 1 << 30  # root: as asked
    finally:
        kill(s)


# holds an O_PATH handle on each node named (no permission on the node needed), then sleeps
O_PATH_HOLDER = r"""
import os, sys, time
held = [os.open(p, os.O_PATH) for p in sys.argv[1:]]
print("held", flush=True)
time.sleep(300)
"""


def _nvidia_nodes(tmp: Path, n: int = 8) -> list[Path]:
    """Real character devices of major 195 (``/dev/nvidiaN``), root's, 0600: no other
    user may open them for reading or writing."""
    dev = tmp / "dev"
    dev.mkdir()
    nodes = [dev / f"nvidia{i}" for i in range(n)]
    for i, node in enumerate(nodes):
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(195, i))
    return nodes


def test_o_path_handles_on_gpu_nodes_claim_no_gpu(daemon_factory, tmp_path: Path,
                                                  unpriv_user: tuple[int, int]) -> None:
    """Issue 34 item 4: a user who cannot open the GPUs holds an O_PATH fd on each of the
    8 device nodes in 8 rule-matched fakes; root's `alloc --gpus 8` still gets all 8, and
    the gate's look at her processes proves no GPU (it claimed all 8 before)."""
    nodes = _nvidia_nodes(tmp_path)
    script = tmp_path / f"o_path_fake_{os.getpid()}.py"
    script.write_text(O_PATH_HOLDER)
    script.chmod(0o644)
    open_path_for_others(tmp_path)
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", f'[policy]\nname = "t"\n[[job]]\nname = "fake"\n'
                                 f'match.cmdline = ["*{script.name}*"]\n'
                                 'match.env = { LOCAL_RANK = "*" }\n')
    d = daemon_factory(policy_dir=pol, args=["--topology", str(DGX_H100)]).start()
    fakes = [spawn_as(unpriv_user, [sys.executable, str(script), *map(str, nodes)],
                      {"CUDA_VISIBLE_DEVICES": str(r), "LOCAL_RANK": "0"}) for r in range(8)]
    try:
        wait_for(lambda: len(autobind_status(d)["bound"]) == 8, 20, "the 8 fakes bound",
                 detail=d.log)
        wait_for(lambda: all(_fds(p.pid) >= 8 for p in fakes), 10, "each holds 8 handles")
        for p in fakes:
            assert device_gpus(p.pid) == frozenset(), p.pid
        r = d.ctl("--json", "alloc", "--gpus", "8")
        assert r.rc == 0, r.err
        assert sorted(r.json()["gpus"]) == list(range(8))
    finally:
        for p in fakes:
            kill(p)


def _fds(pid: int) -> int:
    try:
        return sum(1 for f in os.listdir(f"/proc/{pid}/fd")
                   if os.readlink(f"/proc/{pid}/fd/{f}").endswith(tuple(
                       f"nvidia{i}" for i in range(8))))
    except OSError:
        return 0


def test_only_reads_and_writes_the_process_may_make_prove_gpu_use(tmp_path: Path,
                                                                   unpriv_user: tuple[int, int]
                                                                   ) -> None:
    """The rule the gate, alloc and GPU-use placement share: an fd open for reading or
    writing counts, an O_PATH one never; and only on a node the process may open."""
    from tunerd.adapters.procfs import Creds, OpenDevice
    from tunerd.jobs.gate import may_open

    uid, gid = unpriv_user
    her = Creds(uid, gid, frozenset())
    node = (0o20660, 0, 44)  # crw-rw---- root:video, as /dev/nvidia0 on many nodes
    rw = OpenDevice(3, os.makedev(195, 0), os.O_RDWR, *node)
    assert may_open(rw, Creds(0, 0, frozenset()))
    assert not may_open(rw, her)  # not in the group: a passed fd proves nothing
    assert may_open(rw, Creds(uid, gid, frozenset({44})))
    assert may_open(rw._replace(mode=0o20666), her)
    assert not may_open(rw._replace(flags=os.O_PATH), Creds(0, 0, frozenset()))
    assert not may_open(rw._replace(flags=os.O_PATH | os.O_RDWR), Creds(0, 0, frozenset()))
    assert may_open(rw._replace(flags=os.O_RDONLY, mode=0o20664), her)
    assert not may_open(rw._replace(flags=os.O_WRONLY, mode=0o20664), her)
