"""tunerd entry point: parse flags, set up logging, run the daemon in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from tunerd.errors import TunerdError
from tunerd.logutil import RepeatFilter
from tunerd.protocol import ExitCode

# syslog priorities, for journald's SyslogLevelPrefix parsing of "<N>" on stderr
_PRIORITY = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}


class JournalFormatter(logging.Formatter):
    """``<6>tunerd.server: message``: journald strips the prefix and keeps the priority."""

    def format(self, record: logging.LogRecord) -> str:
        msg = super().format(record)
        pri = _PRIORITY.get(record.levelname, 6)
        return "\n".join(f"<{pri}>{record.name}: {line}" for line in msg.splitlines())


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(message)s"))
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
    # repeated identical errors (a connection flood, a stream of bad requests) must
    # not flood the log: a few per minute, then a count
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tunerd", description="tunerd host-tuning daemon")
    p.add_argument("--config", type=Path, help="config file (default /etc/tunerd/tunerd.toml)")
    p.add_argument("--policy-dir", type=Path)
    p.add_argument("--runtime-dir", type=Path)
    p.add_argument("--state-dir", type=Path)
    p.add_argument("--topology", type=Path, metavar="SNAPSHOT.json")
    p.add_argument("--metrics-listen", metavar="HOST:PORT|off")
    p.add_argument("--dry-run", action="store_true", default=None)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tunerd.daemon.app import Daemon
    from tunerd.daemon.config import load_config

    try:
        cfg = load_config(args.config, {
            "policy_dir": args.policy_dir, "runtime_dir": args.runtime_dir,
            "state_dir": args.state_dir, "topology": args.topology,
            "metrics_listen": args.metrics_listen, "dry_run": args.dry_run,
            "log_level": args.log_level,
        })
        if cfg.topology is not None:  # a bad snapshot is a usage error, not a traceback
            from tunerd.topology import read_snapshot

            read_snapshot(cfg.topology)
    except TunerdError as err:
        print(f"tunerd: error: {err.message}", file=sys.stderr)
        return int(ExitCode.USAGE)
    setup_logging(cfg.log_level)
    from tunerd.daemon.server import raise_nofile_limit

    raise_nofile_limit()  # a connection, a pidfd, a watcher: each one fd
    try:
        rc = asyncio.run(Daemon(cfg).run())
    except KeyboardInterrupt:
        rc = 0
    return rc


if __name__ == "__main__":
    sys.exit(main())
