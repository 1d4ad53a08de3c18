"""The daemon re-reads the topology on a CPU/memory hotplug uevent (issue 19, item 5).

CPUs are not really taken offline on this shared machine: a synthetic ``change``
uevent for cpu0 (written to its sysfs ``uevent`` file, which changes no setting) is
the same kernel event path the daemon listens to."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import DaemonProc, wait_for

pytestmark = pytest.mark.root

UEVENT = Path("/sys/devices/system/cpu/cpu0/uevent")


def test_cpu_uevent_rereads_the_topology(daemon_factory) -> None:
    d: DaemonProc = daemon_factory().start()
    wait_for(lambda: d.ctl("--json", "status").json()["services"]["hotplug"]["listening"], 10,
             "the daemon's services to start")
    try:
        UEVENT.write_text("change")
    except OSError as err:
        pytest.skip(f"cannot emit a synthetic uevent here: {err}")
    wait_for(lambda: "topology re-read after a CPU/memory hotplug event" in d.log(), 10,
             "the topology to be re-read", detail=d.log)
    topo = d.ctl("--json", "topology")
    assert topo.rc == 0 and topo.json()["cpus"], topo
    assert "hotplug: topology re-read " in d.ctl("status").out  # once, or more if the host
    # had CPU/memory events of its own meanwhile
