"""fleet check flags a node whose interrupts, ACS or GPU/NIC pairing differ from its class
(tunerd_io_path_info), from a recorded Prometheus answer; and the daemon exports it."""

from __future__ import annotations

from typing import Any

from tunerd.cli.fleet import check_fleet


class FakeProm:
    base = "http://prometheus.invalid"

    def __init__(self, io: dict[str, tuple[str, str, str]]) -> None:
        self.io = io
        self.queries = 0

    def query(self, promql: str) -> list[dict[str, Any]]:
        self.queries += 1
        if "tunerd_node_info" in promql:
            return [{"metric": {"instance": i, "class": "h100", "driver": "550"},
                     "value": [0, "1"]} for i in self.io]
        if "tunerd_io_path_info" in promql:
            return [{"metric": {"instance": i, "irq": a, "acs": b, "pairing": c},
                     "value": [0, "1"]} for i, (a, b, c) in self.io.items() if a]
        return []


def test_fleet_check_flags_differing_irq_acs_and_pairing() -> None:
    good = ("placed", "0", "0:switch,1:switch")
    prom = FakeProm({"n1:9400": good, "n2:9400": good, "n3:9400": good,
                     "n4:9400": ("not placed: mlx5_0", "2", "0:switch,1:numa"),
                     "n5:9400": ("", "", "")})  # an older tunerd: not compared
    r = check_fleet(prom)  # type: ignore[arg-type]
    got = {(f["instance"], f["key"]): (f["value"], f["majority"]) for f in r["findings"]}
    assert got == {("n4:9400", "io_irq"): ("not placed: mlx5_0", "placed"),
                   ("n4:9400", "io_acs"): ("2", "0"),
                   ("n4:9400", "io_pairing"): ("0:switch,1:numa", "0:switch,1:switch")}


def test_the_daemon_exports_its_io_path(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    from tests.helpers import write_policy

    dgx = Path(__file__).parent / "fixtures" / "topologies" / "dgx-h100.json"
    pdir = tmp_path / "p"
    write_policy(pdir, "00.toml", '[policy]\nname = "x"\n')
    d = daemon_factory(policy_dir=pdir, args=["--topology", str(dgx)]).start()
    m = d.ctl("metrics")
    assert m.rc == 0, m.err
    line = next(x for x in m.out.splitlines() if x.startswith("tunerd_io_path_info{"))
    assert 'irq="off"' in line and 'acs="n/a"' in line
    assert 'pairing="0:switch,1:switch,2:switch,3:switch,4:switch,5:switch,6:switch,' \
           '7:switch"' in line
