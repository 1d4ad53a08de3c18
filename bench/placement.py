"""Placement decision time on the largest recorded node, next to baselines.

    python bench/placement.py [--rounds N] [--json FILE]

Measured side by side in one run:
  place (warm)        tunerd.jobs.placement.place() with the per-topology index cached
                      (the daemon's steady state), over a mix of requests
  place (cold)        the same on a freshly loaded topology (builds the index)
  brute force         a naive exhaustive GPU search: every k-subset of the free GPUs
                      scored through Topology.link() (no precomputed cost matrix)
  load snapshot       reading + validating the snapshot JSON (load_topology(path))
  read this machine   sysfs + NVML probe of the machine running the benchmark
Target: place (warm) median <= 1 ms.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tunerd.jobs.placement import MODES, PlacementError, PlacementRequest, pair_cost, place  # noqa: E402
from tunerd.topology import Topology, load_topology, read_system  # noqa: E402

FIXTURES = REPO / "tests/fixtures/topologies"


def largest() -> Path:
    return max(FIXTURES.glob("*.json"),
               key=lambda p: (len(load_topology(p).cpus), len(load_topology(p).gpus)))


def requests(topo: Topology, n: int, seed: int = 1
             ) -> list[tuple[PlacementRequest, dict[int, str]]]:
    rnd = random.Random(seed)
    ids = [g.index for g in topo.gpus]
    out = []
    for _ in range(n):
        busy = {i: "lease" for i in rnd.sample(ids, rnd.randint(0, len(ids) // 2))}
        k = rnd.randint(1, len(ids) - len(busy))
        out.append((PlacementRequest(gpus=k, mode=rnd.choice(MODES),
                                     exclusive=rnd.random() < 0.5,
                                     cpus=rnd.choice([None, 4, 16])), busy))
    return out


def brute_force(topo: Topology, k: int, busy: dict[int, str]) -> tuple[int, ...]:
    node_package = {c.numa_node: c.package for c in topo.cpus.values()}
    gpus = {g.index: g for g in topo.gpus}
    free = [i for i in gpus if i not in busy]

    def score(gs: tuple[int, ...]) -> tuple[int, int]:
        costs = [pair_cost(topo.link(a, b), gpus[a], gpus[b], node_package)
                 for a, b in itertools.combinations(gs, 2)]
        return (max(costs, default=0), sum(costs))

    return min(itertools.combinations(free, k), key=score)


def timeit(fn: Callable[[], Any], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3,
            "p95_ms": xs[min(len(xs) - 1, int(0.95 * len(xs)))] * 1e3, "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()

    path = largest()
    topo = load_topology(path)
    reqs = requests(topo, args.rounds)
    it = iter(itertools.cycle(reqs))

    def one_warm() -> None:
        req, busy = next(it)
        try:
            place(topo, req, busy_gpus=busy)
        except PlacementError:
            pass

    one_warm()  # build the index once
    res: dict[str, dict[str, float]] = {}
    res["place (warm)"] = stats(timeit(one_warm, args.rounds))

    cold_topos = [load_topology(path) for _ in range(min(200, args.rounds))]
    cold_it = iter(cold_topos)
    res["place (cold)"] = stats(timeit(
        lambda: place(next(cold_it), PlacementRequest(gpus=4)), len(cold_topos)))

    bf_it = iter(itertools.cycle(reqs))

    def one_bf() -> None:
        req, busy = next(bf_it)
        brute_force(topo, req.gpus, busy)

    res["brute force (GPUs only)"] = stats(timeit(one_bf, min(500, args.rounds)))
    res["load snapshot"] = stats(timeit(lambda: load_topology(path), 50))
    res["read this machine"] = stats(timeit(read_system, 20))

    base = res["place (warm)"]["median_ms"]
    print(f"placement on {path.name}: {topo.summary()}")
    print(f"{'':26}{'median':>10}{'p95':>10}{'x warm':>9}")
    for name, r in res.items():
        print(f"{name:26}{r['median_ms']:>8.3f}ms{r['p95_ms']:>8.3f}ms"
              f"{r['median_ms'] / base:>8.1f}x")
    ok = base <= 1.0
    print(f"target place (warm) median <= 1 ms: {'met' if ok else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"fixture": path.name, "results": res,
                                         "target_met": ok}, indent=2) + "\n")


if __name__ == "__main__":
    main()
