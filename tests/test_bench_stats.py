"""Bench statistics and the interleaved runner, on real subprocesses."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from tunerd.bench import BenchConfig, run_bench
from tunerd.bench.arms import ArmSpec, parse_arm
from tunerd.bench.runner import interleave, run_once
from tunerd.bench.stats import compare, min_runs_for_interval, ratio_interval


def test_metric_line_then_reporter_then_wall_time(tmp_path: Path) -> None:
    res = run_once([sys.executable, "-c", "print('TUNERD_METRIC samples 123.5 higher')"], {}, 30)
    assert (res.metric, res.value, res.higher, res.ok) == ("samples", 123.5, True, True)
    res = run_once([sys.executable, "-c", "pass"], {}, 30)
    assert res.ok and res.metric == "wall_seconds" and res.higher is False
    # a StepReporter's summary (two ranks: their rates add up)
    code = ("import json, os\n"
            "with open(os.environ['TUNERD_BENCH_OUT'], 'a') as f:\n"
            "    for pid, rate in ((1, 10.0), (2, 12.5)):\n"
            "        line = {'pid': pid, 'kind': 'reporter', 'samples_per_s': rate}\n"
            "        f.write(json.dumps(line) + '\\n')\n")
    res = run_once([sys.executable, "-c", code], {}, 30)
    assert (res.metric, res.value) == ("samples_per_second", 22.5)


def test_a_failed_run_keeps_its_exit_code_and_stderr() -> None:
    res = run_once([sys.executable, "-c", "import sys; print('boom: bad data', file=sys.stderr);"
                    " sys.exit(3)"], {}, 30)
    assert not res.ok and res.rc == 3 and res.error == "exit 3"
    assert "boom: bad data" in res.stderr_tail
    res = run_once(["/nonexistent/trainer"], {}, 30)
    assert res.error is not None and "command not found" in res.error
    res = run_once([sys.executable, "-c", "import time; time.sleep(10)"], {}, 0.5)
    assert res.error == "timed out after 0.5 s"


def test_a_run_killed_by_a_signal_names_it_even_a_real_time_one() -> None:
    res = run_once([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"], {}, 30)
    assert not res.ok and res.rc == -9 and res.error == "killed by SIGKILL"
    # real-time signals have no name in signal.Signals: the report must still come back
    code = "import os, signal; os.kill(os.getpid(), signal.SIGRTMIN + 1)"
    res = run_once([sys.executable, "-c", code], {}, 30)
    rt = int(signal.SIGRTMIN) + 1
    assert not res.ok and res.rc == -rt and res.error == f"killed by signal {rt}"


def test_clear_difference_is_called_and_noise_is_not() -> None:
    a = [10.0, 10.2, 9.9, 10.1, 10.0]
    o = compare(a, [8.0, 8.1, 7.9, 8.2, 8.0], "wall_seconds", higher=False)
    assert o.winner == "B" and o.ci is not None and o.ci[1] < 1.0
    assert o.verdict.startswith("B (B) is better: B's wall_seconds is 20.0% lower")
    o = compare(a, [9.0, 11.0, 10.0, 9.5, 10.6], "wall_seconds", higher=False)
    assert o.winner is None and o.verdict.startswith("no difference beyond the noise")
    o = compare([100.0, 101, 99, 100], [80.0, 81, 79, 80], "samples", higher=True,
                name_a="as is")
    assert o.winner == "A" and "A (as is) is better" in o.verdict


def test_interval_is_the_exact_rank_interval_and_honest_about_few_runs() -> None:
    # 5 runs per arm: the 3rd smallest and 3rd largest of the 25 pairwise ratios
    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0, 4.0, 5.0, 6.0]
    ratios = sorted(y / x for x in a for y in b)
    assert ratio_interval(a, b) == (ratios[2], ratios[-3])
    # 4 per arm: the extremes, so a winner needs every B above every A
    assert ratio_interval([1.0, 2, 3, 4], [5.0, 6, 7, 8]) == (5 / 4, 8 / 1)
    assert min_runs_for_interval() == 4
    # 3 per arm cannot give 95%: no winner even when every B beats every A
    o = compare([10.0, 10, 10], [20.0, 20, 20], "rate", True)
    assert o.winner is None and o.ci is None and o.ratio == 2.0
    assert o.verdict == ("no verdict: 3 and 3 runs are too few for a 95% interval (at least "
                         "4 per arm)")
    # many runs: the normal approximation, still excluding 1 for a clear shift
    lo, hi = ratio_interval([10.0 + i % 3 for i in range(30)],  # type: ignore[misc]
                            [12.0 + i % 3 for i in range(30)])
    assert 1.1 < lo <= hi < 1.25


def test_no_ratio_is_explained_never_nan() -> None:
    o = compare([10.0], [11.0, 12.0], "samples", True)
    assert o.ci is None and o.winner is None and o.ratio is not None
    assert o.verdict == ("no verdict: A has 1 successful run; an interval needs at least 2 "
                         "per arm")
    o = compare([], [11.0, 12.0], "samples", True)
    assert o.ratio is None and "A has 0 successful runs" in o.verdict
    o = compare([0.0, 0.0], [1.0, 2.0], "samples", True)
    assert o.ratio is None and "median samples of A is 0" in o.verdict
    assert "nan" not in o.verdict
    o = compare([0.0, 1.0, 2.0, 2.0], [1.0, 2.0, 2.0, 2.0], "samples", True)
    assert o.ci is None and "needs positive values" in o.verdict


def test_schedule_is_abba_with_warmup_first() -> None:
    assert interleave(2, 1) == [("A", True), ("B", True), ("B", False), ("A", False),
                                ("A", False), ("B", False)]


def test_run_bench_alternates_sets_settings_and_discards_warmup(tmp_path: Path) -> None:
    log = tmp_path / "order"
    script = ("import os, sys; amp = os.environ.get('TUNERD_AMP', 'x');"
              "open(sys.argv[1], 'a').write(amp + ' ');"
              "print('TUNERD_METRIC rate', 1 if amp == 'off' else 2, 'higher')")
    cfg = BenchConfig(command=[sys.executable, "-c", script, str(log)], workload="test",
                      arms=(parse_arm("amp=off", "--a"), parse_arm("amp=bf16", "--b")),
                      runs=4, warmup=1)
    res = run_bench(cfg)
    assert log.read_text().split() == ["off", "bf16", "bf16", "off", "off", "bf16",
                                       "bf16", "off", "off", "bf16"]
    assert [r.value for r in res.measured("A")] == [1.0, 1.0, 1.0, 1.0]
    assert res.comparison.metric == "rate" and res.comparison.ratio == 2.0
    assert res.comparison.winner == "B" and res.exit_code() == 0
    # the settings never reached tunerd.torch's helpers, and the result says so
    assert any("did not call tunerd.torch's amp helper" in n for n in res.notes)


def test_arm_specs_are_validated() -> None:
    import pytest

    from tunerd.base.errors import UsageError

    assert parse_arm("placement=tunerd, num_workers=2, pin_memory=yes", "--b") == ArmSpec(
        "tunerd", {"num_workers": 2, "pin_memory": True})
    assert parse_arm("compile=on", "--a").env() == {"TUNERD_COMPILE": "1"}
    for bad, words in [("placement=fast", "placement must be one of"),
                       ("amp=fp8", "amp must be one of"), ("workers=2", "unknown key"),
                       ("num_workers", "expected KEY=VALUE")]:
        with pytest.raises(UsageError, match=words):
            parse_arm(bad, "--b")
