"""tunerd's config file, flags, --help and --version; metrics on any free port."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, DaemonProc
from tunerd.base.errors import UsageError
from tunerd.daemon.config import KEYS, DaemonConfig, describe_keys, load_config


def _cfg(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "tunerd.toml"
    p.write_text(text)
    return p


def test_every_documented_default_is_accepted(tmp_path: Path) -> None:
    """The config file the README shows, with every default written out, loads as is."""
    lines = [f"{key} = {default}" for key, default, _ in describe_keys() if default != "(unset)"]
    cfg = load_config(_cfg(tmp_path, "\n".join(lines) + "\n"), {})
    assert cfg == DaemonConfig()
    assert cfg.debug_apply_delay == 0.0  # was refused: "must be a positive number"


@pytest.mark.parametrize(("line", "key", "words"), [
    ("debug_apply_delay = -1", "debug_apply_delay", "0 or more, got -1"),
    ("verify_interval = 0", "verify_interval", "greater than 0, got 0"),
    ("sample_interval = 0.0", "sample_interval", "greater than 0"),
    ("history_seconds = nan", "history_seconds", "greater than 0, got nan"),
    ("client_timeout = true", "client_timeout", "number of seconds"),
    ("watch_execs = 1", "watch_execs", "true or false, got 1"),
    ("dry_run = \"yes\"", "dry_run", "true or false"),
    ("log_level = \"loud\"", "log_level", "debug|info|warning|error, got 'loud'"),
    ("metrics_listen = \"localhost\"", "metrics_listen", "HOST:PORT"),
    ("metrics_listen = 9464", "metrics_listen", "must be a string"),
    ("policy_dir = 7", "policy_dir", "must be a path, got 7"),
    ("job_python = \"python3\"", "job_python", "absolute path, got 'python3'"),
])
def test_each_key_has_its_own_rule_and_errors_name_file_and_key(
        tmp_path: Path, line: str, key: str, words: str) -> None:
    path = _cfg(tmp_path, line + "\n")
    with pytest.raises(UsageError) as exc:
        load_config(path, {})
    assert str(path) in exc.value.message and repr(key) in exc.value.message
    assert words in exc.value.message


def test_zero_is_valid_where_it_means_something(tmp_path: Path) -> None:
    cfg = load_config(_cfg(tmp_path, 'debug_apply_delay = 0\nmetrics_listen = "127.0.0.1:0"\n'
                                     'job_python = "/opt/conda/bin/python"\n'), {})
    assert cfg.debug_apply_delay == 0.0 and cfg.metrics_listen == "127.0.0.1:0"
    assert cfg.job_python == Path("/opt/conda/bin/python")


def test_flags_win_and_their_errors_name_the_flag(tmp_path: Path) -> None:
    path = _cfg(tmp_path, 'log_level = "debug"\n')
    assert load_config(path, {"log_level": "error", "dry_run": None}).log_level == "error"
    with pytest.raises(UsageError, match=r"^--metrics-listen: .*'h:99999'"):
        load_config(None, {"metrics_listen": "h:99999"})


def test_unknown_key_and_syntax_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"unknown key 'verify'.*known: policy_dir"):
        load_config(_cfg(tmp_path, "verify = 1\n"), {})
    with pytest.raises(UsageError, match=re.escape(str(tmp_path / "tunerd.toml"))):
        load_config(_cfg(tmp_path, "verify_interval = \n"), {})


def test_help_documents_every_option_and_config_key_with_defaults() -> None:
    p = subprocess.run([sys.executable, "-m", "tunerd.daemon.main", "--help"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 0, p.stderr
    text = p.stdout
    for flag, default in (("--config", "/etc/tunerd/tunerd.toml"),
                          ("--policy-dir", "/etc/tunerd/policies"),
                          ("--runtime-dir", "/run/tunerd"), ("--state-dir", "/var/lib/tunerd"),
                          ("--topology", "this machine"), ("--metrics-listen", "127.0.0.1:9464"),
                          ("--dry-run", "off"), ("--log-level", "info")):
        block = text[text.index("\n  " + flag) + 1:]
        block = block[:block.index("\n  --")] if "\n  --" in block else block
        assert "default" in block and default in " ".join(block.split()), (flag, block)
    assert {f.name for f in fields(DaemonConfig)} == set(KEYS)
    for key, default, meaning in describe_keys():
        assert f"  {key} = {default}\n" in text and meaning in text
    assert all(len(line) <= 80 for line in text.splitlines())


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def test_metrics_on_any_free_port_is_logged_and_reported(daemon_factory: Any) -> None:
    d: DaemonProc = daemon_factory(args=["--metrics-listen", "127.0.0.1:0"]).start()
    st = d.ctl("--json", "status").json()["services"]["monitor"]
    port = st["metrics_port"]
    assert isinstance(port, int) and port > 0
    assert st["metrics_address"] == f"127.0.0.1:{port}"
    assert f"metrics on 127.0.0.1:{port}" in d.ctl("status").out
    assert f"Prometheus metrics on http://127.0.0.1:{port}/metrics" in d.log()
    assert "tunerd_up 1.0" in _get(f"http://127.0.0.1:{port}/metrics")


@pytest.mark.root
def test_revert_with_nothing_to_restore_keeps_enforcing(daemon: DaemonProc) -> None:
    def enforcing() -> bool:
        return bool(daemon.ctl("--json", "status").json()["services"]["host"]["enforcing"])

    assert enforcing()
    r = daemon.ctl("revert")
    assert r.rc == 0 and "nothing to restore" in r.out
    assert enforcing()  # a revert that restored nothing must not stop drift correction
    assert "note: settings were reverted" not in daemon.ctl("verify").out
