"""tunerctl entry point.

Start-up speed matters (``tunerctl bind`` runs in job prologs): this module
imports click and the stdlib only, and each command's module is imported only
when that command runs (see LAZY_COMMANDS).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from tunerd import __version__
from tunerd.errors import TunerdError
from tunerd.protocol import ExitCode, exit_code

# command name -> "module:attribute" of its click command
LAZY_COMMANDS: dict[str, str] = {
    "bench": "tunerd.cli.cmd_bench:bench",
    "tune": "tunerd.cli.cmd_tune:tune",
    "status": "tunerd.cli.cmd_core:status",
    "bind": "tunerd.cli.cmd_bind:bind",
    "unbind": "tunerd.cli.cmd_bind:unbind",
    "jobs": "tunerd.cli.cmd_bind:jobs",
    "policy": "tunerd.cli.cmd_policy:policy",
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
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = LAZY_COMMANDS.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        mod_name, _, attr = target.partition(":")
        cmd = getattr(importlib.import_module(mod_name), attr)
        assert isinstance(cmd, click.Command)
        return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--socket", "socket_path", envvar="TUNERD_SOCKET", default=None,
              help="Control socket (default /run/tunerd/tunerd.sock, env TUNERD_SOCKET).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")
@click.version_option(version=__version__, prog_name="tunerctl")
@click.pass_context
def cli(ctx: click.Context, socket_path: str | None, as_json: bool) -> None:
    """Talk to the tunerd host-tuning daemon."""
    from tunerd.cli.context import CliContext

    ctx.obj = CliContext(socket_path=socket_path, as_json=as_json)


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
        from tunerd.cli.context import report_error

        report_error(e, "--json" in (argv if argv is not None else sys.argv))
        code = int(exit_code(e))
    except KeyboardInterrupt:
        code = 130
    else:
        code = int(rv) if isinstance(rv, int) else 0
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
