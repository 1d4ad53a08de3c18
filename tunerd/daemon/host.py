"""HostSettings: plan, apply, verify and revert the policy's host settings.

The first-seen original of every setting is written to state.json (section
``host``) *before* the setting is changed, and kept across re-applies and
restarts, so that ``revert`` restores what the node had before tunerd — even
after a ``kill -9``. Drift is corrected by a periodic verify; a NIC or block
device that appears gets its settings from a kernel uevent listener (pyudev
on the kernel netlink group: no udevd needed) integrated with the loop through
``add_reader``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fnmatch
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tunerd.base.errorlog import ErrorLog
from tunerd.base.errors import Failed, TunerdError
from tunerd.policy import Policy
from tunerd.policy.typed import PolicyModel
from tunerd.tuners import SECTIONS, Change, SettingError, Tuner
from tunerd.tuners.base import normalize
from tunerd.tuners.irq import BALANCE_KEY, RewriteLimit

log = logging.getLogger("tunerd.host")

# policy sections that are lists of {match: glob, ...}
_LIST_SECTIONS = {"nic", "block", "irq"}  # devices that may go away
# uevent subsystem -> policy section whose settings are per device
_UEVENT_SECTIONS = {"net": "nic", "block": "block"}


class HostSettings:
    name = "host"

    def __init__(self, tuners: dict[str, Tuner], section: dict[str, Any],
                 save: Callable[[], None], errors: ErrorLog, *, state_path: Path,
                 dry_run: bool = False, verify_interval: float = 60.0,
                 apply_delay: float = 0.0, plan_only: str | None = None) -> None:
        self.tuners = tuners
        section.setdefault("originals", {})
        section.setdefault("applied_once", [])
        self._host_state = section
        self._save = save
        self.errors = errors
        self.state_path = state_path
        # plan_only: why host settings are planned and never written (a topology replay
        # without --apply-host-settings): a dry run of the host settings alone
        self.plan_only = plan_only
        self.dry_run = dry_run or plan_only is not None
        self.sections: dict[str, int] = {}  # section -> settings the policy manages here
        self.verify_interval = verify_interval
        self.apply_delay = apply_delay
        self._policy: Policy | None = None
        self.lock = asyncio.Lock()
        # False after `tunerctl revert` until the next apply or policy reload: drift
        # correction and hotplug must not undo an operator's revert
        self.enforcing = True
        self.last_apply: dict[str, Any] | None = None
        self.last_verify: dict[str, Any] | None = None
        self.failed: dict[str, str | None] = {}  # key -> desired value whose write failed
        self._monitor: Any = None
        self._verify_task: asyncio.Task[None] | None = None
        self._irq_task: asyncio.Task[None] | None = None
        # [irq]: interrupts put back after an outside write (tunerd_irq_reapplied_total),
        # what tunerd last wrote to each, the keys the last check saw, the last rewrite
        self.irq_reapplied = 0
        self._irq_written: dict[str, str] = {}
        self._irq_seen: set[str] = set()
        self.irq_limit = RewriteLimit()  # each interrupt moved at most 4 times per 10 s
        self.irq_last_rewrite: dict[str, Any] | None = None
        self.irq_last_change: dict[str, Any] | None = None  # a new vector, a rank bound
        self._pending: set[asyncio.Task[Any]] = set()

    # -- state --------------------------------------------------------------------
    @property
    def originals(self) -> dict[str, dict[str, Any]]:
        return self._host_state["originals"]

    def _policy_model(self) -> PolicyModel:
        return self._policy.model if self._policy is not None else PolicyModel()

    def _section(self, name: str) -> Any:
        """The typed policy section tuner ``name`` takes (tunerd.policy.typed)."""
        return self._policy_model().section(name)

    def _apply_once_globs(self) -> tuple[str, ...]:
        return self._policy_model().apply_once

    def _is_once(self, key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, g) for g in self._apply_once_globs())

    def _once_done(self, key: str) -> bool:
        return self._is_once(key) and key in self._host_state["applied_once"]

    def _tuner_for(self, key: str) -> Tuner | None:
        return self.tuners.get(key.partition(":")[0])

    # -- plan ---------------------------------------------------------------------
    def plan_all(self, model: PolicyModel | None = None) -> list[Change]:
        """What ``model`` (default: the policy in force) would change on the host now."""
        model = model if model is not None else self._policy_model()
        changes: list[Change] = []
        for section in SECTIONS:
            try:
                changes += self.tuners[section].plan(model.section(section))
            except Exception as err:  # one broken tuner must not hide the others
                log.exception("planning %s failed", section)
                changes.append(Change(f"{section}:*", None, None, available=False,
                                      reason=f"cannot read: {err!r}"))
        return changes

    def plan(self, policy: Policy | None = None) -> dict[str, Any]:
        """The plan of the policy in force, or of a candidate (``plan --policy-dir``)."""
        changes = self.plan_all(policy.model if policy is not None else None)
        return {
            "changes": [c.to_dict() for c in changes if c.needed and not self._once_done(c.key)],
            "unavailable": [c.to_dict() for c in changes if not c.available],
            "in_sync": sorted(c.key for c in changes if c.available and not c.needed),
            "apply_once_skipped": sorted(c.key for c in changes
                                         if c.needed and self._once_done(c.key)),
            "dry_run": self.dry_run,
            **({"plan_only": self.plan_only} if self.plan_only else {}),
        }

    # -- apply --------------------------------------------------------------------
    async def apply(self, reason: str = "apply") -> dict[str, Any]:
        """Apply the whole policy (and revert settings it no longer names)."""
        async with self.lock:
            self.enforcing = True
            self.failed.clear()
            reverted = self._revert_unmentioned()
            result = await self._apply_changes(self.plan_all(), reason)
            result["reverted"] = reverted
            self.last_apply = {"time": time.time(), "reason": reason,
                               "changed": len(result["changed"]), "errors": len(result["errors"])}
            self._reverify()
            return result

    def _reverify(self) -> None:
        """Read the settings back after writing them, so that ``status`` tells the state
        now, not the drift the last periodic verify saw before the apply."""
        changes = self.plan_all()
        drift = [c for c in changes if c.needed and not self._once_done(c.key)]
        self.last_verify = {"time": time.time(), "drift": len(drift)}
        sections: dict[str, int] = {}
        for c in changes:
            if c.available:
                sec = c.key.partition(":")[0]
                sections[sec] = sections.get(sec, 0) + 1
        self.sections = sections

    def writes(self) -> str:
        """Which host settings this daemon writes to this machine, in words."""
        what = ", ".join(f"{k} ({n})" for k, n in sorted(self.sections.items())) or "none"
        if self.plan_only:
            return (f"planned only, nothing written to this machine ({self.plan_only}); "
                    f"would manage: {what}")
        if self.dry_run:
            return f"dry run, nothing written; would manage: {what}"
        return f"written to this machine: {what}"

    async def _apply_changes(self, changes: list[Change], reason: str,
                             retry_failed: bool = True) -> dict[str, Any]:
        todo = [c for c in changes if c.needed and not self._once_done(c.key)
                and (retry_failed or self.failed.get(c.key, "\0") != c.desired)]
        result: dict[str, Any] = {
            "changed": [], "errors": [], "dry_run": self.dry_run,
            **({"plan_only": self.plan_only} if self.plan_only else {}),
            "unavailable": [c.to_dict() for c in changes if not c.available],
            "apply_once_skipped": sorted(c.key for c in changes
                                         if c.needed and self._once_done(c.key)),
        }
        if self.dry_run:
            for c in todo:
                log.info("dry run (%s): would set %s: %s -> %s", reason, c.key, c.current,
                         c.desired)
            result["would_change"] = [c.to_dict() for c in todo]
            return result
        # an apply_once setting already at the policy's value counts as applied: from
        # now on it is the operator's
        once = self._host_state["applied_once"]
        seen = [c.key for c in changes if c.available and not c.needed
                and self._is_once(c.key) and c.key not in once]
        once.extend(seen)
        if not todo:
            if seen:
                self._save_quietly()
            return result
        # save every original first, in one durable write, before the first change
        new_keys = []
        for c in todo:
            if c.key not in self.originals:
                tuner = self._tuner_for(c.key)
                assert tuner is not None
                self.originals[c.key] = tuner.save_original(c)
                new_keys.append(c.key)
        try:
            if new_keys:  # originals already in state.json are durable: no write needed
                self._save()
        except (OSError, TunerdError) as err:
            for k in new_keys:
                self.originals.pop(k, None)
            why = err.message if isinstance(err, TunerdError) else err.strerror
            raise Failed(f"cannot save originals to {self.state_path}: {why}; "
                         "nothing was changed") from err
        dirty = bool(seen)  # state changed after the first save
        delay = self.apply_delay
        for i, c in enumerate(todo):
            if delay and i:
                await asyncio.sleep(delay)
            tuner = self._tuner_for(c.key)
            assert tuner is not None
            try:
                tuner.apply(c)
            except SettingError as err:
                log.error("%s: cannot set %s", reason, err.message)
                result["errors"].append(err.to_error())
                self.failed[c.key] = c.desired
                if c.key in new_keys and self._unchanged(c):  # no original to keep
                    self.originals.pop(c.key, None)
                    dirty = True
                continue
            except Exception as err:  # a tuner bug must not stop the other settings
                log.exception("%s: setting %s failed", reason, c.key)
                result["errors"].append({"key": c.key, "value": c.desired, "errno": None,
                                         "message": f"{c.key}: {err!r}"})
                continue
            self.failed.pop(c.key, None)
            if c.key.startswith("irq:") and c.desired is not None:
                self._irq_written[c.key] = c.desired
            log.info("%s: set %s: %s -> %s", reason, c.key, c.current, c.desired)
            result["changed"].append({"key": c.key, "from": c.current, "to": c.desired})
            if self._is_once(c.key) and c.key not in self._host_state["applied_once"]:
                self._host_state["applied_once"].append(c.key)
                dirty = True
        if dirty:
            self._save_quietly()
        return result

    def _unchanged(self, c: Change) -> bool:
        """Whether a failed write left the setting at its original (a governor written
        on some CPUs before one refused is not)."""
        tuner = self._tuner_for(c.key)
        now = tuner.read([c.key]).get(c.key) if tuner else None
        return normalize(now) == normalize(c.current)

    def _save_quietly(self) -> None:
        try:
            self._save()
        except (OSError, TunerdError) as err:
            why = err.message if isinstance(err, TunerdError) else err.strerror
            self.errors.record("host", f"cannot save {self.state_path}: {why}", key="save")
        else:
            self.errors.resolve("host", "save")

    # -- revert -------------------------------------------------------------------
    def _revert_keys(self, keys: list[str]) -> dict[str, Any]:
        restored: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        if self.dry_run:
            return {"restored": [], "errors": [], "dry_run": True,
                    "would_restore": [{"key": k, "to": self.originals[k].get("value")}
                                      for k in keys]}
        for key in keys:
            saved = self.originals[key]
            tuner = self._tuner_for(key)
            if tuner is None:
                errors.append({"key": key, "value": saved.get("value"), "errno": None,
                               "message": f"{key}: no tuner for this key"})
                continue
            before = tuner.read([key]).get(key)
            try:
                tuner.revert(key, saved)
            except SettingError as err:
                gone = err.errno == errno.ENOENT and key.split(":")[0] in _LIST_SECTIONS
                if not gone:
                    log.error("revert: cannot restore %s", err.message)
                    errors.append(err.to_error())
                    continue
                # the device went away, and its settings with it
                log.info("revert: %s: device is gone, nothing to restore", key)
            log.info("revert: %s: %s -> %s", key, before, saved.get("value"))
            restored.append({"key": key, "from": before, "to": saved.get("value")})
            del self.originals[key]
            once = self._host_state["applied_once"]
            if key in once:
                once.remove(key)
        self._save_quietly()
        return {"restored": restored, "errors": errors, "dry_run": False}

    def _revert_unmentioned(self) -> list[dict[str, Any]]:
        """Revert settings the policy in force no longer names."""
        stale = []
        for key in list(self.originals):
            section = key.partition(":")[0]
            tuner = self.tuners.get(section)
            if tuner is None or not tuner.mentions(key, self._section(section)):
                stale.append(key)
        if not stale:
            return []
        log.info("policy no longer names %s: reverting", ", ".join(stale))
        res = self._revert_keys(stale)
        for e in res["errors"]:
            self.errors.record("host", f"revert: {e['message']}", key=e.get("key"))
        return res["restored"]

    async def revert(self) -> dict[str, Any]:
        """Restore every saved original; stop enforcing until the next apply or reload.

        A revert with nothing to restore changes nothing, so enforcing stays as it was:
        it must not quietly switch off drift correction and hotplug.
        """
        async with self.lock:
            keys = list(self.originals)
            if keys:
                self.enforcing = False
            return self._revert_keys(keys)

    # -- verify -------------------------------------------------------------------
    def verify(self) -> dict[str, Any]:
        changes = self.plan_all()
        drift = [c for c in changes if c.needed and not self._once_done(c.key)]
        self.last_verify = {"time": time.time(), "drift": len(drift)}
        return {
            "drift": [c.to_dict() for c in drift],
            "checked": sum(1 for c in changes if c.available),
            "unavailable": [c.to_dict() for c in changes if not c.available],
            "apply_once_skipped": sorted(c.key for c in changes
                                         if c.needed and self._once_done(c.key)),
            "enforcing": self.enforcing,
        }

    async def correct_drift(self) -> dict[str, Any]:
        """Periodic verify: re-apply each drifted setting (never apply_once ones)."""
        async with self.lock:
            changes = self.plan_all()
            drift = [c for c in changes if c.needed and not self._once_done(c.key)]
            self.last_verify = {"time": time.time(), "drift": len(drift)}
            if not self.enforcing or not drift:
                return {"changed": [], "errors": []}
            for c in drift:
                if self.failed.get(c.key, "\0") != c.desired:
                    log.warning("drift: %s is %s, policy wants %s; re-applying", c.key,
                                c.current, c.desired)
            result = await self._apply_changes(drift, "drift", retry_failed=False)
            if result["changed"]:
                self._reverify()
            return result

    # -- [irq]: kept in place ------------------------------------------------------
    def _irq_interval(self) -> float:
        return self._policy_model().irq.check_interval_ms / 1000.0

    async def correct_irq(self) -> dict[str, Any]:
        """The quick check of the managed interrupts only (every ``check_interval_ms``):
        an interrupt moved off its CPUs (irqbalance, a driver reload, a link coming up),
        a new MSI-X vector, or a rank bound on its CPUs since: put where the policy wants."""
        section = self._policy_model().irq
        tuner = self.tuners.get("irq")
        if tuner is None or not section.devices:
            return {"changed": [], "errors": []}
        async with self.lock:
            changes = tuner.plan(section)
            seen, before = {c.key for c in changes}, self._irq_seen
            self._irq_seen = seen
            drift = [c for c in changes if c.needed and not self._once_done(c.key)]
            if not self.enforcing or not drift:
                return {"changed": [], "errors": []}
            drift = self._irq_limited(drift, seen)
            if not drift:
                return {"changed": [], "errors": []}
            rewritten = [c for c in drift if c.key in self._irq_written
                         and c.current != self._irq_written[c.key]]
            if rewritten:
                writer = self._irq_writer()
                for c in rewritten:
                    log.warning("irq: %s was moved to CPUs %s (%s); putting it back on %s",
                                c.key, c.current, writer, c.desired)
                self.irq_last_rewrite = {"time": time.time(), "keys": [c.key for c in rewritten],
                                         "likely_writer": writer}
            new = [c.key for c in drift if c.key not in before and before]
            if new:
                log.info("irq: new interrupt(s) %s: placing them", ", ".join(new))
                self.irq_last_change = {
                    "time": time.time(), "keys": new,
                    "why": "new interrupt vector(s) (a driver reload, a link coming up, "
                           "more queues)"}
            moved = [c.key for c in drift if c not in rewritten and c.key in before
                     and c.key in self._irq_written]
            if moved:
                log.info("irq: %s: their CPUs changed (a process bound or unbound, "
                         "housekeeping changed); moving them", ", ".join(moved))
                self.irq_last_change = {
                    "time": time.time(), "keys": moved,
                    "why": "the CPUs they may use changed (a process bound on them)"}
            result = await self._apply_changes(drift, "irq", retry_failed=False)
            done = {x["key"] for x in result["changed"]}
            self.irq_reapplied += sum(1 for c in rewritten if c.key in done)
            return result

    def _irq_limited(self, drift: list[Change], seen: set[str]) -> list[Change]:
        """``drift`` within the rewrite rate limit (the rest waits: it stays drift)."""
        self.irq_limit.forget(seen)
        before = self.irq_limit.held_back
        allowed = [c for c in drift if c.key == BALANCE_KEY or self.irq_limit.allow(c.key)]
        now = self.irq_limit.held_back
        if now > before and (before == 0 or now // 100 > before // 100):  # a few lines
            log.warning("irq: %s moved more than %d times in %.0f s: held back (%d so far)",
                        ", ".join(c.key for c in drift if c not in allowed),
                        self.irq_limit.per_window, self.irq_limit.window,
                        self.irq_limit.held_back)
        return allowed

    def _irq_writer(self) -> str:
        """Who most likely moved a managed interrupt (read only when one was moved)."""
        from tunerd.adapters import procfs

        proc = Path(getattr(self.tuners.get("irq"), "proc", "/proc"))
        pids = []
        try:
            for d in proc.iterdir():
                if d.name.isdigit() and procfs.read_value(d / "comm") == "irqbalance":
                    pids.append(d.name)
        except OSError:
            pass
        if pids:
            return (f"irqbalance is running (pid {', '.join(pids)}); "
                    + ("its --banirq list names them once it restarts"
                       if self._policy_model().irq.irqbalance == "ban"
                       else "[irq] irqbalance = \"leave\": it will keep moving them"))
        return ("no irqbalance running: a driver reload, a link coming up or a manual write "
                "(echo > /proc/irq/N/smp_affinity)")

    async def _irq_loop(self) -> None:
        while True:
            await asyncio.sleep(self._irq_interval())
            try:
                await self.correct_irq()
            except Exception as err:
                log.exception("irq check failed")
                self.errors.record("host", f"irq check failed: {err!r}", key="irq-check")

    async def _verify_loop(self) -> None:
        while True:
            await asyncio.sleep(self.verify_interval)
            try:
                await self.correct_drift()
            except Exception as err:
                log.exception("periodic verify failed")
                self.errors.record("host", f"periodic verify failed: {err!r}", key="verify")

    # -- hotplug ------------------------------------------------------------------
    def _start_uevents(self) -> None:
        try:
            import pyudev

            mon = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
            for subsystem in _UEVENT_SECTIONS:
                mon.filter_by(subsystem)
            try:
                # a burst of hotplug events (50 veths at once) must not overflow the socket
                mon.set_receive_buffer_size(8 << 20)
            except Exception as err:
                log.debug("uevent socket keeps its default buffer: %s", err)
            mon.start()
        except Exception as err:  # no netlink permission, no libudev...
            log.warning("no hotplug re-apply: cannot listen to kernel uevents: %s", err)
            return
        self._monitor = mon
        asyncio.get_running_loop().add_reader(mon.fileno(), self._on_uevent)
        log.debug("listening to kernel uevents for %s", ", ".join(_UEVENT_SECTIONS))

    def _on_uevent(self) -> None:
        while True:
            try:
                dev = self._monitor.poll(timeout=0)
            except Exception as err:
                # ENOBUFS after a burst: events were dropped, so a device that appeared
                # may be unseen. Check every setting once instead of waiting for the
                # periodic verify; the next events still come.
                log.warning("uevent read failed (%s); checking every setting now", err)
                task = asyncio.ensure_future(self.correct_drift())
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
                return
            if dev is None:
                return
            section = _UEVENT_SECTIONS.get(dev.subsystem or "")
            if section is None or dev.action not in ("add", "move", "change", "online"):
                continue
            if section == "block" and dev.device_type != "disk":
                continue  # partitions have no queue of their own
            task = asyncio.ensure_future(self.apply_device(section, dev.sys_name, dev.action))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def apply_device(self, section: str, name: str, why: str = "add") -> dict[str, Any]:
        """Apply the policy's settings for one NIC or block device."""
        if not self.enforcing:
            return {"changed": [], "errors": []}
        tuner: Any = self.tuners[section]
        async with self.lock:
            changes = tuner.plan_device(self._section(section), name)
            if not any(c.needed for c in changes):
                return {"changed": [], "errors": []}
            return await self._apply_changes(changes, f"uevent {why} {name}")

    # -- service ------------------------------------------------------------------
    async def start(self) -> None:
        self._start_uevents()
        self._verify_task = asyncio.ensure_future(self._verify_loop())
        self._irq_task = asyncio.ensure_future(self._irq_loop())

    async def policy_changed(self, policy: Policy) -> None:
        self._policy = policy
        result = await self.apply("policy")
        failed = {str(e.get("key")) for e in result["errors"]}
        for e in result["errors"]:
            self.errors.record("host", f"apply: {e['message']}", key=e.get("key"))
        for c in result["changed"]:
            if c["key"] not in failed:
                self.errors.resolve("host", c["key"])

    async def stop(self) -> None:
        if self._verify_task is not None:
            self._verify_task.cancel()
        if self._irq_task is not None:
            self._irq_task.cancel()
        if self._monitor is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._monitor.fileno())
        for t in list(self._pending):
            t.cancel()

    def status(self) -> dict[str, Any]:
        v = self.last_verify
        drift = "not verified yet" if v is None else (
            "no drift" if not v["drift"] else f"{v['drift']} drifted")
        mode = "enforcing" if self.enforcing else "reverted (not enforcing until apply)"
        irq = ""
        if self._policy_model().irq.devices:
            st = self.irq_status()
            irq = (f"; irq: {st['managed']} managed, {st['reapplied_total']} put back"
                   + (f", not placed: {'; '.join(st['not_placed'].values())}"
                      if st["not_placed"] else ""))
        return {
            "summary": f"{self.writes()}; {len(self.originals)} setting(s) changed from "
                       f"their originals; {drift}; {mode}"
                       + (" (dry run)" if self.dry_run and not self.plan_only else "") + irq,
            "writes": {"written": not self.dry_run, "sections": dict(self.sections),
                       "plan_only": self.plan_only},
            "originals": len(self.originals),
            "enforcing": self.enforcing,
            "last_apply": self.last_apply,
            "last_verify": self.last_verify,
            "hotplug": self._monitor is not None,
            **({"irq": self.irq_status()} if self._policy_model().irq.devices else {}),
        }

    def irq_status(self) -> dict[str, Any]:
        tuner: Any = self.tuners.get("irq")
        stuck = dict(getattr(tuner, "stuck", {}) or {})
        managed = sorted(k for k in self._irq_seen if k.count(":") == 2
                         and k.split(":")[2].isdigit())
        return {"managed": len(managed), "reapplied_total": self.irq_reapplied,
                "rate_limited_total": self.irq_limit.held_back,
                "last_rewrite": self.irq_last_rewrite, "last_change": self.irq_last_change,
                "not_placed": stuck,
                "irqbalance": self._policy_model().irq.irqbalance}
