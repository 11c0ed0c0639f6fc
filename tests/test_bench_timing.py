"""pagedkv_np.bench.timing's helpers for whole runs: rounds, summaries, the
copy ratio and runs in a fresh process.

Summaries are compared with NumPy and :mod:`statistics`; the copy ratio is
checked on a clock that advances by known costs, as ``test_bench`` checks
:func:`round_times`, and once on real copies.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from pagedkv_np.bench import timing
from pagedkv_np.bench.timing import (CopyBaseline, against_copy, fmt_spread, interleave,
                                     medians, percentile, rotated, run_json, spread, timed,
                                     timed_cpu)
from pagedkv_np.errors import ConfigError


# ------------------------------------------------------------------ rounds
def test_rotated_starts_each_round_one_further():
    assert [rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"),
                                                     list("abc")]
    assert rotated([], 3) == []


def test_interleave_calls_each_once_a_round_the_order_rotating():
    calls: list[str] = []

    def way(name):
        def call():
            calls.append(name)
            return f"{name}{sum(c == name for c in calls)}"
        return call

    seen = []
    out = interleave({"a": way("a"), "b": way("b"), "c": way("c")}, 3,
                     on_result=lambda r, key, result: seen.append((r, key, result)))
    assert calls == list("abc") + list("bca") + list("cab")
    assert out == {"a": ["a1", "a2", "a3"], "b": ["b1", "b2", "b3"], "c": ["c1", "c2", "c3"]}
    assert list(out) == ["a", "b", "c"]
    assert seen[:4] == [(0, "a", "a1"), (0, "b", "b1"), (0, "c", "c1"), (1, "b", "b2")]


def test_interleave_without_rotation_keeps_the_order():
    calls: list[int] = []
    out = interleave({i: (lambda i=i: calls.append(i) or i) for i in range(3)}, 2, rotate=False)
    assert calls == [0, 1, 2, 0, 1, 2]
    assert out == {0: [0, 0], 1: [1, 1], 2: [2, 2]}


@pytest.mark.parametrize("rounds", [0, -1, 1.5, True, "2", None])
def test_interleave_refuses_a_bad_round_count_before_calling_anything(rounds):
    calls: list[int] = []
    with pytest.raises(ConfigError, match="Invalid rounds: expected an int >= 1"):
        interleave({"a": lambda: calls.append(1)}, rounds)
    assert calls == []


def test_timed_returns_the_wall_time_and_timed_cpu_the_cpu_time_too():
    assert 0.02 <= timed(lambda: time.sleep(0.02))() < 5.0
    wall, cpu = timed_cpu(lambda: time.sleep(0.05))()
    assert wall >= 0.05 and 0 <= cpu < 0.05   # asleep: the wall clock runs, the CPU hardly

    def spin():
        end = time.process_time() + 0.02
        while time.process_time() < end:
            pass

    wall, cpu = timed_cpu(spin)()
    assert cpu >= 0.02 and wall >= cpu * 0.9


# --------------------------------------------------------------- summaries
@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_spread_is_the_median_and_the_range(n):
    values = np.random.default_rng(n).standard_normal(n).tolist()
    s = spread(iter(values))
    assert s == (statistics.median(values), min(values), max(values))
    assert s.median == pytest.approx(float(np.median(values)))


def test_fmt_spread():
    assert fmt_spread([3.0, 1.0, 2.0]) == "2.0 (1.0-3.0)"
    assert fmt_spread(x for x in (12.25, 10.0)) == "11.1 (10.0-12.2)"
    assert fmt_spread([7.0], digits=0) == "7"
    assert fmt_spread([5.0, 5.0], digits=2) == "5.00"


def test_medians_of_the_rounds_records():
    runs = [{"ttft": 3.0, "rate": 10.0}, {"ttft": 1.0, "rate": 30.0},
            {"ttft": 2.0, "rate": 20.0, "other": 1.0}]
    assert medians(runs, ("ttft", "rate")) == {"ttft": 2.0, "rate": 20.0}
    assert medians(runs, []) == {}


@pytest.mark.parametrize("n", [1, 2, 3, 10, 33])
@pytest.mark.parametrize("q", [0, 5, 25, 50, 95, 99.5, 100])
def test_percentile_matches_numpy(n, q):
    values = np.random.default_rng(n).exponential(size=n).tolist()
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


@pytest.mark.parametrize("call, message", [
    (lambda: spread([]), "Invalid values: expected at least one figure"),
    (lambda: fmt_spread(iter([])), "Invalid values: expected at least one figure"),
    (lambda: medians([], ["a"]), "Invalid runs: expected at least one figure"),
    (lambda: percentile([], 50), "Invalid values: expected at least one figure"),
    (lambda: percentile([1.0], 101), "Invalid q: expected a percentile from 0 to 100"),
    (lambda: percentile([1.0], -1), "Invalid q: expected a percentile from 0 to 100"),
])
def test_summaries_of_nothing_are_clear_errors(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


# ---------------------------------------------------- the copy ratio
def test_against_copy_compares_with_the_faster_copy_round_by_round(monkeypatch):
    clock = [0.0]
    costs = {"op": iter([2.0, 2.0, 2.0, 4.0, 2.0]),      # warm-up, calibration, rounds 2-4
             "one": iter([1.0, 1.0, 1.5, 1.0, 3.0]),
             "two": iter([3.0, 3.0, 0.5, 3.0, 3.0])}

    def fake(name):
        def fn():
            clock[0] += next(costs[name])
        return fn

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    result = against_copy(fake("op"), [(fake("one"), 1), (fake("two"), 2)], repeat=4,
                          min_time=0.5)
    # rounds: op 2 2 4 2, one-thread copy 1 1.5 1 3, two-thread copy 3 0.5 3 3
    assert result.seconds == 2.0
    assert (result.copy_seconds, result.copy_threads) == (0.5, 2)
    assert result.ratio == 0.25
    assert result.ratios == [1 / 2, 0.5 / 2, 1 / 4, 3 / 2]


def test_against_copy_on_real_copies():
    base = CopyBaseline()
    try:
        nbytes = 1 << 20
        src, dst = np.ones(nbytes // 2, np.uint8), np.zeros(nbytes // 2, np.uint8)
        result = against_copy(lambda: np.copyto(dst, src), base.copies(nbytes), repeat=3,
                              min_time=0.001)
        assert result.copy_threads in (1, 2) and len(result.ratios) == 3
        assert all(math.isfinite(r) and r > 0 for r in result.ratios)
        assert result.ratio == pytest.approx(result.copy_seconds / result.seconds)
        with pytest.raises(ConfigError, match="Invalid copies"):
            against_copy(lambda: None, [], repeat=2, min_time=0.001)
    finally:
        base.close()


# -------------------------------------------------- a fresh process
def test_run_json_parses_the_last_marked_line():
    code = "print('loading'); print('{\"a\": 1}'); print('RESULT [2, 3]'); print('bye')"
    assert run_json([sys.executable, "-c", code], timeout=60, marker="RESULT ") == [2, 3]
    assert run_json([sys.executable, "-c", "print('{\"a\": 1}')"], timeout=60) == {"a": 1}


def test_run_json_of_a_failed_process_raises_and_shows_its_stderr(capfd):
    code = "import sys; sys.stderr.write('boom: the child failed\\n'); sys.exit(3)"
    with pytest.raises(subprocess.CalledProcessError) as exc:
        run_json([sys.executable, "-c", code], timeout=60)
    assert exc.value.returncode == 3
    assert "boom: the child failed" in capfd.readouterr().err


def test_run_json_without_a_result_line_is_a_clear_error():
    with pytest.raises(ConfigError, match="no line starts with 'RESULT '"):
        run_json([sys.executable, "-c", "print('no result')"], timeout=60, marker="RESULT ")
