"""tunerctl bench: A/B training benchmark (as is vs. placed by tunerd)."""

from __future__ import annotations

import json
import sys

import click

from tunerd.cli.context import get_ctx


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--runs", type=click.IntRange(2, 1000), default=5, show_default=True,
              help="Measured runs per arm.")
@click.option("--warmup", type=click.IntRange(0, 100), default=1, show_default=True,
              help="Runs per arm discarded first.")
@click.option("--gpus", type=click.IntRange(0, 1024), default=None, help="B arm: GPUs to lease.")
@click.option("--cpus", type=click.IntRange(1, 65536), default=None, help="B arm: CPUs to lease.")
@click.option("--exclusive", is_flag=True, help="B arm: exclusive placement.")
@click.option("--timeout", type=float, default=3600.0, show_default=True,
              help="Seconds before one run counts as failed.")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def bench(runs: int, warmup: int, gpus: int | None, cpus: int | None, exclusive: bool,
          timeout: float, cmd: tuple[str, ...]) -> int:
    """A/B-test CMD as it is (A) against `tunerctl run` placement (B).

    Without CMD a small built-in training loop is used (torch if installed). A command can
    report its own metric by printing `TUNERD_METRIC <name> <value> [higher|lower]`.

    Example: tunerctl bench --runs 7 --gpus 1 -- python train.py --epochs 1
    """
    from tunerd.abtest import format_outcome, run_ab

    ctx = get_ctx()
    command = list(cmd) or [sys.executable, "-m", "tunerd.workload"]
    tuned = [sys.executable, "-m", "tunerd.cli.main"]
    if ctx.socket_path:
        tuned += ["--socket", ctx.socket_path]
    tuned.append("run")
    if gpus is not None:
        tuned += ["--gpus", str(gpus)]
    if cpus is not None:
        tuned += ["--cpus", str(cpus)]
    if exclusive:
        tuned.append("--exclusive")
    tuned.append("--")
    ctx.call("ping")  # fail early (exit 3) when the B arm cannot work
    outcome = run_ab(command, tuned, runs=runs, warmup=warmup, timeout=timeout,
                     progress=None if ctx.as_json else lambda s: click.echo(s, err=True))
    if ctx.as_json:
        click.echo(json.dumps(outcome.to_dict(), indent=2))
    else:
        click.echo(format_outcome(outcome))
    return 1 if outcome.a.failures or outcome.b.failures or not outcome.b.values else 0
