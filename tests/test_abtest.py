"""A/B comparison statistics and the runner, on real subprocesses."""

from __future__ import annotations

import sys

from tunerd.abtest import Arm, bootstrap_ratio_ci, compare, run_ab, run_once


def test_metric_line_is_used_over_wall_time() -> None:
    res = run_once([sys.executable, "-c", "print('TUNERD_METRIC samples 123.5 higher')"], 30)
    assert res == ("samples", 123.5, True)
    res = run_once([sys.executable, "-c", "pass"], 30)
    assert res is not None and res[0] == "wall_seconds" and res[2] is False
    assert run_once([sys.executable, "-c", "raise SystemExit(3)"], 30) is None


def test_clear_difference_is_called_and_noise_is_not() -> None:
    a = Arm("A", ["a"], values=[10.0, 10.2, 9.9, 10.1, 10.0])
    b = Arm("B", ["b"], values=[8.0, 8.1, 7.9, 8.2, 8.0])
    o = compare(a, b, "wall_seconds", higher=False)
    assert o.verdict.startswith("B (tunerd placement) is better by 20")
    assert o.ci[1] < 1.0
    noisy = Arm("B", ["b"], values=[9.0, 11.0, 10.0, 9.5, 10.6])
    o = compare(a, noisy, "wall_seconds", higher=False)
    assert o.verdict.startswith("no difference")
    lo, hi = bootstrap_ratio_ci([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert lo <= 2.0 <= hi


def test_run_ab_alternates_and_discards_warmup(tmp_path) -> None:
    log = tmp_path / "order"
    script = ("import os, sys; arm = os.environ.get('ARM', 'A');"
              "open(sys.argv[1], 'a').write(arm);"
              "print('TUNERD_METRIC rate', 1 if arm == 'A' else 2, 'higher')")
    o = run_ab([sys.executable, "-c", script, str(log)], ["env", "ARM=B"], runs=2, warmup=1)
    assert log.read_text() == "ABBAAB"  # ABBA blocks, warm-up pair included
    assert o.a.values == [1.0, 1.0] and o.b.values == [2.0, 2.0]
    assert o.metric == "rate" and o.higher_is_better and o.ratio == 2.0
    assert o.verdict.startswith("B (tunerd placement) is better by 100")
