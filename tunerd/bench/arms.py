"""What an arm of a benchmark is, and how it is run.

An arm is a placement plus training settings::

    placement=tunerd                    # through `tunerctl run` (the daemon places it)
    placement=unbound,amp=off           # as is, autocast off
    num_workers=4,pin_memory=true,compile=on

Placement is one of ``unbound`` (the command as is), ``tunerd`` (``tunerctl run``
with the bench's --gpus/--ncpus/--cpus) and ``exclusive`` (the same, exclusive; with
--noisy the hog is moved off the arm's CPUs). The training settings reach the command
through the environment overrides of ``tunerd.torch`` (``TUNERD_NUM_WORKERS`` ...):
the built-in workload uses those helpers; a user's script does if it calls them, and
bench says so when it does not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from tunerd.adapters import isolated
from tunerd.base.errors import UsageError
from tunerd.torch.settings import ENV, parse_setting

__all__ = ["PLACEMENTS", "ArmSpec", "Interpreter", "PlacementRequest", "parse_arm", "probe"]

PLACEMENTS = ("unbound", "tunerd", "exclusive")
# [[job]] placement mode a bench placement corresponds to
RULE_PLACEMENT = {"unbound": "none", "tunerd": "gpu-local", "exclusive": "exclusive"}


@dataclass(frozen=True)
class ArmSpec:
    placement: str = "unbound"
    settings: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        parts = [f"placement={self.placement}"]
        parts += [f"{k}={_fmt(v)}" for k, v in sorted(self.settings.items())]
        return ", ".join(parts)

    def env(self) -> dict[str, str]:
        return {ENV[k]: _fmt(v) for k, v in self.settings.items()}

    def with_setting(self, key: str, value: Any) -> ArmSpec:
        if key == "placement":
            return ArmSpec(str(value), dict(self.settings))
        return ArmSpec(self.placement, {**self.settings, key: value})

    def to_dict(self) -> dict[str, Any]:
        return {"placement": self.placement, "settings": dict(self.settings),
                "describe": self.describe()}


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def parse_arm(text: str, option: str) -> ArmSpec:
    """``placement=tunerd,amp=off`` -> ArmSpec; UsageError names the option and the part."""
    placement = "unbound"
    settings: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep:
            raise UsageError(f"{option} {text!r}: expected KEY=VALUE, got {part!r}")
        if key == "placement":
            if raw.strip() not in PLACEMENTS:
                raise UsageError(f"{option} {text!r}: placement must be one of "
                                 f"{', '.join(PLACEMENTS)}, got {raw!r}")
            placement = raw.strip()
        elif key in ENV:
            try:
                settings[key] = parse_setting(key, raw, f"{option} {text!r}")
            except ValueError as err:
                raise UsageError(str(err)) from None
        else:
            raise UsageError(f"{option} {text!r}: unknown key {key!r} (known: placement, "
                             f"{', '.join(ENV)})")
    return ArmSpec(placement, settings)


@dataclass(frozen=True)
class PlacementRequest:
    """What a ``tunerd``/``exclusive`` arm asks ``tunerctl run`` for."""

    gpus: int | None = None
    ncpus: int | None = None
    cpus: str | None = None  # a cpulist

    def describe(self) -> str:
        parts = []
        if self.gpus is not None:
            parts.append(f"--gpus {self.gpus}")
        if self.ncpus is not None:
            parts.append(f"--ncpus {self.ncpus}")
        if self.cpus is not None:
            parts.append(f"--cpus {self.cpus}")
        return " ".join(parts) or "the daemon's default share"


def tunerctl_prefix(spec: ArmSpec, req: PlacementRequest, socket_path: str | None,
                    hog_pid: int | None) -> list[str]:
    """The ``tunerctl run ... --`` words an arm's command is prefixed with ([] if none)."""
    if spec.placement == "unbound":
        return []
    argv = isolated.python_argv(sys.executable, "-m", "tunerd.cli.main")
    if socket_path:
        argv += ["--socket", socket_path]
    argv.append("run")
    if req.gpus is not None:
        argv += ["--gpus", str(req.gpus)]
    if req.ncpus is not None:
        argv += ["--ncpus", str(req.ncpus)]
    if req.cpus is not None:
        argv += ["--cpus", req.cpus]
    if spec.placement == "exclusive":
        argv.append("--exclusive")
        if hog_pid is not None:
            argv += ["--exclusive-scope", f"pid:{hog_pid}"]
    return [*argv, "--"]


@dataclass(frozen=True)
class Interpreter:
    path: str
    executable: str
    version: str
    torch: str | None  # torch's version, None if it cannot import torch
    how: str = ""  # how it was chosen: "--python", "python3 on PATH", "tunerctl's own" ...

    def describe(self) -> str:
        torch = f"torch {self.torch}" if self.torch else "no torch"
        how = f", {self.how}" if self.how else ""
        return f"{self.executable} (Python {self.version}, {torch}{how})"

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "executable": self.executable, "version": self.version,
                "torch": self.torch, "how": self.how}


_PROBE = """
import importlib.util, json, sys
spec = importlib.util.find_spec("torch")
version = None
if spec is not None:
    try:
        import importlib.metadata as md
        version = md.version("torch")
    except Exception:
        version = "unknown version"
print(json.dumps({"executable": sys.executable, "version": sys.version.split()[0],
                  "torch": version}))
"""


def probe(python: str, timeout: float = 30.0) -> Interpreter:
    """Which Python ``python`` is and whether it has torch (without importing torch)."""
    try:
        p = subprocess.run(isolated.python_argv(python, "-c", _PROBE), capture_output=True,
                           text=True, timeout=timeout, cwd=isolated.CWD,
                           env=isolated.scrubbed())
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UsageError(f"--python {python}: cannot run it: {err}") from None
    if p.returncode != 0:
        tail = p.stderr.strip().splitlines()[-1:] or ["no output"]
        raise UsageError(f"--python {python}: exited with {p.returncode}: {tail[0]}")
    try:
        d = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise UsageError(f"--python {python}: is this a Python interpreter? It printed "
                         f"{p.stdout[:200]!r}") from None
    return Interpreter(python, str(d["executable"]), str(d["version"]), d.get("torch"))
