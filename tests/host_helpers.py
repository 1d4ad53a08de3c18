"""Helpers for host-settings tests: network namespaces, veths, a daemon run inside one.

Everything a test changes lives in a namespace it created (deleted in a finally)
or in a temporary /proc, /sys, /etc tree.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import DaemonProc, write_policy

_counter = itertools.count()


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def netns() -> Iterator[str]:
    """A fresh network namespace with a unique name, deleted afterwards."""
    name = f"tunerd-t{os.getpid()}-{next(_counter)}"
    sh("ip", "netns", "add", name)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def add_veth(ns: str, a: str, b: str) -> None:
    sh("ip", "-n", ns, "link", "add", a, "type", "veth", "peer", "name", b)


def ns_link(ns: str, ifname: str) -> dict[str, object]:
    """`ip -n NS -j link show dev IF` (mtu, txqlen, ...)."""
    out = json.loads(sh("ip", "-n", ns, "-j", "-d", "link", "show", "dev", ifname))
    return out[0]


def ns_mtu(ns: str, ifname: str) -> int:
    return int(ns_link(ns, ifname)["mtu"])  # type: ignore[call-overload]


def ns_sysctl(ns: str, name: str) -> str:
    return " ".join(sh("ip", "netns", "exec", ns, "sysctl", "-n", name).split())


def ns_set_sysctl(ns: str, name: str, value: str) -> None:
    sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{name}={value}")


@dataclass
class NsDaemonProc(DaemonProc):
    """The real daemon started with `ip netns exec NS` (ip execs it: the PID is tunerd's).

    The runtime dir is a world-traversable temp dir, so that unprivileged users
    can reach the socket (pytest's tmp_path is under a 0700 directory).
    """

    netns: str | None = None
    config: dict[str, object] = field(default_factory=dict)
    _runtime: Path | None = None

    @property
    def runtime_dir(self) -> Path:
        if self._runtime is None:
            self._runtime = Path(tempfile.mkdtemp(prefix="tunerd-host-run-"))
            os.chmod(self._runtime, 0o755)
        return self._runtime

    @property
    def config_path(self) -> Path:
        return self.tmp / "tunerd.toml"

    def write_config(self) -> None:
        lines = [f"{k} = {json.dumps(str(v) if isinstance(v, Path) else v)}"
                 for k, v in self.config.items()]
        self.config_path.write_text("\n".join(lines) + "\n")

    def argv(self) -> list[str]:
        self.write_config()
        base = [*super().argv(), "--config", str(self.config_path)]
        return ["ip", "netns", "exec", self.netns, *base] if self.netns else base

    def cleanup(self) -> None:
        try:
            self.stop()
        except Exception:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
        if self._runtime is not None:
            shutil.rmtree(self._runtime, ignore_errors=True)


def make_daemon(tmp: Path, policy: str, *, ns: str | None, **config: object) -> NsDaemonProc:
    """A daemon (not started) whose /etc is a temp dir; ``config`` goes to its TOML config."""
    tmp.mkdir(parents=True, exist_ok=True)
    pdir = tmp / "policies"
    write_policy(pdir, "50-host.toml", policy)
    etc = tmp / "etc"
    etc.mkdir(exist_ok=True)
    cfg: dict[str, object] = {"etc_root": etc, "verify_interval": 600}
    cfg.update(config)
    return NsDaemonProc(tmp=tmp, policy_dir=pdir, netns=ns, config=cfg)


def host_fingerprint() -> dict[str, str | None]:
    """A few host values that no host-settings test may change."""
    def read(p: str) -> str | None:
        try:
            return Path(p).read_bytes().decode(errors="replace")
        except OSError:
            return None

    return {
        "somaxconn": read("/proc/sys/net/core/somaxconn"),
        "tcp_rmem": read("/proc/sys/net/ipv4/tcp_rmem"),
        "printk_ratelimit_burst": read("/proc/sys/kernel/printk_ratelimit_burst"),
        "lo_mtu": read("/sys/class/net/lo/mtu"),
        "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "nccl.conf": read("/etc/nccl.conf"),
        "vda_scheduler": read("/sys/block/vda/queue/scheduler"),
        "netns": " ".join(sorted(n for n in os.listdir("/run/netns")
                                 if n.startswith(f"tunerd-t{os.getpid()}-")))
        if os.path.isdir("/run/netns") else "",
    }
