"""tunerctl bind stays cheap to start: it runs in job prologs (see bench/bind_latency.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO

PROBE = """
import json as _printer  # loaded first so it does not count (the probe prints with it)
import sys
before = set(sys.modules)
from tunerd.cli.main import main
rc = main(["--socket", "/nonexistent/tunerd.sock", "bind", "1", "--cpus", "0"])
print(__import__("json").dumps({"rc": rc, "new": sorted(set(sys.modules) - before)}))
"""

HEAVY = ("psutil", "rich", "pynvml", "pyudev", "prometheus_client", "torch",
         "dataclasses", "socket", "asyncio", "tunerd.daemon", "tunerd.topology",
         "tunerd.binding", "tunerd.policy")


def test_bind_path_imports_nothing_heavy() -> None:
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["rc"] == 3  # no daemon there: unreachable, after parsing the arguments
    loaded = [m for m in out["new"] if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert loaded == [], loaded
    assert "tunerd.cli.cmd_bind" in out["new"]
