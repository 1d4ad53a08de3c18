"""tunerctl fleet check: find the odd node and the slow node through Prometheus."""

from __future__ import annotations

import click

from tunerd.cli.context import get_ctx
from tunerd.cli.types import Group


@click.group(cls=Group)
def fleet() -> None:
    """Compare the nodes of the fleet (through Prometheus, not the daemon)."""


@fleet.command("check")
@click.option("--prometheus", "url", required=True, envvar="TUNERD_PROMETHEUS",
              metavar="URL", help="Prometheus base URL, e.g. http://prometheus:9090 "
              "(env TUNERD_PROMETHEUS).")
@click.option("--class-label", default="class", show_default=True, metavar="L",
              help="Label of tunerd_node_info that groups comparable nodes.")
@click.option("--match", default="", metavar="MATCHERS",
              help='Only nodes whose series match these PromQL label matchers, '
              'e.g. cluster="a",rack=~"r1.*".')
@click.option("--window", default="5m", show_default=True, metavar="DURATION",
              help="Straggler window (a PromQL duration).")
@click.option("--straggler-threshold", "threshold", default=0.10, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="A node's step time above the job median by more than this share.")
@click.option("--timeout", default=10.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Seconds per read.")
@click.option("--deadline", default=30.0, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Seconds for the whole check, every query together.")
def check(url: str, class_label: str, match: str, window: str, threshold: float,
          timeout: float, deadline: float) -> int:
    """Every node against its class majority: NCCL-interface MTU and subnet, NCCL
    settings, driver/CUDA/NCCL versions, policy hash; and stragglers of multi-node jobs.

    Exit 0 when consistent, 1 with findings (one line each), a bad answer or
    Prometheus not reachable (one line; 3 is kept for tunerd's own daemon).
    """
    from tunerd.cli.fleet import Prometheus, check_fleet, format_findings

    ctx = get_ctx()
    result = check_fleet(Prometheus(url, timeout, deadline), class_label, window, threshold,
                         match)
    ctx.emit(result, format_findings)
    return 1 if result["findings"] else 0
