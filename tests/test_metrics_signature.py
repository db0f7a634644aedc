"""The signature's statistics on series whose answer is known: slopes, CIs, oscillation, coverage, verdicts."""

import numpy as np
import pytest

from openrlhf_populora.metrics import signature as sig
from openrlhf_populora.metrics.runs import load_run
from openrlhf_populora.metrics.synthetic import write_synthetic_run

STEPS = np.arange(1, 31, dtype=float)


def noise(seed: int, scale: float, n: int = 30) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, scale, n)


def test_slope_of_an_exactly_linear_series_is_exact():
    xs = np.array([3, 4, 7, 8, 12, 15, 16, 20, 21, 30], dtype=float)  # gaps: steps with no value
    trend = sig.fit_trend(xs, 0.37 * xs - 2.5)
    assert abs(trend.slope - 0.37) < 1e-12 and abs(trend.intercept + 2.5) < 1e-12
    assert abs(trend.lo - 0.37) < 1e-12 and abs(trend.hi - 0.37) < 1e-12  # no residual: a zero-width CI
    assert trend.n == 10


def test_slope_and_t_interval_match_the_hand_computation():
    # x mean 3.5, y mean 3.5; Sxy = 19, Sxx = 21 -> slope 19/21; residual sum of squares by hand below
    xs, ys = [1.0, 2.0, 4.0, 7.0], [2.0, 3.0, 1.0, 8.0]
    trend = sig.fit_trend(xs, ys)
    slope = 19 / 21
    assert abs(trend.slope - slope) < 1e-12
    assert abs(trend.intercept - (3.5 - slope * 3.5)) < 1e-12
    fitted = [3.5 + slope * (x - 3.5) for x in xs]
    rss = sum((y - f) ** 2 for y, f in zip(ys, fitted, strict=True))
    half = 4.302652729911275 * (rss / 2 / 21) ** 0.5  # t(0.975, df = n - 2 = 2) from a table
    assert trend.lo == pytest.approx(slope - half, abs=1e-9) and trend.hi == pytest.approx(slope + half, abs=1e-9)


def test_non_finite_values_are_dropped_not_used():
    ys = 0.5 * STEPS + noise(3, 0.4)
    holed = ys.copy()
    holed[[4, 17]] = np.nan
    kept = np.ones(30, bool)
    kept[[4, 17]] = False
    assert sig.fit_trend(STEPS, holed) == sig.fit_trend(STEPS[kept], ys[kept])
    assert sig.fit_trend(STEPS, holed).n == 28


def test_rising_falling_and_flat_series_get_their_verdicts():
    rising = sig.fit_trend(STEPS, 0.02 * STEPS + noise(1, 0.1))
    falling = sig.fit_trend(STEPS, 1.0 - 0.02 * STEPS + noise(2, 0.1))
    flat = sig.fit_trend(STEPS, 0.5 + noise(4, 0.1))
    assert rising.lo > 0 and falling.hi < 0 and flat.lo < 0 < flat.hi
    assert sig.trend_verdict("r", rising, +1).verdict == sig.HOLDS
    assert sig.trend_verdict("r", rising, -1).verdict == sig.DOES_NOT_HOLD
    assert sig.trend_verdict("f", falling, -1).verdict == sig.HOLDS
    assert sig.trend_verdict("f", falling, +1).verdict == sig.DOES_NOT_HOLD
    assert sig.trend_verdict("x", flat, +1).verdict == sig.DOES_NOT_HOLD
    assert sig.trend_verdict("x", flat, -1).verdict == sig.DOES_NOT_HOLD


def test_too_few_points_give_not_enough_steps():
    xs = STEPS[: sig.MIN_POINTS - 1]
    short = sig.fit_trend(xs, 0.1 * xs)
    assert short.slope == pytest.approx(0.1)  # computed, but too short for a verdict
    assert sig.trend_verdict("c", short, +1).verdict == sig.NOT_ENOUGH
    enough = sig.fit_trend(STEPS[: sig.MIN_POINTS], 0.1 * STEPS[: sig.MIN_POINTS])
    assert sig.trend_verdict("c", enough, +1).verdict == sig.HOLDS
    assert sig.trend_verdict("c", sig.fit_trend([], []), +1).verdict == sig.NOT_ENOUGH  # series missing
    assert sig.fit_trend([1.0, 2.0], [1.0, 3.0]).slope is None  # no CI from two points
    osc = sig.oscillation(xs, np.sin(xs))
    assert sig.oscillation_verdict("o", osc, osc).verdict == sig.NOT_ENOUGH
    assert sig.greater_verdict("g", 0.5, None, (30, 30)).verdict == sig.NOT_ENOUGH
    assert sig.greater_verdict("g", 0.5, 0.4, (30, 9)).verdict == sig.NOT_ENOUGH


def test_oscillation_amplitude_and_period_of_an_exact_sinusoid_on_a_trend():
    # a steep trend (2 per step) around a small wave: the wave is measured, and tested off the trend
    ys = 0.3 * np.sin(2 * np.pi * STEPS / 10) + 2.0 * STEPS + 0.2  # period 10 = span / 3, on the grid
    osc = sig.oscillation(STEPS, ys)
    assert abs(osc.amplitude - 0.3) < 1e-9 and abs(osc.period - 10) < 1e-9
    assert osc.p_value == pytest.approx(1 / (sig.OSCILLATION_PERMUTATIONS + 1))
    line = sig.oscillation(STEPS, 0.01 * STEPS)
    assert line.amplitude < 1e-12 and line.p_value == 1.0


def test_one_slow_cycle_over_the_whole_run_is_not_taken_at_full_amplitude():
    # periods start at span / 1.5 = 20 steps: a single rise and fall (period 30) leaks in only partly
    osc = sig.oscillation(STEPS, np.sin(2 * np.pi * STEPS / 30))
    assert osc.period == pytest.approx(20.0) and 0.5 < osc.amplitude < 0.7


def test_an_oscillating_series_scores_higher_than_a_monotone_one_with_the_same_noise():
    eps = noise(5, 0.04)
    wave = sig.oscillation(STEPS, 0.45 + 0.2 * np.sin(STEPS / 3) + eps)
    mono = sig.oscillation(STEPS, 0.55 + 0.013 * STEPS + eps)
    assert 0.15 < wave.amplitude < 0.25 and 15 <= wave.period <= 25  # true: 0.2, 2*pi*3 = 18.8 steps
    assert mono.amplitude < wave.amplitude / 3
    assert wave.p_value <= 0.002 and mono.p_value > 0.05
    assert sig.oscillation_verdict("o", wave, mono).verdict == sig.HOLDS
    assert sig.oscillation_verdict("o", mono, wave).verdict == sig.DOES_NOT_HOLD
    assert sig.oscillation(STEPS, 0.45 + 0.2 * np.sin(STEPS / 3) + eps) == wave  # seeded: reproducible


def test_a_larger_amplitude_that_noise_explains_does_not_hold():
    a, b = sig.oscillation(STEPS, noise(6, 0.05)), sig.oscillation(STEPS, noise(7, 0.01))
    assert a.amplitude > b.amplitude and a.p_value >= sig.OSCILLATION_ALPHA
    verdict = sig.oscillation_verdict("o", a, b)
    assert verdict.verdict == sig.DOES_NOT_HOLD and "noise" in verdict.detail


def test_coverage_counts_and_last_third():
    assert sig.last_third(range(10)).tolist() == [6, 7, 8, 9]
    assert sig.last_third(range(9)).tolist() == [6, 7, 8]
    assert sig.steps_adding([0, 2, 0, 1, -1]) == 2
    base = dict(points=30, overall_end=0.4, distinct_end=10.0, new_cell_points=30, steps_adding=5,
                last_third_points=10)
    assert sig.still_adding_verdict("c", sig.CoverageSummary(**base, last_third_adding=1)).verdict == sig.HOLDS
    assert sig.still_adding_verdict("c", sig.CoverageSummary(**base, last_third_adding=0)).verdict \
        == sig.DOES_NOT_HOLD
    assert sig.greater_verdict("g", 0.4, 0.4, (30, 30)).verdict == sig.DOES_NOT_HOLD
    assert sig.greater_verdict("g", 0.41, 0.4, (30, 30)).verdict == sig.HOLDS


def test_short_runs_compare_with_every_verdict_not_enough_steps(tmp_path):
    pop = load_run(write_synthetic_run(tmp_path / "p", mode="population", steps=sig.MIN_POINTS - 1, seed=2))
    base = load_run(write_synthetic_run(tmp_path / "b", mode="baseline", steps=sig.MIN_POINTS - 1, seed=1))
    comparison = sig.compare_runs(pop, base, permutations=99)
    assert len(comparison.verdicts) == 2 * 5 + 4
    assert {v.verdict for v in comparison.verdicts.values()} == {sig.NOT_ENOUGH}
    assert comparison.complexity["loc"][0].slope is not None  # the numbers are still reported


def test_text_table_columns_are_aligned(tmp_path):
    pop = load_run(write_synthetic_run(tmp_path / "p", mode="population", steps=12, seed=2))
    base = load_run(write_synthetic_run(tmp_path / "b", mode="baseline", steps=12, seed=1))
    comparison = sig.compare_runs(pop, base, permutations=99)
    text = sig.format_text(comparison)
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("axis ")))
    block = lines[start:start + 6]
    column = block[0].index("baseline falls")
    assert all(line[column - 2:column] == "  " and line[column:].strip() in (sig.HOLDS, sig.DOES_NOT_HOLD,
                                                                          "baseline falls") for line in block)
    markdown = sig.format_markdown(comparison)
    rows = [line for line in markdown.splitlines() if line.startswith("| ast_depth")]
    assert rows and rows[0].count("|") == 6
