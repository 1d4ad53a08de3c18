"""Does automatic binding make a DDP job slower? torchrun, unbound vs auto-bound.

The job of issue 11: ``torchrun --nproc-per-node 2`` of contrib/examples/ddp_train.py
(gloo, CPU, nn.Linear(1024, 1024), DataLoader num_workers=1 per rank). The real
daemon runs throughout with the bundled ``torch-training`` rule of policies/00-base.toml
(only the rule: 00-base.toml's vm.numa_balancing would change a host setting). The two
arms run the same file under two names, and only the bound arm's environment carries the
token the rule is narrowed to: ``ddp_train.py``'s ranks are bound as they exec;
``ddp_unbound.py``'s match nothing and run as they are. Arms alternate (A B B A ...),
one warm-up pair first; while a run goes, the daemon's ``jobs`` are polled to show
which CPUs each rank got, and to check that the arms are what they claim.

Reported: median samples/s of each arm, the slowdown (unbound rate / bound rate: the
acceptance is <= 1.03) and the 95% interval of bound/unbound (tunerd.bench.stats).

    python bench/ddp_binding.py [--runs 5] [--steps 60] [--helpers] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from _leases_common import REPO, Daemon, bundled_torch_rule, write_json

from tunerd.bench.runner import interleave, run_once
from tunerd.bench.stats import compare


class JobWatch(threading.Thread):
    """Polls the daemon's jobs while a run goes: pid -> CPUs of rule-bound processes."""

    def __init__(self, socket: Path) -> None:
        super().__init__(daemon=True)
        self.socket = socket
        self.seen: dict[int, str] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        from tunerd.wire.client import Client

        with Client(str(self.socket)) as c:
            while not self.stop_event.wait(0.2):
                for j in c.call("jobs").get("jobs", []):
                    if j.get("origin") == "rule":
                        self.seen[j["pid"]] = j["cpus"]

    def stop(self) -> dict[int, str]:
        self.stop_event.set()
        self.join(5)
        return self.seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="measured runs per arm (>= 5)")
    ap.add_argument("--steps", type=int, default=60, help="batches per rank per run")
    ap.add_argument("--helpers", action="store_true",
                    help="both arms use tunerd.torch (worker pinning, StepReporter)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tunerd-ddp-"))
    src = (REPO / "contrib" / "examples" / "ddp_train.py").read_text()
    scripts = {"bound": tmp / "ddp_train.py", "unbound": tmp / "ddp_unbound.py"}
    for p in scripts.values():
        p.write_text(src)
    token = secrets.token_hex(6)
    port = 29400 + os.getpid() % 500
    results: dict[str, list[float]] = {"unbound": [], "bound": []}
    walls: dict[str, list[float]] = {"unbound": [], "bound": []}
    cpus_seen: list[dict[int, str]] = []
    problems: list[str] = []
    d: Daemon | None = None
    try:
        d = Daemon(bundled_torch_rule(token, "ddp-bench"))
        base_env = {"TUNERD_SOCKET": str(d.socket), "PYTHONPATH": str(REPO)}
        for i, (label, warm) in enumerate(interleave(args.runs, 1)):
            arm = "unbound" if label == "A" else "bound"
            # the bundled rule takes ranks by their environment and tree, whatever the
            # script is called: only the bound arm carries the token the rule is narrowed to
            env = {**base_env, "TUNERD_BENCH_TOKEN": token} if arm == "bound" else base_env
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-port", str(port + i % 50), str(scripts[arm]),
                    "--steps", str(args.steps)] + (["--helpers"] if args.helpers else [])
            watch = JobWatch(d.socket)
            watch.start()
            r = run_once(argv, env, 600, label, i, warm)
            seen = watch.stop()
            tag = " (warm-up)" if warm else ""
            if not r.ok:
                problems.append(f"{arm} run {i}: {r.error}: {r.stderr_tail[-500:]}")
                print(f"{arm}{tag}: failed, {r.error}", file=sys.stderr)
                continue
            if r.metric != "samples_per_second":  # e.g. its wall time: not a rate
                problems.append(f"{arm} run {i}: printed no samples_per_second (measured "
                                f"{r.metric}); --steps must exceed the example's warm-up (5)")
                print(f"{arm}{tag}: no rate measured", file=sys.stderr)
                continue
            if (arm == "bound") != bool(seen):
                problems.append(f"{arm} run {i}: rule-bound processes seen: {seen}")
            if arm == "bound" and seen:
                cpus_seen.append(seen)
            print(f"{arm}{tag}: {r.value:.1f} samples/s, wall {r.wall_s:.2f} s"
                  + (f", ranks bound to {sorted(set(seen.values()))}" if seen else ""),
                  file=sys.stderr)
            if not warm and r.value is not None:
                results[arm].append(r.value)
                walls[arm].append(r.wall_s)
    finally:
        if d is not None:
            d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    c = compare(results["unbound"], results["bound"], "samples_per_second", True,
                "unbound", "auto-bound")
    mu = statistics.median(results["unbound"]) if results["unbound"] else None
    mb = statistics.median(results["bound"]) if results["bound"] else None
    slowdown = mu / mb if mu and mb else None
    out: dict[str, Any] = {
        "job": "torchrun --nproc-per-node 2 contrib/examples/ddp_train.py (gloo, CPU, "
               f"num_workers=1, {args.steps} steps per rank)" + (", --helpers" if args.helpers
                                                                 else ""),
        "cpus_on_machine": len(os.sched_getaffinity(0)),
        "samples_per_s": results, "wall_s": walls,
        "median_unbound": mu, "median_bound": mb,
        "slowdown_unbound_over_bound": slowdown,
        "ratio_bound_over_unbound": c.ratio, "ci95_bound_over_unbound": c.ci,
        "verdict": c.verdict, "ranks_bound_to": [sorted(set(s.values())) for s in cpus_seen],
        "problems": problems,
        "acceptance_slowdown_le_1.03": None if slowdown is None else slowdown <= 1.03,
    }
    print(json.dumps(out, indent=2))
    write_json(args.json, out)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
