"""Policies from a ConfigMap: a kubelet-style ``..data`` symlink swap of the policy dir
(real symlinks, real renames) reloads a real daemon within 1 s, with no SIGHUP.

A bad update keeps the old policy and shows the error; an update that changes
nothing makes no host write; SIGTERM reverts nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from inotify_simple import INotify, flags

from tests.helpers import wait_for
from tests.host_helpers import NsDaemonProc

POLICY = """[policy]
name = "{name}"

[nccl]
NCCL_DEBUG = "{debug}"
"""


class ConfigMapDir:
    """A directory laid out as the kubelet lays out a ConfigMap volume."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.gen = 0
        path.mkdir()

    def publish(self, files: dict[str, str]) -> float:
        """Write a new generation and swap ``..data`` to it; returns the swap's time."""
        self.gen += 1
        new = self.path / f"..2026_12_01_00_00_{self.gen:02d}.{os.getpid()}"
        new.mkdir()
        for name, text in files.items():
            (new / name).write_text(text)
        old = os.readlink(self.path / "..data") if (self.path / "..data").is_symlink() else None
        tmp = self.path / "..data_tmp"
        os.symlink(new.name, tmp)
        os.rename(tmp, self.path / "..data")  # the atomic swap
        t = time.monotonic()
        for name in files:  # the visible names: symlinks through ..data, made once
            link = self.path / name
            if not link.is_symlink():
                os.symlink(f"..data/{name}", link)
        for link in self.path.iterdir():
            if link.is_symlink() and link.name != "..data" and link.name not in files:
                link.unlink()
        if old is not None:
            shutil.rmtree(self.path / old)
        return t


@pytest.fixture
def configmap(tmp_path: Path) -> Iterator[tuple[ConfigMapDir, NsDaemonProc]]:
    cm = ConfigMapDir(tmp_path / "policies")
    cm.publish({"50-node.toml": POLICY.format(name="k8s-a", debug="WARN")})
    etc = tmp_path / "etc"
    etc.mkdir()
    d = NsDaemonProc(tmp=tmp_path, policy_dir=cm.path,
                     config={"etc_root": etc, "verify_interval": 600})
    try:
        d.start()
        yield cm, d
    finally:
        d.cleanup()


def _names(d: NsDaemonProc) -> list[str]:
    return list(d.ctl("--json", "status").json()["policy"]["names"])


def test_configmap_swap_reloads_within_1s_bad_update_keeps_old(
        configmap: tuple[ConfigMapDir, NsDaemonProc]) -> None:
    cm, d = configmap
    nccl = d.tmp / "etc" / "nccl.conf"
    wait_for(lambda: "NCCL_DEBUG=WARN" in (nccl.read_text() if nccl.exists() else ""),
             5.0, "the first policy applied")
    r = d.ctl("status")
    assert "policies: k8s-a (files: " in r.out and "50-node.toml" in r.out, r.out

    t0 = cm.publish({"50-node.toml": POLICY.format(name="k8s-b", debug="INFO")})
    wait_for(lambda: "NCCL_DEBUG=INFO" in nccl.read_text(), 1.0,
             "the swapped policy applied within 1 s", detail=d.log)
    took = time.monotonic() - t0
    assert _names(d) == ["k8s-b"]
    print(f"..data swap to policy applied: {took * 1000:.0f} ms")

    # a bad update: rejected, the old policy stays, the error shows (as after SIGHUP)
    cm.publish({"50-node.toml": POLICY.format(name="k8s-c", debug="INFO") + "[nccl\n"})
    wait_for(lambda: d.ctl("--json", "status").json()["policy"]["error"], 1.5,
             "the rejected update shown")
    r = d.ctl("status")
    assert r.rc == 1 and "policy error (old policy kept)" in r.out, r.out
    assert "50-node.toml" in r.out and "k8s-b" in r.out
    assert "NCCL_DEBUG=INFO" in nccl.read_text()

    # fixed again; then a rollout of the same content: no reload, no host write
    cm.publish({"50-node.toml": POLICY.format(name="k8s-b", debug="INFO")})
    wait_for(lambda: not d.ctl("--json", "status").json()["policy"]["error"], 1.5,
             "the fixed update taken")
    ino = INotify()
    ino.add_watch(str(nccl.parent), flags.MODIFY | flags.CREATE | flags.MOVED_TO
                  | flags.DELETE | flags.ATTRIB)
    try:
        before = d.ctl("--json", "status").json()["services"]["policywatch"]
        cm.publish({"50-node.toml": POLICY.format(name="k8s-b", debug="INFO")})
        wait_for(lambda: d.ctl("--json", "status").json()["services"]["policywatch"]
                 ["unchanged_total"] > before["unchanged_total"], 2.0, "the swap seen")
        after = d.ctl("--json", "status").json()["services"]["policywatch"]
        assert after["reloads_total"] == before["reloads_total"]
        assert ino.read(timeout=0) == []  # 0 host writes
    finally:
        ino.close()

    # SIGTERM during a rollout reverts nothing (revert is an operator's command)
    cm.publish({"50-node.toml": POLICY.format(name="k8s-d", debug="TRACE")})
    assert d.stop() == 0
    text = nccl.read_text()
    assert "NCCL_DEBUG=INFO" in text or "NCCL_DEBUG=TRACE" in text, text
    # the original is still saved, for an explicit `tunerctl revert` later
    assert "nccl:NCCL_DEBUG" in (d.state_dir / "state.json").read_text()


def test_sighup_still_reloads_and_a_plain_dir_edit_too(
        configmap: tuple[ConfigMapDir, NsDaemonProc]) -> None:
    cm, d = configmap
    # an editor writing a new file into the dir (no ..data): reloaded too
    (cm.path / "60-extra.toml").write_text(POLICY.format(name="extra", debug="INFO"))
    wait_for(lambda: _names(d) == ["k8s-a", "extra"], 1.5, "the new file in force",
             detail=d.log)
    (cm.path / "60-extra.toml").unlink()
    d.signal(signal.SIGHUP)
    wait_for(lambda: _names(d) == ["k8s-a"], 2.0, "the file removed (SIGHUP or watch)")
    assert any(p.is_dir() for p in cm.path.iterdir())  # untouched ConfigMap layout


def test_missing_dir_is_watched_through_its_parent(tmp_path: Path) -> None:
    """A policy dir that does not exist yet (two levels missing) is picked up within 1 s
    of being made, from inotify events on its nearest existing ancestor, not by trying
    every half second (the watcher in process; the directory and files real)."""
    import asyncio
    from typing import Any

    from tunerd.daemon import policywatch
    from tunerd.daemon.policywatch import PolicyWatch

    target = tmp_path / "etc" / "policies"
    reloads: list[float] = []

    async def reload() -> dict[str, Any]:
        reloads.append(time.monotonic())
        return {}

    async def scenario() -> float:
        w = PolicyWatch(target, reload)
        await w.start()
        try:
            await asyncio.sleep(0.2)
            assert w.status()["watching"] is False and not reloads
            (tmp_path / "etc").mkdir()
            await asyncio.sleep(0.1)
            target.mkdir()
            (target / "50-node.toml").write_text(POLICY.format(name="late", debug="INFO"))
            t0 = time.monotonic()
            while not reloads:
                assert time.monotonic() - t0 < 1.0, "the new dir not seen within 1 s"
                await asyncio.sleep(0.01)
            assert w.status()["watching"] is True
            return reloads[0] - t0
        finally:
            await w.stop()

    assert policywatch.RETRY >= 2.0  # picked up by the events, not by the backstop
    assert asyncio.run(scenario()) < 1.0
