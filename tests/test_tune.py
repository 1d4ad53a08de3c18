"""tunerctl tune end to end on a small workload: a script whose batches really are faster
with 2 DataLoader workers, reading num_workers through tunerd.torch.dataloader_kwargs
(no torch needed for that helper, which keeps the test fast)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from tests.helpers import REPO, CliResult, run_ctl

SMALL_TRAIN = """
import sys, time
sys.path.insert(0, {repo!r})
import tunerd.torch as tt

kw = tt.dataloader_kwargs(cuda=False)   # computed: 1 worker on 2 CPUs; tune varies it
workers = kw.get("num_workers", 0)
t0 = time.perf_counter()
for _ in range(4):  # a batch waits 40 ms for data with 1 worker, 10 ms with 2; more than
    time.sleep({{0: 0.04, 1: 0.04, 2: 0.01}}.get(workers, 0.03))  # 2 oversubscribe 2 CPUs
print("TUNERD_METRIC samples_per_second", 4 * 32 / (time.perf_counter() - t0), "higher")
"""


def tune(*args: str, socket: str, timeout: float = 240) -> CliResult:
    return run_ctl("--socket", socket, "tune", *args, timeout=timeout)


@pytest.fixture
def small_train(tmp_path: Path) -> Path:
    p = tmp_path / "small_train.py"
    p.write_text(SMALL_TRAIN.format(repo=str(REPO)))
    return p


def test_tune_keeps_what_helps_skips_what_cannot_apply_and_prints_a_rule(
        daemon, small_train: Path) -> None:
    r = tune("--quick", "--", sys.executable, str(small_train), socket=str(daemon.socket))
    assert r.rc == 0, r.err + r.out
    log = r.err
    # settings the script never reads are skipped, with the reason
    assert "pin_memory: skipped (no CUDA" in log
    assert "amp: skipped (the command does not use tunerd.torch.Amp)" in log
    assert "compile" not in log  # --quick leaves torch.compile out
    # placement was tried and changed nothing measurable here
    assert "placement: as is" not in log and "placement: unbound -> tunerd:" in log
    # num_workers: 1 -> 2 helps (kept), 2 -> 4 does not: the walk stops there
    assert "num_workers: 1 -> 2: B (" in log and "num_workers: 1 -> 2: B" in log
    assert "num_workers: 2 -> 4: A (" in log and "kept 2" in log
    assert "num_workers: 4 -> 8" not in log and "num_workers: 2 -> 1" not in log
    rule = tomllib.loads(r.out)
    job = rule["job"][0]
    assert job["name"] == "tuned-small_train"
    assert job["match"]["cmdline"] == ["*small_train.py*"]
    assert job["workers"] == 2 and job["torch"] == {"num_workers": 2}
    assert job["placement"] in ("none", "gpu-local", "exclusive")
    assert "# kept (each one's 95% interval of the ratio excluded 1): num_workers=2: " in r.out
    assert job["match"]["user"] == ["root"]  # the measured job's user, not everyone's


def test_tune_json_and_saved_rule_pass_policy_check(daemon, small_train: Path,
                                                    tmp_path: Path) -> None:
    saved = tmp_path / "50-tuned.toml"
    r = tune("--quick", "--json", "--settings", "num_workers", "--save", str(saved), "--",
             sys.executable, str(small_train), socket=str(daemon.socket))
    assert r.rc == 0, r.err
    d = json.loads(r.out)
    assert d["final"]["settings"] == {"num_workers": 2}
    assert [s["kept"] for s in d["steps"]][:1] == [True]
    assert d["rule"] == saved.read_text()
    check = run_ctl("policy", "check", str(saved))
    assert check.rc == 0, check.out + check.err


def test_tune_without_daemon_skips_placement(small_train: Path, tmp_path: Path) -> None:
    r = tune("--quick", "--settings", "placement,num_workers", "--", sys.executable,
             str(small_train), socket=str(tmp_path / "none.sock"))
    assert r.rc == 0, r.err
    assert "placement: skipped (the daemon is not reachable" in r.err
    assert tomllib.loads(r.out)["job"][0]["placement"] == "none"


def test_tune_of_a_failing_command_says_why(tmp_path: Path) -> None:
    r = tune("--quick", "--settings", "num_workers", "--", sys.executable, "-c",
             "import sys; sys.exit('no dataset at /data/train')", socket=str(tmp_path / "x"))
    assert r.rc == 1
    assert "failed as it is (exit 1)" in r.err and "no dataset at /data/train" in r.err


def test_steps_with_a_command_is_a_usage_error(tmp_path: Path) -> None:
    r = tune("--steps", "10", "--", sys.executable, "-c", "pass", socket=str(tmp_path / "x"))
    assert r.rc == 2 and "--steps" in r.err and "built-in workload" in r.err, r.err


def _result(command: list[str], kept: list[bool]) -> Any:
    """A TuneResult of comparisons with made-up medians: the first one measured the start
    at 5715, later ones drifted (as a loaded machine does) to 9179 without a change."""
    from tunerd.bench import BenchResult
    from tunerd.bench.arms import ArmSpec
    from tunerd.bench.stats import Comparison
    from tunerd.bench.tune import Step, TuneResult

    steps = []
    for i, k in enumerate(kept):
        a, b = (5715.0, 6100.0) if i == 0 else (9179.0, 9000.0)
        c = Comparison("samples_per_second", True, a, b, b / a, (b / a - 0.05, b / a + 0.05)
                       if k else (0.9, 1.1), "B" if k else None, "B (..)" if k else "no winner")
        steps.append(Step("num_workers", 2 + i, ArmSpec(), ArmSpec(), BenchResult(
            config=None, runs=[], comparison=c, elapsed_s=1.0), k, 1))  # type: ignore[arg-type]
    return TuneResult(command=command, probe=None, start=ArmSpec(),  # type: ignore[arg-type]
                      final=ArmSpec(), known={}, steps=steps)


def test_the_summary_speaks_only_of_kept_changes() -> None:
    from tunerd.bench.tune import rule_snippet

    none_kept = _result(["python", "train.py"], [False, False])
    assert none_kept.gain() == (5715.0, None)  # no "5715 -> 9179 (1.606x)" from drift
    text = rule_snippet(none_kept, user="alice")
    assert "# measured" not in text and "interval excluded 1" not in text
    assert "# kept: nothing (no change helped beyond the noise)" in text
    one = rule_snippet(_result(["python", "train.py"], [True, False]), user="alice")
    assert "# kept (each one's 95% interval of the ratio excluded 1): num_workers=2: " \
        "1.067x (95% 1.017-1.117)" in one


@pytest.mark.parametrize(("command", "cmdline"), [
    (["python", "/data/jobs/train.py", "--epochs", "3"], "*train.py*"),
    (["/usr/bin/python3", "-m", "mypkg.train", "--lr", "1"], "*-m mypkg.train*"),
    (["python3", "-c", "import x; x.main()"], "*python3 -c import x; x.main()*"),
    (["./trainer", "--fast"], "*trainer*"),
    (["env", "A=1", "python", "-c", "pass"], "*env A=1 python -c pass*"),
    (["python", "-c", "print([1]*2)"], "*python -c print([[]1][*]2)*"),
])
def test_the_rule_matches_the_measured_job_never_every_python(
        command: list[str], cmdline: str) -> None:
    from tunerd.bench.tune import rule_snippet

    rule = tomllib.loads(rule_snippet(_result(command, [True]), user="alice"))["job"][0]
    assert rule["match"]["cmdline"] == [cmdline]
    assert rule["match"]["user"] == ["alice"]
    assert not any(g.strip("*") in ("python", "python3") for g in rule["match"]["cmdline"])
