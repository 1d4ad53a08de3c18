"""What `tunerctl top` draws: GPUs, NUMA nodes and bound jobs, in 80 columns.

Imported only by the ``top`` command (it imports rich). ``render`` is a pure
function of the daemon's ``top`` reply, so the layout is tested at 80 columns.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
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


SPARKS = "\u2581\u2582\u2583\u2584\u2585\u2586\u2587\u2588"  # ▁▂▃▄▅▆▇█
HISTORY = 8  # samples per job in the sparkline

# key -> (what the jobs table is sorted by, the sort key of one job row; largest first)
SORTS: dict[str, tuple[str, Any]] = {
    "c": ("cpu", lambda j: j.get("tree_cpu_cores", j.get("cpu_cores")) or 0.0),
    "m": ("memory", lambda j: j.get("rss_bytes") or 0),
    "s": ("samples/s", lambda j: (j.get("torch") or {}).get("samples_per_s") or 0.0),
    "p": ("pid", lambda j: -int(j.get("pid") or 0)),  # smallest first
    "n": ("name", None),  # alphabetical
}
HELP = "q quit  ? help  sort: c cpu  m memory  s samples/s  p pid  n name"


def sparkline(values: list[float]) -> str:
    """``▁▃▇█``: each value against the largest of them (all zero: the lowest bar)."""
    top = max(values, default=0.0)
    if top <= 0:
        return SPARKS[0] * len(values)
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))]
                   for v in values)


@dataclass
class TopState:
    """What the viewer chose (sort, help) and each job's recent CPU, between frames."""

    sort: str = "c"
    help: bool = False
    history: dict[int, deque[float]] = field(default_factory=dict)

    def key(self, k: str) -> bool:
        """Handle one key press; False when it means quit."""
        if k in ("q", "Q", "\x03"):
            return False
        if k == "?":
            self.help = not self.help
        elif k in SORTS:
            self.sort = k
        return True

    def record(self, reply: dict[str, Any]) -> None:
        jobs = (reply.get("sample") or {}).get("jobs") or []
        live = set()
        for j in jobs:
            if "pid" not in j or "error" in j:
                continue
            pid = int(j["pid"])
            live.add(pid)
            cores = j.get("tree_cpu_cores", j.get("cpu_cores"))
            self.history.setdefault(pid, deque(maxlen=HISTORY)).append(float(cores or 0.0))
        for pid in set(self.history) - live:
            del self.history[pid]

    def order(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        _, by = SORTS.get(self.sort, SORTS["c"])
        if by is None:
            return sorted(jobs, key=lambda j: str(j.get("name") or ""))
        return sorted(jobs, key=by, reverse=True)


def _jobs(sample: dict[str, Any], state: TopState | None = None) -> RenderableType:
    jobs = sample.get("jobs") or []
    if state is not None:
        jobs = state.order(jobs)
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
    if state is not None:
        t.add_column("Hist", no_wrap=True)  # CPU, the last HISTORY samples
    for j in jobs:
        if "error" in j:
            t.add_row(str(j.get("pid")), Text(str(j.get("name") or "-")),
                      Text(str(j["error"]), style="red"))
            continue
        cores = j.get("tree_cpu_cores", j.get("cpu_cores"))
        cpu = "-" if cores is None else f"{cores * 100:.0f}%"
        loc = j.get("locality_ratio")
        rate = (j.get("torch") or {}).get("samples_per_s")
        cells: list[RenderableType] = [
            # user text as Text: rich never parses a process name ("[/x]") as markup
            str(j["pid"]), Text(str(j.get("name") or "-")), Text(str(j.get("cpus") or "-")),
            ",".join(str(g) for g in j.get("gpus") or []) or "-",
            cpu, str(j.get("workers") or 0), fmt_bytes(j.get("rss_bytes")),
            Text(fmt_pct(loc), style="red" if loc is not None and loc < 0.8 else ""),
            "-" if rate is None else f"{rate:.4g}"]
        if state is not None:
            cells.append(sparkline(list(state.history.get(int(j["pid"]), ()))))
        t.add_row(*cells)
    return t


def render(reply: dict[str, Any], state: TopState | None = None) -> RenderableType:
    """One frame. With ``state`` (the live view): jobs sorted as chosen, a CPU history
    sparkline per job, and the key line (or the help) at the bottom."""
    from tunerd.base.text import safe_tree

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
    parts: list[RenderableType] = [head, _gpus(sample), _numa(sample), _jobs(sample, state)]
    if state is not None:
        if state.help:
            parts += [Note("Keys: q quit; ? this help; jobs sorted by c CPU (the job with its "
                           "DataLoader workers), m memory (RSS), s samples/s (tunerd.torch's "
                           "reporter), p pid, n name. Hist: CPU of the last "
                           f"{HISTORY} samples of each job, against its own peak. W: "
                           "DataLoader workers; Local: memory on the job's NUMA nodes.",
                           style="dim")]
        else:
            parts.append(Text(f"{HELP}  (by {SORTS[state.sort][0]})", style="dim",
                              no_wrap=True, overflow="ellipsis"))
    return Group(*parts)
