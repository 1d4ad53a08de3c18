"""The monitor in a real daemon: metrics (promtool, HTTP, a real Prometheus), top, advise."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DaemonProc, ready_child, wait_for
from tests.monitor_helpers import free_port
from tunerd.adapters.procfs import Process

PROMTOOL = "/usr/bin/promtool"
PROMETHEUS = "/usr/bin/prometheus"


def fast_config(tmp: Path, interval: float = 0.25) -> list[str]:
    cfg = tmp / "tunerd.toml"
    cfg.write_text(f"sample_interval = {interval}\nhistory_seconds = 60\n")
    return ["--config", str(cfg)]


def promtool_check(text: str) -> None:
    if not os.path.exists(PROMTOOL):
        pytest.skip(f"{PROMTOOL} not installed: the exposition's syntax was not checked")
    p = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stdout + p.stderr


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


@pytest.mark.skipif(not os.path.exists(PROMTOOL), reason="promtool not installed")
def test_metrics_command_and_http_endpoint_pass_promtool(daemon_factory: Any,
                                                         tmp_path: Path) -> None:
    port = free_port()
    d: DaemonProc = daemon_factory(args=["--metrics-listen", f"127.0.0.1:{port}"]).start()
    r = d.ctl("metrics")
    assert r.rc == 0, r.err
    promtool_check(r.out)
    assert "tunerd_up 1.0" in r.out
    assert "tunerd_gpu_monitoring_available 0.0" in r.out  # no driver on this machine
    assert 'tunerd_numa_memory_total_bytes{numa_node="0"}' in r.out
    assert 'tunerd_pressure_stalled_seconds_total{kind="some",resource="io"}' in r.out
    assert "tunerd_process_resident_memory_bytes" in r.out
    body = http_get(f"http://127.0.0.1:{port}/metrics")
    promtool_check(body)
    assert "tunerd_up 1.0" in body
    assert http_get(f"http://127.0.0.1:{port}/healthz") == "ok\n"  # the DaemonSet's probes
    st = d.ctl("status")
    assert f"metrics on 127.0.0.1:{port}" in st.out


def test_metrics_listen_ipv6_and_bad_values(daemon_factory: Any) -> None:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    d: DaemonProc = daemon_factory(args=["--metrics-listen", f"[::1]:{port}"], name="v6").start()
    assert "tunerd_up 1.0" in http_get(f"http://[::1]:{port}/metrics")
    d.stop()
    for bad, words in (("localhost", "HOST:PORT"), ("127.0.0.1:99999", "port must be"),
                       ("[::1:9464", "HOST:PORT")):
        b: DaemonProc = daemon_factory(args=["--metrics-listen", bad], name=f"bad{len(bad)}")
        b.start(wait=False)
        assert b.proc is not None
        assert b.proc.wait(20) == 2, b.log()
        assert words in b.log() and repr(bad) in b.log()


@pytest.mark.skipif(not os.path.exists(PROMETHEUS), reason="prometheus not installed")
def test_a_real_prometheus_scrapes_tunerd(daemon_factory: Any, tmp_path: Path) -> None:
    port, prom_port = free_port(), free_port()
    daemon_factory(args=["--metrics-listen", f"127.0.0.1:{port}"]).start()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: tunerd\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{port}']\n")
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed in finally
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        def query() -> Any:
            try:
                res = json.loads(http_get(
                    f"http://127.0.0.1:{prom_port}/api/v1/query?query=tunerd_up"))
            except OSError:
                return None
            return res["data"]["result"]

        result = wait_for(query, 60, "Prometheus to scrape tunerd_up", interval=0.2)
        assert result[0]["metric"]["job"] == "tunerd"
        assert result[0]["metric"]["instance"] == f"127.0.0.1:{port}"
        assert result[0]["value"][1] == "1"
    finally:
        prom.send_signal(signal.SIGTERM)
        try:
            prom.wait(20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()


def test_top_once_renders_in_80_columns(daemon: DaemonProc) -> None:
    r = daemon.ctl("top", "--once")
    assert r.rc == 0, r.err
    assert "NUMA nodes" in r.out and "GPUs: not available" in r.out
    assert "\x1b[?1049h" not in r.out  # no alternate screen for --once
    reply = daemon.ctl("--json", "top").json()
    assert reply["sample"]["host"]["numa"]
    assert_fits_80(reply)


def assert_fits_80(reply: dict[str, Any]) -> str:
    from rich.console import Console

    from tunerd.cli.top_view import render

    buf = StringIO()
    Console(file=buf, width=80, force_terminal=False, color_system=None).print(render(reply))
    text = buf.getvalue()
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long, "\n".join(too_long)
    return text


def test_top_layout_with_gpus_and_many_jobs_fits_80_columns(tmp_path: Path) -> None:
    """A replayed 2-GPU sample plus jobs with long names and cpu lists, at 80 columns."""
    from tests.monitor_helpers import TelemetryReplay
    from tunerd.adapters import nvml
    from tunerd.monitor.gpu import GpuSampler

    with nvml.use_backend(TelemetryReplay()):
        gpu = GpuSampler().sample()
    jobs = [{"pid": 400000 + i, "name": "a-very-long-training-job-name-" * 2,
             "cpus": "0-3,8-11,16-19,24-27,32-35", "mems": "0-1", "gpus": [0, 1, 2, 3, 4, 5],
             "cpu_cores": 12.5, "rss_bytes": 3.5e11, "locality_ratio": 0.42} for i in range(5)]
    numa = [{"node": n, "cpus": "0-47,96-143", "busy_ratio": 0.999,
             "memory_used_bytes": 5e11, "memory_total_bytes": 1.1e12} for n in range(8)]
    text = assert_fits_80({"sample": {"time": 0, "gpu": gpu, "host": {"numa": numa},
                                      "jobs": jobs}})
    assert "sw_power_cap,sw_thermal" in text or "sw_power_cap" in text
    assert "400004" in text


BUSY = """
import hashlib, os, resource, threading, time
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(115)]
buf = b"x" * (1 << 20)
def spin():
    while True:
        hashlib.sha256(buf).digest()   # releases the GIL: all threads really run
for _ in range(8):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def busy_child() -> Iterator[subprocess.Popen[str]]:
    with ready_child(BUSY) as p:
        yield p


@pytest.mark.root
def test_advise_on_a_real_bound_job(daemon_factory: Any, tmp_path: Path,
                                    busy_child: subprocess.Popen[str]) -> None:
    """8 busy threads bound to 1 CPU with 115 of 128 fds open: two findings, end to end."""
    d: DaemonProc = daemon_factory(args=fast_config(tmp_path)).start()
    pid = busy_child.pid
    r = d.ctl("bind", str(pid), "--cpus", "0")
    assert r.rc == 0, r.err

    def findings() -> Any:
        res = d.ctl("--json", "advise", str(pid))
        if "jobs" not in json.loads(res.out):  # not sampled yet: "not a bound job"
            return None
        got = {f["id"]: f for j in json.loads(res.out)["jobs"] for f in j["findings"]}
        return got if {"fd-limit", "cpu-oversubscription"} <= set(got) else None

    got = wait_for(findings, 30, "advise findings", interval=0.2)
    assert got["fd-limit"]["evidence"]["nofile_soft"] == 128
    assert got["fd-limit"]["evidence"]["open_fds"] >= 115
    assert got["cpu-oversubscription"]["evidence"]["ncpus"] == 1
    assert got["cpu-oversubscription"]["evidence"]["runnable_threads_median"] >= 3
    human = d.ctl("advise", str(pid))
    assert human.rc == 1 and "fix: Raise the limit" in human.out
    # the same job in top and in the metrics
    top = d.ctl("--json", "top").json()
    [job] = [j for j in top["sample"]["jobs"] if j["pid"] == pid]
    assert job["cpus"] == "0" and job["open_fds"] >= 115 and job["rss_bytes"] > 0
    text = d.ctl("top", "--once").out
    assert str(pid) in text
    metrics = d.ctl("metrics").out
    assert f'tunerd_job_max_fds{{job="{job["name"]}",pid="{pid}"}} 128.0' in metrics
    assert "tunerd_binds_total 1.0" in metrics  # counted by the JobRegistry at bind time
    # an unbound pid is a clear error; an exited job leaves top
    bad = d.ctl("advise", "1")
    assert bad.rc == 1 and "process 1 is not a bound job" in bad.err
    busy_child.kill()
    busy_child.wait()
    wait_for(lambda: not d.ctl("--json", "top").json()["sample"]["jobs"], 10, "job to leave",
             interval=0.2)
    promtool_check(metrics)  # last: it skips where promtool is missing


REPORTER = """
import os, sys, time
sys.path.insert(0, {repo!r})
from tunerd.wire.client import Client
# what tunerd.torch.StepReporter sends on a GPU node, with the numbers given directly
with Client({sock!r}) as c:
    r = c.call("report", pid=os.getpid(), steps=10, step_time_s=0.1, samples_per_s=320.0,
               device="cuda", memory={{"reserved": 60 << 30, "allocated": 20 << 30,
                                      "max_allocated": 24 << 30}})
assert r["accepted"] is True, r
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.root
def test_torch_stats_reported_by_a_job_reach_advise(daemon_factory: Any,
                                                    tmp_path: Path) -> None:
    from tests.helpers import REPO

    d: DaemonProc = daemon_factory(args=fast_config(tmp_path)).start()
    with ready_child(REPORTER.format(repo=str(REPO), sock=str(d.socket))) as p:
        assert d.ctl("bind", str(p.pid), "--cpus", "0").rc == 0

        def frag() -> Any:
            res = json.loads(d.ctl("--json", "advise", str(p.pid)).out)
            fs = [f for j in res.get("jobs", []) for f in j["findings"]
                  if f["id"] == "gpu-memory-fragmentation"]
            return fs[0] if fs else None

        f = wait_for(frag, 20, "fragmentation finding", interval=0.2)
        assert f["evidence"]["reserved_bytes"] == 60 << 30
        assert f["evidence"]["reserved_over_allocated"] == 3.0
        top = d.ctl("--json", "top").json()
        job = next(j for j in top["sample"]["jobs"] if j["pid"] == p.pid)
        assert job["torch"]["samples_per_s"] == 320.0 and job["torch"]["steps"] == 10
        # ... and the metrics (one series per reported figure)
        metrics = d.ctl("metrics").out
        assert f'tunerd_job_samples_per_second{{job="python",pid="{p.pid}"}} 320.0' in metrics
        assert f'tunerd_job_torch_reserved_bytes{{job="python",pid="{p.pid}"}}' in metrics


@pytest.mark.root
def test_no_file_a_user_can_plant_freezes_the_sampler(daemon_factory: Any,
                                                      tmp_path: Path) -> None:
    """Issue 9: any user could mkfifo RUNTIME_DIR/jobs/PID.json for a bound PID; the
    sampler blocked in open() and SIGTERM left the daemon alive for 20 s. Torch stats
    now come with the `report` command: the runtime dir has no directory a user may
    write, and the sampler keeps sampling a bound job."""
    d: DaemonProc = daemon_factory(args=fast_config(tmp_path)).start()
    # the daemon reads files only from these two trees (and /proc, /sys, the policy
    # dir and config root passes it): no directory in them may be a user's to write
    writable = [str(q) for top in (d.runtime_dir, d.state_dir) for q in [top, *top.rglob("*")]
                if q.is_dir() and (q.stat().st_mode & 0o022 or q.stat().st_uid != 0)]
    assert writable == [], f"directories other users may write: {writable}"
    with ready_child("import time\nprint('ready', flush=True)\ntime.sleep(120)") as p:
        assert d.ctl("bind", str(p.pid), "--cpus", "0").rc == 0

        def samples() -> int:
            return int(d.ctl("--json", "status").json()["services"]["monitor"]["samples_total"])

        first = samples()
        wait_for(lambda: samples() >= first + 4, 15, "four more samples")
        top = d.ctl("--json", "top").json()["sample"]
        assert [j["pid"] for j in top["jobs"]] == [p.pid] and top["jobs"][0]["torch"] is None
        t0 = time.monotonic()
        assert d.stop(timeout=10) == 0
        assert time.monotonic() - t0 < 10


@pytest.mark.root
def test_report_for_another_users_process_is_refused(daemon_factory: Any,
                                                     unpriv_user: tuple[int, int]) -> None:
    from tests.helpers import run_as
    from tunerd.base.errors import PermissionDenied

    d: DaemonProc = daemon_factory().start()
    d.tmp.parent.chmod(0o755)
    uid, gid = unpriv_user
    with pytest.raises(PermissionDenied, match="may only report for its own processes"):
        run_as(uid, gid, _call, str(d.socket), "report", {"pid": 1, "steps": 1})
    # a malformed report is a usage error naming the field, not a traceback
    r = _call_raw(str(d.socket), "report", {"pid": os.getpid(), "samples_per_s": "fast"})
    assert r["ok"] is False and r["error"]["code"] == "usage"
    assert "samples_per_s" in r["error"]["message"]


def _call_raw(sock: str, cmd: str, args: dict[str, Any]) -> Any:
    import socket as so

    with so.socket(so.AF_UNIX, so.SOCK_STREAM) as s:
        s.connect(sock)
        s.sendall(json.dumps({"id": 1, "cmd": cmd, "args": args}).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            buf += s.recv(65536)
    return json.loads(buf)


def _call(sock: str, cmd: str, args: dict[str, Any] | None = None) -> Any:
    from tunerd.wire.client import Client

    with Client(sock) as c:
        return c.call(cmd, **(args or {}))


@pytest.mark.root
def test_another_user_may_read_metrics_top_and_advise(unpriv_user: tuple[int, int]) -> None:
    """Read-only monitor commands are open to every user (README, "Privileges")."""
    import shutil
    import tempfile

    from tests.helpers import run_as, write_policy

    base = Path(tempfile.mkdtemp(prefix="tunerd-mon-auth-", dir="/tmp"))
    os.chmod(base, 0o755)  # pytest's tmp dirs are root-only: the user must reach the socket
    write_policy(base / "policies", "00.toml", '[policy]\nname = "t"\n')
    d = DaemonProc(tmp=base, policy_dir=base / "policies")
    try:
        d.start()
        uid, gid = unpriv_user
        sock = str(d.socket)
        assert "tunerd_up 1.0" in run_as(uid, gid, _call, sock, "metrics")["text"]
        assert run_as(uid, gid, _call, sock, "top")["sample"]["host"]["cpus"]
        assert run_as(uid, gid, _call, sock, "advise") == {"jobs": [], "interval": 1.0}
    finally:
        d.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_metrics_port_in_use_is_reported_and_the_daemon_keeps_serving(
        daemon_factory: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d: DaemonProc = daemon_factory(args=["--metrics-listen", f"127.0.0.1:{port}"]).start()
        st = d.ctl("status")
        assert st.rc == 0
        assert f"cannot listen on 127.0.0.1:{port}" in st.out
        assert "tunerd_up 1.0" in d.ctl("metrics").out  # the socket path still works


GUIDE_EXAMPLE = """
import time, torch
from torch.utils.data import DataLoader, Dataset

class Synthetic(Dataset):  # the guide's example: CPU-side preprocessing per sample
    def __len__(self): return 1 << 30
    def __getitem__(self, i):
        x = torch.randn(256, 256)
        for _ in range(4):
            x = torch.tanh(x @ x.T / 256)
        return x[0, :1024 // 4].repeat(4), torch.randint(0, 10, ())

torch.set_num_threads(1)
model = torch.nn.Linear(1024, 1024)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Synthetic(), batch_size=32, num_workers=4)
print("ready", flush=True)
for x, _ in loader:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.root
def test_the_guides_example_on_one_cpu_is_found_within_15s(daemon_factory: Any,
                                                           tmp_path: Path) -> None:
    """Issue 11: 4 DataLoader workers and the loop bound to 1 CPU gave "no findings";
    the job's own CPU share (57%) hid its workers. advise now counts them."""
    pytest.importorskip("torch")
    d: DaemonProc = daemon_factory().start()  # the default 1 s sampling
    with ready_child(GUIDE_EXAMPLE, stderr=subprocess.DEVNULL) as p:
        cpu = str(min(os.sched_getaffinity(0)))
        t0 = time.monotonic()
        r = d.ctl("bind", str(p.pid), "--cpus", cpu)
        assert r.rc == 0, r.err
        # the workers were forked before the bind: they keep their masks, so bind them too
        wait_for(lambda: len(Process(p.pid).children()) >= 4, 30, "4 DataLoader workers")
        for w in Process(p.pid).children():
            assert d.ctl("bind", str(w), "--cpus", cpu).rc == 0

        def finding() -> Any:
            res = d.ctl("--json", "advise", str(p.pid)).json()  # an error until sampled
            ids = {f["id"]: f for j in res.get("jobs") or [] for f in j["findings"]}
            return ids.get("data-loading-cpu-starved") or ids.get("cpu-oversubscription")

        f = wait_for(finding, 15, "a data-loading or oversubscription finding", interval=0.5)
        assert time.monotonic() - t0 < 30
        top = next(j for j in d.ctl("--json", "top").json()["sample"]["jobs"]
                   if j["pid"] == p.pid)
        assert top["workers"] >= 4, top
        assert f["evidence"].get("workers", 4) >= 4


LOSES_ITS_BINDING = """
import os, sys, time
cpus = sorted(os.sched_getaffinity(0))
pid = os.fork()
if pid == 0:  # a "DataLoader worker" whose mask something reset after the fork
    os.sched_setaffinity(0, set(cpus))
    time.sleep(120)
    os._exit(0)
print("ready", pid, flush=True)
time.sleep(120)
"""


@pytest.mark.root
def test_advise_names_the_ways_a_binding_is_lost(daemon_factory: Any) -> None:
    """Issue 11: OMP_NUM_THREADS larger than the CPUs given (pytorch#82219) and a worker
    running outside its parent's CPUs (pytorch#28389, Intel OpenMP after fork)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    d: DaemonProc = daemon_factory().start()
    p = subprocess.Popen([sys.executable, "-c", LOSES_ITS_BINDING], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "16"})
    try:
        assert p.stdout is not None
        _, worker = p.stdout.readline().split()
        time.sleep(0.2)  # the worker widened its mask back to every CPU
        cpu = str(min(os.sched_getaffinity(0)))
        # the parent alone is bound (as a bind after the fork leaves a worker's mask)
        assert d.ctl("bind", str(p.pid), "--cpus", cpu).rc == 0

        def ids() -> set[str]:
            r = d.ctl("--json", "advise", str(p.pid))  # exit 1: findings, or not sampled yet
            jobs = r.json().get("jobs") or []
            return {f["id"] for j in jobs for f in j["findings"]}

        got = wait_for(lambda: (i := ids()) >= {"omp-threads-oversubscribe",
                                                "worker-affinity-lost"} and i, 15,
                       "both binding findings")
        assert got
        assert int(worker) > 0
    finally:
        p.kill()
        p.wait()


def test_top_once_right_after_bind_lists_the_job(daemon_factory: Any, tmp_path: Path) -> None:
    """A bind made since the last sample is in `top --once` at once (with its CPUs and
    no readings yet), not "No bound jobs" until the next sample (issue 29)."""
    d = daemon_factory(args=fast_config(tmp_path, interval=60.0)).start()
    wait_for(lambda: d.ctl("--json", "top").json().get("sample"), 10, "the first sample")
    p = subprocess.Popen(["sleep", "60"])
    try:
        r = d.ctl("bind", str(p.pid), "--cpus", "0")
        assert r.rc == 0, r.err
        top = d.ctl("top", "--once")
        assert top.rc == 0, top.err
        assert "No bound jobs" not in top.out, top.out
        row = next(line for line in top.out.splitlines() if line.strip().startswith(str(p.pid)))
        assert "sleep" in row and " 0 " in f" {row} ", row
    finally:
        p.kill()
        p.wait()
