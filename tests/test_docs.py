"""The documentation cannot drift from the code:

- every ``tunerctl ...`` / ``tunerd ...`` command shown in a code block of README.md
  or docs/*.md parses: the subcommand exists and accepts the flags and arguments used
  (resolved with click's ``make_context`` / tunerd's argparse parser, never run);
- docs/configuration.md is what scripts/gen_docs.py generates from the config key
  table (tunerd.daemon.config), so a new or changed key fails here until regenerated;
- README.md stays a front page (at most 250 lines) and links only to files that exist
  (or that other branches add: the lead merges them).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import click
import pytest

from tests.helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# written on other branches at the same time; links to them are expected to dangle here
OTHER_BRANCH_DOCS = {"security-limits.md", "jobs.md", "performance.md", "kubernetes.md",
                     "fleet.md", "ansible.md", "gpu.md"}
_SHELL = {"", "sh", "bash", "console", "shell"}  # ```text blocks show output / --help
_STOP = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "2>&1", "&"}


def shell_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(line of the first line, lines) of every fenced shell code block."""
    out: list[tuple[int, list[str]]] = []
    lang: str | None = None
    body: list[str] = []
    first = 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, body, first = line[3:].strip(), [], n + 1
            else:
                if lang in _SHELL:
                    out.append((first, body))
                lang = None
        elif lang is not None:
            body.append(line)
    return out


def commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line, argv) of each tunerctl/tunerd command in the shell code blocks of ``path``."""
    out: list[tuple[int, list[str]]] = []
    for first, lines in shell_blocks(path.read_text()):
        i = 0
        while i < len(lines):
            line, n = lines[i], first + i
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i]
            i += 1
            line = re.sub(r"^\s*(\$|#)\s+(?=(sudo )?tuner)", "", line)  # prompts
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            if words[:1] == ["sudo"]:
                words = words[1:]
            for start, w in enumerate(words):
                if w in ("tunerctl", "tunerd") and (start == 0 or words[start - 1] in _STOP
                                                   or words[start - 1] in ("sudo", "exec")):
                    argv = []
                    for x in words[start:]:
                        if x in _STOP:
                            break
                        argv.append(re.sub(r"\$\{?\w+\}?", "1", x))  # $PID, ${N}
                    out.append((n, argv))
    return out


def parse_tunerctl(args: list[str]) -> None:
    """Resolve ``tunerctl ARGS`` down to its last subcommand and parse every level's
    options and arguments (types converted); raises click's UsageError/BadParameter."""
    from tunerd.cli.main import cli

    ctx = cli.make_context("tunerctl", list(args), obj=types.SimpleNamespace(as_json=False))
    cmd: click.Command = cli
    while isinstance(cmd, click.Group):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            break
        name, sub, sub_args = cmd.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        ctx = sub.make_context(name, sub_args, parent=ctx)
        cmd = sub


def parse_tunerd(args: list[str]) -> None:
    from tunerd.daemon.main import parse_args

    try:
        parse_args(args)
    except SystemExit as e:
        if e.code not in (0, None):
            raise AssertionError(f"tunerd {' '.join(args)}: argparse exit {e.code}") from None


ALL = [(p, n, argv) for p in DOCS for n, argv in commands(p)]


def test_docs_show_commands() -> None:
    assert len(ALL) > 60, [a for _, _, a in ALL]  # the extractor finds what the pages show
    assert any(a[:2] == ["tunerctl", "bind"] for _, _, a in ALL)


@pytest.mark.parametrize(("path", "line", "argv"), ALL,
                         ids=[f"{p.name}:{n}" for p, n, _ in ALL])
def test_documented_command_parses(path: Path, line: int, argv: list[str]) -> None:
    where = f"{path.relative_to(REPO)}:{line}: {shlex.join(argv)}"
    try:
        if argv[0] == "tunerctl":
            parse_tunerctl(argv[1:])
        else:
            parse_tunerd(argv[1:])
    except click.exceptions.Exit:
        pass  # --help / --version
    except click.ClickException as err:
        raise AssertionError(f"{where}: {err.format_message()}") from None
    except AssertionError as err:
        raise AssertionError(f"{where}: {err}") from None


def test_the_parser_check_can_fail() -> None:
    for bad in (["bind", "--no-such-flag", "1"], ["plan", "--policy-dirr", "x"], ["nope"]):
        with pytest.raises(click.ClickException):
            parse_tunerctl(bad)
    with pytest.raises(AssertionError):
        parse_tunerd(["--no-such-flag"])


def test_configuration_md_is_generated_from_the_key_table() -> None:
    r = subprocess.run([sys.executable, str(REPO / "scripts/gen_docs.py"), "--check"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def test_readme_is_a_front_page_and_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            dest = (page.parent / target).resolve()
            if dest.name in OTHER_BRANCH_DOCS:
                continue
            assert dest.exists(), f"{page.relative_to(REPO)}: link to missing {target}"


def test_policies_md_describes_each_bundled_policy_and_rule_exactly() -> None:
    """docs/policies.md's table row of each bundled file names its match, every [[job]]
    rule with each of its keys and values, and every host setting it writes."""
    try:
        import tomllib
    except ImportError:  # python 3.10
        import tomli as tomllib

    rows = {m.group(1): m.group(0) for m in re.finditer(
        r"^\| `(00-[a-z0-9-]+\.toml)` \|.*$", (REPO / "docs/policies.md").read_text(), re.M)}
    files = sorted((REPO / "policies").glob("*.toml"))
    assert sorted(rows) == [f.name for f in files]
    for f in files:
        row, doc = rows[f.name], tomllib.loads(f.read_text())
        for job in doc.get("job", []):
            assert f"`[[job]] {job['name']}`" in row, (f.name, job["name"])
            for key, value in job.items():
                if key == "name":
                    continue
                if key == "match":
                    for mk, mv in value.items():
                        want = (f"match.{mk} = true" if mv is True
                                else f"match.{mk} = {json.dumps(mv)}".replace('", "', '", "'))
                        assert want in row, (f.name, job["name"], want)
                else:
                    assert f"{key} = {json.dumps(value)}" in row, (f.name, key, value)
        for key, value in (doc.get("sysctl") or {}).items():
            assert f"`{key}`" in row or key.rsplit(".", 1)[-1] in row, (f.name, key)
            assert str(value) in row, (f.name, key, value)
        for key, value in (doc.get("nccl") or {}).items():
            assert f"{key}={value}" in row, (f.name, key)
        for key, value in (doc.get("vm") or {}).items():
            assert f"{key} = {json.dumps(value)}" in row, (f.name, key)
        assert "*torchrun*" not in row and "LOCAL_RANK` set" not in row


def test_bundled_policy_comments_say_which_binds_take_the_fd_limit() -> None:
    """[limits] nofile is applied by `run` and rule binds, never by a plain `bind`
    (that one needs --nofile): 00-default.toml's comment said otherwise."""
    text = (REPO / "policies/00-default.toml").read_text()
    assert "`tunerctl bind` / `tunerctl run` use" not in text
    assert "`tunerctl run` leases and [[job]] rule binds apply" in text
    assert "a plain `tunerctl bind` changes a limit only when given --nofile" in text


def test_readme_commands_run_in_the_root_shell_the_quick_start_assumes() -> None:
    """The Quick start puts the reader in a root shell ("no sudo needed"): a `sudo` in a
    README command fails there (`sudo: command not found` on a bare image)."""
    readme = REPO / "README.md"
    assert "in a root shell" in readme.read_text()
    bad = []
    for first, lines in shell_blocks(readme.read_text()):
        for i, line in enumerate(lines):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                words = line.split()
            if "sudo" in words:
                bad.append(f"README.md:{first + i}: {line}")
    assert not bad, "\n".join(bad)


@pytest.mark.root
def test_the_readme_status_sample_has_every_line_a_fresh_daemon_prints(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The tour's `tunerctl status` sample names the same sections, in the same order, as
    a real daemon's status (a service added later, `gpuuse`, was missing)."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"```sh\ntunerctl status\n```\n```text\n(.*?)```", text, re.S)
    assert m, "README.md: no `tunerctl status` sample"
    sample = [ln.split(":")[0] for ln in m.group(1).splitlines()[1:]]
    d = daemon_factory().start()
    real = [ln.split(":")[0] for ln in d.ctl("status").out.splitlines()[1:] if ln.strip()]
    assert sample == real, (sample, real)
