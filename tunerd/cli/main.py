"""tunerctl entry point.

Start-up speed matters (``tunerctl bind`` runs in job prologs): this module
imports click and the stdlib only, and each command's module is imported only
when that command runs (see LAZY_COMMANDS).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from tunerd import __version__
from tunerd.base.errors import TunerdError
from tunerd.cli.types import Group
from tunerd.wire.protocol import ExitCode, exit_code

# command name -> "module:attribute" of its click command
LAZY_COMMANDS: dict[str, str] = {
    "bench": "tunerd.cli.cmd_bench:bench",
    "tune": "tunerd.cli.cmd_tune:tune",
    "status": "tunerd.cli.cmd_core:status",
    "reload": "tunerd.cli.cmd_core:reload",
    "bind": "tunerd.cli.cmd_bind:bind",
    "unbind": "tunerd.cli.cmd_bind:unbind",
    "jobs": "tunerd.cli.cmd_bind:jobs",
    "policy": "tunerd.cli.cmd_policy:policy",
    "env": "tunerd.cli.cmd_env:env",
    # -- host settings:
    "plan": "tunerd.cli.cmd_host:plan",
    "apply": "tunerd.cli.cmd_host:apply",
    "verify": "tunerd.cli.cmd_host:verify",
    "revert": "tunerd.cli.cmd_host:revert",
    # -- topology:
    "topology": "tunerd.cli.cmd_topology:topology",
    # -- leases:
    "alloc": "tunerd.cli.cmd_leases:alloc",
    "release": "tunerd.cli.cmd_leases:release",
    "run": "tunerd.cli.cmd_leases:run",
    "leases": "tunerd.cli.cmd_leases:leases",
    # -- monitor:
    "top": "tunerd.cli.cmd_monitor:top",
    "metrics": "tunerd.cli.cmd_monitor:metrics",
    "doctor": "tunerd.cli.cmd_monitor:doctor",
    "advise": "tunerd.cli.cmd_monitor:advise",
    # -- fleet (Prometheus):
    "fleet": "tunerd.cli.cmd_fleet:fleet",
}


# Commands that make one request, print the answer and return (what job prologs and
# epilogs run): when one has returned there is nothing left for the interpreter's
# teardown to do (no threads, temporary files, atexit handlers or open files of its
# own), and that teardown -- freeing every module and object -- is 16-17 M of the
# 154 M instructions of a `tunerctl bind` (bench/bind_latency.py --instructions). Run
# as a program (main() with no argv), tunerctl then flushes its output and ends at once
# (_exit_now); other commands end the usual way.
EXIT_FAST = frozenset({"bind", "unbind", "jobs", "status", "reload", "alloc", "release",
                       "leases"})
_exit_fast = [False]  # set by the root callback once click has resolved the command


def _exit_now(code: int) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return  # a closed or broken stdout: the interpreter reports it, as it always has
    os._exit(code)


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().obj.as_json = True


def with_json_option(cmd: click.Command) -> click.Command:
    """Let ``--json`` stand after the command too (``tunerctl doctor --json``).

    Added to every command and subcommand as click parses it, so it is an option
    of that command only: in ``run -- CMD --json`` the ``--json`` stays part of CMD.
    A command that defines its own ``--json`` keeps it.
    """
    if not any("--json" in p.opts for p in cmd.params):
        cmd.params.append(click.Option(
            ["--json"], is_flag=True, expose_value=False, callback=_set_json,
            help="Machine-readable JSON output (same as tunerctl --json)."))
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            with_json_option(sub)
    return cmd


def _show_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    # click.version_option's behaviour and text, without its two gettext calls (see
    # tunerd.cli.types.Command: start-up time)
    if value and not ctx.resilient_parsing:
        click.echo(f"tunerctl, version {__version__}", color=ctx.color)
        _exit_fast[0] = True  # nothing else ran: no teardown needed (EXIT_FAST)
        ctx.exit()


class LazyGroup(Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = LAZY_COMMANDS.get(cmd_name)
        if target is None:
            cmd = super().get_command(ctx, cmd_name)
            return None if cmd is None else with_json_option(cmd)
        mod_name, _, attr = target.partition(":")
        cmd = getattr(importlib.import_module(mod_name), attr)
        assert isinstance(cmd, click.Command)
        return with_json_option(cmd)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "socket_path", envvar="TUNERD_SOCKET", default=None,
              help="Control socket (default /run/tunerd/tunerd.sock, env TUNERD_SOCKET).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")
# Job prologs and epilogs must never wait long for a hung daemon: this bounds the
# connect and each reply (not a whole multi-request command such as `top`).
@click.option("--timeout", "timeout", envvar="TUNERCTL_TIMEOUT", default=60.0,
              show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds to wait for the daemon to accept and to answer each request;"
                   " on expiry exit 3 (env TUNERCTL_TIMEOUT).")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True,
              callback=_show_version, help="Show the version and exit.")
@click.pass_context
def cli(ctx: click.Context, socket_path: str | None, as_json: bool, timeout: float) -> None:
    """Talk to the tunerd host-tuning daemon."""
    from tunerd.cli.context import CliContext

    _exit_fast[0] = ctx.invoked_subcommand in EXIT_FAST
    ctx.obj = CliContext(socket_path=socket_path, as_json=as_json, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    """Run tunerctl; returns (and exits with) a documented ExitCode."""
    try:
        rv: Any = cli.main(args=argv, prog_name="tunerctl", standalone_mode=False)
    except click.exceptions.Exit as e:
        code = int(e.exit_code)
    except click.ClickException as e:  # usage errors: exit 2
        e.show()
        code = int(e.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        code = int(ExitCode.FAILED)
    except TunerdError as e:
        from tunerd.cli.context import CliContext, report_error

        report_error(e, CliContext.active is not None and CliContext.active.as_json)
        code = int(exit_code(e))
    except KeyboardInterrupt:
        code = 130
    else:
        code = int(rv) if isinstance(rv, int) else 0
    if argv is None:
        if _exit_fast[0]:
            _exit_now(code)
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
