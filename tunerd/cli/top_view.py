"""What `tunerctl top` draws: GPUs, NUMA nodes and bound jobs, in 80 columns.

Imported only by the ``top`` command (it imports rich). ``render`` is a pure
function of the daemon's ``top`` reply, so the layout is tested at 80 columns.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType
from rich.table import Table
from rich.text import Text


def fmt_bytes(v: float | None) -> str:
    if v is None:
        return "-"
    for unit, div in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if abs(v) >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}B"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.0f}%"


def fold(text: str, width: int) -> list[str]:
    """Greedy word wrap that never breaks inside a `command` (backtick span)."""
    lines: list[str] = []
    cur = ""
    for tok in re.findall(r"`[^`]*`\S*|\S+", text):
        if cur and len(cur) + 1 + len(tok) > width:
            lines.append(cur)
            cur = tok
        else:
            cur = f"{cur} {tok}" if cur else tok
    if cur:
        lines.append(cur)
    return lines


class Note:
    """A line of prose wrapped at the console's width by ``fold``."""

    def __init__(self, text: str, style: str = "") -> None:
        self.text = text
        self.style = style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        for line in fold(self.text, options.max_width):
            yield Text(line, style=self.style, no_wrap=True, overflow="ellipsis")


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                 expand=False, title_style="bold")


def _gpus(sample: dict[str, Any]) -> RenderableType:
    gpu = sample.get("gpu") or {}
    if not gpu.get("available"):
        return Note(f"GPUs: {gpu.get('reason') or 'not available'}", style="yellow")
    t = _table("GPUs")
    for col in ("GPU", "Util", "Memory", "Power", "Temp", "SM clock", "Throttle"):
        t.add_column(col, no_wrap=True, overflow="ellipsis",
                     justify="left" if col in ("GPU", "Throttle") else "right")
    for g in gpu.get("gpus") or []:
        mem = f"{fmt_bytes(g.get('memory_used_bytes'))}/{fmt_bytes(g.get('memory_total_bytes'))}"
        power = "-" if g.get("power_watts") is None else f"{g['power_watts']:.0f}W"
        temp = "-" if g.get("temperature_celsius") is None else f"{g['temperature_celsius']:.0f}C"
        clk = "-" if g.get("sm_clock_hertz") is None else f"{g['sm_clock_hertz'] / 1e6:.0f}MHz"
        names = [n for n in g.get("throttle_reason_names") or [] if n != "gpu_idle"]
        t.add_row(str(g["gpu"]), fmt_pct(g.get("utilization_ratio")), mem, power, temp, clk,
                  Text(",".join(names) or "-", style="red" if names else ""))
    return t


def _numa(sample: dict[str, Any]) -> RenderableType:
    host = sample.get("host") or {}
    t = _table("NUMA nodes")
    for col in ("Node", "CPUs", "CPU", "Mem used", "Mem total"):
        t.add_column(col, no_wrap=True, overflow="ellipsis",
                     justify="right" if col != "CPUs" else "left", max_width=30)
    for n in host.get("numa") or []:
        t.add_row(str(n["node"]), n.get("cpus") or "-", fmt_pct(n.get("busy_ratio")),
                  fmt_bytes(n.get("memory_used_bytes")), fmt_bytes(n.get("memory_total_bytes")))
    return t


def _jobs(sample: dict[str, Any]) -> RenderableType:
    jobs = sample.get("jobs") or []
    if not jobs:
        return Note("No bound jobs (`tunerctl bind PID` / `tunerctl run -- CMD`).", style="dim")
    t = _table("Jobs")
    t.add_column("PID", justify="right", no_wrap=True)
    t.add_column("Name", no_wrap=True, overflow="ellipsis", max_width=10)
    t.add_column("CPUs", no_wrap=True, overflow="ellipsis", max_width=9)
    t.add_column("GPUs", no_wrap=True, overflow="ellipsis", max_width=5)
    # CPU: the job with its DataLoader workers (W); samples/s from tunerd.torch's reporter
    for col in ("CPU", "W", "RSS", "Local", "Smp/s"):
        t.add_column(col, justify="right", no_wrap=True)
    for j in jobs:
        if "error" in j:
            t.add_row(str(j.get("pid")), Text(j.get("name") or "-"),
                      Text(j["error"], style="red"))
            continue
        cores = j.get("tree_cpu_cores", j.get("cpu_cores"))
        cpu = "-" if cores is None else f"{cores * 100:.0f}%"
        loc = j.get("locality_ratio")
        rate = (j.get("torch") or {}).get("samples_per_s")
        # user text as Text: rich never parses a process name ("[/x]") as markup
        t.add_row(str(j["pid"]), Text(j.get("name") or "-"), Text(j.get("cpus") or "-"),
                  ",".join(str(g) for g in j.get("gpus") or []) or "-",
                  cpu, str(j.get("workers") or 0), fmt_bytes(j.get("rss_bytes")),
                  Text(fmt_pct(loc), style="red" if loc is not None and loc < 0.8 else ""),
                  "-" if rate is None else f"{rate:.4g}")
    return t


def render(reply: dict[str, Any]) -> RenderableType:
    from tunerd.text import safe_tree

    sample = safe_tree(reply.get("sample") or {})  # control characters escaped
    host = sample.get("host") or {}
    psi = host.get("psi") or {}

    def avg(res: str) -> str:
        return fmt_pct((psi.get(res) or {}).get("some_avg10"))

    when = time.strftime("%H:%M:%S", time.localtime(sample.get("time") or time.time()))
    head = Text.assemble(
        ("tunerd top ", "bold"), f"{when}  cpu {fmt_pct(host.get('cpu_busy_ratio'))}  "
        f"iowait {fmt_pct(host.get('iowait_ratio'))}  "
        f"psi cpu {avg('cpu')} mem {avg('memory')} io {avg('io')}")
    head.truncate(80, overflow="ellipsis")
    return Group(head, _gpus(sample), _numa(sample), _jobs(sample))
