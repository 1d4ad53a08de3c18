"""deploy/ansible (the tunerd role and site.yml) for real, with ansible-core on this host:
`ansible-playbook -i localhost, --connection=local` into a temporary tree (every path of
the role moved there, tunerd_init=none, a dry-run daemon without metrics). One install
is shared by the module, in order: first run installs and starts, second run changes
nothing, --check --diff shows a policy change without making it, an invalid policy set
is refused before anything is put in place, a real change is reloaded into the running
daemon, a new wheel restarts it, tunerd_state=absent removes it. Plus yamllint and
ansible-lint on the role and playbook."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import REPO, wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]

ANSIBLE = REPO / "deploy/ansible"
BIN = Path(sys.executable).parent  # ansible-playbook, yamllint, ansible-lint (test extras)

POLICY_A = '[policy]\nname = "class-a"\n\n[limits]\nnofile = 65536\n'
POLICY_B = '[policy]\nname = "class-b"\n\n[limits]\nnofile = 32768\n'
POLICY_BAD = '[policy]\nname = "class-c"\n\n[limits]\nnofile = "lots"\n'


class Node:
    """The role's every path under one temporary directory, and how to run the play."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.prefix = root / "opt/tunerd"
        self.first: subprocess.CompletedProcess[str] | None = None
        self.vars: dict[str, Any] = {
            "tunerd_prefix": str(self.prefix),
            "tunerd_bin_dir": str(root / "usr/local/bin"),
            "tunerd_etc_dir": str(root / "etc/tunerd"),
            "tunerd_unit_dir": str(root / "etc/systemd/system"),
            "tunerd_bash_completion_dir": str(root / "usr/share/bash-completion/completions"),
            "tunerd_zsh_completion_dir": str(root / "usr/local/share/zsh/site-functions"),
            "tunerd_runtime_dir": str(root / "run/tunerd"),
            "tunerd_state_dir": str(root / "var/lib/tunerd"),
            "tunerd_log_file": str(root / "var/log/tunerd.log"),
            "tunerd_stage_dir": str(root / "var/cache/tunerd-ansible"),
            "tunerd_init": "none",
            "tunerd_args": "--metrics-listen off --dry-run",
            "tunerd_policies": {"10-class.toml": POLICY_A},
            # as on a remote node: no become (root already), the node's own Python
            "ansible_become": False,
            "ansible_python_interpreter": "/usr/bin/python3",
        }
        self.socket = root / "run/tunerd/tunerd.sock"
        self.policy_file = root / "etc/tunerd/policies/10-class.toml"
        for d in ("tmp", "ansible-home"):
            (root / d).mkdir()

    def play(self, *args: str, timeout: float = 600,
             **overrides: object) -> subprocess.CompletedProcess[str]:
        vars_file = self.root / "vars.json"
        vars_file.write_text(json.dumps({**self.vars, **overrides}))
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "HOME": os.environ.get("HOME", "/root"),  # pip's cache, as install.sh uses it
               "TMPDIR": str(self.root / "tmp"),
               "ANSIBLE_HOME": str(self.root / "ansible-home"),
               "ANSIBLE_LOCAL_TEMP": str(self.root / "ansible-home/tmp"),
               "ANSIBLE_REMOTE_TEMP": str(self.root / "ansible-home/remote"),
               "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
               "ANSIBLE_NOCOLOR": "1"}
        env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
        return subprocess.run(
            [str(BIN / "ansible-playbook"), "-i", "localhost,", "--connection=local",
             str(ANSIBLE / "site.yml"), "-e", f"@{vars_file}", *args],
            capture_output=True, text=True, timeout=timeout, env=env)

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.prefix / "bin/tunerctl"), "--socket", str(self.socket),
                               *args], capture_output=True, text=True, timeout=60)

    def pid(self) -> int:
        r = self.ctl("--json", "status")
        assert r.returncode == 0, r.stdout + r.stderr
        return int(json.loads(r.stdout)["pid"])

    def policy(self) -> dict:
        r = self.ctl("--json", "policy", "show")
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)

    def daemon_pids(self) -> list[int]:
        """Every tunerd process running this tree's install (argv[1] is its script)."""
        mine = str(self.prefix / "bin/tunerd").encode()
        out = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                try:
                    argv = (proc / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if len(argv) > 1 and argv[1] == mine:
                    out.append(int(proc.name))
        return out


def changed(r: subprocess.CompletedProcess[str]) -> int:
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    m = re.search(r"^localhost\s+: ok=\d+\s+changed=(\d+)\s+unreachable=0\s+failed=0",
                  r.stdout, re.M)
    assert m, r.stdout[-3000:]
    return int(m.group(1))


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    except OSError:
        return False


@pytest.fixture(scope="module", autouse=True)
def ansible_lint(tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """ansible-lint on the role and playbook (~8 s), started with the module: it only
    reads deploy/ansible (the plays copy the checkout's tunerd, policies, scripts and
    systemd, never deploy/), so it runs beside the first play, which waits on pip most of
    its 30 s, rather than after. test_lint_clean looks at its result."""
    tmp = tmp_path_factory.mktemp("ansible-lint")
    out = tmp / "output"
    with out.open("w") as f:
        # --offline: no collection installs, no version check over the network
        lint = subprocess.Popen([str(BIN / "ansible-lint"), "--offline", "--nocolor"],
                                cwd=ANSIBLE, stdout=f, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "ANSIBLE_HOME": str(tmp / "ah"),
                                     "XDG_CACHE_HOME": str(tmp / "cache")})
    try:
        yield lint, out
    finally:
        if lint.poll() is None:
            lint.kill()
        lint.wait()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    if not (BIN / "ansible-playbook").exists():
        pytest.fail(f"no ansible-playbook beside {sys.executable}: "
                    "pip install -e '.[test]' (scripts/test.sh does)")
    root = Path(tempfile.mkdtemp(prefix="tunerd-ansible-"))
    n = Node(root)
    try:
        n.first = n.play()
        yield n
    finally:
        for pid in n.daemon_pids():  # whatever happened: the daemons this tree started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(root, ignore_errors=True)


def test_first_run_installs_and_starts(node: Node) -> None:
    assert node.first is not None and changed(node.first) > 0
    st = json.loads(node.ctl("--json", "status").stdout)
    assert st["dry_run"] and st["policy"]["sources"] == [str(node.policy_file)]
    assert node.policy()["policy"]["name"] == "class-a"
    assert node.policy_file.read_text().endswith(POLICY_A)
    assert node.daemon_pids() == [st["pid"]]
    log = Path(node.vars["tunerd_log_file"])
    assert log.exists()  # install.sh's no-systemd start: the daemon logs there
    for link in ("tunerd", "tunerctl"):
        target = os.readlink(Path(node.vars["tunerd_bin_dir"]) / link)
        assert target == str(node.prefix / "bin" / link)


def test_second_run_changes_nothing(node: Node) -> None:
    before = node.pid()
    r = node.play()
    assert changed(r) == 0, r.stdout
    assert node.pid() == before


def test_check_diff_shows_a_policy_change_without_making_it(node: Node) -> None:
    before = node.pid()
    r = node.play("--check", "--diff", tunerd_policies={"10-class.toml": POLICY_B})
    assert changed(r) >= 1
    assert "-nofile = 65536" in r.stdout and "+nofile = 32768" in r.stdout, r.stdout
    assert node.policy_file.read_text().endswith(POLICY_A)
    assert node.policy()["limits"]["nofile"] == 65536 and node.pid() == before


def test_invalid_policy_set_is_refused_before_it_is_in_place(node: Node) -> None:
    # --tags tunerd_policies: only the policy part of the role (as an operator pushing
    # policies would run it; cheaper than a whole run)
    r = node.play("--tags", "tunerd_policies", tunerd_policies={"10-class.toml": POLICY_BAD})
    assert r.returncode != 0
    # tunerctl policy check's line (wrapped by the yaml callback): the file, key and value
    out = " ".join(r.stdout.split())
    assert re.search(r'FAIL \S*/10-class\.toml: limits\.nofile: expected an integer .*"lots"',
                     out), r.stdout[-4000:]
    assert node.policy_file.read_text().endswith(POLICY_A)
    assert node.policy()["policy"]["name"] == "class-a"


def test_policy_change_is_reloaded(node: Node) -> None:
    before = node.pid()
    r = node.play("--tags", "tunerd_policies", tunerd_policies={"10-class.toml": POLICY_B})
    assert changed(r) == 2, r.stdout  # the file, and the reload handler
    assert re.search(r"RUNNING HANDLER \[tunerd : Reload tunerd's policies.*\nchanged",
                     r.stdout)
    pol = node.policy()  # in force in the same daemon: reloaded, not restarted
    assert pol["policy"]["name"] == "class-b" and pol["limits"]["nofile"] == 32768
    assert node.pid() == before
    node.vars["tunerd_policies"] = {"10-class.toml": POLICY_B}


@pytest.fixture(scope="module", autouse=True)
def new_wheel(tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A wheel of this checkout with another version (9.9.9), as CI would build it, for
    test_new_wheel_restarts_the_daemon: built from a copy, so it is started with the
    module and built beside the first play rather than in the test."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "wheel-src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "policies", src / "policies")
    shutil.copytree(REPO / "tunerd", src / "tunerd", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    init = src / "tunerd/__init__.py"
    init.write_text(re.sub(r'__version__ = "[^"]*"', '__version__ = "9.9.9"', init.read_text()))
    with (root / "pip.log").open("w") as log:
        w = subprocess.Popen([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                              "--no-build-isolation", "-w", str(root / "dist"), str(src)],
                             stdout=log, stderr=subprocess.STDOUT, text=True, cwd=root)
    try:
        yield w, root
    finally:
        if w.poll() is None:
            w.kill()
        w.wait()


def test_new_wheel_restarts_the_daemon(node: Node,
                                       new_wheel: tuple[subprocess.Popen[str], Path]) -> None:
    w, root = new_wheel
    assert w.wait(300) == 0, (root / "pip.log").read_text()
    wheel = next((root / "dist").glob("tunerd-9.9.9-*.whl"))
    before = node.pid()
    r = node.play(tunerd_source=str(wheel))
    assert changed(r) > 0
    assert re.search(r"RUNNING HANDLER \[tunerd : Restart tunerd without systemd\].*\n"
                     r"changed", r.stdout), r.stdout[-4000:]
    after = node.pid()
    assert after != before and not _alive(before)
    assert json.loads(node.ctl("--json", "status").stdout)["version"] == "9.9.9"
    assert node.policy()["policy"]["name"] == "class-b"  # the restart kept the policies
    node.vars["tunerd_source"] = str(wheel)


def test_absent_removes_it(node: Node) -> None:
    pid = node.pid()
    r = node.play(tunerd_state="absent")
    assert changed(r) > 0
    wait_for(lambda: not _alive(pid), 10, "the daemon to exit")
    for gone in (node.prefix, Path(node.vars["tunerd_bin_dir"]) / "tunerctl",
                 Path(node.vars["tunerd_stage_dir"]), Path(node.vars["tunerd_runtime_dir"])):
        assert not os.path.lexists(gone), gone
    assert node.daemon_pids() == []
    assert node.policy_file.exists()  # like uninstall.sh: the etc dir stays (tunerd_purge)


def test_lint_clean(ansible_lint: tuple[subprocess.Popen[str], Path]) -> None:
    y = subprocess.run([str(BIN / "yamllint"), "-s", "."], cwd=ANSIBLE, capture_output=True,
                       text=True, timeout=120)
    assert y.returncode == 0, y.stdout + y.stderr
    lint, out = ansible_lint
    lint.wait(300)
    text = out.read_text()
    assert lint.returncode == 0, text
    assert "Passed" in text


def test_example_inventory_policies_pass_the_check(tmp_path: Path) -> None:
    """Each class of inventory/ (its group_vars combined with all.yml's, as the
    example's combine() does) is a policy set that tunerctl policy check accepts."""
    gv = ANSIBLE / "inventory/group_vars"
    common = yaml.safe_load((gv / "all.yml").read_text())["tunerd_common_policies"]
    hosts = yaml.safe_load((ANSIBLE / "inventory/hosts.yml").read_text())
    for cls, model in (("h100_sxm", "NVIDIA H100 80GB HBM3"), ("l40s_pcie", "NVIDIA L40S")):
        assert cls in hosts["all"]["children"]
        own = yaml.safe_load((gv / f"{cls}.yml").read_text())
        assert f"| combine({cls.split('_')[0]}_policies)" in own["tunerd_policies"]
        d = tmp_path / cls
        d.mkdir()
        for name, text in {**common, **own[f"{cls.split('_')[0]}_policies"]}.items():
            (d / name).write_text(text)
        r = subprocess.run([str(BIN / "tunerctl"), "policy", "check", str(d),
                            "--gpu-model", model, "--gpus", "8"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "FAIL" not in r.stdout and "WARN" not in r.stdout, \
            r.stdout + r.stderr
