"""scripts/gpu-check.sh on this GPU-less machine: every step runs against replay where
it can, the rest is skipped with one line each, the report is written, exit 0."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

STEPS = ["env", "topology", "telemetry", "readings", "doctor", "placement", "training",
         "bench"]


@pytest.mark.root
@pytest.mark.slow
def test_gpu_check_without_a_gpu_replays_skips_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TUNERD_SOCKET")}
    env.update(PYTHON=sys.executable, OUT=str(out))  # the report lands in $OUT
    p = subprocess.run(["sh", str(REPO / "scripts/gpu-check.sh"), "--no-install", "--quick",
                        "--no-bench", "--budget", "150"],
                       capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads((out / "gpu-check.json").read_text())
    got = {s["name"]: s for s in rep["steps"]}
    assert list(got) == STEPS and rep["ok"] is True and rep["gpu"] is False
    # one printed line per step, and every SKIP says why
    for s in rep["steps"]:
        assert f"[{s['status']}] {s['name']}: " in p.stdout
        assert s["detail"].strip(), s
    assert {n: got[n]["status"] for n in ("telemetry", "placement", "bench")} == \
        {"telemetry": "SKIP", "placement": "SKIP", "bench": "SKIP"}
    # ... and the rest really ran: a saved topology of this machine
    topo = json.loads((out / "topology.json").read_text())
    assert len(topo["cpus"]) == os.cpu_count() and topo["gpus"] == []
    # the readings comparison ran on the replayed telemetry, with units converted
    rows = {r["field"]: r for r in got["readings"]["data"]["rows"][0]}
    assert rows["power.draw"]["ok"] and rows["power.draw"]["daemon"] == pytest.approx(612.345)
    assert rows["memory.total"]["daemon"] == pytest.approx(85520809984 / 2**20)
    assert got["readings"]["status"] == got["doctor"]["status"] == "PASS"
    assert got["doctor"]["data"]["torch"]["status"] in ("PASS", "SKIP")
    # the training example reported to the daemon: metrics had its figures
    m = got["training"]["data"]["metrics"]
    assert got["training"]["status"] == "PASS", got["training"]
    assert m["tunerd_job_samples_per_second"] > 0 and m["tunerd_job_step_seconds"] > 0
    assert got["training"]["data"]["top_once_lists_job"] is True
    md = (out / "gpu-check.md").read_text()
    assert "| readings | PASS |" in md and "Tolerances" in md


def test_gpu_check_compares_within_tolerances_and_catches_a_unit_error() -> None:
    """The comparison itself: a daemon reading in the wrong unit (mW as W) fails."""
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check as gc

    smi = {"power.draw": "612.3", "memory.total": "81559", "clocks.sm": "1980",
           "clocks_event_reasons.active": "0x0000000000000001"}
    daemon = {"power_watts": 612.345, "memory_total_bytes": 81559 * 2**20,
              "sm_clock_hertz": 1.98e9, "throttle_reasons": 0}
    rows, bad = gc.compare_readings(daemon, smi, smi)
    assert bad == [] and all(r["ok"] in (True, None) for r in rows)
    rows, bad = gc.compare_readings({**daemon, "power_watts": 612345.0}, smi, smi)
    assert len(bad) == 1 and bad[0].startswith("power.draw: daemon 612345")
    # a reading the daemon lacks while nvidia-smi has it is a mismatch too
    _, bad = gc.compare_readings({**daemon, "sm_clock_hertz": None}, smi, smi)
    assert bad == ["clocks.sm: daemon None, nvidia-smi 1980"]
    # power/thermal throttling seen by nvidia-smi but not by the daemon
    _, bad = gc.compare_readings(daemon, {**smi, "clocks_event_reasons.active": "0x24"},
                                 {**smi, "clocks_event_reasons.active": "0x24"})
    assert bad and bad[0].startswith("throttle reasons")


def _script_wheels() -> set[str]:
    """The distributions scripts/gpu-check.sh --prepare downloads, normalised."""
    text = (REPO / "scripts/gpu-check.sh").read_text()
    names: set[str] = set()
    for var in ("RUNTIME_WHEELS", "PURE_WHEELS", "PLATFORM_WHEELS"):
        m = re.search(var + r'="([^"]*)"', text)
        assert m, var
        names |= {_norm(re.split(r"[<>=!~;\[ ]", w)[0]) for w in m.group(1).split()}
    return names


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_prepared_wheels_cover_every_runtime_dependency() -> None:
    """--prepare downloads each runtime dependency of pyproject.toml and each of theirs
    (psutil went missing once: the GPU node's daemon step died on its import)."""
    from importlib import metadata

    try:
        import tomllib
    except ImportError:  # python 3.10
        import tomli as tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    want: set[str] = set()
    todo = [re.split(r"[<>=!~;\[ ]", d)[0] for d in deps]
    while todo:
        name = _norm(todo.pop())
        if name in want:
            continue
        want.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:  # tomli on 3.11+: not installed here
            continue
        todo += [re.split(r"[<>=!~;\[ ]", r)[0] for r in reqs
                 if "extra ==" not in r and "sys_platform == \"win32\"" not in r]
    missing = want - _script_wheels()
    assert not missing, f"scripts/gpu-check.sh --prepare does not download {sorted(missing)}"
    assert {"setuptools", "pip"} <= _script_wheels()


NEEDS_WHEELS = pytest.mark.skipif(
    not (REPO / ".whl").is_dir(), reason="no .whl/ prepared here "
    "(scripts/gpu-check.sh --prepare): the bare-machine run is not checked")


@NEEDS_WHEELS
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no /usr/bin/python3")
@pytest.mark.root
@pytest.mark.slow
def test_gpu_check_on_a_bare_python_from_the_prepared_wheels(tmp_path: Path) -> None:
    """The GPU node as the check meets it: a python3 with nothing installed (no pip, no
    psutil, no torch: a fresh venv made --without-pip) and .whl/ alone. Install, then
    every step that needs no GPU passes, the others are skipped, exit 0."""
    bare = tmp_path / "python3"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(bare)], check=True,
                   timeout=120)
    probe = subprocess.run([str(bare / "bin/python"), "-c", "import pip"],
                           capture_output=True, timeout=30)
    assert probe.returncode != 0  # truly bare
    _check_installs_and_runs(tmp_path, str(bare / "bin/python"))


def _old_setuptools_pythons() -> list[str]:
    """This machine's pythons whose own site-packages carry a setuptools older than 77
    (Debian 12's 66, pyenv's 65): what many GPU images have."""
    import shutil

    found: list[str] = []
    for py in ("/usr/bin/python3", shutil.which("python3"), sys.executable):
        if not py or not os.path.exists(py) or os.path.realpath(py) in map(
                os.path.realpath, found):
            continue
        p = subprocess.run([py, "-c", "import setuptools; print(setuptools.__version__)"],
                           capture_output=True, text=True, timeout=60)
        if p.returncode == 0 and int(p.stdout.split(".")[0]) < 77:
            found.append(py)
    return found


@NEEDS_WHEELS
@pytest.mark.root
@pytest.mark.slow
def test_gpu_check_installs_on_a_python_with_an_old_setuptools(tmp_path: Path) -> None:
    """A python3 whose site-packages hold setuptools < 77 (which refuses pyproject's PEP
    639 `license = "Apache-2.0"`): the check's venv sees it through its .pth, so the
    install must take the carried setuptools from .whl/, not that one (it failed in
    2 s, before checking anything). Every such python of this machine is tried."""
    pythons = _old_setuptools_pythons()
    if not pythons:
        pytest.skip("no python3 with a setuptools < 77 here")
    for i, py in enumerate(pythons):
        _check_installs_and_runs(tmp_path / str(i), py)


def _check_installs_and_runs(tmp_path: Path, python: str) -> None:
    """scripts/gpu-check.sh with ``python`` as the machine's python3: install from .whl/,
    every step that needs no GPU passes, the others are skipped, exit 0."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items()
           if k not in ("OUT", "TUNERD_SOCKET", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(GPU_CHECK_VENV=str(tmp_path / "venv"), PYTHON=python,
               PIP_CONFIG_FILE=os.devnull, OUT=str(out))
    p = subprocess.run(["sh", str(REPO / "scripts/gpu-check.sh"), "--quick", "--no-bench",
                        "--budget", "150"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "installed tunerd" in p.stdout
    [line] = [x for x in p.stdout.splitlines() if "installed tunerd" in x]
    assert line.count("(") == line.count(")"), line  # "(torch from ...)" closed
    rep = json.loads((out / "gpu-check.json").read_text())
    got = {s["name"]: s["status"] for s in rep["steps"]}
    assert list(got) == STEPS and rep["ok"] is True, got
    assert {n for n, st in got.items() if st == "PASS"} == \
        {"env", "topology", "readings", "doctor"}, got
    for s in rep["steps"]:  # one line each, the skips say why
        assert p.stdout.count(f"[{s['status']}] {s['name']}: ") == 1
    if "no torch in python3" in line:
        assert "no torch" in next(s["detail"] for s in rep["steps"]
                                  if s["name"] == "training")
    r = subprocess.run([str(tmp_path / "venv/bin/tunerctl"), "--version"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.strip()
