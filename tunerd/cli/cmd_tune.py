"""tunerctl tune: one change at a time, kept only when the benchmark says it helps."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from tunerd.cli.cmd_bench import (
    _Progress,
    resolve_workload,
    run_plan,
    workload_command,
    workload_options,
)
from tunerd.cli.context import get_ctx
from tunerd.cli.types import Command, cpu_args


def _daemon_answers() -> bool:
    from tunerd.base.errors import DaemonUnreachable, PermissionDenied

    try:
        get_ctx().call("ping")
    except (DaemonUnreachable, PermissionDenied):
        return False
    return True


@click.command(cls=Command, context_settings={"allow_interspersed_args": False})
@click.option("--quick", is_flag=True,
              help="4 runs per arm (the fewest that can name a winner), no warm-up, one "
                   "round, no torch.compile trial.")
@click.option("--settings", "only", metavar="LIST", default=None,
              help="Settings to vary, comma-separated, in this order: placement, "
                   "num_workers, pin_memory, amp, compile [default: all; --quick: all but "
                   "compile].")
@click.option("--rounds", type=click.IntRange(1, 5), default=None,
              help="Passes over the settings; a pass that keeps nothing ends the search "
                   "[default: 2; --quick: 1].")
@click.option("--save", "save", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the [[job]] rule to this file.")
@workload_options
def tune(quick: bool, runs: int | None, warmup: int | None, only: str | None,
         rounds: int | None, gpus: int | None, ncpus: int | None, cpus: str | None,
         noisy: bool, python: str | None, steps: int | None, timeout: float | None,
         save: Path | None, cmd: tuple[str, ...]) -> int:
    """Find the settings that make CMD train faster, and print them as a [[job]] rule.

    Varies one setting at a time (placement, num_workers, pin_memory, amp, compile),
    benchmarks each change against the best so far (as `tunerctl bench` does), keeps
    it only when the 95% interval says it helps, and stops a direction at the first
    change that does not. Settings other than placement reach CMD through
    tunerd.torch (dataloader_kwargs, Amp, maybe_compile); those CMD does not use are
    skipped, and the output says so. Without CMD the built-in workload is tuned.

    \b
    Example:
      tunerctl tune --quick -- python train.py --max-steps 200
      tunerctl tune --save /etc/tunerd/policies/50-tuned.toml -- torchrun ... train.py
    """
    from tunerd.bench import BenchConfig, tunerd_on_path
    from tunerd.bench.arms import ArmSpec, PlacementRequest
    from tunerd.bench.tune import DIMENSIONS, rule_snippet, search

    ctx = get_ctx()
    as_json = ctx.as_json
    command = workload_command(cmd, python, steps)
    if only is not None:
        dims = tuple(d.strip().replace("-", "_") for d in only.split(",") if d.strip())
        bad = [d for d in dims if d not in DIMENSIONS]
        if bad or not dims:
            raise click.BadParameter(f"unknown setting(s) {', '.join(bad) or '(none)'}; "
                                     f"choose from {', '.join(DIMENSIONS)}",
                                     param_hint="--settings")
    else:
        dims = tuple(d for d in DIMENSIONS if not (quick and d == "compile"))
    ncpus, cpulist = cpu_args(ncpus, cpus)
    daemon = _daemon_answers() if "placement" in dims else False
    runs, warmup, timeout = run_plan(quick, runs, warmup, timeout)
    with tunerd_on_path() as path_env:
        command, interp, workload, env = resolve_workload(command, python, steps, quick,
                                                          path_env)
        start = ArmSpec("unbound")
        cfg = BenchConfig(command=command, workload=workload, arms=(start, start),
                          placement=PlacementRequest(gpus, ncpus, cpulist), interpreter=interp,
                          runs=runs, warmup=warmup, timeout=timeout,
                          noisy=len(os.sched_getaffinity(0)) if noisy else 0,
                          socket_path=ctx.socket_path, env=env)
        say = None if as_json else (lambda s: click.echo(s, err=True))
        if say:
            say(f"tuning: {workload}" + (f" ({interp.describe()})" if interp else ""))
        from tunerd.bench import BenchResult, run_bench

        def bench(c: BenchConfig) -> BenchResult:
            with _Progress(quiet=True) as progress:
                return run_bench(c, progress)

        result = search(cfg, dims=dims, daemon=daemon, rounds=rounds or (1 if quick else 2),
                        bench=bench, report=say)
    probe = result.probe.run
    if probe.error is not None:
        from tunerd.base.errors import Failed

        tail = f"; stderr (last lines):\n{probe.stderr_tail}" if probe.stderr_tail else ""
        raise Failed(f"the command failed as it is ({probe.error}), so there is nothing to "
                     f"tune{tail}")
    snippet = rule_snippet(result)
    if save is not None:
        save.write_text(snippet)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        start_m, end_m = result.gain()
        n = f"{len(result.steps)} comparison(s) in {result.elapsed_s:.0f} s"
        metric = result.steps[0].result.comparison.metric if result.steps else None
        if start_m and end_m:
            click.echo(f"{metric}: {start_m:.4g} as it was, {end_m:.4g} with the kept "
                       f"changes ({end_m / start_m:.3f}x); {n}",
                       err=True)  # stdout is the rule alone, ready for a policy file
        elif result.steps:
            click.echo(f"{metric}: nothing kept, no change helped beyond the noise; {n}",
                       err=True)
        click.echo(snippet, nl=False)
        if save is not None:
            click.echo(f"# written to {save}; check it with: tunerctl policy check {save}",
                       err=True)
    sys.stdout.flush()
    return 0
