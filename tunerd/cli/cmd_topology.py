"""tunerctl topology [--save FILE]: what the node has (CPUs, NUMA, GPUs, links, NICs)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import click

from tunerd.base.errors import DaemonUnreachable, Failed
from tunerd.cli.context import get_ctx
from tunerd.cli.types import Command


def _save(data: dict[str, Any], path: Path) -> None:
    """Write atomically: a half-written snapshot must never replace a good one."""
    path = path.expanduser()
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    except OSError as err:
        raise Failed(f"cannot write {path}: {err.strerror or err}") from err
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise Failed(f"cannot write {path}: {err.strerror or err}") from err


@click.command(cls=Command)
@click.option("--save", "save", type=click.Path(dir_okay=False, path_type=Path),
              metavar="FILE", help="Write the topology as a JSON snapshot "
              "(replay it with `tunerd --topology FILE`).")
@click.option("--local", is_flag=True,
              help="Read this machine directly instead of asking the daemon.")
def topology(save: Path | None, local: bool) -> int:
    """CPUs, cores, NUMA nodes, GPUs and their links, NICs.

    Asks the daemon (which may replay a snapshot); if the daemon is not running,
    reads this machine directly.
    """
    ctx = get_ctx()
    data: dict[str, Any] | None = None
    origin = ""
    if not local:
        try:
            data = ctx.call("topology")
        except DaemonUnreachable as err:
            click.echo(f"tunerctl: {err.message}", err=True)
            click.echo("tunerctl: reading this machine's topology directly", err=True)
    if data is None:
        from tunerd.topology import read_system

        data = read_system().to_json()
        origin = "read locally"
    from tunerd.topology.render import render

    if save is not None:
        if not data.get("source"):
            # a snapshot should always say where its facts come from
            import time

            data["source"] = {
                "summary": f"recorded with `tunerctl topology --save` on {data.get('hostname')}",
                "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        _save(data, save)
        click.echo(f"saved the topology of {data.get('hostname')} to {save}", err=True)
    if ctx.as_json:
        # each GPU's NIC, derived from the snapshot (never saved in it)
        from tunerd.topology.iopath import gpu_nics, pairing_json
        from tunerd.topology.model import Topology
        from tunerd.topology.nodemap import node_map

        topo = Topology.from_json(data)
        data = {**data, "gpu_nics": pairing_json(gpu_nics(topo)),
                "node_map": node_map(topo).to_json()}
    ctx.emit(data, lambda d: render(d, origin))
    return 0
