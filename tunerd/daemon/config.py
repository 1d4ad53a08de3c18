"""Daemon configuration: /etc/tunerd/tunerd.toml (optional) overridden by flags."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tunerd.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG = Path("/etc/tunerd/tunerd.toml")


@dataclass
class DaemonConfig:
    policy_dir: Path = Path("/etc/tunerd/policies")
    runtime_dir: Path = Path("/run/tunerd")
    state_dir: Path = Path("/var/lib/tunerd")
    topology: Path | None = None
    metrics_listen: str = "127.0.0.1:9464"
    dry_run: bool = False
    log_level: str = "info"
    verify_interval: float = 60.0  # seconds between periodic verify/re-apply
    sample_interval: float = 1.0  # seconds between monitor samples
    history_seconds: float = 3600.0  # monitor history kept in memory
    client_timeout: float = 30.0  # seconds a control client may stay silent mid-request
    max_connections_per_user: int = 128  # open control connections per non-root uid
    watch_execs: bool = True  # proc-connector watcher for [[job]] rules
    # -- host settings: roots the tuners read and write (tests point them at a temp tree)
    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    etc_root: Path = Path("/etc")
    debug_apply_delay: float = 0.0  # seconds slept between two host writes (crash tests)

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / "tunerd.sock"

    @property
    def state_path(self) -> Path:
        return self.state_dir / "state.json"


_PATH_KEYS = {"policy_dir", "runtime_dir", "state_dir", "topology",
              "proc_root", "sys_root", "etc_root"}


def load_config(path: Path | None, overrides: dict[str, Any]) -> DaemonConfig:
    """Read the TOML config (if any), then apply command-line overrides."""
    cfg = DaemonConfig()
    known = {f.name: f for f in fields(DaemonConfig)}
    values: dict[str, Any] = {}
    cfg_path = path or DEFAULT_CONFIG
    if path is not None or cfg_path.exists():
        try:
            raw = tomllib.loads(cfg_path.read_text())
        except OSError as err:
            raise UsageError(f"{cfg_path}: cannot read config: {err.strerror}") from err
        except tomllib.TOMLDecodeError as err:
            raise UsageError(f"{cfg_path}: {err}") from err
        for key, val in raw.items():
            k = key.replace("-", "_")
            if k not in known:
                raise UsageError(f"{cfg_path}: unknown key {key!r}")
            values[k] = val
    values.update({k: v for k, v in overrides.items() if v is not None})
    for k, v in values.items():
        default = getattr(cfg, k)
        if k in _PATH_KEYS:
            v = Path(v)
        elif isinstance(default, bool):
            if not isinstance(v, bool):
                raise UsageError(f"config key {k!r} must be true or false, got {v!r}")
        elif isinstance(default, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise UsageError(f"config key {k!r} must be a positive number, got {v!r}")
            v = float(v)
        elif isinstance(default, int):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"config key {k!r} must be a positive integer, got {v!r}")
        elif not isinstance(v, str):
            raise UsageError(f"config key {k!r} must be a string, got {v!r}")
        setattr(cfg, k, v)
    if cfg.log_level not in ("debug", "info", "warning", "error"):
        raise UsageError(f"log level must be debug|info|warning|error, got {cfg.log_level!r}")
    return cfg
