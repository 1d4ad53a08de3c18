#!/usr/bin/env python3
"""Every GPU path of tunerd on a real GPU node, in one short run (scripts/gpu-check.sh).

Steps (each PASS, WARN, FAIL or SKIP with one line of evidence):

 1. env        python, torch (and what it sees of CUDA), nvidia-smi, NVML
 2. topology   ``tunerctl topology --local --save``; GPU NUMA node and local CPUs vs sysfs
 3. telemetry  tests/fixtures/nvml/record_telemetry.py (the replay fixture's format)
 4. readings   the daemon's GPU sample vs ``nvidia-smi --query-gpu`` (TOLERANCES below);
               without a GPU: the same comparison on the replayed h100x2 telemetry
 5. doctor     ``tunerctl doctor`` driver/CUDA/cuDNN/NCCL/torch lines vs torch, nvidia-smi
 6. placement  ``tunerctl run --gpus 1`` runs on the GPU's sysfs local_cpulist
 7. training   bench/gpu_train.py (AMP + GradScaler + accumulation + DataLoader workers +
               pin_memory + StepReporter) under ``tunerctl run``; its throughput, step
               time and CUDA memory reach ``tunerctl metrics`` and ``top --once``
 8. bench      ``tunerctl bench --quick``: bundled policy placement vs none (built-in
               workload), and a dataloader-bound variant (workers doing CPU work)

Writes gpu-check.md and gpu-check.json (plus topology.json, telemetry.json,
daemon.log) to --out, $OUT when set, else a new folder it names. Exit 0 when no
step FAILed (SKIPs included: that is how it runs on a machine without a GPU), else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"

# nvidia-smi field -> (daemon sample key, scale from the daemon's unit to nvidia-smi's,
# absolute tolerance, relative tolerance). A reading passes when it lies within the
# tolerance of the range of two nvidia-smi reads taken just before and just after it.
SMI_FIELDS: dict[str, tuple[str, float, float, float]] = {
    "utilization.gpu": ("utilization_ratio", 100.0, 15.0, 0.0),       # %, sampled windows
    "utilization.memory": ("memory_utilization_ratio", 100.0, 15.0, 0.0),
    "memory.total": ("memory_total_bytes", 1 / 2**20, 1.0, 0.0),      # MiB, exact
    "memory.used": ("memory_used_bytes", 1 / 2**20, 256.0, 0.02),      # MiB
    "temperature.gpu": ("temperature_celsius", 1.0, 3.0, 0.0),         # C
    "power.draw": ("power_watts", 1.0, 15.0, 0.10),                    # W
    "enforced.power.limit": ("power_limit_watts", 1.0, 1.0, 0.0),      # W
    "clocks.sm": ("sm_clock_hertz", 1e-6, 50.0, 0.10),                 # MHz
    "clocks.mem": ("memory_clock_hertz", 1e-6, 10.0, 0.0),             # MHz
    "pcie.link.gen.current": ("pcie_link_generation", 1.0, 0.0, 0.0),
    "pcie.link.width.current": ("pcie_link_width", 1.0, 0.0, 0.0),
}
# 0x1 (idle) flips with load from one read to the next: compared without it
REASONS_VOLATILE = 0x1
TOLERANCES = "; ".join(f"{k} ±{a:g}{f' or {r:.0%}' if r else ''}"
                       for k, (_, _, a, r) in SMI_FIELDS.items())


@dataclass
class Step:
    name: str
    status: str
    detail: str
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Ctx:
    out: Path
    work: Path
    python: str
    quick: bool
    bench: bool
    policy_dir: Path | None
    deadline: float
    steps: list[Step] = field(default_factory=list)
    gpu: bool = False
    torch: dict[str, Any] = field(default_factory=dict)
    topo: dict[str, Any] = field(default_factory=dict)
    daemon: subprocess.Popen[bytes] | None = None
    socket: Path | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()


def tunerctl(ctx: Ctx, *args: str) -> list[str]:
    argv = [ctx.python, "-m", "tunerd.cli.main"]
    if ctx.socket is not None:
        argv += ["--socket", str(ctx.socket)]
    return argv + list(args)


def sh(argv: list[str], timeout: float, env: dict[str, str] | None = None,
       cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run argv; never raises: a timeout is rc 124, a missing program rc 127."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=max(1.0, timeout),
                              env=env, cwd=cwd or REPO)
    except subprocess.TimeoutExpired as err:
        out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else ""
        return subprocess.CompletedProcess(argv, 124, out, f"timed out after {timeout:.0f} s")
    except OSError as err:
        return subprocess.CompletedProcess(argv, 127, "", str(err))


def tail(text: str, n: int = 6) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


class Skip(Exception):
    pass


class Failed(Exception):
    def __init__(self, detail: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.data = data or {}


def run_step(ctx: Ctx, name: str, fn: Callable[[Ctx], tuple[str, str, dict[str, Any]]],
             min_left: float = 10.0) -> Step:
    t0 = time.monotonic()
    if ctx.left() < min_left:
        st = Step(name, SKIP, f"not started: {ctx.left():.0f} s of the time budget left")
    else:
        try:
            status, detail, data = fn(ctx)
            st = Step(name, status, detail, data)
        except Skip as s:
            st = Step(name, SKIP, str(s))
        except Failed as f:
            st = Step(name, FAIL, str(f), f.data)
        except Exception as err:  # a bug of the check itself: say where, keep going
            st = Step(name, FAIL, f"{type(err).__name__}: {err}",
                      {"traceback": traceback.format_exc(limit=4)})
    st.seconds = round(time.monotonic() - t0, 2)
    ctx.steps.append(st)
    print(f"[{st.status}] {name}: {st.detail} ({st.seconds:.1f} s)", flush=True)
    return st


# -- 1. environment --------------------------------------------------------------------
TORCH_INFO = r"""
import json
out = {}
try:
    import torch
    out["version"] = torch.__version__
    out["cuda_build"] = torch.version.cuda
    out["cuda"] = torch.cuda.is_available()
    if out["cuda"]:
        out["device"] = torch.cuda.get_device_name(0)
        out["device_count"] = torch.cuda.device_count()
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    try:
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else v
    except Exception as e:
        out["nccl"] = None
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _smi_rows(fields: list[str]) -> list[dict[str, str]] | None:
    r = sh(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
           30)
    if r.returncode != 0:
        return None
    return [dict(zip(fields, [v.strip() for v in line.split(",")], strict=False))
            for line in r.stdout.strip().splitlines()]


# older nvidia-smi spellings of a field, tried when the newer one is refused
SMI_ALIASES = {"clocks_event_reasons.active": "clocks_throttle_reasons.active"}


def smi_query(fields: list[str]) -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu`` rows; a field this nvidia-smi does not know (it refuses
    the whole query then) is asked alone, under its older name, or left out."""
    rows = _smi_rows(fields)
    if rows is not None:
        return rows
    merged: list[dict[str, str]] = []
    for f in fields:
        got = _smi_rows([f])
        if got is None and f in SMI_ALIASES:
            got = [{f: row[SMI_ALIASES[f]]} for row in _smi_rows([SMI_ALIASES[f]]) or []]
        for i, row in enumerate(got or []):
            if i >= len(merged):
                merged.append({})
            merged[i].update(row)
    if not merged:
        r = sh(["nvidia-smi", "-L"], 30)
        raise Failed(f"nvidia-smi --query-gpu: no field answered: {tail(r.stderr or r.stdout)}")
    return merged


def step_env(ctx: Ctx) -> tuple[str, str, dict[str, Any]]:
    r = sh([ctx.python, "-c", TORCH_INFO], min(120, ctx.left()))
    try:
        ctx.torch = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        ctx.torch = {"error": f"probe rc {r.returncode}: {tail(r.stderr)}"}
    from tunerd.adapters import nvml

    smi = shutil.which("nvidia-smi")
    data: dict[str, Any] = {"python": ctx.python, "python_version": sys.version.split()[0],
                            "torch": ctx.torch, "nvidia_smi": smi,
                            "nvml": nvml.available(), "nvml_reason": nvml.reason()}
    if smi:
        rows = smi_query(["index", "name", "driver_version", "pci.bus_id", "memory.total"])
        data["smi_gpus"] = rows
    ctx.gpu = bool(smi and nvml.available() and nvml.device_count() > 0)
    t = ctx.torch
    torch_txt = (f"torch {t.get('version')} (CUDA build {t.get('cuda_build')}, cuda available "
                 f"{t.get('cuda')})" if "version" in t else f"no torch: {t.get('error')}")
    if ctx.gpu:
        d = nvml.devices()[0]
        detail = (f"{nvml.device_count()} GPU(s), {d.name}, driver {nvml.driver_version()}; "
                  f"{torch_txt}")
        if not t.get("cuda"):
            return FAIL, detail + ": the GPU is there but torch cannot use it", data
        return PASS, detail, data
    if data.get("smi_gpus"):
        return FAIL, (f"nvidia-smi lists {len(data['smi_gpus'])} GPU(s) but tunerd's NVML layer "
                      f"sees none: {nvml.reason() or 'NVML reports none'}"), data
    return PASS, f"no GPU here ({nvml.reason() or 'NVML reports none'}); {torch_txt}", data


# -- 2. topology ----------------------------------------------------------------------
def sysfs_gpu(bus: str) -> dict[str, Any]:
    base = Path("/sys/bus/pci/devices") / bus
    def rd(name: str) -> str | None:
        try:
            return (base / name).read_text().strip()
        except OSError:
            return None
    from tunerd.base.cpulist import parse_cpulist

    node = rd("numa_node")
    cpus = rd("local_cpulist")
    return {"numa_node": int(node) if node and node.lstrip("-").isdigit() else None,
            "local_cpus": sorted(parse_cpulist(cpus)) if cpus else None,
            "current_link_speed": rd("current_link_speed"),
            "current_link_width": rd("current_link_width")}


def _cpus(v: Any) -> list[int]:
    """A snapshot's cpulist ("0-15,32") or list as a sorted list of CPU ids."""
    from tunerd.base.cpulist import parse_cpulist

    if isinstance(v, str):
        return sorted(parse_cpulist(v)) if v.strip() else []
    return sorted(int(c) for c in v or [])


def step_topology(ctx: Ctx) -> tuple[str, str, dict[str, Any]]:
    dest = ctx.out / "topology.json"
    r = sh(tunerctl(ctx, "topology", "--local", "--save", str(dest)), min(60, ctx.left()))
    if r.returncode != 0 or not dest.exists():
        raise Failed(f"tunerctl topology --local --save: rc {r.returncode}: {tail(r.stderr)}")
    ctx.topo = json.loads(dest.read_text())
    gpus = ctx.topo.get("gpus") or []
    data: dict[str, Any] = {"file": dest.name, "cpus": len(ctx.topo.get("cpus") or []),
                            "numa_nodes": len(ctx.topo.get("numa_nodes") or []),
                            "gpus": len(gpus), "note": ctx.topo.get("note")}
    if not ctx.gpu:
        if gpus:
            raise Failed(f"{len(gpus)} GPU(s) in the topology but no GPU found by the check")
        return PASS, (f"saved {dest.name}: {data['cpus']} CPUs, {data['numa_nodes']} NUMA "
                      f"node(s), no GPU ({ctx.topo.get('note')})"), data
    bad = []
    for g in gpus:
        sf = sysfs_gpu(g["pci_bus_id"])
        g_cpus = _cpus(g.get("local_cpus"))
        data.setdefault("per_gpu", []).append({"index": g["index"], "bus": g["pci_bus_id"],
                                               "numa_node": g.get("numa_node"),
                                               "sysfs": sf, "local_cpus": g_cpus})
        want_node = sf["numa_node"] if sf["numa_node"] is not None and sf["numa_node"] >= 0 \
            else None
        if want_node is not None and g.get("numa_node") != want_node:
            bad.append(f"GPU {g['index']}: NUMA node {g.get('numa_node')}, sysfs {want_node}")
        if sf["local_cpus"] is not None and g_cpus != sf["local_cpus"]:
            bad.append(f"GPU {g['index']}: local CPUs differ from sysfs local_cpulist")
    smi_n = len(smi_query(["index"]))
    if smi_n != len(gpus):
        bad.append(f"{len(gpus)} GPU(s) in the topology, nvidia-smi lists {smi_n}")
    detail = (f"saved {dest.name}: {data['cpus']} CPUs, {data['numa_nodes']} NUMA node(s), "
              f"{len(gpus)} GPU(s) ({gpus[0]['model']}, NUMA node {gpus[0].get('numa_node')})")
    if bad:
        raise Failed(detail + "; " + "; ".join(bad), data)
    return PASS, detail + "; NUMA node and local CPUs agree with sysfs", data


# -- 3. telemetry ---------------------------------------------------------------------
def step_telemetry(ctx: Ctx) -> tuple[str, str, dict[str, Any]]:
    if not ctx.gpu:
        raise Skip("no GPU: nothing to record (the replay fixture is "
                   "tests/fixtures/nvml/h100x2-telemetry.json)")
    dest = ctx.out / "telemetry.json"
    r = sh([ctx.python, "tests/fixtures/nvml/record_telemetry.py", str(dest)], 60)
    if r.returncode != 0 or not dest.exists():
        raise Failed(f"record_telemetry.py: rc {r.returncode}: {tail(r.stderr)}")
    rec = json.loads(dest.read_text())
    nulls = sorted({k for g in rec["gpus"] for k, v in g.items() if v is None})
    return PASS, (f"saved {dest.name}: {len(rec['gpus'])} GPU(s), driver "
                  f"{rec['driver_version']}; not supported: {', '.join(nulls) or 'none'}"), \
        {"file": dest.name, "unsupported": nulls}


# -- 4. daemon readings vs nvidia-smi ---------------------------------------------------
def start_daemon(ctx: Ctx) -> None:
    run = ctx.work / "run"
    state = ctx.work / "state"
    pol = ctx.policy_dir or (ctx.work / "policies")  # empty: the bundled default policy
    pol.mkdir(parents=True, exist_ok=True)
    cfg = ctx.work / "tunerd.toml"
    cfg.write_text("sample_interval = 0.5\nhistory_seconds = 600\n")
    log = open(ctx.out / "daemon.log", "ab")  # noqa: SIM115 - the daemon's
    ctx.daemon = subprocess.Popen(
        [ctx.python, "-m", "tunerd.daemon.main", "--config", str(cfg), "--policy-dir", str(pol),
         "--runtime-dir", str(run), "--state-dir", str(state), "--metrics-listen", "off",
         "--log-level", "info", "--scope-pid", str(os.getpid())],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    log.close()
    ctx.socket = run / "tunerd.sock"
    # every child (the training job's StepReporter, bench's placed arm) talks to this one
    os.environ["TUNERD_SOCKET"] = str(ctx.socket)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ctx.daemon.poll() is not None:
            raise Failed(f"tunerd exited with {ctx.daemon.returncode}: "
                         f"{tail((ctx.out / 'daemon.log').read_text(errors='replace'))}")
        if ctx.socket.exists() and sh(tunerctl(ctx, "--json", "status"), 10).returncode in (0, 1):
            return
        time.sleep(0.1)
    raise Failed("tunerd did not become ready in 30 s")


def stop_daemon(ctx: Ctx) -> None:
    p = ctx.daemon
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def daemon_gpu_sample(ctx: Ctx) -> dict[str, Any]:
    r = sh(tunerctl(ctx, "--json", "top"), 30)
    if r.returncode != 0:
        raise Failed(f"tunerctl top: rc {r.returncode}: {tail(r.stderr)}")
    return dict((json.loads(r.stdout).get("sample") or {}).get("gpu") or {})


def _f(v: str | None) -> float | None:
    try:
        return float(v) if v not in (None, "", "[N/A]", "N/A", "[Not Supported]") else None
    except ValueError:
        return None


def compare_readings(gpu: dict[str, Any], before: dict[str, str],
                     after: dict[str, str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of (field, daemon, nvidia-smi before/after, ok) and the mismatches."""
    rows, bad = [], []
    for fld, (key, scale, atol, rtol) in SMI_FIELDS.items():
        d = gpu.get(key)
        lo_hi = [x for x in (_f(before.get(fld)), _f(after.get(fld))) if x is not None]
        if d is None or not lo_hi:
            rows.append({"field": fld, "daemon": d, "smi": lo_hi, "ok": None})
            if (d is None) != (not lo_hi):
                bad.append(f"{fld}: daemon {d}, nvidia-smi {before.get(fld)}")
            continue
        val = float(d) * scale
        lo, hi = min(lo_hi), max(lo_hi)
        tol = max(atol, rtol * hi)
        ok = lo - tol <= val <= hi + tol
        rows.append({"field": fld, "daemon": round(val, 3), "smi": lo_hi, "ok": ok})
        if not ok:
            bad.append(f"{fld}: daemon {val:g}, nvidia-smi {lo:g}..{hi:g} (±{tol:g})")
    # throttle ("clocks event") reasons: hex masks, the idle bit left out
    masks = [int(v, 16) & ~REASONS_VOLATILE for v in (before.get("clocks_event_reasons.active"),
                                                        after.get("clocks_event_reasons.active"))
             if v and v.startswith("0x")]
    d_mask = gpu.get("throttle_reasons")
    ok_mask = d_mask is not None and masks and (int(d_mask) & ~REASONS_VOLATILE) in masks
    rows.append({"field": "clocks_event_reasons.active", "daemon": d_mask, "smi": masks,
                 "ok": ok_mask if masks else None})
    if masks and not ok_mask:
        bad.append(f"throttle reasons: daemon {d_mask}, nvidia-smi {[hex(m) for m in masks]}")
    return rows, bad


def replayed_smi(rec: dict[str, Any]) -> list[dict[str, str]]:
    """What nvidia-smi --query-gpu prints for a recorded node (units as nvidia-smi's)."""
    def s(v: Any) -> str:
        return "[N/A]" if v is None else f"{v:g}" if isinstance(v, float) else str(v)
    out = []
    for g in rec["gpus"]:
        u, m = g.get("utilization") or {}, g.get("memory") or {}
        out.append({
            "utilization.gpu": s(u.get("gpu")), "utilization.memory": s(u.get("memory")),
            "memory.total": s(m["total"] / 2**20 if m else None),
            "memory.used": s(m["used"] / 2**20 if m else None),
            "temperature.gpu": s(g.get("temperature")),
            "power.draw": s(g["power_mw"] / 1000 if g.get("power_mw") is not None else None),
            "enforced.power.limit": s(g["power_limit_mw"] / 1000
                                      if g.get("power_limit_mw") is not None else None),
            "clocks.sm": s(g.get("sm_clock_mhz")), "clocks.mem": s(g.get("mem_clock_mhz")),
            "pcie.link.gen.current": s(g.get("pcie_link_gen")),
            "pcie.link.width.current": s(g.get("pcie_link_width")),
            "clocks_event_reasons.active": f"0x{int(g.get('clocks_event_reasons') or 0):016x}",
        })
    return out


def step_readings(ctx: Ctx) -> tuple[str, str, dict[str, Any]]:
    fields = [*SMI_FIELDS, "clocks_event_reasons.active"]
    if not ctx.gpu:
        # the same comparison, on the replayed h100x2 telemetry through the real adapter
        sys.path.insert(0, str(REPO))
        from tests.monitor_helpers import TELEMETRY, TelemetryReplay
        from tunerd.adapters import nvml
        from tunerd.monitor.gpu import GpuSampler

        with nvml.use_backend(TelemetryReplay()):
            sample = GpuSampler().sample()
        smi = replayed_smi(json.loads(TELEMETRY.read_text()))
        rows, bad = [], []
        for g, row in zip(sample["gpus"], smi, strict=False):
            r, b = compare_readings(g, row, row)
            rows.append(r)
            bad += b
        gpu = daemon_gpu_sample(ctx)
        if gpu.get("available"):
            bad.append("the daemon reports GPU monitoring on a node without a GPU")
        data = {"replayed": TELEMETRY.name, "rows": rows, "daemon_gpu": gpu,
                "tolerances": TOLERANCES}
        if bad:
            raise Failed("replayed telemetry: " + "; ".join(bad), data)
        n = sum(1 for r in rows for x in r if x["ok"])
        return PASS, (f"no GPU: the daemon says '{gpu.get('reason')}'; the comparison on "
                      f"replayed {TELEMETRY.name}: {n} readings agree"), data
    deadline = time.monotonic() + 20
    gpu = daemon_gpu_sample(ctx)
    while not gpu.get("gpus") and time.monotonic() < deadline:
        time.sleep(0.5)
        gpu = daemon_gpu_sample(ctx)
    if not gpu.get("available") or not gpu.get("gpus"):
        raise Failed(f"the daemon has no GPU sample: {gpu.get('reason')}")
    before = smi_query(fields)
    gpu = daemon_gpu_sample(ctx)
    after = smi_query(fields)
    rows, bad = [], []
    for g, b, a in zip(gpu["gpus"], before, after, strict=False):
        r, m = compare_readings(g, b, a)
        rows.append(r)
        bad += m
    # NUMA node: the daemon's topology vs sysfs vs `nvidia-smi topo -m`
    r = sh(tunerctl(ctx, "--json", "topology"), 30)
    dt = json.loads(r.stdout) if r.returncode == 0 else {}
    topo_m = sh(["nvidia-smi", "topo", "-m"], 30).stdout
    for g in dt.get("gpus") or []:
        sf = sysfs_gpu(g["pci_bus_id"])
        if sf["numa_node"] is not None and sf["numa_node"] >= 0 \
                and g.get("numa_node") != sf["numa_node"]:
            bad.append(f"GPU {g['index']} NUMA node: daemon {g.get('numa_node')}, "
                       f"sysfs {sf['numa_node']}")
    data = {"rows": rows, "tolerances": TOLERANCES, "nvidia_smi_topo": topo_m[-2000:],
            "smi_before": before, "smi_after": after}
    n = sum(1 for rr in rows for x in rr if x["ok"])
    if bad:
        raise Failed(f"{len(bad)} mismatch(es): " + "; ".join(bad), data)
    return PASS, f"{n} readings agree with nvidia-smi within the tolerances", data


# -- 5. doctor ------------------------------------------------------------------------
def step_doctor(ctx: Ctx) -> tuple[str, str, dict[str, Any]]:
    r = sh(tunerctl(ctx, "--json", "doctor", "--python", ctx.python), min(150, ctx.left()))
    try:
        checks = {c["id"]: c for c in json.loads(r.stdout)["checks"]}
    except (ValueError, KeyError, TypeError):
        raise Failed(f"tunerctl doctor: rc {r.returncode}: "
                     f"{tail(r.stderr or r.stdout)}") from None
    t = ctx.torch
    bad: list[str] = []

    def ev(cid: str) -> str:
        return str(checks.get(cid, {}).get("evidence", ""))

    def status(cid: str) -> str:
        return str(checks.get(cid, {}).get("status", "missing"))

    if "version" in t and t["version"] not in ev("torch"):
        bad.append(f"torch line '{ev('torch')}' lacks torch {t['version']}")
    if ctx.gpu:
        smi = smi_query(["driver_version"])[0]["driver_version"]
        drv = checks.get("nvidia-driver", {}).get("data") or {}
        if drv.get("driver") != smi:
            bad.append(f"driver: doctor {drv.get('driver')}, nvidia-smi {smi}")
        header = sh(["nvidia-smi"], 30).stdout
        m = re.search(r"CUDA Version:\s*([\d.]+)", header)
        if m and drv.get("cuda_driver") != m.group(1):
            bad.append(f"CUDA driver: doctor {drv.get('cuda_driver')}, nvidia-smi {m.group(1)}")
        if t.get("cuda_build") and t["cuda_build"] not in ev("cuda-version"):
            bad.append(f"cuda-version line lacks torch's CUDA {t['cuda_build']}")
        if t.get("cudnn") and str(t["cudnn"]) not in ev("cudnn"):
            bad.append(f"cudnn line '{ev('cudnn')}', torch says {t['cudnn']}")
        if t.get("nccl") and str(t["nccl"]) not in ev("nccl"):
            bad.append(f"nccl line '{ev('nccl')}', torch says {t['nccl']}")
        if status("torch-cuda") != PASS:
            bad.append(f"torch-cuda is {status('torch-cuda')}: {ev('torch-cuda')}")
    else:
        if status("nvidia-driver") not in (SKIP, FAIL):
            bad.append(f"nvidia-driver is {status('nvidia-driver')} without a GPU")
        if status("cuda-version") != SKIP:
            bad.append(f"cuda-version is {status('cuda-version')} without a GPU")
    data = {cid: {k: c.get(k) for k in ("status", "evidence")} for cid, c in checks.items()
            if cid in ("nvidia-driver", "torch", "torch-cuda", "cuda-version", "cudnn", "nccl")}
    if bad:
        raise Failed("; ".join(bad), data)
    lines = ", ".join(f"{k} {v['status']}" for k, v in data.items())
    return PASS, f"agrees with torch and nvidia-smi: {lines}", data


# -- 6. placement ---------------------------------------------------------------------
PRINT_PLACE = ("import json, os; print('PLACE ' + json.dumps({'cpus': sorted("
               "os.sched_getaffinity(0)), 'cvd': os.environ.get('CUDA_VISIBLE_DEVICES')}))")


def _place(out: str) -> dict[str, Any]:
    for line in out.splitlines():
        if line.startswith("PLACE "):
            return dict(json.loads(line[6:]))
    return {}


def step_placement(ctx: Ctx) -> tuple[str, str, dict[str, Any]]:
    if not ctx.gpu:
        r = sh(tunerctl(ctx, "run", "--ncpus", "1", "--", ctx.python, "-c", PRINT_PLACE), 60)
        got = _place(r.stdout)
        if r.returncode != 0 or len(got.get("cpus") or []) != 1:
            raise Failed(f"tunerctl run --ncpus 1: rc {r.returncode}, ran on {got.get('cpus')}: "
                         f"{tail(r.stderr)}")
        raise Skip(f"no GPU: `run --gpus 1` not checked (run --ncpus 1 ran on CPU "
                   f"{got['cpus'][0]} as leased)")
    r = sh(tunerctl(ctx, "run", "--gpus", "1", "--", ctx.python, "-c", PRINT_PLACE), 60)
    got = _place(r.stdout)
    if r.returncode != 0 or not got:
        raise Failed(f"tunerctl run --gpus 1: rc {r.returncode}: {tail(r.stderr)}")
    gpus = ctx.topo.get("gpus") or []
    idx = int(str(got.get("cvd") or "0").split(",")[0]) if str(got.get("cvd")).isdigit() else 0
    g = next((x for x in gpus if x["index"] == idx), gpus[0])
    local = sysfs_gpu(g["pci_bus_id"])["local_cpus"]
    data = {"cpus": got["cpus"], "cuda_visible_devices": got.get("cvd"),
            "gpu_local_cpulist": local}
    if local is None:
        raise Failed(f"no local_cpulist in sysfs for {g['pci_bus_id']}", data)
    if not set(got["cpus"]) <= set(local):
        raise Failed(f"ran on CPUs {got['cpus']}, outside GPU {idx}'s local CPUs {local}", data)
    return PASS, (f"CUDA_VISIBLE_DEVICES={got.get('cvd')}; ran on {len(got['cpus'])} CPU(s), "
                  f"all in GPU {idx}'s local_cpulist ({len(local)} CPUs)"), data


# -- 7. the guide's minimal example ------------------------------------------------------
def _metric(text: str, name: str, pid: int) -> float | None:
    m = re.search(rf'^{name}{{[^}}]*pid="{pid}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def train_args(ctx: Ctx, extra: list[str]) -> list[str]:
    base = [ctx.python, "bench/gpu_train.py"]
    if not ctx.gpu:  # two loaded CPUs: a small model, so it stays a few seconds
        base += ["--features", "64", "--batch", "32", "--samples", "512", "--workers", "2"]
    return base + extra


def step_training(ctx: Ctx) -> tuple[str, str, dict[str, Any]]:
    if "version" not in ctx.torch:  # a bare python3: the example needs torch
        raise Skip(f"no torch in {ctx.python}: the training example not run "
                   f"({ctx.torch.get('error', 'not probed')})")
    seconds = ("8" if ctx.quick else "12") if ctx.gpu else ("3" if ctx.quick else "6")
    run = ["run", "--gpus", "1"] if ctx.gpu else ["run", "--ncpus", "2"]
    argv = tunerctl(ctx, *run, "--", *train_args(ctx, ["--seconds", seconds, "--steps", "8"]))
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=REPO)
    want = ["tunerd_job_samples_per_second", "tunerd_job_step_seconds"]
    if ctx.gpu:
        want += ["tunerd_job_torch_allocated_bytes", "tunerd_job_torch_reserved_bytes"]
    seen: dict[str, float] = {}
    top_ok = False
    deadline = time.monotonic() + float(seconds) + 90
    try:
        while time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.3)
            text = sh(tunerctl(ctx, "metrics"), 20).stdout
            for name in want:
                v = _metric(text, name, p.pid)
                if v is not None:
                    seen[name] = v
            if len(seen) == len(want) and not top_ok:
                top = sh(tunerctl(ctx, "top", "--once"), 20).stdout
                top_ok = str(p.pid) in top
                js = json.loads(sh(tunerctl(ctx, "--json", "top"), 20).stdout or "{}")
                job = next((j for j in (js.get("sample") or {}).get("jobs") or []
                            if j.get("pid") == p.pid), {})
                seen["top_samples_per_s"] = float((job.get("torch") or {})
                                                  .get("samples_per_s") or 0)
            if top_ok:
                break
        out, err = p.communicate(timeout=max(5.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    summary: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("GPU_TRAIN "):
            summary = json.loads(line[10:])
    data = {"metrics": seen, "top_once_lists_job": top_ok, "run": summary}
    if p.returncode != 0 or not summary:
        raise Failed(f"training rc {p.returncode}: {tail(err)}", data)
    missing = [n for n in want if n not in seen]
    if missing or not top_ok:
        raise Failed(f"not in metrics: {missing or 'none'}; top --once lists the job: "
                     f"{top_ok}", data)
    mem = summary["reporter"].get("memory") or {}
    detail = (f"{summary['device']} {summary['amp']} (GradScaler {summary['grad_scaler']}), "
              f"{summary['num_workers']} workers, pin_memory {summary['pin_memory']}: "
              f"{summary['samples_per_s']:.0f} samples/s; metrics has samples/s "
              f"{seen['tunerd_job_samples_per_second']:.0f}, step "
              f"{seen['tunerd_job_step_seconds'] * 1e3:.1f} ms")
    if ctx.gpu:
        detail += f", CUDA allocated {seen['tunerd_job_torch_allocated_bytes'] / 2**20:.0f} MiB"
        if not summary.get("grad_scaler") or summary["device"] != "cuda":
            raise Failed(detail + ": not fp16 + GradScaler on CUDA", data)
    else:
        detail += f" (CPU: no CUDA memory; RSS {mem.get('rss', 0) / 2**20:.0f} MiB)"
    return PASS, detail + "; top --once lists it", data


# -- 8. bench -----------------------------------------------------------------------
def _bench(ctx: Ctx, args: list[str], timeout: float) -> dict[str, Any]:
    r = sh(tunerctl(ctx, "--json", "bench", "--quick", *args), timeout)
    try:
        res = json.loads(r.stdout)
    except ValueError:
        raise Failed(f"tunerctl bench {' '.join(args)}: rc {r.returncode}: "
                     f"{tail(r.stderr)}") from None
    c = res.get("comparison") or {}
    return {"ratio": c.get("ratio"), "ci": c.get("ci"), "winner": c.get("winner"),
            "metric": c.get("metric"), "median_a": c.get("median_a"),
            "median_b": c.get("median_b"), "verdict": c.get("verdict"), "rc": r.returncode,
            "elapsed_s": res.get("elapsed_s")}


def step_bench(ctx: Ctx) -> tuple[str, str, dict[str, Any]]:
    if not ctx.bench:
        raise Skip("--no-bench")
    if not ctx.gpu:
        raise Skip("no GPU: `bench --quick` on CUDA not run (tests/test_bench_cli.py runs "
                   "it on the CPU)")
    per = max(60.0, (ctx.left() - 20) / 2)
    builtin = _bench(ctx, ["--gpus", "1", "--python", ctx.python], per)
    loader = _bench(ctx, ["--gpus", "1", "--", *train_args(
        ctx, ["--sample-work", "4000", "--workers", "4", "--steps", "24"])], per)
    data = {"builtin_policy_vs_none": builtin, "dataloader_bound": loader}

    def fmt(b: dict[str, Any]) -> str:
        ci = b.get("ci")
        r = b.get("ratio")
        return (f"B/A {r:.3f} (95% {ci[0]:.3f}-{ci[1]:.3f})" if r is not None and ci
                else f"no ratio ({b.get('verdict')})")
    detail = f"built-in: {fmt(builtin)}; dataloader-bound: {fmt(loader)}"
    if builtin.get("ratio") is None or loader.get("ratio") is None:
        raise Failed(detail, data)
    return PASS, detail, data


# -- report -------------------------------------------------------------------------
def write_report(ctx: Ctx, started: float) -> int:
    failed = [s for s in ctx.steps if s.status == FAIL]
    res = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "host": os.uname().nodename, "gpu": ctx.gpu,
           "elapsed_s": round(time.time() - started, 1),
           "ok": not failed, "tolerances": TOLERANCES, "steps": [asdict(s) for s in ctx.steps]}
    (ctx.out / "gpu-check.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    lines = [f"# tunerd GPU check, {res['when']}", "",
             f"host `{res['host']}`; GPU: {'yes' if ctx.gpu else 'none (replay where possible)'}"
             f"; {res['elapsed_s']} s; result: {'OK' if not failed else 'FAILED'}", "",
             "| step | result | s | evidence |", "| --- | --- | --- | --- |"]
    for s in ctx.steps:
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.1f} | "
                     f"{s.detail.replace('|', '/')} |")
    lines += ["", f"Tolerances (daemon vs nvidia-smi): {TOLERANCES}; throttle reasons "
              "compared without the idle bit.", ""]
    (ctx.out / "gpu-check.md").write_text("\n".join(lines))
    print(f"report: {ctx.out / 'gpu-check.md'} and gpu-check.json "
          f"({len(failed)} failed, {sum(s.status == SKIP for s in ctx.steps)} skipped)")
    return 1 if failed else 0


@contextlib.contextmanager
def daemon_running(ctx: Ctx) -> Iterator[None]:
    try:
        start_daemon(ctx)
        yield
    finally:
        stop_daemon(ctx)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="report folder (default: $OUT, else a new folder in /tmp)")
    ap.add_argument("--quick", action="store_true", help="shorter training step")
    ap.add_argument("--no-bench", action="store_true", help="leave out `tunerctl bench`")
    ap.add_argument("--budget", type=float, default=330.0,
                    help="seconds for the whole check (steps not started after it: SKIP)")
    ap.add_argument("--policy-dir", type=Path, default=None,
                    help="the daemon's policies (default: none, i.e. the bundled default)")
    a = ap.parse_args(argv)
    out = a.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else
                    Path(tempfile.mkdtemp(prefix="tunerd-gpu-check-")))
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tunerd-gpu-check-work-") as work:
        ctx = Ctx(out=out, work=Path(work), python=sys.executable, quick=a.quick,
                  bench=not a.no_bench, policy_dir=a.policy_dir,
                  deadline=time.monotonic() + a.budget)
        print(f"tunerd GPU check: report in {out}", flush=True)
        run_step(ctx, "env", step_env)
        run_step(ctx, "topology", step_topology)
        run_step(ctx, "telemetry", step_telemetry)
        try:
            with daemon_running(ctx):
                run_step(ctx, "readings", step_readings)
                run_step(ctx, "doctor", step_doctor)
                run_step(ctx, "placement", step_placement)
                run_step(ctx, "training", step_training, min_left=40)
                run_step(ctx, "bench", step_bench, min_left=120)
        except Failed as f:
            ctx.steps.append(Step("daemon", FAIL, str(f)))
        return write_report(ctx, started)


if __name__ == "__main__":
    sys.exit(main())
