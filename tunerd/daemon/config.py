"""Daemon configuration: /etc/tunerd/tunerd.toml (optional) overridden by flags.

Every key is listed once in ``KEYS`` with its meaning and its own check, so
``tunerd --help``, the README and the validation cannot disagree. An error names
the file and the key (or the flag) and the value it got.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tunerd.base.errors import UsageError
from tunerd.base.safefs import read_trusted

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_CONFIG = Path("/etc/tunerd/tunerd.toml")
MAX_CONFIG_BYTES = 1 << 20  # a config is a few lines: larger is refused unread
LOG_LEVELS = ("debug", "info", "warning", "error")


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
    max_reply_bytes: int = 4 << 20  # one reply to a non-root uid; past it an error reply
    max_binds_per_user: int = 1024  # processes one non-root user may hold bound (bind)
    watch_execs: bool = True  # proc-connector watcher for [[job]] rules
    # the exec watcher thread runs SCHED_FIFO 1 while execs are sparse (false: nice -10)
    exec_watch_realtime: bool = True
    # a reload binds the matching processes already running; false: refuse a policy that
    # would bind other users' running processes (as `tunerctl reload --no-rebind-running`)
    reload_rebinds_running: bool = True
    # -- host settings: roots the tuners read and write (tests point them at a temp tree)
    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    etc_root: Path = Path("/etc")
    debug_apply_delay: float = 0.0  # seconds slept between two host writes (crash tests)
    # ... and before a bind the exec watcher's thread made is recorded
    # seconds a `tunerctl bind` waits once placed (and held), before it binds (race tests)
    debug_bind_delay: float = 0.0
    # the Python training jobs run with; `tunerctl doctor` checks its torch
    job_python: Path | None = None
    # an NVML recording (tests/fixtures/nvml) replayed with --topology (tests only)
    debug_nvml_replay: Path | None = None
    # a JSON file {"<gpu index>": [pids]}: the replayed GPUs' compute processes, read
    # again when it changes (tests only, with --topology: tunerd.topology.nvml_replay)
    debug_gpu_processes: Path | None = None
    # "MAJOR:MINOR,..." by GPU index: the replayed GPUs' device nodes, for nodes a test
    # can open without the NVIDIA driver (tests only, with --topology: tunerd.jobs.gate)
    debug_gpu_device_nodes: str | None = None
    # the kubelet's PodResources API: which GPUs and CPUs each pod got (tunerd.jobs.podresources)
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    # one daemon binds processes on a node: the node-wide claim every unscoped,
    # non-dry-run daemon locks (tunerd.daemon.runtime.NodeClaim), whatever its runtime dir
    node_lock: Path = Path("/run/tunerd.lock")
    # a test daemon: [[job]] rules bind only this process and its descendants, and no
    # node-wide claim is taken (tunerd.jobs.scope); None: the whole node
    scope_pid: int | None = None
    # subordinate uids: each counts as its user for per-user limits (tests: a temp file)
    subuid_file: Path = Path("/etc/subuid")
    # with --topology: write the replayed node's host settings (sysctl, NIC, NCCL, block,
    # vm, IRQ, PCIe, CPU) to this machine; False: they are planned, never written
    apply_host_settings: bool = False

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / "tunerd.sock"

    @property
    def state_path(self) -> Path:
        return self.state_dir / "state.json"


class _Bad(Exception):
    """A value that breaks its key's rule; the message says what was expected."""


def _path(v: Any) -> Path:
    if not isinstance(v, (str, Path)) or not str(v):
        raise _Bad(f"must be a path, got {v!r}")
    return Path(v)


def _abs_path(v: Any) -> Path:
    p = _path(v)
    if not p.is_absolute():
        raise _Bad(f"must be an absolute path, got {v!r}")
    return p


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad(f"must be true or false, got {v!r}")
    return v


def _seconds(minimum: float, inclusive: bool) -> Callable[[Any], float]:
    what = f"{minimum:g} or more" if inclusive else f"greater than {minimum:g}"

    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Bad(f"must be a number of seconds ({what}), got {v!r}")
        ok = v >= minimum if inclusive else v > minimum
        if not ok or v != v or v == float("inf"):
            raise _Bad(f"must be a number of seconds {what}, got {v!r}")
        return float(v)

    return check


def _count(minimum: int) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise _Bad(f"must be an integer, {minimum} or more, got {v!r}")
        return v

    return check


def _scope_pid(v: Any) -> int:
    pid = _count(1)(v)
    if pid == 1:  # init's subtree is every process: the whole node, with no node lock
        raise _Bad("1 is init, whose subtree is the whole node: a test daemon scoped to it "
                   "would bind every process without the node lock; give the pid of the "
                   "test's own process, or drop it (an unscoped daemon takes the node lock)")
    return pid


def _log_level(v: Any) -> str:
    if v not in LOG_LEVELS:
        raise _Bad(f"must be one of {'|'.join(LOG_LEVELS)}, got {v!r}")
    return str(v)


def _listen(v: Any) -> str:
    from tunerd.monitor.listen import parse_listen

    if not isinstance(v, str):
        raise _Bad(f"must be a string (HOST:PORT or off), got {v!r}")
    try:
        parse_listen(v)
    except UsageError as err:
        raise _Bad(err.message) from err
    return v


def _device_nodes(v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"\d{1,4}:\d{1,7}(,\d{1,4}:\d{1,7}){0,63}", v):
        raise _Bad(f"must be MAJOR:MINOR,... (one per GPU index), got {v!r}")
    return v


def device_nodes(text: str) -> dict[tuple[int, int], int]:
    """``debug_gpu_device_nodes`` as (major, minor) -> GPU index."""
    out: dict[tuple[int, int], int] = {}
    for i, item in enumerate(text.split(",")):
        major, minor = item.split(":")
        out[(int(major), int(minor))] = i
    return out


# key -> (meaning shown by `tunerd --help`, check that returns the typed value)
KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "policy_dir": ("directory of policy *.toml files (none there: the bundled default)",
                   _path),
    "runtime_dir": ("control socket, pidfile, per-process state (tmpfs)", _path),
    "state_dir": ("durable state: the original of every host setting changed", _path),
    "topology": ("replay this topology snapshot instead of reading the machine", _path),
    "metrics_listen": ("Prometheus endpoint HOST:PORT, [IPv6]:PORT, port 0 = any free "
                       "port, or off", _listen),
    "dry_run": ("plan and log every change, write nothing", _bool),
    "log_level": ("debug | info | warning | error", _log_level),
    "verify_interval": ("seconds between drift checks (drift is re-applied)",
                        _seconds(0, inclusive=False)),
    "sample_interval": ("seconds between monitor samples", _seconds(0, inclusive=False)),
    "history_seconds": ("seconds of monitor history kept in memory",
                        _seconds(0, inclusive=False)),
    "client_timeout": ("seconds a control client may stay silent mid-request",
                       _seconds(0, inclusive=False)),
    "max_connections_per_user": ("open control connections one non-root uid may hold",
                                 _count(1)),
    "max_reply_bytes": ("bytes of one reply to a non-root uid (past it: an error reply)",
                        _count(4096)),
    "max_binds_per_user": ("processes one non-root user may hold bound with tunerctl "
                           "bind", _count(1)),
    "watch_execs": ("proc-connector exec watcher for [[job]] rules (false: /proc scans)",
                    _bool),
    "exec_watch_realtime": ("the exec watcher at SCHED_FIFO 1 while execs are sparse "
                            "(false: nice -10)", _bool),
    "reload_rebinds_running": ("false: a reload refuses a policy binding others' running "
                               "processes", _bool),
    "proc_root": ("/proc the host-setting tuners use (tests: a temporary tree)", _path),
    "sys_root": ("/sys the host-setting tuners use", _path),
    "etc_root": ("/etc the host-setting tuners use (nccl.conf)", _path),
    "debug_apply_delay": ("seconds slept between host writes and before a rule bind's "
                          "record (tests)",
                          _seconds(0, inclusive=True)),
    "debug_bind_delay": ("seconds `tunerctl bind` waits once placed and held (tests)",
                         _seconds(0, inclusive=True)),
    "job_python": ("absolute path of the Python training jobs use (`tunerctl doctor`)",
                   _abs_path),
    "debug_nvml_replay": ("NVML recording's driver/CUDA with --topology (tests)",
                          _abs_path),
    "debug_gpu_processes": ("JSON {GPU: [pids]}: the replayed GPUs' processes "
                            "(tests, --topology)",
                            _abs_path),
    "debug_gpu_device_nodes": ("MAJOR:MINOR,... by GPU index: replayed GPU device nodes "
                               "(tests)", _device_nodes),
    "pod_resources_socket": ("the kubelet's PodResources gRPC socket (pod -> GPUs, CPUs)",
                             _abs_path),
    "node_lock": ("node-wide lock: one unscoped, non-dry-run tunerd per node",
                  _abs_path),
    "scope_pid": ("rules bind only this pid's subtree, not 1; no node lock (test daemons)",
                  _scope_pid),
    "subuid_file": ("subordinate uids: each counts as its user for per-user limits",
                    _abs_path),
    "apply_host_settings": ("with --topology: write host settings to this machine "
                            "(false: planned only)", _bool),
}


def describe_keys() -> list[tuple[str, str, str]]:
    """(key, default as TOML text, meaning) for every config key, in file order."""
    out = []
    for f in fields(DaemonConfig):
        default = getattr(DaemonConfig, f.name)
        if default is None:
            shown = "(unset)"
        elif isinstance(default, bool):
            shown = "true" if default else "false"
        elif isinstance(default, float):
            shown = f"{default:.1f}" if default == int(default) else f"{default:g}"
        elif isinstance(default, int):
            shown = str(default)
        else:
            shown = f'"{default}"'
        out.append((f.name, shown, KEYS[f.name][0]))
    return out


def load_config(path: Path | None, overrides: dict[str, Any]) -> DaemonConfig:
    """Read the TOML config (if any), then apply command-line overrides.

    ``overrides`` maps a key to a flag's value (None: flag not given).
    """
    cfg = DaemonConfig()
    cfg_path = path or DEFAULT_CONFIG
    raw: dict[str, Any] = {}
    if path is not None or cfg_path.exists():
        try:
            # trusted as the policy dir is: owned by root (or the daemon's own uid),
            # writable by no one else, in dirs that are the same (Failed: exit 1)
            raw = tomllib.loads(read_trusted(cfg_path, "config file", MAX_CONFIG_BYTES)
                                .decode("utf-8"))
        except OSError as err:
            raise UsageError(f"{cfg_path}: cannot read config: {err.strerror}") from err
        except UnicodeDecodeError as err:
            raise UsageError(f"{cfg_path}: not UTF-8 text: {err.reason}") from err
        except tomllib.TOMLDecodeError as err:
            raise UsageError(f"{cfg_path}: {err}") from err
    for key, val in raw.items():
        k = key.replace("-", "_")
        if k not in KEYS:
            raise UsageError(f"{cfg_path}: unknown key {key!r} (known: {', '.join(KEYS)})")
        _set(cfg, k, val, f"{cfg_path}: key {key!r}")
    for k, val in overrides.items():
        if val is not None:
            _set(cfg, k, val, "--" + k.replace("_", "-"))
    return cfg


def _set(cfg: DaemonConfig, key: str, value: Any, where: str) -> None:
    check = KEYS[key][1]
    try:
        setattr(cfg, key, check(value))
    except _Bad as err:
        raise UsageError(f"{where}: {err}") from err
