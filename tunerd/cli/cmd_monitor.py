"""tunerctl top / metrics / doctor / advise."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from tunerd.cli.context import get_ctx


@click.command()
@click.option("--once", is_flag=True, help="Print one frame and exit (no full-screen view).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
def top(once: bool, interval: float) -> int:
    """Live view of GPUs, NUMA nodes and bound jobs."""
    ctx = get_ctx()
    if ctx.as_json:
        ctx.emit(ctx.call("top"))
        return 0
    from rich.console import Console
    from rich.live import Live

    from tunerd.cli.top_view import render

    console = Console()
    if once:
        console.print(render(ctx.call("top")))
        return 0
    try:
        with Live(render(ctx.call("top")), console=console, screen=True,
                  auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(ctx.call("top")), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


@click.command()
def metrics() -> int:
    """Prometheus exposition text (the same as the /metrics endpoint)."""
    ctx = get_ctx()
    text = ctx.call("metrics")["text"]
    if ctx.as_json:
        ctx.emit({"text": text})
    else:
        click.echo(text, nl=False)
    return 0


@click.command()
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="Directory the training data is read from (default: current directory).")
@click.option("--python", "python", default=None,
              help="Python whose torch to check (default: the one running tunerctl).")
def doctor(data_dir: Path | None, python: str | None) -> int:
    """Environment self-check: driver, CUDA, torch, NCCL, PCIe, filesystems, limits."""
    from tunerd.doctor import Env, format_report, run_checks

    ctx = get_ctx()
    env = Env()
    if python:
        env.python = python
    results = run_checks(data_dir=data_dir or Path.cwd(), env=env)
    summary = {s: sum(1 for r in results if r.status == s)
               for s in ("PASS", "WARN", "FAIL", "SKIP")}
    report = {"checks": [r.to_dict() for r in results], "summary": summary}
    ctx.emit(report, lambda _r: format_report(results))
    return 1 if summary["FAIL"] else 0


def _human_advice(res: dict[str, Any]) -> str:
    lines: list[str] = []
    for job in res.get("jobs") or []:
        lines.append(f"pid {job['pid']} ({job.get('name') or '-'}), "
                     f"{job['samples']} sample(s):")
        if not job["findings"]:
            lines.append("  no findings")
        for f in job["findings"]:
            ev = ", ".join(f"{k}={v}" for k, v in f["evidence"].items() if v is not None)
            lines += [f"  [{f['severity'].upper()}] {f['id']}: {f['title']}",
                      f"    evidence: {ev}", f"    why: {f['why']}", f"    fix: {f['fix']}"]
    return "\n".join(lines) or "no bound jobs to advise on"


@click.command()
@click.argument("pid", type=int, required=False)
def advise(pid: int | None) -> int:
    """Bottleneck findings for a bound job (or every bound job)."""
    ctx = get_ctx()
    res = ctx.call("advise", pid=pid)
    ctx.emit(res, _human_advice)
    # like a check that found problems: exit 1 when a warning or worse was found
    bad = any(f["severity"] in ("warning", "critical")
              for j in res.get("jobs") or [] for f in j["findings"])
    return 1 if bad else 0
