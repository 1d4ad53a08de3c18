"""STATE_DIR/state.json: atomic, durable writes that survive kill -9 mid-write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tunerd.daemon.state import StateStore, write_atomic


def test_roundtrip_and_sections(tmp_path: Path) -> None:
    s = StateStore(tmp_path / "state.json")
    s.load()
    s.section("host")["sysctl:net.core.somaxconn"] = {"original": "4096"}
    s.save()
    t = StateStore(tmp_path / "state.json")
    t.load()
    assert t.section("host") == {"sysctl:net.core.somaxconn": {"original": "4096"}}
    assert (tmp_path / "state.json").stat().st_mode & 0o777 == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".state.json.tmp")]


def test_corrupt_state_is_kept_aside_not_overwritten(tmp_path: Path) -> None:
    p = tmp_path / "state.json"
    p.write_text('{"host": {"sysctl:x": ')
    s = StateStore(p)
    s.load()
    assert s.load_error and "corrupt" in s.load_error
    aside = [q for q in tmp_path.iterdir() if q.name.startswith("state.json.corrupt-")]
    assert len(aside) == 1 and aside[0].read_text() == '{"host": {"sysctl:x": '
    assert not p.exists()


WRITER = r"""
import sys
from pathlib import Path
from tunerd.daemon.state import write_atomic
path = Path(sys.argv[1])
i = 0
while True:
    i += 1
    # ~2 MiB per version so that a kill lands inside a write most of the time
    write_atomic(path, ('{"version": %d, "pad": "%s"}' % (i, "x" * (2 << 20))).encode())
"""


def test_kill9_during_writes_never_leaves_a_torn_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_atomic(path, b'{"version": 0}')
    seen: set[int] = set()
    for n in range(8):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(path)],
                             cwd=Path(__file__).resolve().parent.parent)
        time.sleep(0.15 + 0.05 * n)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        data = json.loads(path.read_bytes())  # must always parse: old or new, never half
        seen.add(data["version"])
    assert max(seen) > 0  # the writer really replaced the file
