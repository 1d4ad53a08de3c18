"""Parameter types shared by tunerctl commands, with messages that say what was expected.

click's own ``IntRange`` answers a typo with "'notapid' is not a valid integer range";
these say "PID must be a positive integer, got 'notapid'". On the start-up path of
job prologs: imports click only (tunerd.base.cpulist, stdlib-only, when a list is parsed).
"""

from __future__ import annotations

from typing import Any

import click

from tunerd.base.text import plural as plural  # re-exported: the commands import it from here

HELP_TEXT = "Show this message and exit."


def _show_help(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(ctx.get_help(), color=ctx.color)
        ctx.exit()


def _help_option(cmd: Command | Group, ctx: click.Context) -> click.Option | None:
    names = cmd.get_help_option_names(ctx)
    if not names or not cmd.add_help_option:
        return None
    if cmd.fixed_help_option is None or cmd.fixed_help_option.opts != names:
        # made once and kept: click tells eager parameters apart by identity
        cmd.fixed_help_option = click.Option(
            [*names, "_tunerctl_help"], is_flag=True, expose_value=False, is_eager=True,
            help=HELP_TEXT, callback=_show_help)
    return cmd.fixed_help_option


class Command(click.Command):
    """A tunerctl command (``@click.command(cls=Command)``).

    Its -h/--help option has a fixed help text: click's own ``help_option`` passes
    the text through ``gettext`` each time it makes the option (once per command
    parsed), and the first ``gettext`` call imports ``locale`` and its alias tables,
    about a sixth of what ``tunerctl bind`` added to ``import click``
    (bench/bind_latency.py). click ships no translations, so the text is the same;
    the option works as click's does (eager, prints the help, exits), and
    ``get_help_option`` is click's hook for it, which usage errors also ask for
    their "Try '... --help' for help." line.
    """

    fixed_help_option: click.Option | None = None

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        return _help_option(self, ctx)


class Group(click.Group):
    """A tunerctl command group (help option as Command's); the commands and groups
    made with its ``command``/``group`` decorators are a Command and a Group."""

    command_class = Command
    group_class = type  # click: subgroups are of this same class
    fixed_help_option: click.Option | None = None

    def get_help_option(self, ctx: click.Context) -> click.Option | None:
        return _help_option(self, ctx)


class CountType(click.ParamType):
    """An integer in [minimum, maximum]; ``what`` names it in errors (click already
    names an option, so options leave it out: "Invalid value for '--ncpus': must be
    a positive integer, got 'x'")."""

    def __init__(self, what: str = "", minimum: int = 1, maximum: int | None = None,
                 metavar: str = "N") -> None:
        self.what = what
        self.minimum = minimum
        self.maximum = maximum
        self.name = metavar

    def _expected(self) -> str:
        if self.maximum is not None:
            return f"an integer from {self.minimum} to {self.maximum}"
        if self.minimum == 1:
            return "a positive integer"
        if self.minimum == 0:
            return "an integer, 0 or more"
        return f"an integer, {self.minimum} or more"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        else:
            text = str(value).strip()
            # int() would also take "1_000" and "+3"; a PID or count is plain digits
            if not text.isdigit():
                self.fail(f"{self._subject()} {self._expected()}, got {value!r}", param, ctx)
            n = int(text)
        if n < self.minimum or (self.maximum is not None and n > self.maximum):
            self.fail(f"{self._subject()} {self._expected()}, got {n}", param, ctx)
        return n

    def _subject(self) -> str:
        return f"{self.what} must be" if self.what else "must be"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return self.name


class SecondsType(click.ParamType):
    """A number of seconds, at least ``minimum``."""

    name = "SECONDS"

    def __init__(self, minimum: float) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"must be a number of seconds, got {value!r}", param, ctx)
        if not v >= self.minimum:  # also false for NaN
            self.fail(f"must be at least {self.minimum:g} s, got {value!r}", param, ctx)
        return v


class CpuListType(click.ParamType):
    """The kernel's cpulist syntax, checked here so a typo never reaches the daemon."""

    name = "LIST"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        from tunerd.base.cpulist import CpuListError, format_cpulist, parse_cpulist

        try:
            ids = parse_cpulist(str(value))
        except CpuListError as err:
            self.fail(str(err), param, ctx)
        if not ids:
            self.fail("empty list", param, ctx)
        return format_cpulist(ids)


PID = CountType("PID", metavar="PID")
CPULIST = CpuListType()


def cpu_args(ncpus: int | None, cpus: str | None) -> tuple[int | None, str | None]:
    """(count, cpulist) from ``--ncpus N`` / ``--cpus LIST``: ``--cpus`` is a CPU list
    everywhere, as in bind (``--cpus 1`` is CPU 1; the old count spelling is gone)."""
    if ncpus is not None and cpus is not None:
        raise click.UsageError("give --ncpus N (a count) or --cpus LIST (exact CPUs), not both")
    return ncpus, cpus
