"""tunerctl's surface: --json anywhere, one meaning per flag, messages, --version, plurals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from tests.helpers import REPO, DaemonProc, run_ctl
from tunerd import __version__
from tunerd.cli.main import LAZY_COMMANDS, cli


def _all_commands() -> list[tuple[str, ...]]:
    """Every command path, groups included: ("status",), ("policy",), ("policy", "check")..."""
    ctx = click.Context(cli)
    out: list[tuple[str, ...]] = []
    for name in sorted(LAZY_COMMANDS):
        cmd = cli.get_command(ctx, name)
        assert cmd is not None
        out.append((name,))
        if isinstance(cmd, click.Group):
            out += [(name, sub) for sub in sorted(cmd.commands)]
    return out


@pytest.mark.parametrize("path", _all_commands(), ids=" ".join)
def test_every_command_takes_json_after_its_name(path: tuple[str, ...]) -> None:
    r = run_ctl(*path, "--help")
    assert r.rc == 0, r.err
    assert "--json" in r.out, f"tunerctl {' '.join(path)} --help does not list --json"


@pytest.mark.root
def test_json_after_the_command_against_a_real_daemon(module_daemon: DaemonProc,
                                                      tmp_path: Path) -> None:
    daemon = module_daemon  # these tests leave nothing held: one daemon for them
    for args in (("status", "--json"), ("jobs", "--json"), ("leases", "--json"),
                 ("plan", "--json"), ("verify", "--json"), ("top", "--json"),
                 ("advise", "--json"), ("policy", "show", "--json"),
                 ("policy", "--json", "show"), ("--json", "status")):
        r = daemon.ctl(*args)
        assert r.rc in (0, 1), (args, r.err)
        json.loads(r.out)  # the whole output is JSON
    r = run_ctl("policy", "check", str(daemon.policy_dir), "--json")
    assert r.rc == 0 and json.loads(r.out)["files"]
    # a Python without torch: its torch check is a quick SKIP (tests/test_doctor.py runs
    # doctor on this interpreter's real torch)
    r = run_ctl("doctor", "--data-dir", str(tmp_path), "--json", "--python", "/usr/bin/python3")
    assert {c["id"] for c in json.loads(r.out)["checks"]} >= {"training-python", "torch"}
    # an error of a command given --json after its name is reported as JSON too
    r = run_ctl("--socket", str(tmp_path / "none.sock"), "status", "--json")
    assert r.rc == 3 and json.loads(r.out)["error"]["code"] == "unreachable"


@pytest.mark.root
def test_json_after_dash_dash_belongs_to_the_command(module_daemon: DaemonProc) -> None:
    daemon = module_daemon
    show = 'for a in "$@"; do echo "arg=$a"; done'
    r = daemon.ctl("run", "--", "sh", "-c", show, "sh", "--json", "x")
    assert r.rc == 0, r.err
    assert r.out.splitlines() == ["arg=--json", "arg=x"]
    assert "{" not in r.err  # tunerctl itself did not switch to JSON
    # without `--`, everything after the command's first word is the command's too
    r = daemon.ctl("run", "sh", "-c", show, "sh", "--json")
    assert r.rc == 0 and r.out.splitlines() == ["arg=--json"], r.err
    r = daemon.ctl("run", "--json", "--", "true")
    assert r.rc == 0 and json.loads(r.err.splitlines()[0])["id"].startswith("L")


@pytest.mark.root
def test_ncpus_counts_and_cpus_is_a_list(module_daemon: DaemonProc) -> None:
    daemon = module_daemon
    r = daemon.ctl("alloc", "--ncpus", "1", "--json")
    assert r.rc == 0, r.err
    lease = json.loads(r.out)
    assert len(lease["cpus"].split(",")) == 1 and "-" not in lease["cpus"]
    assert "warning" not in r.err
    assert daemon.ctl("release", lease["id"]).rc == 0
    # --cpus is a CPU list as in bind: `--cpus 1` is CPU 1, never one CPU counted from 0
    r = daemon.ctl("run", "--cpus", "1", "--", "grep", "Cpus_allowed_list", "/proc/self/status")
    assert r.rc == 0, r.err
    assert r.out.split(":")[1].strip() == "1" and "deprecated" not in r.err
    r = daemon.ctl("run", "--ncpus", "1", "--cpus", "0", "--", "true")
    assert r.rc == 2 and "not both" in r.err


@pytest.mark.root
def test_a_cpu_list_for_run_is_parsed_and_sent_as_a_list(module_daemon: DaemonProc) -> None:
    daemon = module_daemon
    r = daemon.ctl("run", "--cpus", "0-x", "--", "true")
    assert r.rc == 2 and "--cpus" in r.err  # refused by tunerctl, before the daemon
    r = daemon.ctl("run", "--cpus", "0-0", "--", "true")
    # leases on exact CPU lists come with the placing service; until then a clear refusal
    assert r.rc in (0, 2), r.err
    if r.rc == 2:
        assert "exact CPU lists" in r.err and "--ncpus" in r.err


@pytest.mark.parametrize(("args", "words"), [
    (("bind", "notapid"), "PID must be a positive integer, got 'notapid'"),
    (("bind", "0"), "PID must be a positive integer, got 0"),
    (("unbind", "1.5"), "PID must be a positive integer, got '1.5'"),
    (("advise", "12x"), "PID must be a positive integer, got '12x'"),
    (("bind", "1", "--nofile", "many"), "must be a positive integer, got 'many'"),
    (("alloc", "--gpus", "two"), "must be an integer, 0 or more, got 'two'"),
    (("run", "--ncpus", "0", "--", "true"), "must be a positive integer, got 0"),
    (("run", "--workers", "5000", "--", "true"), "must be an integer from 0 to 1024"),
    (("top", "--interval", "fast"), "must be a number of seconds, got 'fast'"),
])
def test_bad_pids_and_counts_get_plain_messages(args: tuple[str, ...], words: str) -> None:
    r = run_ctl("--socket", "/nonexistent/tunerd.sock", *args)
    assert r.rc == 2, r.out + r.err
    assert words in r.err
    assert "valid integer" not in r.err and "integer range" not in r.err


def test_version_of_both_programs() -> None:
    r = run_ctl("--version")
    assert r.rc == 0 and r.out.strip() == f"tunerctl, version {__version__}"
    p = subprocess.run([sys.executable, "-m", "tunerd.daemon.main", "--version"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"tunerd {__version__}"
    assert __version__ == "0.2.0"


def test_plurals_in_human_output() -> None:
    from tunerd.cli.cmd_bind import _human_bind, _human_jobs
    from tunerd.cli.cmd_host import _human_verify

    assert "(1 thread)" in _human_bind({"pid": 7, "threads": 1, "cpus": "0"})
    assert "(2 threads)" in _human_bind({"pid": 7, "threads": 2, "cpus": "0"})
    assert "(1 pages moved)" not in _human_bind({"pid": 7, "threads": 3, "mems": "0",
                                                 "pages_moved": 1})
    assert "no drift (1 setting checked)" in _human_verify({"drift": [], "checked": 1})
    leases = _human_jobs({"jobs": [], "leases": [{"id": "L1", "user": "alice"}]})
    assert "LEASE" in leases and "L1" in leases and "alice" in leases


def test_jobs_past_hidepid_shows_hidden_not_a_cut_marker() -> None:
    """Past hidepid=2 another user's /proc/PID/comm is unreadable and the daemon sends
    its command line as "(hidden: /proc is mounted hidepid)": NAME was "(hidden:"."""
    from tunerd.cli.cmd_bind import _human_jobs

    gone = 2**22 + 12345  # above any pid_max: no /proc/PID/comm to read, as past hidepid
    out = _human_jobs({"jobs": [{"pid": gone, "cmdline": "(hidden: /proc is mounted hidepid)",
                                 "origin": "bind", "cpus": "0"}]})
    row = next(ln for ln in out.splitlines() if ln.startswith(str(gone)))
    assert row.split()[1] == "(hidden)", out
    assert "(hidden:" not in out, out


def test_top_never_wraps_inside_a_command() -> None:
    from io import StringIO

    from rich.console import Console

    from tunerd.cli.top_view import render

    reason = ("not available: NVML could not start: NVML Shared Library Not Found. Is the "
              "NVIDIA driver installed and loaded? (check `nvidia-smi` and "
              "`lsmod | grep nvidia`)")
    for width in (80, 60, 45):
        buf = StringIO()
        Console(file=buf, width=width, color_system=None).print(render(
            {"sample": {"gpu": {"available": False, "reason": reason}, "jobs": []}}))
        text = buf.getvalue()
        assert "`lsmod | grep nvidia`" in text and "`tunerctl run -- CMD`" in text, text
        assert all(len(line.rstrip()) <= width for line in text.splitlines())


def test_unreachable_hint_fits_how_tunerd_runs(tmp_path: Path) -> None:
    from tunerd.cli.service_hint import install_manifest, log_hint, unreachable_message

    units = tmp_path / "units"
    units.mkdir()
    (units / "tunerd.service").write_text("[Service]\nExecStart=/opt/tunerd/bin/tunerd\n")
    m = {"UNIT_DIR": str(units), "LOG_FILE": "/srv/log/tunerd.log", "PREFIX": "/srv/tunerd",
         "DAEMON_FLAGS": "--metrics-listen off"}
    assert "journalctl -u tunerd" in log_hint(m, systemd=True)
    plain = log_hint(m, systemd=False)  # unit file present, but systemd is not PID 1
    assert "systemctl" not in plain and "its log is /srv/log/tunerd.log" in plain
    assert "`nohup /srv/tunerd/bin/tunerd --metrics-listen off >>/srv/log/tunerd.log" in plain
    assert "/var/log/tunerd.log" in log_hint({}, systemd=False)
    # the manifest install.sh writes, read back
    (tmp_path / "share/tunerd").mkdir(parents=True)
    (tmp_path / "share/tunerd/install.env").write_text(
        "PREFIX='/srv/tunerd'\nTUNERD_ARGS='--metrics-listen 0.0.0.0:9464'\n"
        "DAEMON_FLAGS='--state-dir /srv/state --metrics-listen 0.0.0.0:9464'\n")
    got = install_manifest(tmp_path)
    assert got["DAEMON_FLAGS"] == "--state-dir /srv/state --metrics-listen 0.0.0.0:9464"
    assert install_manifest(tmp_path / "nothing") == {}
    msg = unreachable_message("tunerd is not reachable at /run/tunerd/tunerd.sock: No such "
                              "file or directory (is the daemon running? see `systemctl "
                              "status tunerd`)")
    assert msg.startswith("tunerd is not reachable at /run/tunerd/tunerd.sock: No such file "
                          "or directory\n  ")


def test_completion_scripts_are_produced_and_complete_command_names(tmp_path: Path) -> None:
    bindir = Path(sys.executable).parent  # the dev venv's tunerctl console script
    assert (bindir / "tunerctl").exists()
    env = {**os.environ, "PATH": f"{bindir}:/usr/bin:/bin"}

    def source(shell: str) -> str:
        p = subprocess.run([str(bindir / "tunerctl")], capture_output=True, text=True,
                           timeout=60, env={**env, "_TUNERCTL_COMPLETE": f"{shell}_source"})
        assert p.returncode == 0, p.stderr
        return p.stdout

    script = tmp_path / "tunerctl.bash"
    script.write_text(source("bash"))
    done = subprocess.run(["bash", "-c", f"source {script}; COMP_WORDS=(tunerctl adv); "
                           "COMP_CWORD=1; _tunerctl_completion tunerctl; "
                           'printf "%s\\n" "${COMPREPLY[@]}"'],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.stdout.split() == ["advise"], done.stdout + done.stderr
    zsh = source("zsh")
    assert zsh.startswith("#compdef tunerctl") and "_TUNERCTL_COMPLETE=zsh_complete" in zsh
    # zsh itself is not installed here: ask the program the way that script does
    q = subprocess.run([str(bindir / "tunerctl")], capture_output=True, text=True, timeout=60,
                       env={**env, "COMP_WORDS": "tunerctl policy ch", "COMP_CWORD": "2",
                            "_TUNERCTL_COMPLETE": "zsh_complete"})
    assert q.stdout.splitlines()[:2] == ["plain", "check"], q.stdout


def test_an_unreachable_prometheus_is_not_blamed_on_tunerd() -> None:
    """fleet check names Prometheus and never suggests starting tunerd (issue 29)."""
    r = run_ctl("fleet", "check", "--prometheus", "http://127.0.0.1:1")
    assert r.rc == 1, r  # 3 is "daemon not reachable" (tunerd's): not this
    assert "cannot reach Prometheus at http://127.0.0.1:1" in r.err
    assert "is Prometheus running there?" in r.err
    assert "start it with" not in r.err and "tunerd is not run" not in r.err, r.err
