"""`tunerd --log-file` only where no one else can put a file first (issue 28, found 6).

In a directory others can write, a file a user created there first stayed hers (and
she read other users' command lines from it); a FIFO there hung tunerd at start.
Replayed with the real test user; each case must make tunerd exit 1 at once, naming
the path and why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.security_helpers import forked_as, recv

pytestmark = pytest.mark.root


def _create(conn, path: str) -> None:  # type: ignore[no-untyped-def]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)
    conn.send("made")
    conn.recv()


def _refused(daemon_factory, log_file: Path, why: str) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory(args=["--log-file", str(log_file)])
    d.start(wait=False)
    assert d.proc is not None
    rc = d.proc.wait(20)  # a FIFO used to hang it here
    out = d.log()
    assert rc == 1, (rc, out)
    assert f"log file {log_file}" in out and why in out, out
    assert "Traceback" not in out


def test_a_file_a_user_made_first_in_a_shared_dir_is_refused(
        daemon_factory, unpriv_user: tuple[int, int]) -> None:
    shared = Path(f"/tmp/tunerd-shared-log-{os.getpid()}")
    shared.mkdir()
    shared.chmod(0o777)  # e.g. a /var/log/something others may write to
    try:
        log_file = shared / "tunerd.log"
        with forked_as(*unpriv_user, _create, str(log_file)) as conn:
            assert recv(conn) == "made"
        _refused(daemon_factory, log_file, "writable by group and others")
        assert log_file.stat().st_size == 0  # nothing of the daemon's went there
        # a FIFO there: refused as well, at once
        fifo = shared / "fifo.log"
        os.mkfifo(fifo)
        _refused(daemon_factory, fifo, "writable by group and others")
    finally:
        for p in shared.iterdir():
            p.unlink()
        shared.rmdir()


def test_in_a_trusted_dir_only_regular_files_of_root(daemon_factory, tmp_path: Path,
                                                     unpriv_user: tuple[int, int]) -> None:
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    fifo = logs / "fifo.log"
    os.mkfifo(fifo)
    _refused(daemon_factory, fifo, "not a regular file")
    theirs = logs / "theirs.log"
    theirs.write_text("")
    os.chown(theirs, *unpriv_user)
    _refused(daemon_factory, theirs, f"owned by uid {unpriv_user[0]}")
    link = logs / "link.log"
    link.symlink_to(logs / "elsewhere.log")
    _refused(daemon_factory, link, "symbolic link")
    ok = logs / "tunerd.log"
    d = daemon_factory(args=["--log-file", str(ok)], name="ok").start()
    assert d.proc is not None and d.proc.poll() is None
    assert ok.stat().st_mode & 0o777 == 0o600
