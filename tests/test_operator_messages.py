"""Messages an operator meets on a first day (issue 19, item 4): each one says what
happened and what to do, with the documented exit code."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import REPO
from tests.security_helpers import start_daemon, wait_exit

pytestmark = pytest.mark.root


def test_tunerd_as_non_root_on_dirs_it_cannot_create_is_exit_4_with_a_hint(
        daemon_factory, unpriv_user: tuple[int, int]) -> None:
    d = daemon_factory()  # its dirs sit in a root-owned 0755 tree: not creatable by the user
    start_daemon(d, user=unpriv_user, wait=False)
    assert wait_exit(d) == 4, d.log()
    log = d.log()
    assert f"cannot start: runtime dir {d.runtime_dir}: Permission denied" in log, log
    assert "hint: tunerd runs as root" in log and "--runtime-dir" in log


def test_uninstall_as_non_root_says_it_removes(unpriv_user: tuple[int, int]) -> None:
    uid, gid = unpriv_user
    r = subprocess.run(["sh", str(REPO / "scripts/uninstall.sh")], user=uid, group=gid,
                       capture_output=True, text=True, timeout=30, cwd="/")
    assert r.returncode == 4, r
    assert "uninstall.sh: must run as root (it removes what install.sh put in" in r.stderr
    assert "installs into" not in r.stderr


def test_a_cut_command_line_ends_in_an_ellipsis() -> None:
    from tunerd.jobs.autobind import _cut

    assert _cut("python train.py") == "python train.py"
    long = "torchrun --nproc-per-node 8 " + "x" * 100
    assert len(_cut(long)) == 80 and _cut(long).endswith("\u2026")
    assert _cut(long).startswith("torchrun --nproc-per-node 8 x")
