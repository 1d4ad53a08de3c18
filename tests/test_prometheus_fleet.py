"""contrib/prometheus/tunerd-fleet.yml: valid, and passing its `promtool test rules` file.

The same rules on a real Prometheus scraping real daemons: tests/test_fleet.py."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.helpers import REPO

RULES_DIR = REPO / "contrib" / "prometheus"
RULES = RULES_DIR / "tunerd-fleet.yml"
ALERTS = {"TunerdNodeDiffersFromItsClass", "TunerdStraggler"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_fleet_rules_are_valid_and_pass_their_promtool_unit_tests() -> None:
    def promtool(*args: str) -> str:
        p = subprocess.run(["promtool", *args], capture_output=True, text=True,
                           cwd=RULES_DIR, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    assert "SUCCESS: 10 rules found" in promtool("check", "rules", RULES.name)
    assert "SUCCESS" in promtool("test", "rules", "tunerd-fleet.test.yml")
    tests = (RULES_DIR / "tunerd-fleet.test.yml").read_text()
    assert set(re.findall(r"^\s+- alert: (\w+)", RULES.read_text(), re.M)) == ALERTS
    for name in ALERTS:  # each alert has a test that expects it to fire
        assert re.search(rf"alertname: {name}\n\s+exp_alerts:\n\s+- exp_labels", tests), name
