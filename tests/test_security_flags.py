"""One gate for every combination of the flags of bind, run and alloc (issue 28, found 1).

Root holds CPU 1 exclusively (an ``alloc --cpus 1 --exclusive`` lease) and a GPU (an
``alloc --gpus 1 --exclusive`` lease). ``bind PID --cpus 1`` was refused, but
``bind PID --cpus 1 --gpus 0`` put the user's process on root's exclusive CPU: the
CPU-list check only ran without ``--gpus``. Here every combination of the flags of
``bind``, ``run`` and ``alloc`` is tried by the real test user (under a policy that
lets users hold exclusive CPUs, so that no other refusal hides a gap): each one is
refused, or what it got holds none of root's CPUs and (where it holds GPUs) none of
root's GPUs.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import write_policy
from tests.leases_helpers import cpus_allowed, kill, snapshot_with_gpus_here
from tests.security_helpers import ctl_as, spawn_as
from tunerd.base.cpulist import parse_cpulist

pytestmark = pytest.mark.root

ONLINE = sorted(parse_cpulist(Path("/sys/devices/system/cpu/online").read_text()))


def _ids(v: Any) -> set[int]:
    if v is None or v == "":
        return set()
    if isinstance(v, list):
        return set(v)
    return set(parse_cpulist(str(v)))


def _combos(flags: dict[str, list[list[str]]]) -> list[list[str]]:
    return [[a for part in parts for a in part] for parts in itertools.product(*flags.values())]


def _run_json(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """`tunerctl --json run` prints its lease as JSON on stderr before it execs."""
    for line in r.stderr.splitlines():
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    return {}


def _try_all(d: Any, user: tuple[int, int], held_cpus: set[int], held_gpus: set[int],
             pid: int) -> tuple[int, list[str]]:
    """Every combination of bind/run/alloc flags by ``user``; (tried, gaps)."""
    gaps: list[str] = []
    tried = 0
    lo, hi = ONLINE[0], ONLINE[-1]

    def check(argv: list[str], r: subprocess.CompletedProcess[str], got: dict[str, Any],
              holds_gpus: bool) -> None:
        out = r.stdout + r.stderr
        assert "internal error" not in out and "Traceback" not in out, (argv, out)
        if r.returncode != 0:
            assert r.returncode in (1, 2, 4), (argv, r.returncode, out)
            return
        cpus = _ids(got.get("cpus"))
        if cpus & held_cpus:
            gaps.append(f"{' '.join(argv)}: got root's CPUs {sorted(cpus & held_cpus)}")
        if holds_gpus and _ids(got.get("gpus")) & held_gpus:
            gaps.append(f"{' '.join(argv)}: got root's GPUs "
                        f"{sorted(_ids(got.get('gpus')) & held_gpus)}")

    for argv in _combos({"cpus": [[], ["--cpus", str(lo)], ["--cpus", str(hi)],
                                  ["--cpus", f"{lo}-{hi}"]],
                         "gpus": [[], ["--gpus", "0"], ["--gpus", "1"], ["--gpus", "0-1"]],
                         "mems": [[], ["--mems", "0"]],
                         "excl": [[], ["--exclusive"]]}):
        if not argv:
            continue
        tried += 1
        r = ctl_as(user, d.socket, "--json", "bind", str(pid), *argv)
        got = json.loads(r.stdout) if r.returncode == 0 else {}
        check(["bind", *argv], r, got, "--exclusive" in argv)
        aff = _ids(cpus_allowed(pid))
        if aff and aff <= held_cpus:
            gaps.append(f"bind {' '.join(argv)}: the process runs on root's CPUs {aff}")
        ctl_as(user, d.socket, "unbind", str(pid))
    for cmd in ("alloc", "run"):
        for argv in _combos({"gpus": [[], ["--gpus", "1"], ["--gpus", "2"]],
                             "cpus": [[], ["--ncpus", "1"], ["--ncpus", "2"],
                                      ["--cpus", f"{lo}-{lo}"], ["--cpus", f"{hi}-{hi}"],
                                      ["--cpus", f"{lo}-{hi}"]],
                             "excl": [[], ["--exclusive"]]}):
            if cmd == "alloc" and not argv:
                continue
            tried += 1
            if cmd == "alloc":
                r = ctl_as(user, d.socket, "--json", "alloc", *argv)
                got = json.loads(r.stdout) if r.returncode == 0 else {}
            else:
                r = ctl_as(user, d.socket, "--json", "run", *argv, "--", "true")
                got = _run_json(r)
            check([cmd, *argv], r, got, True)
            if got.get("lease") and cmd == "alloc":
                ctl_as(user, d.socket, "release", got["lease"])
    return tried, gaps


@pytest.mark.skipif(len(ONLINE) < 2, reason="needs 2 CPUs")
def test_every_flag_combination_passes_one_gate(daemon_factory, tmp_path: Path,
                                                unpriv_user: tuple[int, int]) -> None:
    snap, _, hi = snapshot_with_gpus_here(tmp_path / "snap.json")  # GPU 0 at lo, 1 at hi
    pol = tmp_path / "pol"
    write_policy(pol, "00.toml", '[policy]\nname = "t"\n[leases]\nuser_exclusive = true\n'
                                 'max_per_user = 1000\n')
    d = daemon_factory(policy_dir=pol, args=["--topology", str(snap)]).start()
    s = spawn_as(unpriv_user, ["sleep", "300"])
    gaps: list[str] = []
    tried = 0
    try:
        # root holds CPU hi exclusively
        a = d.ctl("--json", "alloc", "--cpus", f"{hi}-{hi}", "--exclusive")
        assert a.rc == 0, a
        n, g = _try_all(d, unpriv_user, _ids(a.json()["cpus"]), set(), s.pid)
        tried, gaps = tried + n, gaps + g
        assert d.ctl("release", a.json()["lease"]).rc == 0
        # root holds a GPU (and its CPUs) exclusively
        b = d.ctl("--json", "alloc", "--gpus", "1", "--exclusive")
        assert b.rc == 0, b
        n, g = _try_all(d, unpriv_user, _ids(b.json()["cpus"]), _ids(b.json()["gpus"]),
                        s.pid)
        tried, gaps = tried + n, gaps + g
    finally:
        kill(s)
    assert tried >= 150
    assert not gaps, f"{len(gaps)} of {tried} combinations got what root holds:\n" + \
        "\n".join(gaps)
