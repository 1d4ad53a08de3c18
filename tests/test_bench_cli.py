"""tunerctl bench end to end: the real built-in workload on CPU torch, failures, the
noisy neighbour, the interpreter check, JSON and the PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, CliResult, run_ctl


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def bench(*args: str, socket: str | None = None, timeout: float = 180) -> CliResult:
    pre = ("--socket", socket) if socket else ("--socket", "/nonexistent/tunerd.sock")
    return run_ctl(*pre, "bench", *args, timeout=timeout)


def test_quick_builtin_workload_against_tunerd_placement(daemon) -> None:
    """The real built-in training loop (torch, AMP, accumulation, DataLoader workers),
    A as is and B through `tunerctl run`, cut to 2 runs of 6 batches to keep the suite
    fast (`--quick` alone is 3 runs of 20)."""
    r = bench("--quick", "--runs", "2", "--steps", "6", "--json", socket=str(daemon.socket))
    assert r.rc == 0, r.err + r.out
    d = json.loads(r.out)
    assert "nn.Linear(1024, 1024)" in d["workload"] and "gradient accumulation" in d["workload"]
    assert d["python"]["executable"] and d["python"]["torch"].startswith("2.")
    assert d["arms"]["A"]["placement"] == "unbound" and d["arms"]["B"]["placement"] == "tunerd"
    runs = d["runs"]
    assert [r["arm"] for r in runs] == ["A", "B", "B", "A"] and d["failed"] == 0
    for run in runs:
        assert run["metric"] == "samples_per_second" and run["value"] > 0
        w = run["workload"]
        assert (w["amp"], w["num_workers"], w["accumulation_steps"]) == ("bf16", 4, 4)
        assert {"dataloader", "amp", "compile", "reporter"} <= {h["kind"] for h in run["helpers"]}
        via_run = "run" in run["argv"] and "--" in run["argv"]
        assert via_run is (run["arm"] == "B")
    c = d["comparison"]
    assert c["metric"] == "samples_per_second" and c["higher_is_better"]
    # 2 runs per arm measure a ratio but are too few for an interval, and it says so
    assert c["ratio"] > 0 and c["ci"] is None and c["winner"] is None
    assert c["verdict"] == ("no verdict: 2 and 2 runs are too few for a 95% interval (at least "
                            "4 per arm)")


def test_a_failed_run_shows_exit_code_and_stderr_and_no_nan() -> None:
    cmd = py("import os, sys\n"
             "if os.environ.get('TUNERD_NUM_WORKERS') == '3':\n"
             "    sys.exit('worker setup exploded: /data/shard-7 missing')\n"
             "print('TUNERD_METRIC samples_per_second 100 higher')")
    r = bench("--runs", "2", "--warmup", "0", "--a", "placement=unbound",
              "--b", "num_workers=3", "--", *cmd)
    assert r.rc == 1, r.out + r.err
    out = r.out
    assert "verdict: no verdict: placement=unbound, num_workers=3 has 0 successful runs" in out
    assert "nan" not in out
    assert "B run 1: exit 1" in out and "B run 2: exit 1" in out
    assert "worker setup exploded: /data/shard-7 missing" in out
    assert "failed runs (2):" in out
    assert "command:" in out and "workload: command:" in out


def test_human_table_names_workload_metric_and_verdict() -> None:
    cmd = py("import os\n"
             "print('TUNERD_METRIC rate', 20 if os.environ.get('TUNERD_AMP') == 'off' else 10,"
             " 'higher')")
    r = bench("--runs", "4", "--warmup", "0", "--a", "amp=bf16", "--b", "amp=off", "--", *cmd)
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert any(ln.startswith("metric:   rate (higher is better); 4 run(s) per arm") for ln in lines)
    table = [ln for ln in lines if ln.startswith(("A ", "B "))]
    assert table[0].split()[:4] == ["A", "placement=unbound,", "amp=bf16", "10"]
    assert table[1].split()[:4] == ["B", "placement=unbound,", "amp=off", "20"]
    assert "ratio B/A: 2.000 (95% interval 2.000-2.000)" in r.out
    assert ("verdict: B (placement=unbound, amp=off) is better: B's rate is 100.0% higher"
            in r.out)
    assert "did not call tunerd.torch's amp helper" in r.out  # the script reads env itself
    assert "[8/8]" in r.err  # progress, one line per run without a terminal


def test_no_torch_in_the_chosen_python_is_an_error_never_a_substitute(tmp_path: Path) -> None:
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    bare = str(venv / "bin" / "python")
    r = bench("--quick", "--a", "amp=off", "--b", "amp=bf16", "--python", bare)
    assert r.rc == 1, r.out + r.err
    assert "cannot import torch" in r.err and "--python PATH" in r.err
    assert str(venv) in r.err  # names the interpreter
    assert "TUNERD_METRIC" not in r.out and r.out == ""  # nothing ran in its place
    r = bench("--python", bare, "--", "true")
    assert r.rc == 2 and "--python" in r.err


def test_no_torch_error_names_the_training_python_that_has_it(tmp_path: Path) -> None:
    """The hint is doctor's training Python (python3 on PATH, not tunerd's venv) when it
    has torch, even though both venvs' pythons link to the same base interpreter."""
    import sysconfig

    bare, train = tmp_path / "bare", tmp_path / "train"
    for venv in (bare, train):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                       timeout=120)
    # the training venv sees this venv's packages (torch) through a .pth file
    site = subprocess.run([str(train / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "torch-from-test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    cand = str(train / "bin" / "python3")
    r = run_ctl("--socket", "/nonexistent/tunerd.sock", "bench", "--quick", "--a", "amp=off",
                "--b", "amp=bf16", "--python", str(bare / "bin" / "python"), timeout=180,
                env={"PATH": f"{train / 'bin'}{os.pathsep}{os.environ['PATH']}"})
    assert r.rc == 1, r.out + r.err
    assert f"({cand}, python3 on PATH, has torch: --python {cand})" in r.err, r.err


def _group_members(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":  # zombies wait for init
                out.append(int(d))
    return out


HOG_SEEN = """
import os
hog = int(os.environ["TUNERD_BENCH_HOG"])
members = 0
for d in os.listdir("/proc"):
    if d.isdigit():
        try:
            stat = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[2]) == hog:  # the hog's process group
            members += 1
print("TUNERD_METRIC hog_procs", members, "higher")
"""


def test_noisy_neighbour_runs_during_both_arms_and_is_ended(tmp_path: Path) -> None:
    r = bench("--json", "--noisy", "--noisy-procs", "2", "--runs", "2", "--warmup", "0",
              "--a", "amp=off", "--b", "amp=bf16", "--", *py(HOG_SEEN))
    assert r.rc == 0, r.err
    d = json.loads(r.out)
    assert d["noisy"]["procs"] == 2
    hog = d["noisy"]["pid"]
    assert [run["value"] for run in d["runs"]] == [2.0, 2.0, 2.0, 2.0]  # both arms saw it
    assert not Path(f"/proc/{hog}").exists() and _group_members(hog) == []


def test_exclusive_arm_moves_the_hog_off_its_cpus(daemon) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    probe = py("import os\n"
               "mine = os.sched_getaffinity(0)\n"
               "hog = int(os.environ['TUNERD_BENCH_HOG'])\n"
               "tasks = os.listdir(f'/proc/{hog}/task')\n"
               "theirs = set().union(*(os.sched_getaffinity(int(t)) for t in tasks))\n"
               "print('TUNERD_METRIC overlap', len(mine & theirs), 'lower')")
    r = bench("--json", "--noisy", "--noisy-procs", "2", "--runs", "2", "--warmup", "0",
              "--ncpus", "1", "--a", "placement=unbound", "--b", "placement=exclusive",
              "--", *probe, socket=str(daemon.socket))
    assert r.rc == 0, r.err + r.out
    d = json.loads(r.out)
    b_runs = [run for run in d["runs"] if run["arm"] == "B"]
    assert all("--exclusive-scope" in run["argv"] for run in b_runs)
    assert [run["value"] for run in b_runs] == [0.0, 0.0], b_runs  # hog moved off B's CPU
    assert [run["value"] for run in d["runs"] if run["arm"] == "A"] == [2.0, 2.0]


def test_tunerd_arm_without_daemon_exits_3_before_running() -> None:
    r = bench("--runs", "2", "--", "true")
    assert r.rc == 3 and "not reachable" in r.err


def test_same_arms_and_bad_specs_are_usage_errors() -> None:
    r = bench("--a", "placement=tunerd", "--", "true")
    assert r.rc == 2 and "the same" in r.err
    r = bench("--b", "amp=fp8", "--", "true")
    assert r.rc == 2 and "amp must be one of" in r.err
    r = bench("--cpus", "0-x", "--", "true")
    assert r.rc == 2 and "--cpus" in r.err


def test_steps_with_a_command_is_a_usage_error() -> None:
    r = bench("--steps", "10", "--", "true")
    assert r.rc == 2 and "--steps" in r.err and "built-in workload" in r.err, r.err


def test_no_run_measured_names_no_metric() -> None:
    cmd = py("import sys; sys.exit('no data')")
    r = bench("--runs", "2", "--warmup", "0", "--b", "num_workers=3", "--", *cmd)
    assert r.rc == 1, r.out + r.err
    assert "metric:   none, no run measured anything;" in r.out
    assert "samples_per_second" not in r.out and "wall_seconds" not in r.out
    r = bench("--json", "--runs", "2", "--warmup", "0", "--b", "num_workers=3", "--", *cmd)
    assert r.rc == 1 and json.loads(r.out)["comparison"]["metric"] is None


def test_builtin_workload_reports_no_rate_when_nothing_was_timed() -> None:
    p = subprocess.run([sys.executable, "-m", "tunerd.bench.workload"], capture_output=True,
                       text=True, timeout=180, cwd=REPO,
                       env={**os.environ, "TUNERD_BENCH_STEPS": "1", "TUNERD_NUM_WORKERS": "0"})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "TUNERD_METRIC" not in p.stdout and "TUNERD_WORKLOAD" in p.stdout
    assert "nothing was timed (1 batch(es), 0 warm-up)" in p.stderr


def test_cpus_is_a_cpu_list_and_ncpus_a_count(daemon) -> None:
    """`bench --cpus 1` is CPU 1 as in bind (the count is --ncpus), no warning."""
    r = bench("--json", "--cpus", "1", "--runs", "2", "--warmup", "0", "--",
              *py("print('TUNERD_METRIC x 1 higher')"), socket=str(daemon.socket))
    assert r.rc == 0, r.err
    assert "deprecated" not in r.err
    argv = next(run["argv"] for run in json.loads(r.out)["runs"] if run["arm"] == "B")
    words = argv[argv.index("run"):argv.index("--")]
    assert words[-2:] == ["--cpus", "1"]


def test_png_plots_every_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    cmd = py("import os; print('TUNERD_METRIC rate', 3 if os.environ.get('TUNERD_AMP') == 'off'"
             " else 2, 'higher')")
    r = bench("--png", str(png), "--runs", "2", "--warmup", "1", "--a", "amp=bf16",
              "--b", "amp=off", "--", *cmd)
    assert r.rc == 0, r.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert f"plot: {png}" in r.out


def test_png_without_matplotlib_says_how_to_get_it(tmp_path: Path) -> None:
    # a Python that cannot import matplotlib: the module is blocked before tunerctl runs
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from tunerd.cli.main import main\n"
            "sys.argv[0] = 'tunerctl'; main()")
    p = subprocess.run([sys.executable, "-c", code, "--socket", "/nonexistent", "bench",
                        "--png", str(tmp_path / "x.png"), "--a", "amp=off", "--b", "amp=bf16",
                        "--", "true"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 1, p.stderr
    assert "--png needs matplotlib" in p.stderr and "tunerd[plot]" in p.stderr
    assert p.stdout == ""  # checked before anything ran


def test_builtin_workload_python_is_found_as_doctor_finds_it(tmp_path: Path,
                                                             monkeypatch) -> None:
    """Without --python: python3 on PATH when it has torch, else tunerctl's own; the
    choice is said (``how``), and a PATH python3 without torch is passed over."""
    import sysconfig

    from tunerd.cli.cmd_bench import workload_python

    bare, train = tmp_path / "bare", tmp_path / "train"
    for venv in (bare, train):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                       timeout=120)
    site = subprocess.run([str(train / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "torch-from-test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    monkeypatch.setenv("PATH", f"{train / 'bin'}{os.pathsep}/usr/bin:/bin")
    got = workload_python(None)
    assert (got.path, got.how) == (str(train / "bin" / "python3"), "python3 on PATH")
    assert "python3 on PATH" in got.describe() and got.torch
    monkeypatch.setenv("PATH", f"{bare / 'bin'}")
    got = workload_python(None)
    assert (got.path, got.how) == (sys.executable, "tunerctl's own")
