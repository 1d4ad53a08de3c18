"""Root runs no user's code (issue 16, found 1): the interpreters `tunerctl doctor`,
`bench` and `tune` start (the torch probe, the interpreter probe, the built-in workload,
the `tunerctl run` prefix of an arm) never import from the directory root runs them in.

The test user plants json.py, torch.py and a tunerd/ package, each writing a marker,
in a directory the user owns; root then runs the real commands there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import DaemonProc, run_as

pytestmark = pytest.mark.root

TUNERCTL = str(Path(sys.executable).parent / "tunerctl")  # the console script: its
# sys.path[0] is the venv's bin/, so only what tunerctl starts can see the planted files

PLANT = ("import os\n"
         "with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), {marker!r}),"
         " 'a') as f:\n"
         "    f.write('uid %d imported {name}\\n' % os.getuid())\n")


def _plant(d: str) -> None:
    """As the test user: the files a user leaves in a shared directory."""
    Path(d, "json.py").write_text(PLANT.format(marker="MARKER", name="json.py"))
    Path(d, "torch.py").write_text(PLANT.format(marker="MARKER", name="torch.py"))
    Path(d, "tunerd").mkdir()
    Path(d, "tunerd", "__init__.py").write_text(PLANT.format(marker="../MARKER",
                                                             name="tunerd/"))
    # a sitecustomize on PYTHONPATH would be the caller's own (scrubbed); planted here it
    # must not run either
    Path(d, "sitecustomize.py").write_text(PLANT.format(marker="MARKER",
                                                        name="sitecustomize.py"))


@pytest.fixture
def planted(unpriv_user: tuple[int, int]) -> Iterator[Path]:
    uid, gid = unpriv_user
    d = Path(tempfile.mkdtemp(prefix="tunerd-shared-"))
    os.chmod(d, 0o777)
    try:
        os.chown(d, uid, gid)
        run_as(uid, gid, _plant, str(d))
        yield d
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


def _root_runs(d: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run([TUNERCTL, *args], cwd=d, capture_output=True, text=True,
                          timeout=timeout, env=env)


def _marker(d: Path) -> str:
    m = d / "MARKER"
    return m.read_text() if m.exists() else ""


def test_root_doctor_in_a_planted_dir_imports_nothing_from_it(planted: Path) -> None:
    r = _root_runs(planted, "--json", "doctor", "--python", sys.executable,
                   "--data-dir", str(planted))
    assert _marker(planted) == "", _marker(planted)
    assert r.returncode in (0, 1) and '"torch"' in r.stdout, r.stdout + r.stderr


def test_root_bench_in_a_planted_dir_imports_nothing_from_it(planted: Path,
                                                              daemon: DaemonProc) -> None:
    # arm B's `tunerctl run` prefix and the noisy neighbour are interpreters bench starts
    r = _root_runs(planted, "--socket", str(daemon.socket), "bench", "--runs", "2",
                   "--warmup", "0", "--noisy", "--noisy-procs", "1", "--json", "--",
                   "/bin/sh", "-c", "echo TUNERD_METRIC samples_per_second 1 higher")
    assert _marker(planted) == "", _marker(planted)
    assert r.returncode == 0, r.stdout + r.stderr


def test_builtin_workload_in_a_planted_dir_imports_nothing_from_it(planted: Path) -> None:
    """The built-in workload's interpreter, as bench starts it, in the planted directory.
    /usr/bin/python3 has no torch: the workload stops at `import torch` (fast), where a
    planted torch.py on sys.path would have been imported instead."""
    from tunerd.bench import builtin_command, tunerd_on_path

    with tunerd_on_path() as path_env:
        argv = builtin_command("/usr/bin/python3", path_env)
        env = {**os.environ, **path_env, "PYTHONPATH": str(planted), "TUNERD_BENCH_STEPS": "2"}
        p = subprocess.run(argv, cwd=planted, env=env, capture_output=True, text=True,
                           timeout=60)
    assert _marker(planted) == "", _marker(planted)
    assert "No module named 'torch'" in p.stderr, p.stderr


def test_root_tune_in_a_planted_dir_imports_nothing_from_it(planted: Path,
                                                             daemon: DaemonProc) -> None:
    # the command itself is root's own choice (it runs in its directory, as asked); what
    # tune starts around it (the `tunerctl run` prefix of the placement arm) must not
    r = _root_runs(planted, "--socket", str(daemon.socket), "tune", "--quick", "--runs", "2",
                   "--warmup", "0", "--settings", "placement", "--", "/bin/sh", "-c",
                   "echo TUNERD_METRIC samples_per_second 1 higher")
    assert _marker(planted) == "", _marker(planted)
    assert r.returncode == 0, r.stdout + r.stderr
