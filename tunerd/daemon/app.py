"""The Daemon: owns the loop, the state store, the policy in force and the services."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import time
from typing import Any, Protocol

from tunerd.daemon.config import DaemonConfig
from tunerd.daemon.notify import Notifier
from tunerd.daemon.registry import HANDLER_MODULES
from tunerd.daemon.server import ControlServer
from tunerd.daemon.state import DurableStore, RuntimeStore, SplitState
from tunerd.errors import TunerdError
from tunerd.policy import NodeFacts, Policy, PolicyError, load_policy_dir
from tunerd.protocol import exit_code
from tunerd.safefs import prepare_dir

log = logging.getLogger("tunerd")


class Service(Protocol):
    """A long-running part of the daemon (tuners, watchers, monitor...)."""

    name: str

    async def start(self) -> None: ...

    async def policy_changed(self) -> None:
        """Called on the loop after a new policy was put in force (start and reload)."""

    async def stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


# "module:Class" of each service; each class is built as Class(daemon)
SERVICE_FACTORIES: list[str] = [
    # -- binding:
    "tunerd.daemon.jobs:JobRegistry",
    # -- host settings:
    "tunerd.daemon.host:HostSettings",
    # -- leases / exec watcher:
    "tunerd.daemon.leases:LeaseService",
    # -- monitor:
    "tunerd.monitor.service:Monitor",
]


class Daemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        durable = DurableStore(cfg.state_path)
        self.state = SplitState(RuntimeStore(cfg.runtime_dir / "state.json", legacy=durable),
                                durable)
        self.notifier = Notifier.from_env()
        self.policy: Policy | None = None
        self.policy_error: str | None = None
        self.policy_loaded_at: float | None = None
        self.started_at = time.time()
        self.services: list[Service] = []
        self.server = ControlServer(
            self, cfg.socket_path, idle_timeout=cfg.client_timeout,
            max_connections_per_user=cfg.max_connections_per_user)
        self.errors: list[dict[str, Any]] = []  # recent errors shown by `tunerctl status`
        self._stop = asyncio.Event()
        self._topology: Any = None
        # feature areas attach themselves here when their service is built
        self.jobs: Any = None  # tunerd.daemon.jobs.JobRegistry (bindings)
        self.host: Any = None  # host settings service (plan/apply/verify/revert)
        self.leases: Any = None  # leases / exec watcher service
        self.monitor: Any = None  # samplers and metrics service

    # -- topology and policy -------------------------------------------------
    @property
    def topology(self) -> Any:
        if self._topology is None:
            from tunerd.topology import load_topology

            self._topology = load_topology(self.cfg.topology)
        return self._topology

    def node_facts(self) -> NodeFacts:
        topo = self.topology
        return NodeFacts(
            hostname=topo.hostname, gpu_models=tuple(g.model for g in topo.gpus)
        )

    def load_policy(self) -> Policy:
        return load_policy_dir(self.cfg.policy_dir, self.node_facts())

    def record_error(self, source: str, message: str) -> None:
        log.error("%s: %s", source, message)
        self.errors.append({"time": time.time(), "source": source, "message": message})
        del self.errors[:-50]

    async def reload(self) -> bool:
        """Load policies again; a bad policy is rejected and the old one stays."""
        self.notifier.reloading()
        try:
            new = self.load_policy()
        except PolicyError as err:
            self.policy_error = err.message
            self.record_error("reload", f"policy rejected, keeping the previous one: {err}")
            self.notifier.status(f"policy error: {err.message}"[:200])
            self.notifier.send("READY=1")
            return False
        self.policy, self.policy_error = new, None
        self.policy_loaded_at = time.time()
        log.info("policies reloaded: %s", ", ".join(new.sources))
        await self._policy_changed()
        self.notifier.send("READY=1", f"STATUS={self.summary()}")
        return True

    async def _policy_changed(self) -> None:
        for svc in self.services:
            try:
                await svc.policy_changed()
            except Exception as err:
                log.exception("service %s failed to take the new policy", svc.name)
                self.record_error(svc.name, f"policy change failed: {err!r}")

    def summary(self) -> str:
        n = len(self.policy.sources) if self.policy else 0
        return f"serving; {n} policy file(s) in force"

    # -- lifecycle -----------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        try:  # owned by root (or by us, unprivileged), writable by nobody else
            prepare_dir(self.cfg.runtime_dir, 0o755, "runtime dir")
            prepare_dir(self.cfg.state_dir, 0o700, "state dir")
        except TunerdError as err:
            log.error("cannot start: %s", err.message)
            return 1
        try:
            self.state.load()
        except TunerdError as err:  # damaged originals and no usable backup
            log.error("cannot start: %s", err.message)
            return 1
        if self.state.load_error:
            self.record_error("state", self.state.load_error)
        try:
            self.policy = self.load_policy()
        except PolicyError as err:
            log.error("cannot start: %s", err.message)
            return 1
        self.policy_loaded_at = time.time()
        log.info("policies in force: %s", ", ".join(self.policy.sources))

        for mod in HANDLER_MODULES:
            importlib.import_module(mod)
        for spec in SERVICE_FACTORIES:
            mod_name, _, cls_name = spec.partition(":")
            cls = getattr(importlib.import_module(mod_name), cls_name)
            self.services.append(cls(self))

        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))

        try:
            await self.server.start()
        except TunerdError as err:
            log.error("cannot start: %s", err.message)
            return 1
        started: list[Service] = []
        try:
            for svc in self.services:
                await svc.start()
                started.append(svc)
            await self._policy_changed()
            self.notifier.ready(self.summary())
            log.info("tunerd ready (pid %d)", os.getpid())
            watchdog = self._start_watchdog()
            await self._stop.wait()
            if watchdog:
                watchdog.cancel()
        except TunerdError as err:
            log.error("fatal: %s", err.message)
            return int(exit_code(err))
        finally:
            self.notifier.stopping()
            log.info("stopping")
            await self.server.stop()
            for svc in reversed(started):
                try:
                    await svc.stop()
                except Exception:
                    log.exception("service %s failed to stop", svc.name)
        return 0

    def _start_watchdog(self) -> asyncio.Task[None] | None:
        interval = self.notifier.watchdog_interval()
        if interval is None:
            return None

        async def beat() -> None:
            while True:
                self.notifier.watchdog()
                await asyncio.sleep(interval)

        return asyncio.ensure_future(beat())

    def status(self) -> dict[str, Any]:
        svc: dict[str, Any] = {}
        for s in self.services:
            with contextlib.suppress(Exception):
                svc[s.name] = s.status()
        return {
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "dry_run": self.cfg.dry_run,
            "replay": self.cfg.topology is not None,
            "policy": {
                "sources": self.policy.sources if self.policy else [],
                "loaded_at": self.policy_loaded_at,
                "error": self.policy_error,
            },
            "errors": self.errors[-10:],
            "services": svc,
        }
