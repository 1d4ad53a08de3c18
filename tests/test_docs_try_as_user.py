"""docs/install.md's "try it as yourself" command runs as an ordinary user beside an
installed daemon (one that holds the node lock), as written (issue 35 item 5)."""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import TEST_USER
from tests.helpers import REPO


def _doc_command() -> list[str]:
    text = (REPO / "docs/install.md").read_text()
    m = re.search(r"try it as yourself.*?```sh\n(tunerd [^\n]+)\n```", text, re.S)
    assert m, "docs/install.md: no `tunerd ...` block after 'try it as yourself'"
    return shlex.split(m.group(1).replace("$USER", TEST_USER))


def _run_as_user(argv: list[str], lock: Path, seconds: float) -> tuple[int | None, str]:
    """``argv`` (tunerd ...) as the test user, its node lock ``lock``: (exit code, or
    None when still running after ``seconds`` (then stopped), its stderr)."""
    cmd = ["runuser", "-u", TEST_USER, "--", "env", f"PYTHONPATH={REPO}", "HOME=/tmp",
           sys.executable, "-c", "import sys; from tunerd.daemon.main import main; "
           "sys.exit(main())", *argv[1:], "--node-lock", str(lock)]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd="/tmp")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.1)
    rc = p.poll()
    if rc is None:
        p.send_signal(signal.SIGTERM)  # runuser passes it on
    _, err = p.communicate(timeout=30)
    return rc, err


@pytest.mark.root
@pytest.mark.usefixtures("unpriv_user")
def test_the_try_it_as_a_user_command_runs_beside_the_installed_daemon() -> None:
    argv = _doc_command()
    assert "--dry-run" in argv or "--scope-pid" in argv, argv
    base = Path(tempfile.mkdtemp(prefix="tunerd-lock-"))  # root's, 0755: a lock dir
    os.chmod(base, 0o755)
    lock = base / "tunerd.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the installed daemon's claim
        os.write(fd, f"{os.getpid()} /run/tunerd {int(time.time())}\n".encode())
        rc, err = _run_as_user(argv, lock, 6.0)
        assert rc is None, f"exit {rc}: {err}"  # it ran until stopped
        assert "ready" in err, err
        # what the doc said before: the same without --dry-run/--scope-pid exits 1
        bare = [a for a in argv if a != "--dry-run"]
        rc, err = _run_as_user(bare, lock, 30.0)
        assert rc == 1 and "another tunerd" in err, (rc, err)
    finally:
        os.close(fd)
        subprocess.run(["rm", "-rf", str(base), f"/tmp/tunerd-{TEST_USER}"], check=False)
