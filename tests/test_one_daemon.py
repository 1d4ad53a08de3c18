"""One daemon binds processes on a node (issue 26 item 7).

- A second unscoped tunerd, whatever its runtime dir, refuses to start and names the
  first (pid, runtime dir): the node-wide lock (``--node-lock``, default
  /run/tunerd.lock). Both daemons here use a temporary lock, so a real tunerd on
  this machine is neither disturbed nor in the way.
- A scoped daemon (``--scope-pid``, what the test suite gives every daemon it starts)
  binds by its rules only processes in that pid's subtree: a matching process outside
  keeps its CPUs, one inside is bound.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, DaemonProc, wait_for
from tests.leases_helpers import (
    autobind_status,
    cpus_allowed,
    kill,
    rule_policy,
    spawn,
    unique_sleeper,
)
from tunerd.base.cpulist import parse_cpulist

HOST_CPUS = frozenset(os.sched_getaffinity(0))


def _unscoped(daemon_factory, name: str, lock: Path) -> DaemonProc:  # type: ignore[no-untyped-def]
    d: DaemonProc = daemon_factory(name=name, args=["--node-lock", str(lock)])
    d.scoped = False  # its policy has no [[job]] rule: it binds nothing either way
    return d


@pytest.mark.root
def test_a_second_unscoped_daemon_refuses_naming_the_first(tmp_path: Path,
                                                          daemon_factory) -> None:
    lock = tmp_path / "node.lock"
    first = _unscoped(daemon_factory, "first", lock).start()
    second = _unscoped(daemon_factory, "second", lock)
    assert first.runtime_dir != second.runtime_dir
    p = subprocess.run([*second.argv(), "--log-level", "info"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert first.proc is not None
    assert f"pid {first.proc.pid}" in lines[0] and str(first.runtime_dir) in lines[0], lines
    assert not second.socket.exists()  # it touched nothing of its own runtime dir
    assert first.ctl("--json", "status").rc in (0, 1)
    # read-only and scoped daemons take no claim: both start beside the first
    for name, extra in (("dry", ["--dry-run"]), ("scoped", ["--scope-pid", str(os.getpid())])):
        d = _unscoped(daemon_factory, name, lock)
        d.extra_args += extra
        d.start()
        assert d.ctl("--json", "status").rc in (0, 1)
        d.stop()
    # the claim goes with its holder, SIGKILL included
    first.kill9()
    _unscoped(daemon_factory, "third", lock).start()


def test_the_node_lock_defaults_to_a_fixed_path_outside_the_runtime_dir() -> None:
    from tunerd.daemon.config import DaemonConfig, load_config

    cfg = load_config(None, {"runtime_dir": Path("/tmp/elsewhere")})
    assert cfg.node_lock == DaemonConfig().node_lock == Path("/run/tunerd.lock")
    assert cfg.scope_pid is None
    out = subprocess.run([sys.executable, "-m", "tunerd.daemon.main", "--help"],
                         capture_output=True, text=True, timeout=60, cwd=REPO).stdout
    assert "--node-lock" in out and "/run/tunerd.lock" in out and "--scope-pid" in out


@pytest.mark.root
@pytest.mark.skipif(len(HOST_CPUS) < 2, reason="needs 2 CPUs to move between")
def test_a_scoped_daemon_binds_only_inside_its_scope(tmp_path: Path, daemon_factory) -> None:
    exe = unique_sleeper(tmp_path, f"scope_train_{os.getpid()}")
    target = max(HOST_CPUS)
    pol = rule_policy(tmp_path / "pol", f'[[job]]\nname = "t"\nmatch.cmdline = ["*{exe.name}*"]\n'
                      f'match.env = {{ LOCAL_RANK = "*" }}\ncpus = "{target}"\n')
    # the scope: a shell that starts the inside rank when told to; the outside rank is
    # pytest's own child, not the shell's (a sibling of the scope, never under it)
    root = subprocess.Popen(["bash", "-c", f'read _; LOCAL_RANK=0 exec "{exe}" 30'],
                            stdin=subprocess.PIPE)
    d = daemon_factory(policy_dir=pol, args=["--scope-pid", str(root.pid)]).start()
    outside = spawn([str(exe), "30"], {"LOCAL_RANK": "0"})
    try:
        assert root.stdin is not None
        root.stdin.write(b"go\n")
        root.stdin.close()
        wait_for(lambda: cpus_allowed(root.pid) == str(target), 10,
                 "the rank inside the scope to be bound", detail=d.log)
        time.sleep(0.5)  # the outside one was exec'd before: its event is handled too
        assert parse_cpulist(cpus_allowed(outside.pid) or "") == HOST_CPUS
        jobs = d.ctl("--json", "jobs").json()["jobs"]
        assert [j["pid"] for j in jobs if j.get("origin") == "rule"] == [root.pid]
        st = autobind_status(d)
        assert st["scope"]["pid"] == root.pid and st["scope"]["out_of_scope"] >= 1
        # a reload rescans /proc: still only inside
        assert d.ctl("reload").rc == 0
        time.sleep(0.5)
        assert parse_cpulist(cpus_allowed(outside.pid) or "") == HOST_CPUS
    finally:
        kill(outside)
        kill(root)  # type: ignore[arg-type]


def test_the_node_lock_is_never_a_symlink_nor_in_a_dir_others_may_write(tmp_path: Path) -> None:
    from tunerd.base.errors import Failed
    from tunerd.daemon.runtime import NodeClaim

    d = tmp_path / "lockdir"
    d.mkdir(mode=0o755)
    (d / "target").write_text("")
    (d / "tunerd.lock").symlink_to(d / "target")
    with pytest.raises(Failed, match="cannot open the node lock"):
        NodeClaim.acquire(d / "tunerd.lock", tmp_path / "run")
    assert (d / "target").read_text() == ""  # nothing written through the link
    for mode in (0o777, 0o1777):  # anyone could swap the file, or (sticky) pre-create it
        open_dir = tmp_path / f"open{mode:o}"
        open_dir.mkdir()
        open_dir.chmod(mode)
        with pytest.raises(Failed, match=r"node lock dir .*writable by"):
            NodeClaim.acquire(open_dir / "tunerd.lock", tmp_path / "run")
    claim = NodeClaim.acquire(d / "ok.lock", tmp_path / "run")
    try:
        assert os.stat(d / "ok.lock").st_mode & 0o777 == 0o600  # no one else may even open it
        pid, run, started = (d / "ok.lock").read_text().split()
        assert (int(pid), run) == (os.getpid(), str(tmp_path / "run")) and int(started) > 0
    finally:
        claim.release()


def test_the_scope_is_the_subtree_of_its_pid() -> None:
    from tunerd.jobs.scope import ProcessScope

    child = subprocess.Popen(["sleep", "30"])
    try:
        mine = ProcessScope(os.getpid())
        assert mine.admits(child.pid) and mine.admits(os.getpid())
        theirs = ProcessScope(child.pid)  # a subtree below us: we are outside it
        assert theirs.admits(child.pid)
        assert not theirs.admits(os.getpid()) and not theirs.admits(1)
        assert theirs.status() == {"pid": child.pid, "out_of_scope": 2}
        assert not mine.admits(999_999_999)  # gone: outside
    finally:
        kill(child)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["flag", "config"])
def test_scope_pid_1_is_refused(tmp_path: Path, how: str) -> None:
    """init's subtree is the whole node: `--scope-pid 1` would bind everything with no
    node lock (issue 34 item 8); refused as a usage error, one line, before anything."""
    argv = [sys.executable, "-m", "tunerd.daemon.main", "--runtime-dir", str(tmp_path / "run"),
            "--state-dir", str(tmp_path / "state"), "--metrics-listen", "off",
            "--dry-run"]  # were it to start (before the fix), it would write nothing
    if how == "flag":
        argv += ["--scope-pid", "1"]
    else:
        conf = tmp_path / "tunerd.toml"
        conf.write_text("scope_pid = 1\n")
        conf.chmod(0o644)
        argv += ["--config", str(conf)]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=10, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail("tunerd --scope-pid 1 started (it ran for 10 s)")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "1 is init" in lines[0] and "scope" in lines[0], lines
    assert not (tmp_path / "run").exists()  # nothing touched
