"""Where to look when the daemon does not answer, for the way tunerd was installed.

scripts/install.sh records what it did in ``PREFIX/share/tunerd/install.env``
(PREFIX is the venv tunerctl runs from, ``sys.prefix``): the log file it starts
the daemon with when systemd is not PID 1, and the unit it installed. With
systemd running and a tunerd unit present, the answer is systemctl/journalctl;
otherwise it is that log file and the command that starts the daemon.
Imported only on the exit-3 path.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

DEFAULT_LOG = "/var/log/tunerd.log"
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system",
             "/usr/lib/systemd/system", "/lib/systemd/system")
# what tunerd.wire.client appends to its connect error; the hint below replaces it
_CLIENT_SUFFIX = " (is the daemon running? see `systemctl status tunerd`)"


def install_manifest(prefix: Path | None = None) -> dict[str, str]:
    """KEY=value lines written by scripts/install.sh; {} for a copy it did not install."""
    path = (prefix or Path(sys.prefix)) / "share/tunerd/install.env"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if len(words) == 1 and "=" in words[0]:
            key, _, value = words[0].partition("=")
            out[key] = value
    return out


def systemd_running(run_dir: Path = Path("/run/systemd/system")) -> bool:
    # the check sd_booted(3) makes
    return run_dir.is_dir()


def unit_installed(manifest: dict[str, str]) -> bool:
    dirs = [manifest["UNIT_DIR"]] if manifest.get("UNIT_DIR") else []
    return any((Path(d) / "tunerd.service").exists() for d in [*dirs, *UNIT_DIRS])


def log_hint(manifest: dict[str, str] | None = None, systemd: bool | None = None) -> str:
    m = install_manifest() if manifest is None else manifest
    if (systemd_running() if systemd is None else systemd) and unit_installed(m):
        return ("see `systemctl status tunerd` and `journalctl -u tunerd`; "
                "start it with `systemctl start tunerd`")
    log = m.get("LOG_FILE") or DEFAULT_LOG
    tunerd = str(Path(m["PREFIX"]) / "bin/tunerd") if m.get("PREFIX") else "tunerd"
    args = m.get("DAEMON_FLAGS", "")
    start = f"nohup {tunerd}{' ' + args if args else ''} >>{log} 2>&1 </dev/null &"
    return (f"tunerd is not run by systemd here; its log is {log}; start it with "
            f"`{start}` (or run scripts/install.sh again)")


def unreachable_message(message: str) -> str:
    """The client's exit-3 message with the hint that fits this node."""
    base = message[:-len(_CLIENT_SUFFIX)] if message.endswith(_CLIENT_SUFFIX) else message
    return f"{base}\n  {log_hint()}"
