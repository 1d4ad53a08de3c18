"""tests/slurm_helpers.py's own safety: the host lock root opens in /tmp, and a teardown
that goes on after a wait failed (so that a broken Slurm run leaves no daemons,
cgroups or temporary trees behind)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.slurm_helpers import SlurmCluster, SlurmError, host_lock

pytestmark = pytest.mark.root


def test_host_lock_refuses_a_symlink_and_never_follows_it(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    lock = tmp_path / "tunerd-test-slurm.lock"
    lock.symlink_to(target)
    with pytest.raises(SlurmError, match=str(lock)), host_lock(lock):
        pass
    assert not target.exists()  # root created nothing where the link points


def test_host_lock_refuses_a_fifo_at_once(tmp_path: Path) -> None:
    lock = tmp_path / "tunerd-test-slurm.lock"
    os.mkfifo(lock)
    with pytest.raises(SlurmError, match="not a regular file"), host_lock(lock):
        pass


def test_host_lock_refuses_another_users_file(tmp_path: Path,
                                              unpriv_user: tuple[int, int]) -> None:
    lock = tmp_path / "tunerd-test-slurm.lock"
    lock.write_text("")
    os.chown(lock, *unpriv_user)
    with pytest.raises(SlurmError, match=f"uid {unpriv_user[0]}"), host_lock(lock):
        pass


def test_host_lock_is_exclusive_and_made_root_only(tmp_path: Path) -> None:
    lock = tmp_path / "tunerd-test-slurm.lock"
    with host_lock(lock):
        st = lock.stat()
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_mode & 0o777 == 0o600
        with pytest.raises(SlurmError, match="held"), host_lock(lock, wait_s=0.5):
            pass
    with host_lock(lock):  # released: the next session takes it (an old file is kept)
        pass


class _LeftoverCgroup(SlurmCluster):
    """A cluster whose "cgroup made by slurmd" is a plain directory of the test's: its
    cgroup.procs lists a process forever, so the wait for it to empty times out (after
    0.5 s here: how long does not matter, that the teardown goes on after it does)."""

    CGROUP_WAIT_S = 0.5

    def cgroup_dirs(self) -> list[Path]:
        return [self.root / "cg"]


def test_teardown_goes_on_after_a_cgroup_wait_times_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = _LeftoverCgroup(tmp_path)
    leftover = subprocess.Popen(["sleep", "60"])  # ours: the teardown kills it by PID
    try:
        (tmp_path / "cg").mkdir()
        (tmp_path / "cg" / "cgroup.procs").write_text(f"{leftover.pid}\n")
        cluster.stop()  # raised AssertionError (the wait's) before, skipping the rest
        assert leftover.wait(10) == -9
    finally:
        leftover.kill()
        leftover.wait()
    out = capsys.readouterr().out
    assert f"killed leftover pid {leftover.pid}" in out
    assert f"could not remove {tmp_path / 'cg'}" in out and "waiting for" in out
