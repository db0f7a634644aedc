"""The statistics behind the signature's verdicts, on plain arrays (``analysis/signature.py`` applies them to runs).

Every test here is built to keep its false "holds" rate at or under 5% on series in which nothing happens,
including autocorrelated ones (``benchmarks/compare_calibration.py`` measures it; ``tests/unit/analysis/test_compare_calibration.py``
holds it in CI):

- **Slopes** (``fit_trend``): ordinary least squares slope per step with Newey-West (HAC) standard errors
  from ``statsmodels`` (Bartlett kernel, ``floor(4 (n/100)^(2/9))`` lags, small-sample correction), and a
  two-sided 95% interval ``slope +- t(0.975, n-2) x se``. HAC errors allow for autocorrelated residuals, but
  no interval from one short series can tell a trend from the wander of a strongly persistent one (a random
  walk). So a trend also needs the series to forget its past: the fitted red-noise coefficient ``phi`` of
  its residual (``red_noise_phi``) must be under ``MAX_PHI``; at or above it the verdict is "cannot tell".
  The interval used is the wider of the HAC one and the red-noise one (``fit_trend``).
- **Red noise** (``red_noise_phi``): the AR(1) coefficient ``phi`` whose simulated series, detrended the
  same way, give on average the lag-1 autocorrelation the observed residual has (indirect inference: the
  plain lag-1 autocorrelation of a detrended residual is biased low, much more so in short series).
- **Oscillation** (``oscillation``): a sinusoid fitted jointly with a linear trend over periods
  ``span / k``, ``k = 2, 2.5, ... n/2`` (at least two cycles in the run); the statistic is the largest
  amplitude divided by the standard deviation of the residual off the trend. Its p-value comes from
  ``SURROGATES`` AR(1) series with the fitted ``phi`` (red noise, not shuffled residuals), put through the
  same fit. Curvature (a rise that levels off) raises the fitted ``phi``, so it enters the null rather
  than the signal. The **index** ``log(statistic) - median(log(statistic of the surrogates))`` says how
  many times larger the oscillation is than red noise of the same colour would give; its spread is the
  surrogates' standard deviation of ``log(statistic)``.
- **Coverage** (``rarefied_cells``): the expected number of distinct cells among ``m`` programs drawn
  without replacement (Hurlbert's rarefaction, ``sum_i 1 - C(N - N_i, m) / C(N, m)``), so arms with
  different numbers of programs are compared at the smaller number.
- **Several seeds**: per-seed statistics, then a t-test across seeds (``seed_mean``, ``welch``): valid
  whatever the within-run autocorrelation, since seeds are independent runs, and exact when the per-seed
  statistics are normal (small cell counts are not; seeds that tie exactly give no interval at all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

CI_LEVEL = 0.95
MAX_PHI = 0.75  # at or above it, one series cannot tell a trend from red-noise wander
MIN_CYCLES = 2.0
SURROGATES = 499
PHI_GRID = np.round(np.arange(0.0, 0.99, 0.01), 2)
PHI_MAX = float(PHI_GRID[-1])
SEED = 0


def finite_pairs(xs: Sequence[float], ys: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The (x, y) pairs where both are finite, as float arrays."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    keep = np.isfinite(xs) & np.isfinite(ys)
    return xs[keep], ys[keep]


def t_quantile(probability: float, df: float) -> float:
    from scipy.stats import t  # scipy is slow to import: only when needed

    return float(t.ppf(probability, df))


# --- red noise ---------------------------------------------------------------------------------------------

def ar1_series(phi: float, n: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` stationary AR(1) series of length ``n`` (columns), unit innovations:
    ``u_t = phi u_(t-1) + e_t``, ``u_0 ~ N(0, 1 / (1 - phi^2))``."""
    from scipy.signal import lfilter

    shocks = rng.standard_normal((n, count))
    shocks[0] /= math.sqrt(1.0 - phi * phi)
    return lfilter([1.0], [1.0, -phi], shocks, axis=0)


def line_residuals(columns: np.ndarray) -> np.ndarray:
    """Each column minus its least-squares line over the positions 0..n-1."""
    xc = np.arange(len(columns), dtype=float) - (len(columns) - 1) / 2
    return columns - columns.mean(axis=0) - np.outer(xc, xc @ columns) / (xc @ xc)


def lag1(columns: np.ndarray) -> np.ndarray:
    """Lag-1 autocorrelation ``sum r_t r_(t-1) / sum r_t^2`` of each (zero-mean) column."""
    columns = columns.reshape(len(columns), -1)
    den = np.einsum("ij,ij->j", columns, columns)
    return np.einsum("ij,ij->j", columns[1:], columns[:-1]) / np.where(den > 0, den, 1.0)


@lru_cache(maxsize=64)
def _lag1_curve(n: int, draws: int = 300) -> np.ndarray:
    """Mean lag-1 autocorrelation of the detrended residual of AR(1) series, for each ``phi`` of ``PHI_GRID``."""
    rng = np.random.default_rng(12345 + n)
    return np.array([lag1(line_residuals(ar1_series(phi, n, draws, rng))).mean() for phi in PHI_GRID])


def red_noise_phi(residual: np.ndarray) -> float:
    """The AR(1) ``phi`` in [0, ``PHI_MAX``] whose detrended series have, on average, ``residual``'s lag-1
    autocorrelation (the curve is increasing in ``phi``; linear interpolation on ``PHI_GRID``)."""
    observed = float(lag1(np.asarray(residual, dtype=float))[0])
    curve = np.maximum.accumulate(_lag1_curve(len(residual)))
    return float(np.interp(observed, curve, PHI_GRID))


# --- trends ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Trend:
    """A least-squares trend: ``n`` finite points; the rest is None when ``n < 3``. ``hac_half`` and
    ``red_half`` are the half-widths of the HAC and of the red-noise intervals; ``lo``/``hi`` is the wider
    of the two; ``phi`` is the residual's fitted red-noise coefficient."""

    n: int
    slope: float | None = None
    lo: float | None = None
    hi: float | None = None
    intercept: float | None = None
    hac_half: float | None = None
    red_half: float | None = None
    phi: float | None = None

    @property
    def half(self) -> float:
        return (self.hi - self.lo) / 2

    @property
    def persistent(self) -> bool:
        """Too persistent for one run to tell a trend from wander (``phi >= MAX_PHI``)."""
        return self.phi is not None and self.phi >= MAX_PHI


def newey_west_lags(n: int) -> int:
    """The Newey-West (1994) rule of thumb, ``floor(4 (n / 100)^(2/9))``."""
    return int(4 * (n / 100) ** (2 / 9))


def hac_slope(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float, float]:
    """``(intercept, slope, HAC standard error of the slope)``: statsmodels OLS, Newey-West errors."""
    import statsmodels.api as sm

    fit = sm.OLS(ys, sm.add_constant(xs)).fit(
        cov_type="HAC", cov_kwds={"maxlags": newey_west_lags(len(xs)), "use_correction": True})
    se = float(fit.bse[1])
    return float(fit.params[0]), float(fit.params[1]), se if math.isfinite(se) else 0.0


def red_noise_slope_sd(xs: np.ndarray, residual: np.ndarray, phi: float, surrogates: int = SURROGATES,
                       seed: int = SEED) -> float:
    """The standard deviation of the OLS slope over ``xs`` of AR(1) red noise with ``phi``, scaled so that its
    residual off the line has ``residual``'s standard deviation (simulated, ``surrogates`` series)."""
    noise = ar1_series(phi, len(xs), surrogates, np.random.default_rng(seed))
    xc = xs - xs.mean()
    slopes = xc @ noise / (xc @ xc)
    scale = (noise - noise.mean(axis=0) - np.outer(xc, slopes)).std(axis=0)
    return float(np.std(slopes / scale) * residual.std())


def fit_trend(xs: Sequence[float], ys: Sequence[float], level: float = CI_LEVEL, seed: int = SEED) -> Trend:
    """OLS slope of ``ys`` over ``xs``; its interval at ``level`` is the wider of the Newey-West (HAC) one,
    ``t(n-2) x se``, and the red-noise one, ``z x`` the slope's standard deviation under AR(1) noise fitted
    to the residual."""
    from scipy.stats import norm

    xs, ys = finite_pairs(xs, ys)
    n = len(xs)
    if n < 3 or np.ptp(xs) == 0:
        return Trend(n)
    intercept, slope, se = hac_slope(xs, ys)
    hac_half = t_quantile(0.5 + level / 2, n - 2) * se
    residual = ys - (intercept + slope * xs)
    if n < 6 or not np.any(np.abs(residual) > 1e-12 * max(1.0, float(np.abs(ys).max()))):
        return Trend(n, slope, slope - hac_half, slope + hac_half, intercept, hac_half, 0.0, 0.0)
    phi = red_noise_phi(residual)
    red_half = float(norm.ppf(0.5 + level / 2)) * red_noise_slope_sd(xs, residual, phi, seed=seed)
    half = max(hac_half, red_half)
    return Trend(n, slope, slope - half, slope + half, intercept, hac_half, red_half, phi)


@dataclass(frozen=True)
class Interval:
    """An estimate with a two-sided interval at ``CI_LEVEL``, and what it rests on."""

    estimate: float
    lo: float
    hi: float
    method: str


def difference_of_slopes(first: Trend, second: Trend) -> Interval:
    """``first.slope - second.slope`` with half-width ``sqrt(half1^2 + half2^2)`` (independent runs)."""
    half = math.hypot(first.half, second.half)
    estimate = first.slope - second.slope
    return Interval(estimate, estimate - half, estimate + half, "the two slopes' intervals combined")


NO_SPREAD = "the seeds agree exactly, so their spread cannot measure the noise"


def _agree(values: np.ndarray) -> bool:
    """All equal, up to float rounding (the mean of three equal 0.7s is not exactly 0.7)."""
    return float(np.ptp(values)) <= 1e-12 * max(1.0, float(np.max(np.abs(values))))


def seed_mean(values: Sequence[float], level: float = CI_LEVEL) -> Interval:
    """The mean of per-seed values with a one-sample t interval (``k - 1`` df)."""
    values = np.asarray(values, dtype=float)
    k = len(values)
    mean = float(values.mean())
    spread = float(values.std(ddof=1))
    if _agree(values):  # seeds that agree exactly (small counts tie) leave no spread to measure the noise by
        return Interval(mean, -math.inf, math.inf, f"t across {k} seeds: {NO_SPREAD}")
    half = t_quantile(0.5 + level / 2, k - 1) * spread / math.sqrt(k)
    return Interval(mean, mean - half, mean + half, f"t across {k} seeds")


def welch(first: Sequence[float], second: Sequence[float], level: float = CI_LEVEL) -> Interval:
    """``mean(first) - mean(second)`` with Welch's t interval (Welch-Satterthwaite df)."""
    a, b = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    estimate = float(a.mean() - b.mean())
    if _agree(a) and _agree(b):  # every seed of each arm agrees exactly: no spread to measure the noise by
        return Interval(estimate, -math.inf, math.inf, f"Welch t, {len(a)} vs {len(b)} seeds: {NO_SPREAD}")
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = t_quantile(0.5 + level / 2, df) * se
    return Interval(estimate, estimate - half, estimate + half, f"Welch t, {len(a)} vs {len(b)} seeds")


# --- oscillation -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Oscillation:
    """The dominant oscillation around a linear trend against red noise: ``n`` finite points; the rest is None
    when too few. ``amplitude`` in the series' units; ``index`` = log(statistic / red noise's median);
    ``spread`` = the surrogates' standard deviation of log(statistic)."""

    n: int
    amplitude: float | None = None
    period: float | None = None
    p_value: float | None = None
    phi: float | None = None
    index: float | None = None
    spread: float | None = None


def oscillation_periods(xs: np.ndarray) -> np.ndarray:
    """Candidate periods in steps: ``span / k`` for ``k = MIN_CYCLES, +0.5, ... n/2`` (span = n spacings)."""
    n = len(xs)
    span = float(np.ptp(xs)) * n / (n - 1)
    return span / np.arange(MIN_CYCLES, n / 2 + 1e-9, 0.5)


@lru_cache(maxsize=32)
def _projectors(xs_key: bytes, periods_key: bytes) -> np.ndarray:
    """(periods x 2 x n): the rows of the least-squares solution that give the cosine and sine coefficients of
    a sinusoid of each period fitted jointly with a line (``pinv`` of ``[1, x, cos, sin]``)."""
    xs, periods = np.frombuffer(xs_key), np.frombuffer(periods_key)
    xc = xs - xs.mean()
    rows = []
    for period in periods:
        angle = 2 * np.pi * xc / period
        rows.append(np.linalg.pinv(np.column_stack([np.ones_like(xc), xc, np.cos(angle), np.sin(angle)]))[2:])
    return np.array(rows)


def sinusoid_amplitudes(xs: np.ndarray, columns: np.ndarray, periods: np.ndarray) -> np.ndarray:
    """(periods x columns): the amplitude of a sinusoid of each period fitted jointly with a line."""
    coef = _projectors(xs.astype(float).tobytes(), np.asarray(periods, dtype=float).tobytes()) @ columns
    return np.hypot(coef[:, 0], coef[:, 1])


def oscillation_statistic(xs: np.ndarray, columns: np.ndarray, periods: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column: (largest amplitude / residual standard deviation off the line, the largest amplitude's row)."""
    amplitudes = sinusoid_amplitudes(xs, columns, periods)
    xc = xs - xs.mean()
    residual = columns - columns.mean(axis=0) - np.outer(xc, xc @ columns) / (xc @ xc)
    scale = residual.std(axis=0)
    best = amplitudes.argmax(axis=0)
    top = amplitudes[best, np.arange(amplitudes.shape[1])]
    return top / np.where(scale > 0, scale, np.inf), best


def oscillation(xs: Sequence[float], ys: Sequence[float], surrogates: int = SURROGATES,
                seed: int = SEED) -> Oscillation:
    """The largest sinusoid around a linear trend, tested against AR(1) red noise fitted to the residual."""
    xs, ys = finite_pairs(xs, ys)
    n = len(xs)
    if n < 8 or np.ptp(xs) == 0:
        return Oscillation(n)
    periods = oscillation_periods(xs)
    statistic, best = oscillation_statistic(xs, ys[:, None], periods)
    amplitude = float(sinusoid_amplitudes(xs, ys[:, None], periods[best])[0, 0])
    residual = line_residuals(ys[:, None])[:, 0]
    if not np.any(np.abs(residual) > 1e-12 * max(1.0, float(np.abs(ys).max()))):
        return Oscillation(n, amplitude, float(periods[best[0]]), 1.0, 0.0, None, None)
    phi = red_noise_phi(residual)
    null, _ = oscillation_statistic(xs, ar1_series(phi, n, surrogates, np.random.default_rng(seed)), periods)
    log_null = np.log(null)
    p_value = (1 + int(np.sum(null >= statistic[0]))) / (surrogates + 1)
    return Oscillation(n, amplitude, float(periods[best[0]]), p_value, phi,
                       float(math.log(statistic[0]) - np.median(log_null)), float(log_null.std(ddof=1)))


def difference_of_indices(first: Oscillation, second: Oscillation, level: float = CI_LEVEL) -> Interval:
    """``first.index - second.index`` with ``+- z x sqrt(spread1^2 + spread2^2)`` (red noise's spreads)."""
    from scipy.stats import norm

    estimate = first.index - second.index
    half = float(norm.ppf(0.5 + level / 2)) * math.hypot(first.spread, second.spread)
    return Interval(estimate, estimate - half, estimate + half, "red-noise spread of the two indices")


def fisher_combined(p_values: Sequence[float]) -> float:
    """Fisher's combination of independent p-values: ``-2 sum log p ~ chi2(2k)`` under the null."""
    from scipy.stats import combine_pvalues

    return float(combine_pvalues(list(p_values), method="fisher").pvalue)


# --- coverage ----------------------------------------------------------------------------------------------

def rarefied_cells(cells: Sequence[int], m: int) -> float:
    """Expected number of distinct cells among ``m`` of the programs in ``cells`` (one cell id per program)
    drawn without replacement: ``sum_i 1 - C(N - N_i, m) / C(N, m)`` (Hurlbert 1971)."""
    return rarefied_from_counts(np.unique(np.asarray(cells, dtype=np.int64), return_counts=True)[1], m)


def rarefied_from_counts(counts: Sequence[int], m: int) -> float:
    """``rarefied_cells`` from the number of programs ``N_i`` in each cell (zeros allowed)."""
    from scipy.special import gammaln

    counts = np.asarray(counts, dtype=float)
    counts = counts[counts > 0]
    total = float(counts.sum())
    m = min(int(m), int(total))
    if m <= 0:
        return 0.0
    rest = total - counts
    possible = rest >= m
    log_missed = np.full_like(rest, -np.inf)
    r = rest[possible]
    log_missed[possible] = gammaln(r + 1) - gammaln(r - m + 1) - gammaln(total + 1) + gammaln(total - m + 1)
    return float(np.sum(1.0 - np.exp(log_missed)))


def new_cells(steps: Sequence[int], cells: Sequence[int]) -> dict[int, int]:
    """Per step (those with programs), how many cells its programs occupy that no earlier step's did."""
    steps, cells = np.asarray(steps, dtype=np.int64), np.asarray(cells, dtype=np.int64)
    order = np.argsort(steps, kind="stable")
    _, first = np.unique(cells[order], return_index=True)
    found = np.bincount(np.searchsorted(np.unique(steps), steps[order][first]), minlength=len(np.unique(steps)))
    return dict(zip(np.unique(steps).tolist(), found.tolist(), strict=True))
