"""tunerctl bench: A/B benchmark of a training command (or the built-in workload)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import CPULIST, Command, CountType, cpu_args

QUICK_RUNS = 4
DEFAULT_RUNS = 5
QUICK_STEPS = 20
DEFAULT_STEPS = 48
F = TypeVar("F", bound=Callable[..., Any])


def workload_options(f: F) -> F:
    """The options bench and tune share: runs per arm, placement sizes, the noisy
    neighbour, the workload's interpreter and length, the per-run timeout and CMD."""
    for option in reversed((
        click.option("--runs", type=click.IntRange(2, 1000), default=None,
                     help=f"Measured runs per arm [default: {DEFAULT_RUNS}; "
                          f"--quick: {QUICK_RUNS}]."),
        click.option("--warmup", type=click.IntRange(0, 100), default=None,
                     help="Runs per arm discarded first [default: 1; --quick: 0]."),
        click.option("--gpus", type=CountType(minimum=0, maximum=1024), default=None,
                     help="Placed runs (tunerd, exclusive): GPUs to lease."),
        click.option("--ncpus", type=CountType(maximum=65536), default=None,
                     help="Placed runs: number of CPUs to lease."),
        click.option("--cpus", type=CPULIST, default=None,
                     help="Placed runs: exactly these CPUs (a cpulist, as for bind)."),
        click.option("--noisy", is_flag=True,
                     help="Noisy neighbour: a CPU hog runs during every run (exclusive "
                          "placements move it off their CPUs)."),
        click.option("--python", "python", metavar="PATH", default=None,
                     help="Interpreter of the built-in workload [default: the first with "
                          "torch of python3 on PATH, the config's job_python, tunerctl's "
                          "own]."),
        click.option("--steps", type=click.IntRange(2, 1_000_000), default=None,
                     help=f"Batches of the built-in workload per run [default: {DEFAULT_STEPS}; "
                          f"--quick: {QUICK_STEPS}]."),
        click.option("--timeout", type=click.FloatRange(1, None), default=None,
                     help="Seconds before one run counts as failed [default: 600; "
                          "--quick: 120]."),
        click.argument("cmd", nargs=-1, type=click.UNPROCESSED),
    )):
        f = option(f)
    return f


def run_plan(quick: bool, runs: int | None, warmup: int | None,
             timeout: float | None) -> tuple[int, int, float]:
    """(runs, warm-up runs, per-run timeout) per arm, from the options and --quick."""
    return (runs or (QUICK_RUNS if quick else DEFAULT_RUNS),
            warmup if warmup is not None else (0 if quick else 1),
            timeout or (120.0 if quick else 600.0))


def _torch_hint(exclude: str) -> str:
    """The training Python doctor would check, if it is not ``exclude`` and has torch, for
    the error message ("" if none): python3 on PATH outside tunerd's own venv, else the
    daemon config's job_python."""
    from tunerd.base.errors import TunerdError
    from tunerd.bench.arms import probe
    from tunerd.diagnose.doctor import find_training_python

    found = find_training_python(None, os.environ)
    cand = found.path
    # compared unresolved: venvs' pythons are links to one base interpreter, and the one
    # with torch must not be taken for the bare one that failed
    if cand is None or os.path.abspath(cand) == os.path.abspath(exclude):
        return ""
    try:
        if probe(cand, timeout=10).torch:
            return f" ({cand}, {found.how}, has torch: --python {cand})"
    except TunerdError:
        pass
    return ""


def workload_python(python: str | None) -> Any:
    """The built-in workload's interpreter, found as doctor finds the training Python:
    --python, else python3 on PATH (not tunerd's own venv) or the config's job_python,
    else tunerctl's own; the first of these that has torch. Failed (exit 1) when none
    has: the workload trains with torch, and nothing else is ever run in its place."""
    import dataclasses

    from tunerd.base.errors import Failed, TunerdError
    from tunerd.bench.arms import probe
    from tunerd.diagnose.doctor import find_training_python

    if python:
        interp = probe(python)
        if not interp.torch:
            raise Failed(f"the built-in workload trains with torch, and {interp.executable} "
                         f"(Python {interp.version}) cannot import torch; choose an "
                         f"interpreter that has it with --python PATH"
                         f"{_torch_hint(interp.executable)}, or install torch there "
                         "(pip install 'tunerd[torch]')")
        return dataclasses.replace(interp, how="--python")
    found = find_training_python(None, os.environ)
    candidates = [(found.path, found.how)] if found.path else []
    candidates.append((sys.executable, "tunerctl's own"))
    tried: list[str] = []
    for path, how in candidates:
        try:
            interp = probe(path)
        except TunerdError as err:
            tried.append(f"{path} ({how}): {err}")
            continue
        if interp.torch:
            return dataclasses.replace(interp, how=how)
        tried.append(f"{interp.executable} ({how}): no torch")
    raise Failed("the built-in workload trains with torch and no Python found has it ("
                 + "; ".join(tried) + "): pass the one your training jobs use with "
                 "--python PATH, or run your own command after --")


def workload_command(cmd: tuple[str, ...], python: str | None,
                     steps: int | None) -> list[str]:
    """CMD of bench and tune, without a leading "--"; --python and --steps, which are the
    built-in workload's, only go without one."""
    command = list(cmd)
    if command and command[0] == "--":
        command = command[1:]
    if command and python:
        raise click.UsageError("--python chooses the built-in workload's interpreter; with a "
                               "command, name the interpreter in the command")
    if command and steps is not None:
        raise click.UsageError("--steps sets the built-in workload's batches; with a command, "
                               "pass its own option for its length")
    return command


def resolve_workload(command: list[str], python: str | None, steps: int | None, quick: bool,
                     path_env: dict[str, str]) -> tuple[list[str], Any, str, dict[str, str]]:
    """(command, interpreter, workload name, environment): CMD as given, or the built-in
    workload in its interpreter (which must have torch) with its step count."""
    from tunerd.bench import builtin_command
    from tunerd.bench.workload import NAME

    if command:
        return command, None, "command: " + " ".join(command), {}
    interp = workload_python(python)
    steps = steps or (QUICK_STEPS if quick else DEFAULT_STEPS)
    return (builtin_command(interp.path, path_env), interp, NAME,
            {**path_env, "TUNERD_BENCH_STEPS": str(steps)})


class _Progress:
    """A rich progress bar on a terminal, one line per run otherwise (none with --json)."""

    def __init__(self, quiet: bool) -> None:
        self.bar: Any = None
        self.task: Any = None
        self.quiet = quiet
        self.per_arm = {"A": 0, "B": 0}
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, done: int, total: int, result: Any, what: str) -> None:
        if self.bar is not None:
            if self.task is None:
                self.task = self.bar.add_task("bench", total=total)
            desc = f"running {what}" if result is None else self._line(result)
            self.bar.update(self.task, completed=done, description=desc)
            return
        if result is not None and not self.quiet:
            click.echo(f"[{done}/{total}] {self._line(result)}", err=True)

    def _line(self, r: Any) -> str:
        self.per_arm[r.arm] += 1
        name = f"{r.arm} run {self.per_arm[r.arm]}" + (" (warm-up)" if r.warmup else "")
        if r.error:
            return f"{name}: failed, {r.error} ({r.wall_s:.1f} s)"
        return f"{name}: {r.metric} = {r.value:.4g} ({r.wall_s:.1f} s)"


@click.command(cls=Command, context_settings={"allow_interspersed_args": False})
@click.option("--quick", is_flag=True,
              help="4 runs per arm (the fewest that can name a winner), no warm-up run, a "
                   "shorter built-in workload (<= 60 s on a 2-CPU machine).")
@click.option("--a", "arm_a", metavar="SPEC", default=None,
              help="Arm A: placement=unbound|tunerd|exclusive and settings, e.g. "
                   "'placement=unbound,amp=off' [default: placement=unbound].")
@click.option("--b", "arm_b", metavar="SPEC", default=None,
              help="Arm B, as --a; settings: num_workers, pin_memory, persistent_workers, "
                   "prefetch_factor, amp=off|bf16|fp16, compile [default: placement=tunerd].")
@click.option("--exclusive", is_flag=True, help="Arm B placement=exclusive (older spelling).")
@click.option("--noisy-procs", type=click.IntRange(1, 1024), default=None,
              help="Processes of the hog [default: the CPUs this process may use].")
@click.option("--png", "png", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also plot the metric of every run per arm (needs the 'plot' extra).")
@workload_options
def bench(runs: int | None, warmup: int | None, quick: bool, arm_a: str | None,
          arm_b: str | None, gpus: int | None, ncpus: int | None, cpus: str | None,
          exclusive: bool, noisy: bool, noisy_procs: int | None, python: str | None,
          steps: int | None, timeout: float | None, png: Path | None,
          cmd: tuple[str, ...]) -> int:
    """A/B-test a training command: arm A against arm B, interleaved, with a 95% interval.

    By default A is the command as it is and B runs it through `tunerctl run` (tunerd's
    placement). Arms can also differ in training settings (num_workers, pin_memory, amp,
    compile), which reach the command through tunerd.torch's environment overrides.
    Without CMD the built-in workload runs (the guide's example: nn.Linear(1024, 1024),
    AMP, gradient accumulation, a DataLoader with workers), in --python's interpreter
    (default: found as doctor finds the training Python; the report says which).
    A command reports its figure of merit by printing
    `TUNERD_METRIC <name> <value> [higher|lower]` or through tunerd.torch.StepReporter;
    otherwise wall time is compared.

    \b
    Examples:
      tunerctl bench --quick
      tunerctl bench --a amp=off --b amp=bf16 --runs 7
      tunerctl bench --noisy --b placement=exclusive --ncpus 1
      tunerctl bench --runs 7 --gpus 1 -- python train.py --epochs 1
    """
    from tunerd.bench import BenchConfig, run_bench, tunerd_on_path
    from tunerd.bench.arms import ArmSpec, PlacementRequest, parse_arm
    from tunerd.bench.report import format_human, format_json, plot_missing, write_png

    ctx = get_ctx()
    as_json = ctx.as_json
    command = workload_command(cmd, python, steps)
    a = parse_arm(arm_a, "--a") if arm_a is not None else ArmSpec("unbound")
    b = parse_arm(arm_b, "--b") if arm_b is not None else ArmSpec("tunerd")
    if exclusive:
        b = b.with_setting("placement", "exclusive")
    if a == b:
        raise click.UsageError(f"arms A and B are the same ({a.describe()}): nothing to compare")
    ncpus, cpulist = cpu_args(ncpus, cpus)
    if png is not None and (why := plot_missing()):
        from tunerd.base.errors import Failed

        raise Failed(why)
    runs, warmup, timeout = run_plan(quick, runs, warmup, timeout)
    if any(s.placement != "unbound" for s in (a, b)):
        ctx.call("ping")  # no daemon: exit 3 now, not after the first arm
    with tunerd_on_path() as path_env:
        command, interp, workload, env = resolve_workload(command, python, steps, quick,
                                                          path_env)
        cfg = BenchConfig(command=command, workload=workload, arms=(a, b),
                          placement=PlacementRequest(gpus, ncpus, cpulist), interpreter=interp,
                          runs=runs, warmup=warmup, timeout=timeout,
                          noisy=(noisy_procs or len(os.sched_getaffinity(0))) if noisy else 0,
                          socket_path=ctx.socket_path, env=env)
        with _Progress(quiet=as_json) as progress:
            result = run_bench(cfg, progress)
    click.echo(format_json(result) if as_json else format_human(result))
    if png is not None:
        write_png(result, png)
        if not as_json:
            click.echo(f"plot: {png}")
    return result.exit_code()
