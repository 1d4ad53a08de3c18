"""tunerctl bind stays cheap to start: it runs in job prologs (see bench/bind_latency.py).

tests/test_layering.py checks what the bind path imports at module level; these run it.
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.helpers import REPO, DaemonProc

# click is loaded before the snapshot: the target is bind <= 1.3x `import click`, so what
# counts is what tunerd adds to it. The result is printed with repr (json would be
# loaded first and so not counted).
PROBE = """
import atexit, sys, threading
import click
before = set(sys.modules)
from tunerd.cli.main import main
rc = main(sys.argv[1:])
print(repr({"rc": rc, "new": sorted(set(sys.modules) - before),
            "left": [threading.active_count(), atexit._ncallbacks()]}))
"""

HEAVY = ("psutil", "rich", "pynvml", "pyudev", "prometheus_client", "torch",
         "dataclasses", "asyncio", "tunerd.daemon", "tunerd.topology",
         "tunerd.jobs.binding", "tunerd.policy",
         # what the bind path no longer needs (tunerd.wire.client, tunerd.cli.types.Command)
         "socket", "selectors", "locale", "gettext")

# everything a successful `tunerctl bind PID --cpus LIST` adds to `import click`
BIND_LOADS = {"tunerd", "tunerd.cli", "tunerd.cli.main", "tunerd.cli.cmd_bind",
              "tunerd.cli.context", "tunerd.cli.types", "tunerd.wire", "tunerd.wire.client",
              "tunerd.base", "tunerd.base.cpulist", "tunerd.base.errors",
              "tunerd.wire.protocol", "tunerd.base.text",
              "json", "json.decoder", "json.encoder", "json.scanner", "_json",
              "struct", "_struct", "_socket"}


def probe(*args: str) -> tuple[int, set[str]]:
    """tunerctl ARGS run in a fresh interpreter: (exit status, modules it loaded).

    It also checks what tunerctl.main.EXIT_FAST relies on: these commands leave no
    thread running and no atexit handler behind (they end without the teardown)."""
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    out = ast.literal_eval(p.stdout.strip().splitlines()[-1])
    assert isinstance(out, dict), p.stderr
    assert out["left"] == [1, 0], out["left"]  # main thread only, no atexit handler
    return int(out["rc"]), set(out["new"])


def heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY))


def test_bind_path_imports_nothing_heavy() -> None:
    rc, new = probe("--socket", "/nonexistent/tunerd.sock", "bind", "1", "--cpus", "0")
    assert rc == 3  # no daemon there: unreachable, after parsing the arguments
    assert heavy(new) == []
    assert "tunerd.cli.cmd_bind" in new


@pytest.mark.root
def test_a_bind_that_works_loads_only_the_bind_path(daemon: DaemonProc) -> None:
    kid = subprocess.Popen(["sleep", "60"])
    try:
        rc, new = probe("--socket", str(daemon.socket), "bind", str(kid.pid), "--cpus", "0")
        assert rc == 0, daemon.log()
        assert heavy(new) == []
        assert new <= BIND_LOADS, sorted(new - BIND_LOADS)
        assert {"tunerd.wire.client", "_socket", "tunerd.base.cpulist"} <= new  # it did run
    finally:
        kid.kill()
        kid.wait()


def test_every_command_makes_its_help_option_without_gettext() -> None:
    import click

    from tunerd.cli.main import LAZY_COMMANDS, cli
    from tunerd.cli.types import Command, Group

    ctx = click.Context(cli)
    todo: list[click.Command] = [cli]
    todo += [c for c in (cli.get_command(ctx, n) for n in sorted(LAZY_COMMANDS)) if c]
    assert len(todo) == len(LAZY_COMMANDS) + 1
    while todo:
        cmd = todo.pop()
        # @click.command(cls=Command); a Group's subcommands are Commands by default
        assert isinstance(cmd, (Command, Group)), f"{cmd.name}: a plain {type(cmd).__name__}"
        if isinstance(cmd, click.Group):
            todo += cmd.commands.values()


def test_the_commands_that_exit_fast_exist() -> None:
    from tunerd.cli.main import EXIT_FAST, LAZY_COMMANDS

    assert {"bind", "unbind", "status"} <= EXIT_FAST <= set(LAZY_COMMANDS)
