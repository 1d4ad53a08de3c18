"""One record per process, one pidfd each, one pass per bind (issue 33 item 6).

A real daemon is traced with strace(1) (``pidfd_open`` and ``sched_setaffinity``, every
thread of it) while a rule binds one-thread ranks and ``tunerctl bind`` binds another;
then the daemon's open pidfds are read back from /proc/PID/fdinfo (a pidfd's ``Pid:``
line names its process). Before the ledger a rule bind opened three pidfds for the rank
(the watcher thread's, the exit watch's, the loop's second pass), set its CPUs twice,
and the daemon held two pidfds per rule-bound rank.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.leases_helpers import (
    autobind_status,
    cpus_allowed,
    kill,
    rule_policy,
    spawn,
    unique_sleeper,
)

pytestmark = [pytest.mark.root,
              pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace"),
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")]

TARGET = str(max(os.sched_getaffinity(0)))
CALL = re.compile(r"^\d+\s+(pidfd_open|sched_setaffinity)\((\d+),")


def held_pidfds(daemon_pid: int) -> Counter[int]:
    """pid -> how many pidfds of it the daemon holds now."""
    out: Counter[int] = Counter()
    fd_dir = Path(f"/proc/{daemon_pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            if os.readlink(fd) != "anon_inode:[pidfd]":
                continue
            info = (Path(f"/proc/{daemon_pid}/fdinfo") / fd.name).read_text()
        except OSError:
            continue
        m = re.search(r"^Pid:\s+(-?\d+)", info, re.M)
        if m:
            out[int(m.group(1))] += 1
    return out


def traced(daemon_pid: int, out: Path) -> subprocess.Popen[bytes]:
    """strace on every thread of the daemon, once it is attached to all of them."""
    tr = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=pidfd_open,sched_setaffinity",
                           "-o", str(out), "-p", str(daemon_pid)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tasks = Path(f"/proc/{daemon_pid}/task")

    def attached() -> bool:
        for t in tasks.iterdir():
            status = (t / "status").read_text()
            if re.search(r"^TracerPid:\s+0$", status, re.M):
                return False
        return True

    wait_for(attached, timeout=10, what="strace attached to every daemon thread")
    return tr


def calls(out: Path) -> dict[str, Counter[int]]:
    got: dict[str, Counter[int]] = {"pidfd_open": Counter(), "sched_setaffinity": Counter()}
    for line in out.read_text().splitlines():
        m = CALL.match(line)
        if m:
            got[m.group(1)][int(m.group(2))] += 1
    return got


def test_a_rule_bind_opens_one_pidfd_sets_cpus_once_and_the_daemon_holds_one(
        tmp_path: Path, daemon_factory) -> None:
    exe = unique_sleeper(tmp_path, f"ledger_rank_{os.getpid()}")
    cli = unique_sleeper(tmp_path, f"ledger_cli_{os.getpid()}")
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "one"\n'
                      f'match.cmdline = ["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\n'
                      f'cpus = "{TARGET}"\n')
    d = daemon_factory(policy_dir=pol).start()
    daemon_pid = d.proc.pid
    out = tmp_path / "strace.out"
    tr = traced(daemon_pid, out)
    ranks: list[subprocess.Popen[bytes]] = []
    other = spawn([str(cli), "60"])
    try:
        for i in range(3):
            p = spawn([str(exe), "60"], {"LOCAL_RANK": str(i)})
            ranks.append(p)
            wait_for(lambda p=p: cpus_allowed(p.pid) == TARGET, timeout=10,
                     what=f"rank {i} bound")
        wait_for(lambda: {p.pid for p in ranks} <= {
            j["pid"] for j in d.ctl("--json", "jobs").json()["jobs"]},
            timeout=10, what="the three ranks recorded")
        assert d.ctl("bind", str(other.pid), "--cpus", TARGET).rc == 0
        st = autobind_status(d)
        time.sleep(0.3)  # the loop's last steps after the reply (a save, a log line)
    finally:
        tr.send_signal(signal.SIGINT)
        tr.wait(10)
    try:
        assert st["bound_in_watcher"] >= 3, st  # the thread's bind, then the loop's commit
        got = calls(out)
        for p in ranks:
            assert got["pidfd_open"][p.pid] == 1, (p.pid, got, out.read_text()[-3000:])
            assert got["sched_setaffinity"][p.pid] == 1, (p.pid, got)
        assert got["pidfd_open"][other.pid] == 1, got  # tunerctl bind: its pin's, kept
        assert got["sched_setaffinity"][other.pid] == 1, got
        held = held_pidfds(daemon_pid)
        for p in [*ranks, other]:
            assert held[p.pid] == 1, (p.pid, held)
        # one exits: its one pidfd goes with it, and its record
        kill(ranks[0])
        wait_for(lambda: held_pidfds(daemon_pid)[ranks[0].pid] == 0, timeout=10,
                 what="the exited rank's pidfd closed")
        assert ranks[0].pid not in {j["pid"] for j in d.ctl("--json", "jobs").json()["jobs"]}
        assert held_pidfds(daemon_pid)[ranks[1].pid] == 1
    finally:
        for p in [*ranks, other]:
            kill(p)


def test_an_exec_storm_of_short_ranks_leaves_no_pidfd_and_no_record(
        tmp_path: Path, daemon_factory) -> None:
    """300 rule-matched ranks that exit at once or 30 ms later (bound first), 100
    others beside: afterwards the
    daemon holds no pidfd of any of them, and its ledger (status `jobs.ledger`) no
    record with a pidfd, no binding, no rule slot."""
    exe = unique_sleeper(tmp_path, f"ledger_short_{os.getpid()}")
    other = tmp_path / f"ledger_other_{os.getpid()}"
    shutil.copy("/bin/true", other)
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "short"\n'
                      f'match.cmdline = ["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\n'
                      f'cpus = "{TARGET}"\n')
    d = daemon_factory(policy_dir=pol).start()
    daemon_pid = d.proc.pid
    pids = []
    for _batch in range(8):  # ranks living 0 or 30 ms (bound, then gone), 50 at a time
        procs = [spawn([str(exe), "0.03" if i % 2 else "0"] if i % 4 else [str(other)],
                       {"LOCAL_RANK": str(i % 8)}) for i in range(50)]
        for p in procs:
            pids.append(p.pid)
            p.wait()

    def settled() -> dict[str, object] | None:
        led = d.ctl("--json", "status").json()["services"]["jobs"]["ledger"]
        return led if not {"binding", "rule", "in flight", "pending bind",
                           "unrecorded"} & set(led["slots"]) else None

    led = wait_for(settled, 15, "the ledger empty of the exited ranks",
                   detail=lambda: str(d.ctl("--json", "status").json()["services"]["jobs"]))
    held = held_pidfds(daemon_pid)
    assert not set(held) & set(pids), held
    # what is held is of live processes only (the ranks' parent, this test: its
    # ancestry, cached by the intake on its pidfd)
    assert set(held) <= {os.getpid(), os.getppid()}, held
    assert led["pidfds"] == sum(held.values()), (led, held)
    assert led["records"] <= 64, led  # caches of looks at most
    st = autobind_status(d)
    assert st["bound_in_watcher"] >= 10, st  # bound, recorded, then gone
