"""scripts/install.sh and uninstall.sh for real, into a temporary tree: install, upgrade
in place (daemon restarted with the new code, state kept), completion, the exit-3 hint
of an installed tunerctl, then uninstall. Nothing of the host's /opt, /usr/local, /etc
is touched: every path the scripts use is moved into the tree."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, run_as, wait_for
from tests.launcher_helpers import launcher as torchrun_like
from tests.leases_helpers import descendants, kill_tree, scope_bundled_rule, unique_sleeper

pytestmark = [pytest.mark.root, pytest.mark.slow]

SKIP_IN_COPY = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                      ".mypy_cache", ".ruff_cache", ".pytest_cache")


class Tree:
    """A checkout copy plus every install path, all under one temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.src = root / "src"
        shutil.copytree(REPO, self.src, symlinks=True, ignore=SKIP_IN_COPY)
        self.env = {
            "PREFIX": str(root / "opt/tunerd"), "BIN_DIR": str(root / "usr/local/bin"),
            "ETC_DIR": str(root / "etc/tunerd"), "UNIT_DIR": str(root / "etc/systemd/system"),
            "BASH_COMPLETION_DIR": str(root / "usr/share/bash-completion/completions"),
            "ZSH_COMPLETION_DIR": str(root / "usr/local/share/zsh/site-functions"),
            "RUNTIME_DIR": str(root / "run/tunerd"), "STATE_DIR": str(root / "var/lib/tunerd"),
            "LOG_FILE": str(root / "var/log/tunerd.log"), "INIT": "none",
            # scoped to this test run: its daemons take no node lock (a real tunerd on
            # this node is not in their way) and bind nothing of anyone else's; the
            # bundled 00-base.toml's host setting (vm.numa_balancing) into the tree
            "TUNERD_ARGS": f"--metrics-listen off --scope-pid {os.getpid()} "
                           f"--config {root}/test-tunerd.toml",
        }
        (root / "proc/sys/kernel").mkdir(parents=True)
        (root / "proc/sys/kernel/numa_balancing").write_text("1\n")
        for d in ("sys", "etc-root"):
            (root / d).mkdir()
        (root / "test-tunerd.toml").write_text(
            f'proc_root = "{root}/proc"\nsys_root = "{root}/sys"\netc_root = "{root}/etc-root"\n')
        self.bin = Path(self.env["BIN_DIR"])
        self.socket = Path(self.env["RUNTIME_DIR"]) / "tunerd.sock"

    def script(self, name: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
        # PATH without the dev venv: what an operator's root shell has
        e = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "HOME": os.environ.get("HOME", "/root"), **self.env, **(env or {})}
        e.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})  # pip's setup
        return subprocess.run([str(self.src / "scripts" / name), *args], env=e,
                              capture_output=True, text=True, timeout=timeout)

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin / "tunerctl"), "--socket", str(self.socket), *args],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PATH": "/usr/bin:/bin"})

    def pid(self) -> int:
        r = self.ctl("--json", "status")
        assert r.returncode == 0, r.stdout + r.stderr
        return int(json.loads(r.stdout)["pid"])

    def set_version(self, version: str) -> None:
        init = self.src / "tunerd/__init__.py"
        text = init.read_text()
        start = text.index('__version__ = "') + len('__version__ = "')
        init.write_text(text[:start] + version + text[text.index('"', start):])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    except OSError:
        return False


@pytest.fixture(scope="module")
def tree() -> Iterator[Tree]:
    root = Path(tempfile.mkdtemp(prefix="tunerd-install-"))
    root.chmod(0o755)  # the unprivileged-user test reads the scripts from here
    t = Tree(root)
    yield t
    # whatever happened, stop the daemon this module's install.sh started
    for pidfile_pid in _daemon_pids(t):
        try:
            os.kill(pidfile_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(root, ignore_errors=True)


def _daemon_pids(t: Tree) -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[1] == str(Path(t.env["PREFIX"]) / "bin/tunerd").encode():
            out.append(int(proc.name))
    return out


def test_not_root_gets_a_clear_line(tree: Tree, unpriv_user: tuple[int, int]) -> None:
    def attempt(script: str) -> tuple[int, str]:
        p = subprocess.run([script], capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin"})
        return p.returncode, p.stderr

    for name in ("install.sh", "uninstall.sh", "test.sh"):
        rc, err = run_as(*unpriv_user, attempt, str(tree.src / "scripts" / name))
        assert rc == 4 and "must run as root" in err and "root shell" in err, (name, err)
    assert not Path(tree.env["PREFIX"]).exists()


def test_install_upgrade_and_reinstall(tree: Tree) -> None:
    env = tree.env
    # -- first install, of an "older" release -----------------------------------------
    tree.set_version("0.1.9")
    r = tree.script("install.sh", "--no-start")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "installed tunerd 0.1.9" in r.stdout
    # out of the box the bundled policies are in force: copied into the empty policy dir
    pol = Path(env["ETC_DIR"]) / "policies"
    bundled = sorted(p.name for p in (REPO / "policies").glob("*.toml"))
    assert sorted(p.name for p in pol.glob("*.toml")) == bundled
    assert all((pol / n).read_bytes() == (REPO / "policies" / n).read_bytes() for n in bundled)
    assert f"installed the bundled policies into {pol}: {' '.join(bundled)}" in r.stdout
    assert all((pol / n).stat().st_mode & 0o777 == 0o644 for n in bundled)
    # this machine is shared: the rule narrowed to this test's processes (a site file, as
    # an operator would add one), host settings (00-base.toml's) into the tree
    scope_bundled_rule(pol, "TUNERD_INSTALL_TEST", "never-set")
    (pol / "zz-test-scope.toml").chmod(0o644)
    r = tree.script("install.sh")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "already installed" in r.stdout and "runs without systemd" in r.stdout
    assert "installed the bundled policies" not in r.stdout  # the dir has files: kept
    first = tree.pid()
    st = json.loads(tree.ctl("--json", "status").stdout)
    assert st["policy"]["names"][:2] == ["base", "default"], st["policy"]
    assert st["services"]["autobind"]["summary"].startswith(
        "automatic binding: 1 rule(s) (torch-training), watcher ")
    human = tree.ctl("status").stdout
    assert f"files: {pol}/00-base.toml, {pol}/00-default.toml" in human, human
    for prog, want in (("tunerd", "tunerd 0.1.9"), ("tunerctl", "tunerctl, version 0.1.9")):
        v = subprocess.run([str(tree.bin / prog), "--version"], capture_output=True,
                           text=True, timeout=60)
        assert v.returncode == 0 and v.stdout.strip() == want, v.stderr
    assert (Path(env["ETC_DIR"]) / "tunerd.toml").read_text().count("# job_python =") == 1
    assert Path(env["LOG_FILE"]).exists()
    # state that must survive the upgrade: a lease no process holds
    lease = json.loads(tree.ctl("alloc", "--ncpus", "1", "--json").stdout)["id"]

    # -- upgrade: new version, new code: restarted ------------------------------------
    tree.set_version("0.2.0")
    r = tree.script("install.sh")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tunerd 0.1.9 -> 0.2.0" in r.stdout and f"stopped tunerd (pid {first})" in r.stdout
    second = tree.pid()
    assert second != first and not _alive(first)
    assert "tunerd 0.2.0" in subprocess.run([str(tree.bin / "tunerd"), "--version"],
                                            capture_output=True, text=True).stdout
    leases = json.loads(tree.ctl("leases", "--json").stdout)
    assert [x["id"] for x in leases] == [lease], "the upgrade lost the daemon's state"

    # -- same version, changed code: reinstalled and restarted ------------------------
    with (tree.src / "tunerd/cli/types.py").open("a") as f:
        f.write("\n# changed by test_install\n")
    # a pidfile naming some other process must never get that process signalled
    bystander = subprocess.Popen(["sleep", "120"])
    (Path(env["RUNTIME_DIR"]) / "tunerd.pid").write_text(f"{bystander.pid}\n")
    try:
        r = tree.script("install.sh")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "tunerd 0.2.0 -> 0.2.0: reinstalled (same version, the code changed)" in r.stdout
        assert f"stopped tunerd (pid {second})" in r.stdout
        assert f"names pid '{bystander.pid}', which is not a running tunerd" in r.stderr
        assert bystander.poll() is None  # not signalled
    finally:
        bystander.kill()
        bystander.wait()
    third = tree.pid()
    assert third != second and not _alive(second)
    installed = Path(env["PREFIX"]) / "lib"
    assert any("changed by test_install" in p.read_text()
               for p in installed.glob("python3*/site-packages/tunerd/cli/types.py"))

    # -- nothing changed: nothing restarted -------------------------------------------
    r = tree.script("install.sh")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "already installed" in r.stdout and f"already running (pid {third})" in r.stdout
    assert tree.pid() == third

    # -- the installed unit passes systemd-analyze (systemd is not PID 1 here) --------
    unit = Path(env["UNIT_DIR"]) / "tunerd.service"
    assert f"ExecStart={env['PREFIX']}/bin/tunerd --config {env['ETC_DIR']}/tunerd.toml" \
        in unit.read_text()
    if shutil.which("systemd-analyze"):
        v = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                           text=True, timeout=120)
        assert v.returncode == 0, v.stdout + v.stderr
        assert not [ln for ln in (v.stdout + v.stderr).splitlines() if "tunerd.service" in ln]

    # -- bash completion from the installed script ------------------------------------
    bash_script = Path(env["BASH_COMPLETION_DIR"]) / "tunerctl"
    assert (Path(env["ZSH_COMPLETION_DIR"]) / "_tunerctl").read_text().startswith(
        "#compdef tunerctl")
    done = subprocess.run(["bash", "-c", f'source {bash_script}; COMP_WORDS=(tunerctl sta); '
                           'COMP_CWORD=1; _tunerctl_completion tunerctl; '
                           'printf "%s\\n" "${COMPREPLY[@]}"'],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{tree.bin}:/usr/bin:/bin"})
    assert done.stdout.split() == ["status"], done.stderr

    # -- daemon stopped: the installed tunerctl points at the log install.sh uses ------
    os.kill(third, signal.SIGTERM)
    wait_for(lambda: not _alive(third), 20, "the old daemon to exit")
    r = tree.ctl("status")
    assert r.returncode == 3
    assert f"its log is {env['LOG_FILE']}" in r.stderr
    assert f"nohup {env['PREFIX']}/bin/tunerd --config" in r.stderr
    assert "systemctl" not in r.stderr  # systemd is not running here
    r = tree.script("install.sh")  # unchanged code, daemon not running: just started
    assert r.returncode == 0 and "already installed" in r.stdout, r.stdout + r.stderr
    assert tree.pid() != third
    # (test_uninstall_reverts_stops_and_removes uninstalls it, after the systemd test
    # below has used it: one venv for the module, not a second from scratch)


def test_uninstall_refuses_what_is_not_an_install(tree: Tree, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data").write_text("keep me")
    r = tree.script("uninstall.sh", "--purge", env={"PREFIX": str(precious)})
    assert r.returncode == 1 and "no tunerd install" in r.stderr
    assert (precious / "data").read_text() == "keep me"
    r = tree.script("install.sh", env={"PREFIX": "relative/path"})
    assert r.returncode == 2 and "PREFIX must be an absolute path" in r.stderr


# systemd is not running here: a stand-in systemctl logs each call and starts the
# unit's ExecStart as systemd would (and stops it for restart), so install.sh's
# INIT=systemd path runs for real up to the daemon answering.
FAKE_SYSTEMCTL = r"""#!/bin/sh
echo "$*" >>"$SYSTEMCTL_LOG"
case "$1" in
    restart|start)
        pf="$RUNTIME_DIR/tunerd.pid"
        if [ -f "$pf" ] && kill -0 "$(cat "$pf")" 2>/dev/null; then
            [ "$1" = start ] && exit 0
            kill "$(cat "$pf")"
            while kill -0 "$(cat "$pf" 2>/dev/null)" 2>/dev/null; do sleep 0.1; done
        fi
        cmd=$(sed -n 's/^ExecStart=//p' "$UNIT_DIR/tunerd.service")
        mkdir -p "$(dirname "$LOG_FILE")"
        nohup $cmd >>"$LOG_FILE" 2>&1 </dev/null &
        ;;
esac
exit 0
"""


def test_daemon_reload_only_when_the_unit_changed(tree: Tree) -> None:
    fake = tree.root / "fakebin"
    fake.mkdir()
    (fake / "systemctl").write_text(FAKE_SYSTEMCTL)
    (fake / "systemctl").chmod(0o755)
    log = tree.root / "systemctl.log"
    env = {"INIT": "systemd", "SYSTEMCTL_LOG": str(log),
           "PATH": f"{fake}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

    def calls() -> list[str]:
        out = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return [c for c in out if c != "show -p MainPID --value tunerd"]

    # on the install test_install_upgrade_and_reinstall made (a fresh venv costs more
    # than the test): changed code and no unit file, as for a first install, so
    # install.sh reinstalls, writes the unit, and systemd reloads it and restarts tunerd
    unit = Path(tree.env["UNIT_DIR"]) / "tunerd.service"
    unit.unlink(missing_ok=True)
    with (tree.src / "tunerd/cli/types.py").open("a") as f:
        f.write("\n# changed by test_daemon_reload_only_when_the_unit_changed\n")
    try:
        r = tree.script("install.sh", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert calls() == ["daemon-reload", "enable tunerd", "restart tunerd"]
        mtime = unit.stat().st_mtime_ns
        # the same install again: the unit is unchanged, systemd is not reloaded
        r = tree.script("install.sh", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert calls() == ["enable tunerd", "start tunerd"]
        assert unit.stat().st_mtime_ns == mtime  # not even rewritten
        # a unit edited by hand since: written back, and then systemd reloads it
        unit.write_text(unit.read_text().replace("RestartSec=2s", "RestartSec=9s"))
        r = tree.script("install.sh", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert calls() == ["daemon-reload", "enable tunerd", "start tunerd"]
        assert "RestartSec=2s" in unit.read_text()
    finally:
        pf = Path(tree.env["RUNTIME_DIR"]) / "tunerd.pid"
        if pf.exists():
            pid = int(pf.read_text())
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
                wait_for(lambda: not _alive(pid), 20, "the daemon to exit")


def test_uninstall_reverts_stops_and_removes(tree: Tree) -> None:
    env = tree.env
    # started without systemd again (the systemd test above stopped the daemon it started)
    r = tree.script("install.sh")
    assert r.returncode == 0 and "already installed" in r.stdout, r.stdout + r.stderr
    fourth = tree.pid()
    unit = Path(env["UNIT_DIR"]) / "tunerd.service"
    bash_script = Path(env["BASH_COMPLETION_DIR"]) / "tunerctl"
    assert unit.exists() and bash_script.exists()

    # a process bound by `tunerctl bind`, and a rank the installed bundled rule bound as it
    # exec'd (out of the box: the rule narrowed to this test's env token, see above):
    # uninstall puts both back as unbind does
    all_cpus = sorted(os.sched_getaffinity(0))
    bound = subprocess.Popen(["sleep", "300"])
    exe = unique_sleeper(tree.root, "train_install_test.py")
    launcher = subprocess.Popen([str(torchrun_like()), str(exe), "300"], env={
        "PATH": "/usr/bin:/bin", "LOCAL_RANK": "0", "TUNERD_INSTALL_TEST": "never-set"})
    try:
        b = tree.ctl("bind", str(bound.pid), "--cpus", str(all_cpus[-1]))
        assert b.returncode == 0, b.stdout + b.stderr
        assert sorted(os.sched_getaffinity(bound.pid)) == [all_cpus[-1]]

        def rank() -> dict[str, object] | None:
            jobs = json.loads(tree.ctl("--json", "jobs").stdout)["jobs"]
            return next((j for j in jobs if j.get("origin") == "rule"), None)
        job = wait_for(rank, 15, "the bundled rule to bind the rank")
        assert job["name"] == "torch-training" and job["pid"] in descendants(launcher.pid), job

        # -- uninstall: unbound, reverted, stopped, removed; /etc and state kept ----------
        r = tree.script("uninstall.sh")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "restored 2 bound process(es) as `tunerctl unbind` does" in r.stdout, r.stdout
        assert sorted(os.sched_getaffinity(bound.pid)) == all_cpus
        assert sorted(os.sched_getaffinity(int(str(job["pid"])))) == all_cpus
    finally:
        bound.kill()
        bound.wait()
        kill_tree(launcher)
    # the bundled 00-base.toml's host setting (in the tree), put back
    assert "restored vm:numa_balancing: 0 -> 1" in r.stdout, r.stdout
    assert (tree.root / "proc/sys/kernel/numa_balancing").read_text().strip() == "1"
    assert f"stopped tunerd (pid {fourth})" in r.stdout
    wait_for(lambda: not _alive(fourth), 10, "the daemon to exit")
    for gone in (env["PREFIX"], env["RUNTIME_DIR"], f"{env['BIN_DIR']}/tunerd",
                 f"{env['BIN_DIR']}/tunerctl", str(unit), str(bash_script),
                 f"{env['ZSH_COMPLETION_DIR']}/_tunerctl"):
        assert not os.path.lexists(gone), gone
    for kept in (Path(env["ETC_DIR"]) / "tunerd.toml", Path(env["STATE_DIR"]),
                 Path(env["LOG_FILE"])):
        assert kept.exists(), kept
    # --purge after a plain uninstall removes what it kept, and the directories
    # install.sh created (this tree's: all of them), now empty
    r = tree.script("uninstall.sh", "--purge")
    assert r.returncode == 0, r.stdout + r.stderr
    for gone in (env["ETC_DIR"], env["STATE_DIR"], env["LOG_FILE"], env["ZSH_COMPLETION_DIR"],
                 env["BASH_COMPLETION_DIR"], env["UNIT_DIR"], env["BIN_DIR"]):
        assert not os.path.lexists(gone), (gone, r.stdout)
    # ... and the parents install -d made for them (usr/local/share/zsh was left once):
    # this tree had no usr/ nor etc/ before the install
    for gone in ("usr/local/share/zsh", "usr/share/bash-completion", "etc/systemd", "usr",
                 "etc"):
        assert not (tree.root / gone).exists(), (gone, r.stdout)
    assert "tunerd is purged" in r.stdout
    r = tree.script("uninstall.sh", "--purge")  # nothing left: says so
    assert r.returncode == 1 and "no tunerd install" in r.stderr
