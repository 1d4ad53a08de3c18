"""The Daemon: the loop's lifecycle (start, reload, stop) around services built elsewhere.

It owns no feature: the composition root (``tunerd.daemon.wiring``) builds every
service with only what that service needs and hands the Daemon the list, the
control server, the policy holder and the callbacks that take a new policy.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from tunerd import __version__
from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import PolicyError, TunerdError
from tunerd.daemon.cmd_core import policy_error_public
from tunerd.daemon.notify import Notifier
from tunerd.daemon.policyholder import PolicyHolder
from tunerd.daemon.runtime import PidLock, remove_pidfile, write_pidfile
from tunerd.daemon.server import ControlServer
from tunerd.policy import Policy
from tunerd.wire.protocol import exit_code

__all__ = ["Daemon", "Service"]

log = logging.getLogger("tunerd")

STOP_TIMEOUT = 0.4  # seconds each service gets to stop (SIGTERM must end us within 0.5 s)


class Service(Protocol):
    """A long-running part of the daemon (tuners, watchers, monitor...)."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


PolicyListener = Callable[[Policy], Awaitable[None]]


class Daemon:
    def __init__(self, *, server: ControlServer, services: list[Service],
                 policy: PolicyHolder, errors: ErrorLog, notifier: Notifier,
                 on_policy: list[tuple[str, PolicyListener]], dry_run: bool,
                 replay: Path | None, pidfile: Path | None = None,
                 pidlock: PidLock | None = None) -> None:
        self.server = server
        self.services = services
        # refuses a valid policy on every reload (config reload_rebinds_running = false)
        self.reload_guard: Callable[[Policy], str | None] | None = None
        self.policy = policy
        self.errors = errors
        self.notifier = notifier
        self.on_policy = on_policy
        self.dry_run = dry_run
        self.replay = replay
        self.pidfile = pidfile
        self.pidlock = pidlock  # held since before the socket was touched (wiring)
        self.started_at = time.time()
        self._stop = asyncio.Event()
        self._reloading = asyncio.Lock()

    # -- policy --------------------------------------------------------------------
    async def reload(self, guard: Callable[[Policy], str | None] | None = None,
                     staged: Path | None = None) -> dict[str, Any]:
        """Load policies again; a bad policy is rejected and the old one stays.

        ``guard`` may refuse a valid policy (``reload --no-rebind-running``): it returns
        why, and the old policy stays, as for a bad one, without counting as an error.
        ``staged`` (``reload --policy-dir DIR``): that directory is read and checked
        instead, and only when it is accepted are its files installed into the policy
        dir and put in force, under the reload lock (the watcher's reload waits).
        """
        guard = guard if guard is not None else self.reload_guard
        loop = asyncio.get_running_loop()
        async with self._reloading:
            self.notifier.reloading()
            try:
                # reading the directory is quick, but must never hold the loop
                new = await loop.run_in_executor(
                    None, self.policy.load if staged is None else
                    functools.partial(self.policy.load_staged, staged))
            except PolicyError as err:
                self.notifier.send("READY=1")
                if staged is not None:  # nothing installed: the policy dir is as it was
                    return {"reloaded": False, "error": err.message, **self._in_force(),
                            "staged": str(staged), "installed": False}
                self.policy.error = err.message
                self.errors.record("reload", f"policy rejected, keeping the previous one: "
                                   f"{err.message}")
                # STATUS= is shown to every user (systemctl status): the paths, never a
                # policy file's text (root reads it whole in `tunerctl status`)
                self.notifier.status(f"policy error (previous policy in force): "
                                     f"{policy_error_public(err.message)}"[:200])
                return {"reloaded": False, "error": err.message, **self._in_force()}
            refused = guard(new) if guard is not None else None
            if refused is not None:
                log.warning("reload refused: %s", refused)
                if staged is None:
                    self.errors.record("reload", f"reload refused, keeping the previous "
                                       f"policy: {refused}", level="warning")
                self.notifier.send("READY=1")
                extra = {"staged": str(staged), "installed": False} if staged else {}
                return {"reloaded": False, "error": refused, "refused": True,
                        **self._in_force(), **extra}
            installed: list[str] | None = None
            if staged is not None:
                installed = await loop.run_in_executor(None, self.policy.install, staged)
                log.info("installed %s from %s into %s", ", ".join(installed) or "no file",
                         staged, self.policy.policy_dir)
                new = await loop.run_in_executor(None, self.policy.load)
            self.policy.put(new)
            self.errors.resolve("reload")
            log.info("policies reloaded: %s", self.policy.summary())
            self._warn_policy(new)
            await self._policy_changed(new)
            self.notifier.send("READY=1", f"STATUS={self.summary()}")
            out: dict[str, Any] = {"reloaded": True, "error": None, "in_force": new.sources,
                                   "warnings": list(new.warnings)}
            if installed is not None:
                out.update(staged=str(staged), installed=installed)
            return out

    def _in_force(self) -> dict[str, Any]:
        """What stays in force after a refused reload: its files and when it was loaded."""
        return {"in_force": self.policy.policy.sources if self.policy.policy else [],
                "in_force_since": self.policy.loaded_at}

    def _warn_policy(self, policy: Policy) -> None:
        warnings = list(policy.warnings)
        self.errors.resolve_source("policy")
        for i, w in enumerate(warnings):
            self.errors.record("policy", w, key=i, level="warning")

    async def _policy_changed(self, policy: Policy) -> None:
        for name, listener in self.on_policy:
            try:
                await listener(policy)
            except Exception as err:
                log.exception("service %s failed to take the new policy", name)
                self.errors.record(name, f"policy change failed: {err!r}", key="policy")
            else:
                self.errors.resolve(name, "policy")

    def summary(self) -> str:
        n = len(self.policy.policy.sources) if self.policy.policy else 0
        return f"serving; {n} policy file(s) in force"

    # -- lifecycle -----------------------------------------------------------------
    def request_stop(self) -> None:
        self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        assert self.policy.policy is not None, "the composition root loads the policy"
        log.info("policies in force: %s", self.policy.summary())
        self._warn_policy(self.policy.policy)
        loop.add_signal_handler(signal.SIGTERM, self.request_stop)
        loop.add_signal_handler(signal.SIGINT, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        started: list[Service] = []
        try:
            await self.server.start()
            for svc in self.services:
                await svc.start()
                started.append(svc)
            await self._policy_changed(self.policy.policy)
            self._write_pidfile()
            # Everything built so far (topology, indexes, policy) lives as long as the
            # daemon: move it out of the cyclic GC's reach, so that a full collection
            # walks only what changes (a pause on the loop delays exec events)
            gc.collect()
            gc.freeze()
            self.notifier.ready(self.summary())
            log.info("tunerd %s ready (pid %d)", __version__, os.getpid())
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
                    await asyncio.wait_for(svc.stop(), STOP_TIMEOUT)
                except asyncio.TimeoutError:
                    log.warning("service %s did not stop within %.1f s", svc.name,
                                STOP_TIMEOUT)
                except Exception:
                    log.exception("service %s failed to stop", svc.name)
            self._remove_pidfile()
        return 0

    def _write_pidfile(self) -> None:
        if self.pidfile is None or self.pidlock is not None:  # the lock wrote it
            return
        try:
            write_pidfile(self.pidfile)
        except OSError as err:
            self.errors.record("daemon", f"cannot write {self.pidfile}: {err.strerror}",
                               key="pidfile")

    def _remove_pidfile(self) -> None:
        if self.pidlock is not None:
            self.pidlock.release()
            return
        if self.pidfile is None:
            return
        remove_pidfile(self.pidfile)

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
            try:
                svc[s.name] = s.status()
            except Exception as err:  # one broken status must not hide the others
                svc[s.name] = {"summary": f"status failed: {err!r}"}
        errs = self.errors.to_json()
        pol = self.policy.policy
        return {
            "pid": os.getpid(),
            "version": __version__,
            "uptime_s": round(time.time() - self.started_at, 1),
            "dry_run": self.dry_run,
            "replay": str(self.replay) if self.replay is not None else None,
            "policy": {
                "sources": pol.sources if pol else [],
                "names": list(pol.model.info.names) if pol else [],
                "summary": self.policy.summary(),
                "loaded_at": self.policy.loaded_at,
                "error": self.policy.error,
                "warnings": list(pol.warnings) if pol else [],
            },
            "healthy": errs["errors"] == 0 and self.policy.error is None,
            "errors": [p for p in errs["open"] if p["level"] == "error"],
            "warnings": [p for p in errs["open"] if p["level"] == "warning"],
            "resolved_errors": errs["resolved"],
            "errors_total": errs["total"],
            "services": svc,
        }
