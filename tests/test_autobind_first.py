"""Bind first, persist after: a rule's match gets its CPUs in the exec watcher's thread,
before its binding is saved, and the saved binding holds the masks from before.

Real daemon, real processes, read back from /proc and from the daemon's runtime dir.
"""

from __future__ import annotations

import os
import time
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
from tunerd.base.cpulist import format_cpulist, parse_cpulist

pytestmark = pytest.mark.root

HOST_CPUS = frozenset(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs to move between")


def _saved(runtime_dir: Path, pid: int) -> bool:
    """Whether a file of the runtime dir holds a record of ``pid`` (whatever its layout)."""
    needle = f'"pid":{pid},'.encode()
    for f in runtime_dir.iterdir():
        if f.is_file():
            try:
                if needle in f.read_bytes():
                    return True
            except OSError:
                pass
    return False


@needs_two_cpus
def test_cpus_are_set_before_the_binding_is_saved_and_originals_come_back(
        tmp_path: Path, daemon_factory) -> None:
    exe = unique_sleeper(tmp_path, f"bf_train_{os.getpid()}")
    target = str(max(HOST_CPUS))
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "first"\n'
                      f'match.cmdline = ["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\n'
                      f'cpus = "{target}"\nnofile = 2048\n')
    d = daemon_factory(policy_dir=pol).start()
    p = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
    try:
        # poll both: once the record is on disk, the CPUs must be set already
        seen_bound = seen_saved = False
        deadline = time.monotonic() + 10
        while not seen_saved and time.monotonic() < deadline:
            seen_bound = seen_bound or cpus_allowed(p.pid) == target
            if _saved(d.runtime_dir, p.pid):
                seen_saved = True
                assert cpus_allowed(p.pid) == target, "saved before the CPUs were set"
            time.sleep(0.0002)
        assert seen_saved, d.log
        st = autobind_status(d)
        assert st["bound_in_watcher"] >= 1, st
        rb = [b for b in st["bound"] if b["pid"] == p.pid]
        assert rb and rb[0]["timing"]["bind_first_ms"] is not None
        # its steps on one clock: the kernel's exec stamp <= read <= CPUs set <= now
        tl = [t for t in st["timeline_ns"] if t[0] == p.pid]
        assert len(tl) == 1, st["timeline_ns"]
        assert tl[0][1] <= tl[0][2] <= tl[0][3] <= time.monotonic_ns(), tl
        # the rest of the rule follows the CPUs
        wait_for(lambda: any(j["pid"] == p.pid and j["nofile"] == 2048
                             for j in d.ctl("--json", "jobs").json()["jobs"]), 5,
                 "the fd limit recorded", detail=d.log)
        # the binding outlives the daemon with the masks from before the exec watcher
        # set them (not the new ones /proc showed when the loop recorded it)
        assert d.stop() == 0
        assert cpus_allowed(p.pid) == target
        d.start()
        u = d.ctl("unbind", str(p.pid))
        assert u.rc == 0, u.err
        assert parse_cpulist(cpus_allowed(p.pid) or "") == HOST_CPUS
    finally:
        kill(p)


@needs_two_cpus
def test_a_match_that_exits_at_once_leaves_nothing_held(tmp_path: Path,
                                                        daemon_factory) -> None:
    """Bound in the watcher's thread, killed before the loop records it: no binding, no
    reservation stays; the next rank gets the same CPUs."""
    exe = unique_sleeper(tmp_path, f"bx_train_{os.getpid()}")
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "quick"\n'
                      f'match.cmdline = ["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\n'
                      f'exclusive = true\n')
    d = daemon_factory(policy_dir=pol).start()
    first: str | None = None
    everything = format_cpulist(HOST_CPUS)
    for _ in range(5):
        p = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
        try:
            wait_for(lambda pid=p.pid: cpus_allowed(pid) not in (None, everything), 10,
                     "the rank to be bound", detail=d.log)
            got = cpus_allowed(p.pid)
        finally:
            kill(p)
        first = first or got
        assert got == first  # an exited rank's exclusive CPUs were given back
    wait_for(lambda: d.ctl("--json", "status").json()["services"]["placer"]["reservations"]
             == 0, 5, "the reservations to go", detail=d.log)
    assert d.ctl("--json", "jobs").json()["jobs"] == []
    st = autobind_status(d)
    assert st["bound"] == [] and st["failed"] == 0, st


@needs_two_cpus
def test_a_daemon_stopped_among_execs_leaves_no_process_bound_without_a_record(
        tmp_path: Path, daemon_factory) -> None:
    """SIGTERM while matching processes exec one after another: every one whose CPUs the
    exec watcher's thread set is recorded (with its originals) before the daemon exits,
    so a restarted daemon can put it back; none is left moved with nothing saved."""
    exe = unique_sleeper(tmp_path, f"bs_train_{os.getpid()}")
    target = str(max(HOST_CPUS))
    everything = format_cpulist(HOST_CPUS)
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "stop"\n'
                      f'match.cmdline = ["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\n'
                      f'cpus = "{target}"\n')
    d = daemon_factory(policy_dir=pol)
    procs: list = []
    try:
        for _ in range(2):  # a race: two stops, each with execs in flight as it begins
            d.start()
            warm = [spawn([str(exe), "60"], {"LOCAL_RANK": "0"}) for _ in range(3)]
            procs += warm
            wait_for(lambda w=warm: all(cpus_allowed(p.pid) == target for p in w), 10,
                     "the first ranks to be bound", detail=d.log)
            d.proc.send_signal(15)
            deadline = time.monotonic() + 0.5
            while d.proc.poll() is None and time.monotonic() < deadline:
                procs.append(spawn([str(exe), "60"], {"LOCAL_RANK": "0"}))
            assert d.proc.wait(10) == 0
            moved = [p.pid for p in procs if cpus_allowed(p.pid) not in (None, everything)]
            assert moved, "no process was bound"
            unsaved = [pid for pid in moved if not _saved(d.runtime_dir, pid)]
            assert not unsaved, (unsaved, d.log())
    finally:
        for p in procs:
            kill(p)


@needs_two_cpus
def test_a_daemon_killed_between_bind_and_record_has_the_rank_bound_and_recorded_next_start(
        tmp_path: Path, daemon_factory) -> None:
    """SIGKILL after the watcher's thread set a rank's CPUs, before the loop recorded it
    (debug_apply_delay holds the record back): the next daemon finds it in the
    binds-in-flight journal, puts its mask back and binds it afresh, with a record --
    not "left alone" as if it had chosen those CPUs itself."""
    exe = unique_sleeper(tmp_path, f"bk_train_{os.getpid()}")
    target = str(max(HOST_CPUS))
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "kill"\n'
                      f'match.cmdline = ["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\n'
                      f'cpus = "{target}"\n')
    cfg = tmp_path / "tunerd.toml"
    cfg.write_text("debug_apply_delay = 30\n")
    d = daemon_factory(policy_dir=pol, args=["--config", str(cfg)]).start()
    p = spawn([str(exe), "60"], {"LOCAL_RANK": "0"})
    try:
        wait_for(lambda: cpus_allowed(p.pid) == target, 10, "the rank to be bound",
                 detail=d.log)
        journal = d.runtime_dir / "binds-in-flight"
        assert journal.read_text().startswith(f"{p.pid} "), journal.read_text()
        assert not _saved(d.runtime_dir, p.pid)
        d.proc.kill()
        d.proc.wait(10)
        cfg.write_text("debug_apply_delay = 0\n")
        d.start()

        def recorded() -> bool:
            return any(j["pid"] == p.pid for j in d.ctl("--json", "jobs").json()["jobs"])

        wait_for(recorded, 10, "the rank to be bound again, recorded", detail=d.log)
        assert cpus_allowed(p.pid) == target
        assert "never recorded: CPUs" in d.log()
        assert p.pid not in [a["pid"] for a in autobind_status(d).get("left_alone", [])]
        wait_for(lambda: journal.read_text() == "", 5, "the journal to be emptied")
        assert d.ctl("unbind", str(p.pid)).rc == 0
        assert parse_cpulist(cpus_allowed(p.pid) or "") == HOST_CPUS
    finally:
        kill(p)


@needs_two_cpus
def test_a_users_rank_bound_in_the_watcher_is_recorded_as_that_users(
        tmp_path: Path, daemon_factory, unpriv_user: tuple[int, int]) -> None:
    """The watcher's thread reads a match's uid after setting its CPUs (a rule that
    reserves nothing for others needs none before): the record still has it."""
    import shutil
    import subprocess
    import tempfile

    uid, gid = unpriv_user
    where = Path(tempfile.mkdtemp(prefix="tunerd-bu-"))
    where.chmod(0o755)
    exe = where / f"bu_train_{os.getpid()}"
    shutil.copy("/bin/sleep", exe)
    target = str(max(HOST_CPUS))
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "user"\n'
                      f'match.cmdline = ["*{exe.name}*"]\nmatch.env = {{ LOCAL_RANK = "*" }}\n'
                      f'cpus = "{target}"\n')
    d = daemon_factory(policy_dir=pol).start()

    def as_user() -> None:
        os.setgid(gid)
        os.setuid(uid)

    p = subprocess.Popen([str(exe), "30"], env={"LOCAL_RANK": "0"}, preexec_fn=as_user,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: any(j["pid"] == p.pid for j in d.ctl("--json", "jobs").json()["jobs"]),
                 10, "the rank recorded", detail=d.log)
        job = next(j for j in d.ctl("--json", "jobs").json()["jobs"] if j["pid"] == p.pid)
        assert job["uid"] == uid, job
        assert cpus_allowed(p.pid) == target
        st = autobind_status(d)
        assert st["bound_in_watcher"] >= 1, st
        assert [b["user"] for b in st["bound"] if b["pid"] == p.pid] == ["tunerd-test"], st

    finally:
        kill(p)
        shutil.rmtree(where, ignore_errors=True)
