"""The lower items of issue 28 (found 10): bounded reads and views."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.leases_helpers import kill

pytestmark = pytest.mark.root


def test_a_parents_environment_is_read_as_capped_as_the_ranks_own(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The watcher read a rank's parent's environment up to 1 MiB at real-time priority
    (64 KiB for the rank's own)."""
    from tunerd import procfs
    from tunerd.daemon import intake as intake_mod
    from tunerd.topology import load_topology
    from tunerd.watch.rules import ENVIRON_MATCH_BYTES

    big = {**os.environ, "LOCAL_RANK": "0", **{f"PAD{i}": "x" * (90 << 10) for i in range(10)}}
    parent = subprocess.Popen(["sh", "-c", 'LOCAL_RANK=0 sleep 300 & wait'], env=big)
    try:
        import time

        for _ in range(100):
            kids = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
            if kids:
                break
            time.sleep(0.05)
        child = int(kids[0])
        asked: list[tuple[int, int]] = []
        real = procfs.read_environ_view

        def spy(pid: int, proc: str = procfs.PROC, limit: int = procfs.ARG_READ_MAX
                ) -> Any:
            asked.append((pid, limit))
            return real(pid, proc, limit)

        monkeypatch.setattr(procfs, "read_environ_view", spy)
        it = intake_mod.Intake(load_topology(None), frozenset(os.sched_getaffinity(0)),
                               bound=lambda pid: None, lease=lambda pid: None)
        it.describe(child, quick=True)
        parents = [lim for pid, lim in asked if pid == parent.pid]
        assert parents and max(parents) <= ENVIRON_MATCH_BYTES, asked
    finally:
        kill(parent)
