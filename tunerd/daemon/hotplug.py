"""The node's topology re-read when CPUs or memory are hot-added or taken offline.

The daemon reads the topology once at start; a CPU brought online, or memory
hot-added (a VM resized, a DIMM onlined), would otherwise leave placement and
``tunerctl topology`` on the old node until a restart. Kernel uevents of the
``cpu``, ``memory`` and ``node`` subsystems trigger one re-read (a burst of
events, one per memory block, gives one re-read ``SETTLE`` seconds after the
last). A replayed topology (``--topology``) is never re-read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tunerd.topology import load_topology
from tunerd.topology.model import Topology

__all__ = ["TopologyWatch"]

log = logging.getLogger("tunerd.hotplug")

SUBSYSTEMS = ("cpu", "memory", "node")
SETTLE = 0.5  # seconds without a new event before re-reading


def _describe(t: Topology) -> str:
    return f"{len(t.online_cpus())} CPUs online, {len(t.numa_nodes)} NUMA node(s)"


class TopologyWatch:
    name = "hotplug"

    def __init__(self, topology: Topology, on_change: Callable[[Topology], None],
                 replay: bool = False) -> None:
        self.topology = topology
        self.on_change = on_change
        self.replay = replay
        self.rereads = 0
        self._monitor: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Future[None] | None = None

    async def start(self) -> None:
        if self.replay:
            return
        try:
            import pyudev

            mon = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
            for subsystem in SUBSYSTEMS:
                mon.filter_by(subsystem)
            mon.start()
        except Exception as err:  # no netlink permission, no libudev...
            log.warning("topology is not re-read on CPU/memory hotplug: cannot listen to "
                        "kernel uevents: %s", err)
            return
        self._monitor = mon
        asyncio.get_running_loop().add_reader(mon.fileno(), self._on_uevent)

    async def stop(self) -> None:
        if self._monitor is not None:
            asyncio.get_running_loop().remove_reader(self._monitor.fileno())
            self._monitor = None
        if self._timer is not None:
            self._timer.cancel()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"listening": self._monitor is not None, "rereads": self.rereads}
        if self.rereads:  # said in `tunerctl status` only once it happened
            out["summary"] = (f"topology re-read {self.rereads} time(s) after CPU/memory "
                              f"hotplug: {_describe(self.topology)}")
        return out

    def _on_uevent(self) -> None:
        seen = False
        while True:
            try:
                dev = self._monitor.poll(timeout=0)
            except Exception as err:  # ENOBUFS: events lost; re-read to be sure
                log.debug("uevent read failed: %s", err)
                seen = True
                break
            if dev is None:
                break
            log.debug("uevent %s %s %s", dev.action, dev.subsystem, dev.sys_name)
            seen = True
        if seen:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = asyncio.get_running_loop().call_later(SETTLE, self._reread)

    def _reread(self) -> None:
        self._timer = None
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._reread_now())

    async def _reread_now(self) -> None:
        try:
            new = await asyncio.get_running_loop().run_in_executor(None, load_topology, None)
        except Exception as err:
            log.warning("re-reading the topology after a hotplug event failed: %s", err)
            return
        self.rereads += 1
        old, self.topology = self.topology, new
        log.info("topology re-read after a CPU/memory hotplug event: %s (was %s)",
                 _describe(new), _describe(old))
        self.on_change(new)
