"""Two `tunerctl bind --exclusive` at once never get the same CPUs (issue 15).

A CLI bind places its process and holds the CPUs it got as one step, under the placer's
lock (``BindCommands._near_gpus`` -> ``Placer.reserve``). If the hold came later (after
the bind, as it once did), a second bind placed in between would be given the same
exclusive CPUs. ``debug_bind_delay`` opens that window wide: each bind waits there,
placed, before it changes anything, while the daemon's loop serves the other request.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import own_daemon
from tests.helpers import FIXTURES, REPO, DaemonProc, wait_for
from tests.leases_helpers import cpus_allowed, kill, spawn
from tunerd.base.cpulist import parse_cpulist

pytestmark = pytest.mark.root

# this machine's CPUs with two GPUs added, both local to every CPU: placements on it are
# applied here for real
TWO_GPUS = FIXTURES / "topologies" / "this-machine-2gpus.json"
DELAY = 1.5  # seconds each bind waits between its placement (and hold) and the bind
ONLINE = parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())


@pytest.fixture(scope="module")
def slow_binds() -> Iterator[DaemonProc]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tunerd-race-") as tmp:
        cfg = Path(tmp) / "tunerd.toml"
        cfg.write_text(f"debug_bind_delay = {DELAY}\n")
        with own_daemon(["--topology", str(TWO_GPUS), "--config", str(cfg)]) as d:
            yield d


def _exclusive(d: DaemonProc) -> frozenset[int]:
    r = d.ctl("--json", "status")
    assert r.rc in (0, 1), r.err
    return parse_cpulist(r.json()["services"]["placer"]["exclusive_cpus"] or "")


def _bind(d: DaemonProc, pid: int, *how: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tunerd.cli.main", "--socket", str(d.socket), "--json", "bind",
         str(pid), *how, "--exclusive"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


@pytest.mark.skipif(not {0, 1} <= ONLINE, reason="the snapshot places on CPUs 0-1")
# placed near GPU 0 (the placer chooses), or given CPU 0 (the one the second would get)
@pytest.mark.parametrize("first_how", [("--gpus", "0"), ("--cpus", "0")],
                         ids=["placed", "given"])
def test_two_concurrent_exclusive_binds_get_disjoint_cpus(slow_binds: DaemonProc,
                                                          first_how: tuple[str, str]) -> None:
    d = slow_binds
    wait_for(lambda: not _exclusive(d), 10, "the last test's holds to be released")
    a, b = spawn(["sleep", "300"]), spawn(["sleep", "300"])
    try:
        before = cpus_allowed(a.pid)
        first = _bind(d, a.pid, *first_how)
        # the first is placed (and holds its CPUs) and waits; the second is placed meanwhile
        wait_for(lambda: f"pid {a.pid} placed; binding it in" in d.log(), 20,
                 "the first bind to be placed", detail=d.log)
        second = _bind(d, b.pid, "--gpus", "1")
        wait_for(lambda: f"pid {b.pid} placed; binding it in" in d.log() or second.poll(),
                 20, "the second bind to be placed (or refused)", detail=d.log)
        # ... while the first had not changed its process yet: the window was hit
        assert cpus_allowed(a.pid) == before, (
            "the first bind was done before the second was placed: the machine is too "
            f"slow for DELAY = {DELAY} s\n{d.log()[-3000:]}")
        out_a, err_a = first.communicate(timeout=60)
        out_b, err_b = second.communicate(timeout=60)
        assert first.returncode == 0, (out_a, err_a, d.log()[-3000:])
        got_a = parse_cpulist(cpus_allowed(a.pid) or "")
        if second.returncode != 0:  # refused: a message that says why, b left as it was
            assert second.returncode == 1 and "exclusive" in err_b, (out_b, err_b)
            assert cpus_allowed(b.pid) == before
            return
        got_b = parse_cpulist(cpus_allowed(b.pid) or "")
        assert got_a and got_b and not got_a & got_b, (
            f"pid {a.pid} got CPUs {sorted(got_a)}, pid {b.pid} got {sorted(got_b)}: "
            f"exclusive CPUs given twice\n{d.log()[-3000:]}")
        assert _exclusive(d) == got_a | got_b
    finally:
        kill(a)
        kill(b)
