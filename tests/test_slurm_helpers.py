"""tests/slurm_helpers.py's own safety: a teardown that goes on after a wait failed (so
that a broken Slurm run leaves no daemons, cgroups or temporary trees behind)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.slurm_helpers import SlurmCluster

pytestmark = pytest.mark.root


class _LeftoverCgroup(SlurmCluster):
    """A cluster whose "cgroup made by slurmd" is a plain directory of the test's: its
    cgroup.procs lists a process forever, so the wait for it to empty times out."""

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
