"""The signature's statistics on series whose answer is known: HAC slopes, red noise, oscillation, rarefied
coverage, the last third, seed-level tests, and the verdicts built on them. Each test names the broken
implementation it catches."""

import numpy as np
import pytest
from scipy import stats

from openrlhf_populora.analysis import signature as sig
from openrlhf_populora.analysis import signature_stats as st
from openrlhf_populora.analysis import synthetic as syn
from openrlhf_populora.analysis.runs import load_run
from openrlhf_populora.analysis.synthetic import write_synthetic_run

STEPS = np.arange(1, 41, dtype=float)


def noise(seed: int, scale: float, n: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, scale, n)


def newey_west_se(xs, ys, lags):
    """The Newey-West slope standard error by hand: Bartlett weights 1 - l/(L+1), n/(n-2) correction."""
    x = np.column_stack([np.ones_like(xs), xs])
    beta = np.linalg.lstsq(x, ys, rcond=None)[0]
    scores = x * (ys - x @ beta)[:, None]
    meat = scores.T @ scores
    for lag in range(1, lags + 1):
        gamma = scores[lag:].T @ scores[:-lag]
        meat += (1 - lag / (lags + 1)) * (gamma + gamma.T)
    bread = np.linalg.inv(x.T @ x)
    cov = bread @ meat @ bread * len(xs) / (len(xs) - 2)
    return float(np.sqrt(cov[1, 1]))


def test_the_slope_error_is_newey_wests():
    # Catches: plain OLS standard errors (independent residuals) instead of HAC.
    ys = 0.02 * STEPS + syn.red_noise(0.7, 40, np.random.default_rng(3))
    _, slope, se = st.hac_slope(STEPS, ys)
    assert st.newey_west_lags(40) == 3 and st.newey_west_lags(100) == 4
    assert se == pytest.approx(newey_west_se(STEPS, ys, 3), rel=1e-9)
    ols = stats.linregress(STEPS, ys)
    assert slope == pytest.approx(ols.slope, rel=1e-12) and abs(se - ols.stderr) > 0.1 * ols.stderr
    trend = st.fit_trend(STEPS, ys)
    assert trend.hac_half == pytest.approx(stats.t.ppf(0.975, 38) * se, rel=1e-9)
    assert trend.half == pytest.approx(max(trend.hac_half, trend.red_half))


def test_an_exact_line_has_a_zero_width_interval():
    xs = np.array([3, 4, 7, 8, 12, 15, 16, 20, 21, 30], dtype=float)  # gaps: steps with no value
    trend = st.fit_trend(xs, 0.37 * xs - 2.5)
    assert trend.slope == pytest.approx(0.37, abs=1e-12) and trend.intercept == pytest.approx(-2.5, abs=1e-12)
    assert trend.lo == pytest.approx(0.37, abs=1e-9) and trend.hi == pytest.approx(0.37, abs=1e-9)
    assert trend.n == 10


def test_non_finite_values_are_dropped_not_used():
    ys = 0.5 * STEPS + noise(3, 0.4)
    holed = ys.copy()
    holed[[4, 17]] = np.nan
    kept = np.ones(40, bool)
    kept[[4, 17]] = False
    assert st.fit_trend(STEPS, holed) == st.fit_trend(STEPS[kept], ys[kept])
    assert st.fit_trend(STEPS, holed).n == 38


def test_red_noise_phi_corrects_the_short_series_bias():
    # Catches: the plain lag-1 autocorrelation of the detrended residual as phi (biased low at n = 40),
    # which makes red-noise surrogates too white and lets persistent noise read as trend or oscillation.
    rng = np.random.default_rng(7)
    series = [syn.red_noise(0.8, 40, rng) for _ in range(200)]
    plain = np.mean([st.lag1(st.line_residuals(y[:, None]))[0] for y in series])
    fitted = np.mean([st.red_noise_phi(st.line_residuals(y[:, None])[:, 0]) for y in series])
    assert plain < 0.68 and abs(fitted - 0.8) < 0.05
    white = np.mean([st.red_noise_phi(st.line_residuals(rng.standard_normal((40, 1)))[:, 0]) for _ in range(200)])
    assert white < 0.1


def test_a_too_persistent_series_cannot_tell_a_trend():
    # Catches: a trend verdict on one run whatever its persistence (a random walk then "falls" 10-40% of the time).
    walk = np.cumsum(np.random.default_rng(7).standard_normal(40))
    trend = st.fit_trend(STEPS, walk)
    assert trend.phi >= st.MAX_PHI and trend.persistent
    assert trend.hi < 0  # its interval alone would say "falls"
    verdict = sig.slope_verdict("f", [trend], -1)
    assert verdict.verdict == sig.CANNOT_TELL and "seeds" in verdict.detail
    rising = st.fit_trend(STEPS, 0.05 * STEPS + noise(2, 0.1))
    assert not rising.persistent and sig.slope_verdict("r", [rising], +1).verdict == sig.HOLDS
    assert sig.slope_verdict("r", [rising], -1).verdict == sig.DOES_NOT_HOLD


def test_an_exact_sinusoid_on_a_trend_is_measured_and_significant():
    ys = 0.3 * np.sin(2 * np.pi * STEPS / 10) + 2.0 * STEPS + 0.2 + noise(5, 0.01)  # period 10 = span / 4
    osc = st.oscillation(STEPS, ys, surrogates=199)
    assert osc.amplitude == pytest.approx(0.3, abs=0.01) and osc.period == pytest.approx(10.0)
    assert osc.p_value == pytest.approx(1 / 200) and osc.index > 0
    assert st.oscillation(STEPS, 0.01 * STEPS).p_value == 1.0  # a line has no residual to oscillate


def test_a_curve_that_levels_off_is_not_an_oscillation():
    # Catches: testing against shuffled (white) residuals: the smooth curvature a straight line leaves
    # behind then reads as a slow oscillation (p << 0.05); red noise fitted to it absorbs it.
    xs = np.arange(1, 101, dtype=float)
    saturating = 0.6 * (1 - np.exp(-xs / 15)) + noise(4, 0.02, 100)
    osc = st.oscillation(xs, saturating, surrogates=199)
    assert osc.phi > 0.8 and osc.p_value > 0.2


def test_rarefied_cells_by_hand():
    # Catches: no rarefaction (the distinct cells of all programs): 3 here, not 11/6.
    # cells [1, 1, 2, 3], m = 2 of N = 4: cell 1 missed with C(2,2)/C(4,2) = 1/6, cells 2, 3 with 3/6
    assert st.rarefied_cells([1, 1, 2, 3], 2) == pytest.approx(5 / 6 + 0.5 + 0.5)
    assert st.rarefied_cells([1, 1, 2, 3], 4) == pytest.approx(3.0)
    assert st.rarefied_cells([1, 1, 2, 3], 9) == pytest.approx(3.0)  # m above N: all of them
    assert st.rarefied_from_counts([2, 0, 1, 1], 2) == pytest.approx(11 / 6)


def test_new_cells_are_first_occurrences_in_step_order():
    # step 1 finds cells 5 and 6; step 2 finds 8 (6 seen); step 3 finds 7 (5 seen)
    assert st.new_cells([3, 1, 1, 2, 3, 2], [5, 5, 6, 6, 7, 8]) == {1: 2, 2: 1, 3: 1}


def test_last_third():
    assert sorted(sig.last_third_steps(range(1, 11))) == [7, 8, 9, 10]
    assert sorted(sig.last_third_steps(range(1, 10))) == [7, 8, 9]


def arm(label, n, cells_by_step, composite=None):
    steps = np.arange(1, n + 1)
    program_steps = np.array([s for s, cells in cells_by_step.items() for _ in cells], dtype=np.int64)
    program_cells = np.array([c for cells in cells_by_step.values() for c in cells], dtype=np.int64)
    flat = np.zeros(n) if composite is None else composite
    return sig.ArmSeries(label, steps, flat, flat + 0.5, flat + 0.5, {}, program_steps, program_cells)


def test_still_adding_counts_the_last_third_only():
    # Catches: counting new cells over the whole run instead of its last third.
    # The population finds 12 cells in its first 12 steps, then only known ones; the baseline finds its 4
    # cells in steps 28-30 (the last third), the same number of programs in all (30 each).
    pop = arm("p", 30, {s: [s if s <= 12 else 1] for s in range(1, 31)})
    base = arm("b", 30, {s: [s - 26 if s >= 27 else 1] for s in range(1, 31)})
    p_stats, b_stats, verdicts = sig.compare_series([pop], [base], surrogates=19)
    assert p_stats[0].coverage.last_third_new == 0 and p_stats[0].coverage.whole_run_new == 12
    assert b_stats[0].coverage.last_third_new == 3 and b_stats[0].coverage.whole_run_new == 4
    assert verdicts["coverage/population_still_adding_more"].verdict == sig.DOES_NOT_HOLD
    assert verdicts["coverage/population_still_adding_more"].estimate == -3


def test_thinning_brings_the_larger_arm_to_the_smaller_count():
    # Catches: comparing new cells without thinning: twice the programs find more new cells by themselves.
    pop = arm("p", 30, {s: [100 + 2 * s, 101 + 2 * s] for s in range(1, 31)})  # every program a new cell
    base = arm("b", 30, {s: [s] for s in range(1, 31)})
    p_stats, b_stats, _ = sig.compare_series([pop], [base], surrogates=19)
    assert p_stats[0].coverage.rarefied == pytest.approx(30.0) and b_stats[0].coverage.rarefied == pytest.approx(30.0)
    # thinned to 30 of its 60 programs, about half of the 20 in its last third remain, each a new cell
    assert p_stats[0].coverage.last_third_new == pytest.approx(10.0, abs=1.5)
    assert b_stats[0].coverage.last_third_new == 10 and p_stats[0].coverage.whole_run_new == pytest.approx(30.0)


def test_seed_level_intervals_are_t_and_welch():
    # Catches: a pooled-variance (Student) interval instead of Welch's, or a z instead of a t quantile; the
    # estimate, 1.0333.. - 0.025, lost (x_welch__mutmut_61).
    a, b = [1.0, 1.4, 0.7], [0.1, -0.5, 0.3, 0.2]
    welch = st.welch(a, b)
    assert welch.estimate == pytest.approx(3.1 / 3 - 0.1 / 4) and welch.method == "Welch t, 3 vs 4 seeds"
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert (welch.lo, welch.hi) == pytest.approx((ci.low, ci.high), rel=1e-9)
    one = st.seed_mean(a)
    ci = stats.ttest_1samp(a, 0.0).confidence_interval(0.95)
    assert (one.lo, one.hi) == pytest.approx((ci.low, ci.high), rel=1e-9)


def test_several_seeds_are_judged_across_seeds_not_within_each():
    # Catches: judging each seed's own interval (or pooling the runs): two seeds that clearly rise and one that
    # clearly falls do not make a rise across seeds.
    cells = {s: [s % 3] for s in range(1, 41)}
    pops = [arm(f"p{i}", 40, cells, sign * 0.05 * STEPS + noise(i, 0.05)) for i, sign in enumerate((1, 1, -1))]
    bases = [arm(f"b{i}", 40, cells, noise(10 + i, 0.05)) for i in range(3)]
    p_stats, _, verdicts = sig.compare_series(pops, bases, surrogates=19)
    assert all(sig.slope_verdict("x", [s.composite], np.sign(s.composite.slope)).verdict == sig.HOLDS
               for s in p_stats)
    rises = verdicts["complexity/population_rises"]
    assert rises.verdict == sig.DOES_NOT_HOLD and rises.method == "t across 3 seeds"
    assert rises.estimate == pytest.approx(np.mean([s.composite.slope for s in p_stats]))
    with pytest.raises(ValueError, match="one run per arm, or at least two"):
        sig.compare_series(pops, bases[:1])


def test_oscillates_more_needs_the_difference_not_a_larger_estimate():
    # Catches: "holds" on the population's own p alone with a larger point estimate: two arms that oscillate
    # alike give a positive difference half the time; its interval must then include 0.
    rng = np.random.default_rng(5)
    wave = 2.0 * np.sin(2 * np.pi * np.arange(40) / 10)
    a = st.oscillation(STEPS, wave + syn.red_noise(0.5, 40, rng), surrogates=199)
    b = st.oscillation(STEPS, wave + syn.red_noise(0.5, 40, rng), surrogates=199, seed=1)
    first, second = (a, b) if a.index > b.index else (b, a)
    assert first.p_value < 0.05
    verdict = sig.oscillation_verdict("o", [first], [second])
    assert verdict.verdict == sig.DOES_NOT_HOLD and verdict.lo < 0 < verdict.estimate


def test_short_runs_compare_with_every_verdict_not_enough_steps(tmp_path):
    pop = load_run(write_synthetic_run(tmp_path / "p", mode="population", steps=sig.MIN_POINTS - 1, seed=2))
    base = load_run(write_synthetic_run(tmp_path / "b", mode="baseline", steps=sig.MIN_POINTS - 1, seed=1))
    comparison = sig.compare_runs(pop, base, surrogates=19)
    assert list(comparison.verdicts) == list(sig.CLAIMS)
    assert {v.verdict for v in comparison.verdicts.values()} == {sig.NOT_ENOUGH}
    assert comparison.stats[0][0].axes["loc"].slope is not None  # the numbers are still reported


def test_text_table_columns_are_aligned(tmp_path):
    pop = load_run(write_synthetic_run(tmp_path / "p", mode="population", steps=12, seed=2))
    base = load_run(write_synthetic_run(tmp_path / "b", mode="baseline", steps=12, seed=1))
    comparison = sig.compare_runs(pop, base, surrogates=19)
    lines = sig.format_text(comparison).splitlines()
    start = lines.index(next(line for line in lines if line.startswith("axis ")))
    block = lines[start:start + 7]
    column = block[0].index("baseline ")
    assert all(line[column - 2:column] == "  " for line in block)
    rows = [line for line in sig.format_markdown(comparison).splitlines() if line.startswith("| ast_depth")]
    assert rows and rows[0].count("|") == 5


# --- exact checks of each statistic's parts (the mutation survivors of 2026-12-06; each names its mutant) ---

def test_finite_pairs_returns_float_arrays_for_integer_input():
    # Catches: either array left in its given dtype (x_finite_pairs__mutmut_3 and _7): integer steps or values
    # would come back as integers, not the float arrays the docstring promises.
    xs, ys = st.finite_pairs([1, 2, 3, 4], [5, 6, 7, 8])
    assert xs.dtype == np.float64 and ys.dtype == np.float64
    xs, ys = st.finite_pairs([1.0, 2.0, np.nan, 4.0], [5.0, np.inf, 7.0, 8.0])
    assert xs.tolist() == [1.0, 4.0] and ys.tolist() == [5.0, 8.0]


def test_ar1_series_is_the_stationary_recursion_on_the_same_draws():
    # u_0 = e_0 / sqrt(1 - phi^2), u_t = phi u_(t-1) + e_t, column by column, on the generator's draws in order.
    # Catches: the first value set to sqrt(1 - phi^2) instead of scaled by it (x_ar1_series__mutmut_3), and
    # sqrt(1 + phi^2) (_7): the series would not start in the stationary law.
    phi = 0.6
    got = st.ar1_series(phi, 5, 2, np.random.default_rng(3))
    shocks = np.random.default_rng(3).standard_normal((5, 2))
    want = np.empty_like(shocks)
    want[0] = shocks[0] / 0.8  # sqrt(1 - 0.36)
    for t in range(1, 5):
        want[t] = phi * want[t - 1] + shocks[t]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_line_residuals_detrend_each_column_by_its_own_line():
    # positions 0..3 (centred -1.5, -0.5, 0.5, 1.5): column 1 is a line (residual 0); column 2, [10, 12, 14, 20],
    # has mean 14 and slope 16/5, so its line is 9.2, 12.4, 15.6, 18.8.
    # Catches: the mean of all columns subtracted instead of each column's (x_line_residuals__mutmut_13).
    columns = np.array([[1.0, 10.0], [2.0, 12.0], [3.0, 14.0], [4.0, 20.0]])
    assert st.line_residuals(columns) == pytest.approx(
        np.array([[0.0, 0.8], [0.0, -0.4], [0.0, -1.6], [0.0, 1.2]]), abs=1e-12)


def test_red_noise_slope_sd_by_polyfit_on_the_same_surrogates():
    # The documented recipe computed another way: each surrogate's least-squares slope and residual standard
    # deviation from np.polyfit, the standard deviation of their ratio, times the residual's standard deviation.
    # Catches: the line added to the surrogate instead of subtracted when its residual's scale is taken
    # (x_red_noise_slope_sd__mutmut_17).
    xs = np.array([1.0, 2.0, 4.0, 7.0, 8.0, 11.0])
    residual = np.array([0.3, -0.1, -0.4, 0.2, 0.5, -0.5])
    noise = st.ar1_series(0.4, len(xs), 50, np.random.default_rng(3))
    slopes, scales = [], []
    for column in noise.T:
        slope, intercept = np.polyfit(xs, column, 1)
        slopes.append(slope)
        scales.append(np.std(column - (slope * xs + intercept)))
    want = np.std(np.array(slopes) / np.array(scales)) * residual.std()
    assert st.red_noise_slope_sd(xs, residual, 0.4, surrogates=50, seed=3) == pytest.approx(want, rel=1e-9)


def test_too_few_points_or_one_step_give_no_trend():
    # Catches: a trend fitted when the steps are all equal or when there are fewer than 3 points (the "or" made
    # "and": x_fit_trend__mutmut_7), and the point count lost (n=None: _13).
    assert st.fit_trend([1.0, 2.0], [3.0, 5.0]) == st.Trend(2)
    assert st.fit_trend([4.0] * 5, [1.0, 2.0, 3.0, 4.0, 5.0]) == st.Trend(5)
    assert st.fit_trend([1.0, 2.0, 3.0], [1.0, np.nan, 2.0]) == st.Trend(2)
    # three points are enough: [1, 3, 2] over 1..3 has slope ((-1)(-1) + 0 + (1)(0)) / 2 = 0.5.
    # Catches: a trend first fitted at 4 points (<= 3 for < 3: x_fit_trend__mutmut_8).
    three = st.fit_trend([1.0, 2.0, 3.0], [1.0, 3.0, 2.0])
    assert three.n == 3 and three.slope == pytest.approx(0.5) and three.lo < 0.5 < three.hi


def test_five_points_get_the_hac_interval_alone():
    # xs 1..5, ys [1, 3, 2, 5, 4]: slope 8/10 = 0.8, intercept 3 - 0.8 x 3 = 0.6; under 6 points no red-noise
    # fit: red_half 0, phi 0, interval slope +- t(0.975, 3) x the Newey-West error with 2 lags.
    # Catches: the lower end at slope + half (x_fit_trend__mutmut_67) and red_half None instead of 0 (_57).
    xs, ys = np.arange(1.0, 6.0), np.array([1.0, 3.0, 2.0, 5.0, 4.0])
    trend = st.fit_trend(xs, ys)
    half = stats.t.ppf(0.975, 3) * newey_west_se(xs, ys, 2)
    assert st.newey_west_lags(5) == 2
    # 4 x 0.25^(2/9) = 4 x exp(-0.3081) = 2.94: 2 lags at 25 points (an exponent of 2/10 gives 3.03: 3).
    # Catches: the exponent 2/10 (x_newey_west_lags__mutmut_9), which agrees with 2/9 at 5, 40 and 100 points.
    assert st.newey_west_lags(25) == 2
    assert trend.slope == pytest.approx(0.8) and trend.intercept == pytest.approx(0.6)
    assert (trend.lo, trend.hi) == pytest.approx((0.8 - half, 0.8 + half), rel=1e-9)
    assert trend.hac_half == pytest.approx(half, rel=1e-9)
    assert trend.red_half == 0.0 and trend.phi == 0.0


def test_six_points_are_enough_for_the_red_noise_interval():
    # Catches: the red-noise interval first used at 7 points instead of 6 (x_fit_trend__mutmut_37).
    xs, ys = np.arange(1.0, 7.0), np.array([1.0, 3.0, 2.0, 5.0, 4.0, 6.5])
    trend = st.fit_trend(xs, ys)
    residual = ys - (trend.intercept + trend.slope * xs)
    want = stats.norm.ppf(0.975) * st.red_noise_slope_sd(xs, residual, trend.phi)
    assert trend.red_half > 0 and trend.red_half == pytest.approx(want, rel=1e-12)


def test_the_red_noise_half_width_is_z_times_the_red_noise_slope_sd():
    # Catches: the quantile at 0.5 - level/2 (x_fit_trend__mutmut_77): a negative red-noise half-width, so the
    # interval would silently be the HAC one alone even where red noise makes it wider.
    # Catches also: the seed not handed on to the surrogates (x_fit_trend__mutmut_88): seed 3 would draw seed 0's.
    ys = 0.02 * STEPS + syn.red_noise(0.6, 40, np.random.default_rng(11))
    trend = st.fit_trend(STEPS, ys, seed=3)
    residual = ys - (trend.intercept + trend.slope * STEPS)
    want = 1.959963984540054 * st.red_noise_slope_sd(STEPS, residual, trend.phi, seed=3)
    assert trend.red_half == pytest.approx(want, rel=1e-9) and trend.red_half > 0
    assert want != pytest.approx(1.959963984540054 * st.red_noise_slope_sd(STEPS, residual, trend.phi), rel=1e-6)
    assert trend.half == pytest.approx(max(trend.hac_half, trend.red_half), rel=1e-12)


def test_difference_of_slopes_by_hand():
    # 0.5 [0.2, 0.8] minus 0.1 [0.0, 0.2]: 0.4 +- hypot(0.3, 0.1) = 0.4 +- sqrt(0.1).
    # Catches: the upper end at estimate - half (x_difference_of_slopes__mutmut_17); the method's text, which
    # the verdict carries into compare.json, lost or changed (_11, _18, _19).
    interval = st.difference_of_slopes(st.Trend(10, 0.5, 0.2, 0.8), st.Trend(10, 0.1, 0.0, 0.2))
    assert interval.estimate == pytest.approx(0.4) and interval.method == "the two slopes' intervals combined"
    assert (interval.lo, interval.hi) == pytest.approx((0.4 - 0.1 ** 0.5, 0.4 + 0.1 ** 0.5), rel=1e-12)


def test_seeds_within_the_tolerance_itself_agree():
    # the spread of [0, 1e-12, 0] is exactly the tolerance 1e-12 x max(1, 1e-12): a tie, no interval; twice it
    # is not. Catches: the tolerance made strict (< for <=: x__agree__mutmut_3).
    assert st.seed_mean([0.0, 1e-12, 0.0]).lo == -np.inf
    assert st.welch([0.0, 1e-12, 0.0], [1.0, 1.0, 1.0]).hi == np.inf
    assert np.isfinite(st.seed_mean([0.0, 2e-12, 0.0]).lo)
    # the tolerance is relative above 1: 1e-12 x 1000 = 1e-9 at 1000, so a spread of 1e-10 there is a tie.
    # Catches: the tolerance divided by the values' size instead of multiplied (x__agree__mutmut_4).
    assert st.seed_mean([1000.0, 1000.0 + 1e-10, 1000.0]).lo == -np.inf


def test_tied_seeds_say_why_there_is_no_interval():
    # Catches: the tied seeds' method text dropped (x_seed_mean__mutmut_17): the report would not say why the
    # interval is infinite; Welch's tied estimate lost (x_welch__mutmut_26) or its lower end +inf (_34).
    tied = st.seed_mean([0.5, 0.5, 0.5])
    assert tied.method == f"t across 3 seeds: {st.NO_SPREAD}" and tied.estimate == 0.5
    assert st.welch([3.0] * 2, [1.0] * 3) == st.Interval(2.0, -np.inf, np.inf, f"Welch t, 2 vs 3 seeds: {st.NO_SPREAD}")


def test_a_line_has_no_red_noise_and_no_index():
    # Catches: a line's phi reported as None instead of 0 (x_oscillation__mutmut_53).
    osc = st.oscillation(STEPS, 0.01 * STEPS + 3.0)
    assert (osc.p_value, osc.phi, osc.index, osc.spread) == (1.0, 0.0, None, None)


def test_difference_of_indices_by_hand():
    # 1.0 (spread 0.3) minus 0.2 (spread 0.4): 0.8 +- z(0.975) x hypot(0.3, 0.4) = 0.8 +- 1.959964 x 0.5.
    # Catches: the first arm's spread left out (x_difference_of_indices__mutmut_13), no upper end (_17), and the
    # method's text lost or changed (_18, _25, _26).
    first = st.Oscillation(40, index=1.0, spread=0.3)
    second = st.Oscillation(40, index=0.2, spread=0.4)
    interval = st.difference_of_indices(first, second)
    half = 1.959963984540054 * 0.5
    assert interval.estimate == pytest.approx(0.8) and interval.method == "red-noise spread of the two indices"
    assert (interval.lo, interval.hi) == pytest.approx((0.8 - half, 0.8 + half), rel=1e-12)


def test_a_cell_with_no_programs_adds_exactly_nothing():
    # counts [5, 3, 1], m = 4 of N = 9: missed with C(4,4), C(6,4), C(8,4) over C(9,4) = 1, 15, 70 over 126,
    # so 3 - 86/126 = 146/63. Catches: empty cells kept in the sum (x_rarefied_from_counts__mutmut_7): each adds
    # 1 - exp(a - b - a + b), zero only up to rounding (here 1 ulp off the same counts without the empty cell).
    assert st.rarefied_from_counts([5, 3, 1], 4) == pytest.approx(146 / 63, rel=1e-12)
    assert st.rarefied_from_counts([5, 0, 3, 1], 4) == st.rarefied_from_counts([5, 3, 1], 4)


def test_oscillation_periods_by_hand():
    # 8 steps 1..8: span 7 x 8/7 = 8 steps; k = 2, 2.5, 3, 3.5, 4 (= n/2, included) cycles: 8/k.
    # Catches: whole k only (step 1 or none: x_oscillation_periods__mutmut_12, _15), n/2 itself left out (_16),
    # k up to n/3 (_18) or past n/2 (_19).
    assert st.oscillation_periods(np.arange(1.0, 9.0)) == pytest.approx([4.0, 3.2, 8 / 3, 16 / 7, 2.0], rel=1e-12)


def test_sinusoid_amplitudes_take_integer_periods_in_steps():
    # Catches: the periods handed on in their own dtype (x_sinusoid_amplitudes__mutmut_8, _10): integer periods
    # would be read back from their bytes as floats, not as 10 and 5 steps.
    ys = 0.3 * np.sin(2 * np.pi * STEPS / 10) + 0.05 * STEPS + 1.0
    amplitudes = st.sinusoid_amplitudes(STEPS, ys[:, None], np.array([10, 5]))
    assert amplitudes[0, 0] == pytest.approx(0.3, rel=1e-9) and amplitudes[1, 0] < 0.01


def test_a_column_with_no_residual_has_statistic_zero():
    # a constant column has no residual off its line (scale 0): no oscillation, statistic 0, not 0/0.
    # Catches: dividing by a zero scale (>= 0 for > 0: x_oscillation_statistic__mutmut_36).
    statistic, _ = st.oscillation_statistic(STEPS, np.full((40, 1), 2.0), st.oscillation_periods(STEPS))
    assert statistic.tolist() == [0.0]


def test_eight_points_are_enough_for_an_oscillation():
    # Catches: oscillation first measured at 9 points instead of 8 (x_oscillation__mutmut_8).
    xs = np.arange(1.0, 9.0)
    ys = np.array([0.2, 0.9, 0.1, 0.8, 0.3, 1.0, 0.0, 0.7])
    assert st.oscillation(xs, ys, surrogates=19).index is not None
    assert st.oscillation(xs[:7], ys[:7], surrogates=19) == st.Oscillation(7)


def test_rarefied_cells_at_zero_and_one_program():
    # one program drawn occupies exactly one cell; none, or no programs at all, occupy none.
    # Catches: m = 1 treated as none (<= 1 for <= 0: x_rarefied_from_counts__mutmut_19) and none counted as one
    # cell (_20).
    assert st.rarefied_cells([1, 1, 2, 3], 1) == pytest.approx(1.0, rel=1e-12)
    assert st.rarefied_cells([1, 1, 2, 3], 0) == 0.0
    assert st.rarefied_cells([], 5) == 0.0


def test_the_line_tolerance_is_relative_with_a_floor_of_one():
    # A residual counts when some |r| > 1e-12 x max(1, max |y|). 8 steps, r = +-a in the pattern
    # [1, -1, -1, 1, 1, -1, -1, 1] (zero mean, zero slope on 1..8, so it is its own residual, exactly).
    x8 = np.arange(1.0, 9.0)
    pattern = np.array([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
    # a = 1e-12, the tolerance itself: still a line. Catches: >= for > (x_oscillation__mutmut_39).
    assert st.oscillation(x8, 1e-12 * pattern, surrogates=19).index is None
    # a = 1.5e-12 on values under 1: measured. Catches: a floor of 2 instead of 1 (x_oscillation__mutmut_46).
    assert st.oscillation(x8, 1.5e-12 * pattern, surrogates=19).index is not None
    # a line at 5000 leaves rounding residuals near 1e-12, far under 1e-12 x 5148: still a line.
    # Catches: the tolerance divided by the series' size (x_oscillation__mutmut_40).
    assert st.oscillation(STEPS, 5000.0 + 3.7 * STEPS, surrogates=19).index is None


def test_a_line_reports_a_zero_amplitude_at_a_candidate_period():
    # Catches: a line's amplitude (x_oscillation__mutmut_50) or period (_51) reported as None.
    osc = st.oscillation(STEPS, 0.01 * STEPS + 3.0)
    assert osc.amplitude < 1e-12 and osc.period in st.oscillation_periods(STEPS).tolist()


def test_repeated_single_step_gives_no_oscillation():
    # Catches: the one-step check made ptp == 1 (x_oscillation__mutmut_12): eight values at one step would be
    # fitted over a span of zero.
    assert st.oscillation([5.0] * 8, np.arange(8.0), surrogates=19) == st.Oscillation(8)


def test_index_spread_and_p_value_are_read_off_the_surrogates():
    # The documented recipe from the module's parts: the statistic is the amplitude over the residual's standard
    # deviation; the surrogates are AR(1) series with the fitted phi and the same seed; index = log(statistic)
    # - median(log(null)), spread = their standard deviation (ddof 1), p = (1 + #null >= statistic) / (S + 1).
    # Catches: the median added instead of subtracted (x_oscillation__mutmut_112), ddof 2 (_118).
    ys = 0.5 * np.sin(2 * np.pi * STEPS / 8) + syn.red_noise(0.3, 40, np.random.default_rng(9))
    osc = st.oscillation(STEPS, ys, surrogates=99, seed=4)
    statistic = osc.amplitude / st.line_residuals(ys[:, None])[:, 0].std()
    null, _ = st.oscillation_statistic(STEPS, st.ar1_series(osc.phi, 40, 99, np.random.default_rng(4)),
                                       st.oscillation_periods(STEPS))
    log_null = np.log(null)
    assert osc.index == pytest.approx(np.log(statistic) - np.median(log_null), rel=1e-9)
    assert osc.spread == pytest.approx(np.std(log_null, ddof=1), rel=1e-12)
    assert osc.p_value == (1 + np.sum(null >= statistic)) / 100


def test_lag1_per_column_by_hand():
    # [1, -1, 1, -1]: (-1 - 1 - 1) / 4 = -0.75; [1, 2, -1, -2]: (2 - 2 + 2) / 10 = 0.2; a zero column: 0, not 0/0.
    # Catches: one column forced (reshape to +1: x_lag1__mutmut_6), the zero column's guard made None
    # (_31: a TypeError) or >= 0 (_35: nan).
    columns = np.column_stack([[1.0, -1.0, 1.0, -1.0], [1.0, 2.0, -1.0, -2.0], [0.0, 0.0, 0.0, 0.0]])
    assert st.lag1(columns) == pytest.approx([-0.75, 0.2, 0.0], abs=1e-15)


def test_fit_trends_exact_line_tolerance_is_relative_with_a_floor_of_one():
    # The same tolerance as the oscillation's, for the red-noise part of a trend's interval: 8 steps, the residual
    # pattern of test_the_line_tolerance_is_relative_with_a_floor_of_one.
    x8 = np.arange(1.0, 9.0)
    pattern = np.array([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0])
    # 1.5e-12 on values under 1: a residual, so a red-noise interval. Catches: a floor of 2 (x_fit_trend__mutmut_48).
    assert st.fit_trend(x8, 1.5e-12 * pattern).red_half > 0
    # a line at 5000 leaves rounding residuals near 2e-12, under 1e-12 x 5029.6: an exact line, HAC part alone.
    # Catches: the tolerance divided by the series' size (x_fit_trend__mutmut_42).
    line = st.fit_trend(x8, 5000.0 + 3.7 * x8)
    assert (line.red_half, line.phi) == (0.0, 0.0)
