"""systemd/tunerd.service passes `systemd-analyze verify` and has what the contract asks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

UNIT = REPO / "systemd" / "tunerd.service"


def _keys() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def test_unit_has_the_required_settings() -> None:
    k = _keys()
    assert k["Type"] == "notify"
    assert k["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert k["RuntimeDirectory"] == "tunerd" and k["StateDirectory"] == "tunerd"
    assert k["WatchdogSec"].endswith("s")
    caps = set(k["CapabilityBoundingSet"].split())
    assert "CAP_SYS_NICE" in caps and "CAP_NET_ADMIN" in caps
    assert "CAP_SYS_MODULE" not in caps and "CAP_SYS_RAWIO" not in caps
    assert k["NoNewPrivileges"] == "yes" and k["ProtectSystem"] == "true"
    assert k["ExecStart"] == "/opt/tunerd/bin/tunerd"  # where scripts/install.sh puts it


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart exists: point it at this test run's tunerd
    exe = Path(sys.executable).parent / "tunerd"
    if not exe.exists():
        exe = Path(shutil.which("tunerd") or sys.executable)
    unit = tmp_path / "tunerd.service"
    unit.write_text(UNIT.read_text().replace("/opt/tunerd/bin/tunerd", str(exe)))
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                       timeout=60)
    problems = [ln for ln in (p.stdout + p.stderr).splitlines() if "tunerd.service" in ln]
    assert p.returncode == 0, p.stdout + p.stderr
    assert not problems, problems
