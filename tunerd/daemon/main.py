"""tunerd entry point: parse flags, set up logging, run the daemon in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from tunerd.base.errors import TunerdError, UsageError
from tunerd.base.logutil import (
    LOG_FILE_BACKUPS,
    LOG_FILE_BYTES,
    EscapeFilter,
    PrivateRotatingFileHandler,
    RepeatFilter,
    UserRateFilter,
)
from tunerd.wire.protocol import ExitCode, exit_code

if TYPE_CHECKING:
    from tunerd.daemon.config import DaemonConfig

# syslog priorities, for journald's SyslogLevelPrefix parsing of "<N>" on stderr
_PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


class JournalFormatter(logging.Formatter):
    """``<6>tunerd.server: message``: journald strips the prefix and keeps the priority."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        pri = _PRIORITY.get(record.levelname, 6)
        return "\n".join(f"<{pri}>{record.name}: {line}" for line in msg.splitlines())


def setup_logging(level: str, log_file: Path | None = None) -> None:
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if log_file is not None:  # without journald: rotated by size, bounded on disk
        handler = PrivateRotatingFileHandler(str(log_file))
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elif os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
    # repeated identical errors (a connection flood, a stream of bad requests) must
    # not flood the log: a few per minute, then a count
    handler.addFilter(EscapeFilter())  # first: the filters after it see the escaped text
    handler.addFilter(RepeatFilter())
    handler.addFilter(UserRateFilter())  # what one user's requests cause: 20 lines a minute
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # an exception no code caught (a thread's, the main one's) goes through the same
    # filters, escaped, instead of Python's hooks writing its traceback raw to stderr
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_thread_death


def _log_uncaught(kind: type[BaseException], exc: BaseException,
                  tb: TracebackType | None) -> None:
    logging.getLogger("tunerd").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_thread_death(args: threading.ExceptHookArgs) -> None:
    if issubclass(args.exc_type, SystemExit):
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("tunerd").error("thread %s died (%s)", name, args.exc_type.__name__,
                                      exc_info=args.exc_value)


def _epilog() -> str:
    from tunerd.daemon.config import describe_keys

    lines = ["config file keys (TOML, all optional; a flag given wins over its key):"]
    for key, default, meaning in describe_keys():
        lines += [f"  {key} = {default}", f"      {meaning}"]
    lines += ["", "signals: SIGHUP re-reads the policies (a bad policy is refused and the",
              "old one kept); SIGTERM/SIGINT stop gracefully.",
              "exit codes: 0 stopped cleanly, 1 failed (e.g. a bad policy at start, or",
              "another tunerd holds the node lock),",
              "2 usage error (bad flag, config file or snapshot), 4 permission denied",
              "(not root, and a dir it needs is not writable)."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from tunerd import __version__
    from tunerd.daemon.config import DEFAULT_CONFIG, LOG_LEVELS, DaemonConfig

    d = DaemonConfig()
    p = argparse.ArgumentParser(
        prog="tunerd", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="tunerd: host-tuning daemon for GPU training nodes.\n"
                    "Runs in the foreground (systemd style); talk to it with tunerctl.",
        epilog=_epilog())
    p.add_argument("--version", action="version", version=f"tunerd {__version__}")
    p.add_argument("--config", type=Path, metavar="FILE",
                   help=f"config file (default {DEFAULT_CONFIG}, read if it exists; "
                        "keys below)")
    p.add_argument("--policy-dir", type=Path, metavar="DIR",
                   help=f"policy *.toml files (default {d.policy_dir}; "
                        "none there: the bundled default policy)")
    p.add_argument("--runtime-dir", type=Path, metavar="DIR",
                   help=f"control socket tunerd.sock and per-process state "
                        f"(default {d.runtime_dir})")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help=f"durable state: originals of changed host settings "
                        f"(default {d.state_dir})")
    p.add_argument("--topology", type=Path, metavar="SNAPSHOT.json",
                   help="replay a recorded topology (tunerctl topology --save) instead "
                        "of this machine's (default: this machine)")
    p.add_argument("--metrics-listen", metavar="HOST:PORT|off",
                   help=f"Prometheus /metrics endpoint; [IPv6]:PORT works, port 0 takes "
                        f"any free port (default {d.metrics_listen})")
    p.add_argument("--dry-run", action="store_true", default=None,
                   help="plan and log every change but write nothing to the host "
                        "(default off)")
    p.add_argument("--apply-host-settings", action="store_true", default=None,
                   help="with --topology: write the policy's host settings (sysctl, NIC, "
                        "NCCL, block, vm, IRQ, PCIe) to this machine (default: a replayed "
                        "node's host settings are planned, never written)")
    p.add_argument("--node-lock", type=Path, metavar="FILE",
                   help=f"node-wide lock: one unscoped, non-dry-run tunerd per node, "
                        f"whatever its runtime dir (default {d.node_lock})")
    p.add_argument("--scope-pid", type=int, metavar="PID",
                   help="bind by [[job]] rules only PID and its descendants, and take no "
                        "node lock (test daemons; default: the whole node)")
    p.add_argument("--log-level", choices=LOG_LEVELS,
                   help=f"log verbosity, to stderr (default {d.log_level})")
    p.add_argument("--log-file", type=Path, metavar="FILE",
                   help="log to FILE (mode 0600) instead of stderr, rotated by size: at most "
                        f"{LOG_FILE_BYTES >> 20} MiB x {LOG_FILE_BACKUPS + 1} files "
                        "(for init systems without journald)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tunerd.daemon.config import load_config

    try:
        cfg = load_config(args.config, {
            "policy_dir": args.policy_dir, "runtime_dir": args.runtime_dir,
            "state_dir": args.state_dir, "topology": args.topology,
            "metrics_listen": args.metrics_listen, "dry_run": args.dry_run,
            "log_level": args.log_level, "node_lock": args.node_lock,
            "scope_pid": args.scope_pid, "apply_host_settings": args.apply_host_settings,
        })
        if cfg.topology is not None:  # a bad snapshot is a usage error, not a traceback
            from tunerd.topology import read_snapshot

            read_snapshot(cfg.topology)
    except UsageError as err:
        print(f"tunerd: error: {err.message}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except TunerdError as err:  # an untrusted config file: exit 1
        print(f"tunerd: error: {err.message}", file=sys.stderr)
        return int(exit_code(err))
    try:
        setup_logging(cfg.log_level, args.log_file)
    except TunerdError as err:  # a log file others could have put there: refused
        print(f"tunerd: error: --log-file: {err.message}", file=sys.stderr)
        return int(exit_code(err))
    except OSError as err:
        print(f"tunerd: error: --log-file {args.log_file}: {err.strerror or err}",
              file=sys.stderr)
        return int(ExitCode.USAGE)
    from tunerd.daemon.server import raise_nofile_limit

    raise_nofile_limit()  # a connection, a pidfd, a watcher: each one fd
    try:
        rc = asyncio.run(_run(cfg))
    except KeyboardInterrupt:
        rc = 0
    return rc


async def _run(cfg: DaemonConfig) -> int:
    from tunerd.daemon.wiring import build

    try:
        daemon = build(cfg)
    except TunerdError as err:
        log = logging.getLogger("tunerd")
        log.error("cannot start: %s", err.message)
        if os.geteuid() != 0 and err.details.get("errno") in (errno.EACCES, errno.EPERM):
            log.error("hint: tunerd runs as root (systemctl start tunerd, or sudo tunerd); to "
                      "try it as yourself, give it dirs you own: tunerd --runtime-dir "
                      "/tmp/tunerd-$USER/run --state-dir /tmp/tunerd-$USER/state "
                      "--metrics-listen off --dry-run (or --scope-pid PID)")
            return int(ExitCode.PERMISSION)
        return int(exit_code(err)) if int(exit_code(err)) != int(ExitCode.USAGE) else 1
    return await daemon.run()


if __name__ == "__main__":
    sys.exit(main())
