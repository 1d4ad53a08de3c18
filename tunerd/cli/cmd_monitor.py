"""tunerctl top / metrics / doctor / advise."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import PID, Command, SecondsType, plural


@click.command(cls=Command)
@click.option("--once", is_flag=True, help="Print one frame and exit (no full-screen view).")
@click.option("--interval", type=SecondsType(0.1), default=1.0, show_default=True,
              help="Seconds between refreshes.")
def top(once: bool, interval: float) -> int:
    """Live view of GPUs, NUMA nodes and bound jobs.

    Keys: q quits, ? shows help; the jobs are sorted by c CPU (default), m memory,
    s samples/s, p pid or n name, each with a sparkline of its recent CPU use.
    """
    ctx = get_ctx()
    if ctx.as_json:
        ctx.emit(ctx.call("top"))
        return 0
    from rich.console import Console
    from rich.live import Live

    from tunerd.cli.top_view import TopState, render

    console = Console()
    if once:
        console.print(render(ctx.call("top")))
        return 0
    state = TopState()
    reply = ctx.call("top")
    state.record(reply)
    try:
        with _keys() as read_key, Live(render(reply, state), console=console, screen=True,
                                       auto_refresh=False) as live:
            while True:
                deadline = time.monotonic() + interval
                while (left := deadline - time.monotonic()) > 0:
                    key = read_key(left)
                    if key is None:
                        continue
                    if not state.key(key):
                        return 0
                    live.update(render(reply, state), refresh=True)
                reply = ctx.call("top")
                state.record(reply)
                live.update(render(reply, state), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str | None]]:
    """A reader of single key presses (cbreak mode while the view runs; the terminal
    is restored after). Without a terminal on stdin it only waits."""
    import select
    import sys

    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None

    def wait(timeout: float) -> str | None:
        time.sleep(timeout)
        return None

    if fd is None:
        yield wait
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)

    def read(timeout: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            return None
        return os.read(fd, 1).decode(errors="replace")

    tty.setcbreak(fd)
    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@click.command(cls=Command)
def metrics() -> int:
    """Prometheus exposition text (the same as the /metrics endpoint)."""
    ctx = get_ctx()
    text = ctx.call("metrics")["text"]
    if ctx.as_json:
        ctx.emit({"text": text})
    else:
        from tunerd.base.text import safe

        # label values are user text (job names): no control character reaches the terminal
        click.echo("".join(safe(line) + "\n" for line in text.splitlines()), nl=False)
    return 0


@click.command(cls=Command)
@click.option("--data-dir", type=click.Path(path_type=Path), default=None,
              help="Directory the training data is read from (default: current directory).")
@click.option("--python", "python", default=None, metavar="PATH",
              help="The Python your training jobs run with, whose torch and CUDA to check "
                   "(default: python3 on your PATH other than tunerd's own venv, else "
                   "job_python from the daemon's config file).")
@click.option("--config", "config", type=click.Path(dir_okay=False, path_type=Path),
              default=None, metavar="FILE",
              help="The daemon's config file, for job_python (default /etc/tunerd/tunerd.toml).")
@click.option("--sysfs-root", "sysfs_root", type=click.Path(file_okay=False, exists=True,
                                                              path_type=Path),
              default=None, metavar="DIR",
              help="Read the node from this recorded tree's sys/ instead of /sys (PCIe "
                   "bridges' ACS, links, IOMMU, NUMA), e.g. a copy from another node.")
@click.option("--topology", "snapshot", type=click.Path(dir_okay=False, exists=True,
                                                        path_type=Path),
              default=None, metavar="SNAPSHOT.json",
              help="The node's GPUs and NICs from this snapshot (tunerctl topology --save) "
                   "for the GPU/NIC path checks, instead of this machine's.")
def doctor(data_dir: Path | None, python: str | None, config: Path | None,
           sysfs_root: Path | None, snapshot: Path | None) -> int:
    """Environment self-check: driver, CUDA, torch, NCCL, PCIe, filesystems, limits.

    Says which Python it checked torch in, and how it found it. With --sysfs-root and
    --topology it checks a recorded node (its PCIe ACS, GPU/NIC pairs) from here.
    """
    import os

    from tunerd.diagnose.doctor import Env, find_training_python, format_report, run_checks

    ctx = get_ctx()
    found = find_training_python(python, os.environ, config)
    env = Env(python=found.path, python_how=found.how, python_notes=found.notes)
    if sysfs_root is not None:
        env.sys_root = sysfs_root
    if snapshot is not None:
        from tunerd.topology import read_snapshot

        env.topology = read_snapshot(snapshot)
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
                     f"{plural(job['samples'], 'sample')}:")
        if not job["findings"]:
            lines.append("  no findings")
        for f in job["findings"]:
            ev = ", ".join(f"{k}={v}" for k, v in f["evidence"].items() if v is not None)
            lines += [f"  [{f['severity'].upper()}] {f['id']}: {f['title']}",
                      f"    evidence: {ev}", f"    why: {f['why']}", f"    fix: {f['fix']}"]
    return "\n".join(lines) or "no bound jobs to advise on"


@click.command(cls=Command)
@click.argument("pid", type=PID, required=False)
def advise(pid: int | None) -> int:
    """Bottleneck findings for a bound job (or every bound job)."""
    ctx = get_ctx()
    res = ctx.call("advise", pid=pid)
    ctx.emit(res, _human_advice)
    # like a check that found problems: exit 1 when a warning or worse was found
    bad = any(f["severity"] in ("warning", "critical")
              for j in res.get("jobs") or [] for f in j["findings"])
    return 1 if bad else 0
