"""No user keeps root's daemon from starting through the node lock (issue 34 item 1).

The attacks run as the real unprivileged test user against the daemon's *default* node
lock and the old one (/run/lock/tunerd.lock), inside a private mount namespace whose
/run is a fresh tmpfs (with a sticky, world-writable /run/lock as a distribution has):
nothing on this host's /run is touched, and the daemon under test is the real process
with no --node-lock, entered into that namespace with nsenter.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import REPO, DaemonProc

OLD = "/run/lock/tunerd.lock"

pytestmark = pytest.mark.root


@dataclass
class PrivateRun:
    """A mount namespace (held by a sleeping process) whose /run is a private tmpfs."""

    pid: int

    def enter(self, *argv: str) -> list[str]:
        return ["nsenter", "-t", str(self.pid), "-m", "--", *argv]

    def as_user(self, user: tuple[int, int], code: str) -> list[str]:
        return self.enter("setpriv", f"--reuid={user[0]}", f"--regid={user[1]}",
                          "--clear-groups", "--", sys.executable, "-c", code)

    def sh(self, script: str) -> str:
        return subprocess.run(self.enter("sh", "-c", script), capture_output=True, text=True,
                              check=True, timeout=30).stdout


@pytest.fixture
def private_run() -> Iterator[PrivateRun]:
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
         "mount -t tmpfs -o mode=0755 tunerd-test-run /run && mkdir -m 1777 /run/lock "
         "&& echo ready && exec sleep 600"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        yield PrivateRun(holder.pid)
    finally:
        holder.kill()  # our own child, by pid: the namespace goes with it
        holder.wait()


class NsDaemon(DaemonProc):
    ns: PrivateRun | None = None

    def argv(self) -> list[str]:
        assert self.ns is not None
        return self.ns.enter(*super().argv())


def _daemon(daemon_factory, ns: PrivateRun, name: str) -> NsDaemon:  # type: ignore[no-untyped-def]
    base: DaemonProc = daemon_factory(name=name)
    d = NsDaemon(tmp=base.tmp, policy_dir=base.policy_dir, scoped=False)  # the default lock
    d.ns = ns
    return d


def _lock_path() -> str:
    from tunerd.daemon.config import DaemonConfig

    return str(DaemonConfig().node_lock)


# what the user does, in her own process (a string of Python run by setpriv)
_PRECREATE = """
import os, sys
for p in sys.argv[1:]:
    try:
        os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)); print(p, "created")
    except OSError as e:
        print(p, e.strerror)
"""
_SYMLINK = """
import os, sys
for p in sys.argv[1:]:
    try:
        os.symlink("/run/lock/elsewhere", p); print(p, "linked")
    except OSError as e:
        print(p, e.strerror)
"""
_HARDLINK = """
import os, sys
open("/run/lock/mine", "w").close()
for p in sys.argv[1:]:
    for src, dst in (("/run/lock/mine", p), (p, "/run/lock/alias-" + os.path.basename(p))):
        try:
            os.link(src, dst); print(src, dst, "linked")
        except OSError as e:
            print(src, dst, e.strerror)
"""
_FLOCK = """
import fcntl, os, sys
held = []
for p in sys.argv[1:]:
    try:
        fd = os.open(p, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); held.append(p)
    except OSError as e:
        print(p, e.strerror)
print("holding", *held, flush=True)
sys.stdin.read()
"""


def _run_as(ns: PrivateRun, user: tuple[int, int], code: str) -> str:
    p = subprocess.run([*ns.as_user(user, code), OLD, _lock_path()], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _starts(d: NsDaemon) -> None:
    """Root's daemon starts (and answers) with the default node lock, then stops."""
    d.start()
    assert d.ctl("--json", "status").rc in (0, 1)
    assert d.stop() == 0


def _first_daemon_ran(daemon_factory, ns: PrivateRun) -> None:  # type: ignore[no-untyped-def]
    """A daemon ran and stopped: the lock file (new path) and an old-style one exist,
    root's, as an earlier version or boot left them."""
    _starts(_daemon(daemon_factory, ns, "first"))
    ns.sh(f"echo '1 /run/tunerd 1' > {OLD} && chmod 0644 {OLD}")


@pytest.mark.parametrize("attack", ["precreate", "symlink", "hardlink"])
def test_a_user_cannot_keep_roots_daemon_from_starting(attack: str, private_run: PrivateRun,
                                                       unpriv_user, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    code = {"precreate": _PRECREATE, "symlink": _SYMLINK, "hardlink": _HARDLINK}[attack]
    out = _run_as(private_run, unpriv_user, code)
    _starts(_daemon(daemon_factory, private_run, "root"))
    # she could do it to the old, sticky /run/lock (that was the attack) ...
    assert f"{OLD} created" in out or f"{OLD} linked" in out, out
    # ... and to nothing where the lock now lives
    assert f"{_lock_path()} created" not in out and f"{_lock_path()} linked" not in out, out
    st = os.stat(f"/proc/{private_run.pid}/root{_lock_path()}", follow_symlinks=False)
    assert st.st_uid == 0 and st.st_nlink == 1 and st.st_mode & 0o077 == 0


def test_a_user_cannot_take_the_lock_through_a_read_only_fd(private_run: PrivateRun, unpriv_user,
                                                             daemon_factory) -> None:  # type: ignore[no-untyped-def]
    _first_daemon_ran(daemon_factory, private_run)
    p = subprocess.Popen([*private_run.as_user(unpriv_user, _FLOCK), OLD, _lock_path()],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = ""
        while not line.startswith("holding"):
            line = p.stdout.readline()
            assert line, "the user's process ended"
        _starts(_daemon(daemon_factory, private_run, "second"))
        assert _lock_path() not in line.split()[1:], line  # she could not even open it
    finally:
        p.kill()  # our own child, by pid
        p.wait()


def test_a_second_link_is_never_written_through(private_run: PrivateRun,
                                                daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """With fs.protected_hardlinks off (or root's own slip) the lock file can gain a
    second name elsewhere; the daemon never writes through it: it takes a fresh file."""
    _first_daemon_ran(daemon_factory, private_run)
    lock = _lock_path()
    private_run.sh(f"ln {lock} /run/lock/alias && ln {OLD} /run/lock/alias-old")
    root = f"/proc/{private_run.pid}/root"
    before = Path(f"{root}/run/lock/alias").read_text()
    _starts(_daemon(daemon_factory, private_run, "second"))
    assert Path(f"{root}/run/lock/alias").read_text() == before  # not written through
    assert os.stat(f"{root}{lock}").st_nlink == 1


def test_a_foreign_holder_is_named_from_the_kernels_lock_table(tmp_path: Path,
                                                               unpriv_user) -> None:  # type: ignore[no-untyped-def]
    """Whoever holds the lock is named by the pid the kernel gives, not by the pid the
    file says (a stale one): here a user holds an fd root leaked to her."""
    from tunerd.base.errors import Failed
    from tunerd.daemon.runtime import NodeClaim

    d = tmp_path / "lockdir"
    d.mkdir(mode=0o755)
    lock = d / "tunerd.lock"
    lock.write_text("4000000 /run/tunerd 1\n")  # a daemon long gone
    lock.chmod(0o600)
    fd = os.open(lock, os.O_RDONLY)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drops to the user, locks the leaked fd, waits
        try:
            os.setgid(unpriv_user[1])
            os.setuid(unpriv_user[0])
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(w, b"x")
            time.sleep(30)
        finally:
            os._exit(0)
    os.close(fd)
    try:
        assert os.read(r, 1) == b"x"
        with pytest.raises(Failed) as exc:
            NodeClaim.acquire(lock, tmp_path / "run")
        msg = exc.value.message
        assert f"pid {pid} (python" in msg and f"uid {unpriv_user[0]}" in msg, msg
        assert "4000000, stale" in msg, msg
    finally:
        os.kill(pid, 9)  # our own child, by pid
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)


def test_a_lock_dir_others_may_write_is_refused(tmp_path: Path, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A sticky world-writable dir (the old /run/lock) is where any user can pre-create
    the file: root's own configuration error, refused with one line, before any user can
    matter."""
    sticky = tmp_path / "lock"
    sticky.mkdir()
    sticky.chmod(0o1777)
    d: DaemonProc = daemon_factory(name="sticky", args=["--node-lock", str(sticky / "x.lock")])
    d.scoped = False
    p = subprocess.run([*d.argv(), "--log-level", "info"], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "node lock dir" in lines[0] and "writable by" in lines[0], lines
    with contextlib.suppress(FileNotFoundError):
        assert not (sticky / "x.lock").exists()


def test_a_lock_file_that_is_a_mount_point_is_kept_and_made_ours(
        private_run: PrivateRun, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A Kubernetes hostPath file (FileOrCreate: root's, 0644) is a mount point: it cannot
    be renamed over, so the daemon keeps it, made 0600."""
    lock = _lock_path()
    private_run.sh(f"touch {lock} && chmod 0644 {lock} && mount --bind {lock} {lock}")
    _starts(_daemon(daemon_factory, private_run, "pod"))
    st = os.stat(f"/proc/{private_run.pid}/root{lock}")
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == 0


_FLOCK_PIDFILE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)  # the pidfile is 0644: scripts read it
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
try:
    os.open(sys.argv[1] + ".lock", os.O_RDONLY); print("lock opened")
except OSError as e:
    print("lock", e.strerror)
print("holding", flush=True)
sys.stdin.read()
"""


def test_a_user_cannot_hold_the_runtime_dirs_lock(unpriv_user, daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The same attack on the one-daemon-per-runtime-dir lock: she flocks root's 0644
    pidfile read-only; root's next daemon on that runtime dir still starts."""
    d = daemon_factory(name="pidlock").start()
    pidfile = d.runtime_dir / "tunerd.pid"
    assert d.stop() == 0
    pidfile.write_text("1\n")  # a leftover, as after a crash
    pidfile.chmod(0o644)
    p = subprocess.Popen(["setpriv", f"--reuid={unpriv_user[0]}", f"--regid={unpriv_user[1]}",
                          "--clear-groups", "--", sys.executable, "-c", _FLOCK_PIDFILE,
                          str(pidfile)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        lines = [p.stdout.readline(), p.stdout.readline()]
        assert lines[1] == "holding\n", lines
        d.start()  # before: "another tunerd (pid 1) is running with runtime dir ..."
        assert lines[0] == "lock Permission denied\n", lines
        assert d.proc is not None and pidfile.read_text() == f"{d.proc.pid}\n"
        assert pidfile.stat().st_mode & 0o777 == 0o644
    finally:
        p.kill()  # our own child, by pid
        p.wait()


def test_a_users_daemon_only_looks_at_the_lock(private_run: PrivateRun, unpriv_user,
                                               daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A daemon an ordinary user runs (unscoped, not a dry run) cannot open root's 0600
    lock: it reads the kernel's lock table instead, refuses while root's daemon holds
    the node (naming its pid), and neither creates nor holds the lock when none does."""
    from tests.security_helpers import chown_tree

    root = _daemon(daemon_factory, private_run, "root").start()
    base: DaemonProc = daemon_factory(name="user")
    base.scoped = False
    chown_tree(base.tmp, *unpriv_user)
    argv = private_run.enter("setpriv", f"--reuid={unpriv_user[0]}",
                             f"--regid={unpriv_user[1]}", "--clear-groups", "--",
                             *base.argv(), "--log-level", "info")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 1, p.stderr
    assert root.proc is not None and f"another tunerd (pid {root.proc.pid}" in p.stderr, p.stderr
    assert root.stop() == 0
    user = NsDaemon(tmp=base.tmp, policy_dir=base.policy_dir, scoped=False)
    user.ns = private_run
    user.argv = lambda: argv  # type: ignore[method-assign]
    user.start()  # nobody holds the node now: hers starts, holding nothing
    st = os.stat(f"/proc/{private_run.pid}/root{_lock_path()}")
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o600
    assert user.stop() == 0
