"""The paper's signature (Figs 3, 4, 9, 11), measured: population runs against baseline runs, one or more seeds each.

Seven claims, each with a verdict ``holds`` / ``does not hold`` / ``cannot tell`` / ``not enough steps``:

- ``complexity/population_rises``, ``complexity/baseline_falls``: the slope per step of the **composite
  complexity** (below) lies above 0 in the population and below 0 in the baseline;
- ``complexity/population_minus_baseline``: the population's slope minus the baseline's lies above 0;
- ``coverage/population_covers_more``: at an **equal number of programs** (every run rarefied to the
  smallest run's count of valid programs: the smaller arm's with one seed each, the fewest of any single run
  with several), the population's programs occupy more CVT cells;
- ``coverage/population_still_adding_more``: with both arms thinned to that same number of programs, the
  population finds more new cells in the **last third** of its steps than the baseline does in its own;
- ``solve_rate/population_oscillates_more``: the population's ``train/solve_rate`` oscillates beyond red
  noise (p < 0.05), and its oscillation index exceeds the baseline's (the difference's interval above 0);
- ``solve_rate/baseline_rises``: the baseline's solve-rate slope lies above 0.

**Multiplicity.** The five complexity axes measure one thing (two of them correlated at 0.86 in the
committed CPU run), so they enter as ONE composite: each axis standardised by its mean and standard
deviation over every step of every run compared, then averaged over the axes. Each axis's own slope is
reported without a verdict. The verdicts are tested one by one at 5% (95% intervals, one-sided 2.5% each
way); no family-wise correction: each is calibrated on its own (``benchmarks/compare_calibration.py``).

**One seed per arm** (the statistics: ``analysis/signature_stats.py``): slopes with the wider of a
Newey-West (HAC) and a red-noise interval, and ``cannot tell`` when the residual's fitted red-noise
coefficient is ``MAX_PHI`` or more; oscillation against AR(1) surrogates; covered cells with a bootstrap
over steps; new cells with a Poisson interval ``+- 1.96 sqrt(a + b)``. **Several seeds per arm** (at least
two each): every claim is tested across seeds, one number per run: a one-sample t interval of the slopes,
Welch t intervals of the differences, and Fisher's combination of the population's oscillation p-values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from openrlhf_populora.analysis import signature_stats as st
from openrlhf_populora.analysis.runs import RunData
from openrlhf_populora.metrics.keys import COMPLEXITY_AXES, complexity_key, coverage_key, train_key

HOLDS = "holds"
DOES_NOT_HOLD = "does not hold"
CANNOT_TELL = "cannot tell"
NOT_ENOUGH = "not enough steps"
VERDICTS = (HOLDS, DOES_NOT_HOLD, CANNOT_TELL, NOT_ENOUGH)
MIN_POINTS = 10
OSCILLATION_ALPHA = 0.05
BOOTSTRAPS = 400
THINNINGS = 50
SEED = 0
SOLVE_RATE = train_key("solve_rate")
VALIDITY = train_key("validity")
TREND_KEYS = (VALIDITY, SOLVE_RATE)
COMPOSITE = "composite"
CLAIMS = ("complexity/population_rises", "complexity/baseline_falls", "complexity/population_minus_baseline",
          "coverage/population_covers_more", "coverage/population_still_adding_more",
          "solve_rate/population_oscillates_more", "solve_rate/baseline_rises")
METHOD = {
    "slope": (f"OLS slope per step; 95% interval: the wider of Newey-West (HAC, statsmodels) and red noise "
              f"(AR(1) fitted to the residual); 'cannot tell' when its red-noise phi >= {st.MAX_PHI}"),
    "oscillation": (f"largest sinusoid around a line (periods span/k, k = {st.MIN_CYCLES:g}, +0.5, ... n/2) over "
                    f"the residual's standard deviation; p against {st.SURROGATES} AR(1) red-noise surrogates; "
                    "index = log(statistic / red noise's median)"),
    "coverage": ("CVT cells of the valid programs, each run rarefied (Hurlbert) or thinned to the smallest "
                 "run's number of programs; 'last third': the last ceil(n/3) steps"),
    "multiplicity": ("the five complexity axes enter as one composite (mean of standardised axes); each "
                     "claim tested on its own (a two-sided 95% interval on the claimed side of 0: one-sided "
                     "2.5%), no family-wise correction"),
    "seeds": "one seed per arm: per-run intervals; two or more each: t tests across seeds",
}


# --- what one run contributes ------------------------------------------------------------------------------

@dataclass
class ArmSeries:
    """One run as the statistics see it: series over its steps, and its valid programs' CVT cells by step."""

    label: str
    steps: np.ndarray
    composite: np.ndarray
    solve_rate: np.ndarray
    validity: np.ndarray
    axes: dict[str, np.ndarray] = field(default_factory=dict)
    program_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    program_cells: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class CoverageStats:
    programs: int  # valid programs
    cells: int  # distinct cells they occupy
    rarefied: float | None  # expected cells among m of them
    last_third_new: float | None  # new cells in the last third, thinned to m programs (mean over thinnings)
    last_third_steps: int
    whole_run_new: float | None  # the same over every step, reported


@dataclass(frozen=True)
class RunStats:
    label: str
    steps: int
    composite: st.Trend
    axes: dict[str, st.Trend]
    solve_rate: st.Trend
    validity: st.Trend
    oscillation: st.Oscillation
    coverage: CoverageStats


def last_third_steps(steps: Sequence[int]) -> set[int]:
    """The last ``ceil(n / 3)`` of a run's ``n`` steps."""
    steps = sorted(steps)
    return set(steps[len(steps) - math.ceil(len(steps) / 3):])


def thinned_new_cells(series: ArmSeries, m: int, window: set[int], thinnings: int = THINNINGS,
                      seed: int = SEED) -> float:
    """New cells (first occurrences, in step order) among the run's programs of the steps in ``window``, with
    the run thinned to ``m`` programs chosen at random (mean over ``thinnings``; exact when it has ``m``)."""
    total = len(series.program_cells)
    if total <= m:
        return float(sum(n for s, n in st.new_cells(series.program_steps, series.program_cells).items()
                         if s in window))
    rng = np.random.default_rng(seed)
    counts = []
    for _ in range(thinnings):
        keep = np.sort(rng.choice(total, size=m, replace=False))
        found = st.new_cells(series.program_steps[keep], series.program_cells[keep])
        counts.append(sum(n for s, n in found.items() if s in window))
    return float(np.mean(counts))


def coverage_stats(series: ArmSeries, m: int, seed: int = SEED) -> CoverageStats:
    cells = series.program_cells
    window = last_third_steps(series.steps)
    if not len(cells) or m <= 0:
        return CoverageStats(len(cells), len(set(cells.tolist())), None, None, len(window), None)
    return CoverageStats(len(cells), len(set(cells.tolist())), st.rarefied_cells(cells, m),
                         thinned_new_cells(series, m, window, seed=seed), len(window),
                         thinned_new_cells(series, m, set(series.steps.tolist()), seed=seed))


def run_stats(series: ArmSeries, m: int, surrogates: int = st.SURROGATES, seed: int = SEED) -> RunStats:
    """Every per-run statistic; ``m`` is the number of programs the coverage is rarefied to."""
    xs = series.steps.astype(float)
    return RunStats(
        label=series.label, steps=len(xs),
        composite=st.fit_trend(xs, series.composite, seed=seed),
        axes={axis: st.fit_trend(xs, values, seed=seed) for axis, values in series.axes.items()},
        solve_rate=st.fit_trend(xs, series.solve_rate, seed=seed),
        validity=st.fit_trend(xs, series.validity, seed=seed),
        oscillation=st.oscillation(xs, series.solve_rate, surrogates=surrogates, seed=seed),
        coverage=coverage_stats(series, m, seed=seed))


# --- verdicts ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    claim: str
    verdict: str
    detail: str
    estimate: float | None = None
    lo: float | None = None
    hi: float | None = None
    method: str = ""


def _too_few(*counts: int) -> str | None:
    low = min(counts)
    return None if low >= MIN_POINTS else f"{low} finite points < {MIN_POINTS}"


def _g(value: float | None) -> str:
    return "–" if value is None else f"{value:+.3g}"


def interval_verdict(claim: str, interval: st.Interval, direction: int, what: str) -> Verdict:
    """Holds when the interval lies above 0 (``direction`` +1) or below 0 (-1); cannot tell when it is unbounded
    (seeds that agree exactly)."""
    if math.isinf(interval.lo) and math.isinf(interval.hi):
        return Verdict(claim, CANNOT_TELL, f"{what} {_g(interval.estimate)}: {st.NO_SPREAD}", interval.estimate,
                       interval.lo, interval.hi, interval.method)
    ok = interval.lo > 0 if direction > 0 else interval.hi < 0
    where = "above" if direction > 0 else "below"
    detail = f"{what} {_g(interval.estimate)} [{_g(interval.lo)}, {_g(interval.hi)}] {'' if ok else 'not '}{where} 0"
    return Verdict(claim, HOLDS if ok else DOES_NOT_HOLD, detail, interval.estimate, interval.lo, interval.hi,
                   interval.method)


def _trend_interval(trend: st.Trend) -> st.Interval:
    return st.Interval(trend.slope, trend.lo, trend.hi, "wider of HAC and red-noise intervals")


def slope_verdict(claim: str, trends: Sequence[st.Trend], direction: int) -> Verdict:
    """One run: its slope interval, ``cannot tell`` when too persistent; several: t across the seeds' slopes."""
    reason = _too_few(*(t.n for t in trends))
    if reason:
        return Verdict(claim, NOT_ENOUGH, reason)
    if len(trends) == 1:
        if trends[0].persistent:
            return Verdict(claim, CANNOT_TELL, f"residual red-noise phi {trends[0].phi:.2f} >= {st.MAX_PHI}: one "
                           "run cannot tell a trend from wander; run several seeds", trends[0].slope)
        return interval_verdict(claim, _trend_interval(trends[0]), direction, "slope")
    return interval_verdict(claim, st.seed_mean([t.slope for t in trends]), direction, "mean slope")


def slope_difference_verdict(claim: str, first: Sequence[st.Trend], second: Sequence[st.Trend]) -> Verdict:
    reason = _too_few(*(t.n for t in (*first, *second)))
    if reason:
        return Verdict(claim, NOT_ENOUGH, reason)
    if len(first) == 1:
        if first[0].persistent or second[0].persistent:
            return Verdict(claim, CANNOT_TELL, "a residual is too persistent (red-noise phi "
                           f">= {st.MAX_PHI}) for one run per arm; run several seeds")
        return interval_verdict(claim, st.difference_of_slopes(first[0], second[0]), +1, "difference")
    return interval_verdict(claim, st.welch([t.slope for t in first], [t.slope for t in second]), +1, "difference")


def oscillation_verdict(claim: str, first: Sequence[st.Oscillation], second: Sequence[st.Oscillation]) -> Verdict:
    """Holds when the first arm oscillates beyond red noise (its p, Fisher-combined over seeds, < alpha) and
    its index exceeds the second arm's (the difference's interval above 0)."""
    reason = _too_few(*(o.n for o in (*first, *second)))
    if reason:
        return Verdict(claim, NOT_ENOUGH, reason)
    if any(o.index is None for o in (*first, *second)):
        return Verdict(claim, DOES_NOT_HOLD, "a series has no residual around its line: no oscillation")
    if len(first) == 1:
        p_value, difference = first[0].p_value, st.difference_of_indices(first[0], second[0])
    else:
        p_value = st.fisher_combined([o.p_value for o in first])
        difference = st.welch([o.index for o in first], [o.index for o in second])
    verdict = interval_verdict(claim, difference, +1, "index difference")
    significant = p_value < OSCILLATION_ALPHA
    detail = f"red-noise p {p_value:.3g} ({'<' if significant else '>='} {OSCILLATION_ALPHA}); {verdict.detail}"
    ok = significant and verdict.verdict == HOLDS
    status = HOLDS if ok else CANNOT_TELL if verdict.verdict == CANNOT_TELL else DOES_NOT_HOLD
    return Verdict(claim, status, detail, verdict.estimate, verdict.lo, verdict.hi,
                   verdict.method)


def step_cell_counts(runs: Sequence[ArmSeries]) -> list[np.ndarray]:
    """Per run, (its steps with programs x the cells of all runs): how many of a step's programs fall in each."""
    _, cell_index = np.unique(np.concatenate([r.program_cells for r in runs]), return_inverse=True)
    tables, offset = [], 0
    for run in runs:
        _, step_index = np.unique(run.program_steps, return_inverse=True)
        table = np.zeros((step_index.max() + 1, cell_index.max() + 1), dtype=np.int64)
        np.add.at(table, (step_index, cell_index[offset:offset + len(step_index)]), 1)
        tables.append(table)
        offset += len(step_index)
    return tables


def rarefied_difference(first: np.ndarray, second: np.ndarray) -> float:
    """Rarefied cells of two (steps x cells) count tables at the smaller number of programs, first minus second."""
    a, b = first.sum(axis=0), second.sum(axis=0)
    size = min(a.sum(), b.sum())
    return st.rarefied_from_counts(a, size) - st.rarefied_from_counts(b, size)


def permutation_rarefied_difference(first: ArmSeries, second: ArmSeries, permutations: int = BOOTSTRAPS,
                                    seed: int = SEED, level: float = st.CI_LEVEL) -> st.Interval:
    """Rarefied cells of ``first`` minus ``second`` at the smaller number of programs, ``+- z x`` the standard
    deviation of the same difference over random reassignments of whole steps (their programs together)
    between the two runs, each keeping its number of steps: the spread the difference has when both runs'
    steps come from one process. (A bootstrap over steps gives too narrow a spread: resampled steps repeat
    programs, and richness depends on the rare cells it then misses.)"""
    from scipy.stats import norm

    rng = np.random.default_rng(seed)
    a, b = step_cell_counts([first, second])
    estimate = rarefied_difference(a, b)
    pooled = np.concatenate([a, b])
    draws = []
    for _ in range(permutations):
        order = rng.permutation(len(pooled))
        draws.append(rarefied_difference(pooled[order[:len(a)]], pooled[order[len(a):]]))
    half = float(norm.ppf(0.5 + level / 2)) * float(np.std(draws, ddof=1))
    return st.Interval(float(estimate), float(estimate - half), float(estimate + half),
                       f"spread over {permutations} reassignments of steps between the runs")


def covers_more_verdict(claim: str, first: Sequence[ArmSeries], second: Sequence[ArmSeries],
                        first_stats: Sequence[RunStats], second_stats: Sequence[RunStats]) -> Verdict:
    reason = _too_few(*(len(s.steps) for s in (*first, *second)))
    if reason:
        return Verdict(claim, NOT_ENOUGH, reason)
    if any(not len(s.program_cells) for s in (*first, *second)):
        return Verdict(claim, NOT_ENOUGH, "a run has no valid program")
    if len(first) == 1:
        interval = permutation_rarefied_difference(first[0], second[0])
    else:
        interval = st.welch([s.coverage.rarefied for s in first_stats], [s.coverage.rarefied for s in second_stats])
    return interval_verdict(claim, interval, +1, "cells at equal programs, difference")


def still_adding_verdict(claim: str, first: Sequence[RunStats], second: Sequence[RunStats]) -> Verdict:
    """New cells in the last third at equal programs, first arm minus second: one run each, a Poisson interval
    ``(a - b) +- 1.96 sqrt(a + b)``; several seeds, Welch's t."""
    reason = _too_few(*(s.steps for s in (*first, *second)))
    if reason:
        return Verdict(claim, NOT_ENOUGH, reason)
    if any(s.coverage.last_third_new is None for s in (*first, *second)):
        return Verdict(claim, NOT_ENOUGH, "a run has no valid program")
    if len(first) == 1:
        a, b = first[0].coverage.last_third_new, second[0].coverage.last_third_new
        half = 1.959964 * math.sqrt(a + b)
        interval = st.Interval(a - b, a - b - half, a - b + half, "Poisson: +- 1.96 sqrt(a + b)")
    else:
        interval = st.welch([s.coverage.last_third_new for s in first],
                            [s.coverage.last_third_new for s in second])
    return interval_verdict(claim, interval, +1, "new cells in the last third, difference")


def signature_verdicts(roles: tuple[str, str], first: Sequence[ArmSeries], second: Sequence[ArmSeries],
                       first_stats: Sequence[RunStats], second_stats: Sequence[RunStats]) -> dict[str, Verdict]:
    """The seven claims, keyed by ``CLAIMS`` (role names only in the claim text)."""
    a, b = roles
    return {
        CLAIMS[0]: slope_verdict(f"{a} complexity rises", [s.composite for s in first_stats], +1),
        CLAIMS[1]: slope_verdict(f"{b} complexity falls", [s.composite for s in second_stats], -1),
        CLAIMS[2]: slope_difference_verdict(f"{a} complexity slope > {b}'s", [s.composite for s in first_stats],
                                            [s.composite for s in second_stats]),
        CLAIMS[3]: covers_more_verdict(f"{a} covers more cells than {b} at equal programs", first, second,
                                       first_stats, second_stats),
        CLAIMS[4]: still_adding_verdict(f"{a} adds more new cells than {b} in the last third", first_stats,
                                        second_stats),
        CLAIMS[5]: oscillation_verdict(f"{a} solve rate oscillates more than {b}'s",
                                       [s.oscillation for s in first_stats], [s.oscillation for s in second_stats]),
        CLAIMS[6]: slope_verdict(f"{b} solve rate rises", [s.solve_rate for s in second_stats], +1),
    }


def compare_series(first: Sequence[ArmSeries], second: Sequence[ArmSeries],
                   roles: tuple[str, str] = ("population", "baseline"), surrogates: int = st.SURROGATES,
                   seed: int = SEED) -> tuple[list[RunStats], list[RunStats], dict[str, Verdict]]:
    """Per-run statistics of both arms and the verdicts. One run per arm, or at least two per arm."""
    if not first or not second or (len(first) == 1) != (len(second) == 1):
        raise ValueError(f"give one run per arm, or at least two per arm (got {len(first)} and {len(second)})")
    m = min(len(s.program_cells) for s in (*first, *second))
    first_stats = [run_stats(s, m, surrogates, seed) for s in first]
    second_stats = [run_stats(s, m, surrogates, seed) for s in second]
    return first_stats, second_stats, signature_verdicts(roles, first, second, first_stats, second_stats)


# --- from run directories -----------------------------------------------------------------------------------

def axis_scales(runs: Sequence[RunData]) -> dict[str, tuple[float, float]]:
    """Per complexity axis, ``(mean, standard deviation)`` over every finite value of every run."""
    out = {}
    for axis in COMPLEXITY_AXES:
        values = np.concatenate([run.series(complexity_key(axis))[1] for run in runs])
        values = values[np.isfinite(values)]
        if len(values) > 1 and values.std() > 0:
            out[axis] = (float(values.mean()), float(values.std()))
    return out


def _on_steps(run: RunData, key: str, steps: np.ndarray) -> np.ndarray:
    xs, ys = run.series(key)
    lookup = dict(zip(np.asarray(xs).tolist(), np.asarray(ys, dtype=float).tolist(), strict=True))
    return np.array([lookup.get(s, np.nan) for s in steps.tolist()], dtype=float)


def program_cells(run: RunData, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, cells)`` of the run's valid programs: each program's CVT cell (nearest centroid of its
    descriptor, as the coverage archive assigns it)."""
    from openrlhf_populora.metrics.coverage import program_descriptor

    steps, points = [], []
    for record in run.problems():
        if not record.get("valid") or not isinstance(record.get("program"), str) or "step" not in record:
            continue
        point = program_descriptor(record["program"], record.get("inputs"), record.get("outputs"),
                                   record.get("complexity"))
        if point is not None:
            steps.append(int(record["step"]))
            points.append(point)
    if not points:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    points = np.asarray(points)
    distances = (points ** 2).sum(1)[:, None] - 2 * points @ centroids.T + (centroids ** 2).sum(1)[None, :]
    return np.asarray(steps, dtype=np.int64), distances.argmin(axis=1).astype(np.int64)


def arm_series(run: RunData, scales: dict[str, tuple[float, float]], centroids: np.ndarray) -> ArmSeries:
    steps = np.asarray(run.steps, dtype=np.int64)
    axes = {axis: _on_steps(run, complexity_key(axis), steps) for axis in COMPLEXITY_AXES}
    standardised = [(axes[a] - mean) / sd for a, (mean, sd) in scales.items()]
    composite = np.mean(standardised, axis=0) if standardised else np.full(len(steps), np.nan)
    program_steps, cells = program_cells(run, centroids)
    return ArmSeries(run.label, steps, composite, _on_steps(run, SOLVE_RATE, steps),
                     _on_steps(run, VALIDITY, steps), axes, program_steps, cells)


@dataclass(frozen=True)
class RunInfo:
    label: str
    path: str
    mode: str | None
    steps: int
    first_step: int | None
    last_step: int | None
    synthetic: bool = False  # written by analysis.synthetic: not a real run
    coverage_end: float | None = None  # coverage/overall at its last step (the archive's, seeds included)


def run_info(run: RunData) -> RunInfo:
    steps = run.steps
    _, overall = run.series(coverage_key("overall"))
    return RunInfo(run.label, str(run.path), run.mode, len(steps), steps[0] if steps else None,
                   steps[-1] if steps else None, run.synthetic, float(overall[-1]) if len(overall) else None)


@dataclass
class Comparison:
    """Every number and verdict; arm 0 is the population (or A), arm 1 the baseline (or B)."""

    roles: tuple[str, str]
    runs: tuple[list[RunInfo], list[RunInfo]]
    stats: tuple[list[RunStats], list[RunStats]]
    series: tuple[list[ArmSeries], list[ArmSeries]]
    programs_compared: int
    verdicts: dict[str, Verdict] = field(default_factory=dict)
    # claims reported but not counted: the paper does not predict them for these arms (the baseline's collapse,
    # against a baseline on the failure-rate reward: the reward-rule control), and why
    not_predicted: dict[str, str] = field(default_factory=dict)

    @property
    def seeds(self) -> tuple[int, int]:
        return len(self.runs[0]), len(self.runs[1])

    def to_dict(self) -> dict[str, Any]:
        def arm(i: int) -> list[dict[str, Any]]:
            return [{"run": asdict(info), **asdict(stats)} for info, stats in zip(self.runs[i], self.stats[i],
                                                                               strict=True)]

        return {"method": {**METHOD, "min_points": MIN_POINTS, "oscillation_alpha": OSCILLATION_ALPHA,
                           "max_phi": st.MAX_PHI, "ci_level": st.CI_LEVEL},
                "roles": {"population": self.roles[0], "baseline": self.roles[1]},
                "seeds": {self.roles[0]: self.seeds[0], self.roles[1]: self.seeds[1]},
                "programs_compared": self.programs_compared,
                "arms": {self.roles[0]: arm(0), self.roles[1]: arm(1)},
                "verdicts": {name: asdict(v) for name, v in self.verdicts.items()},
                "not_predicted": dict(self.not_predicted)}


def compare_runs(first: Sequence[RunData] | RunData, second: Sequence[RunData] | RunData,
                 roles: tuple[str, str] = ("population", "baseline"), surrogates: int = st.SURROGATES,
                 seed: int = SEED, centroids: np.ndarray | None = None) -> Comparison:
    """Every statistic and verdict of the signature, ``first`` in the population's place (a run or a list of
    runs, one per seed)."""
    from openrlhf_populora.metrics.coverage import centroids_for

    first = [first] if isinstance(first, RunData) else list(first)
    second = [second] if isinstance(second, RunData) else list(second)
    centroids = centroids_for() if centroids is None else centroids
    scales = axis_scales([*first, *second])
    series = ([arm_series(r, scales, centroids) for r in first], [arm_series(r, scales, centroids) for r in second])
    first_stats, second_stats, verdicts = compare_series(*series, roles=roles, surrogates=surrogates, seed=seed)
    m = min(len(s.program_cells) for s in (*series[0], *series[1]))
    return Comparison(roles, ([run_info(r) for r in first], [run_info(r) for r in second]),
                      (first_stats, second_stats), series, m, verdicts)


# --- tables: the same rows for plain text and Markdown -------------------------------------------------------

@dataclass(frozen=True)
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]


def trend_cell(trends: Sequence[st.Trend]) -> str:
    """One run: ``slope [interval] n=..``; several: the seeds' mean slope with its t interval."""
    if any(t.slope is None for t in trends):
        return f"– (n={min(t.n for t in trends)})"
    if len(trends) == 1:
        t = trends[0]
        flag = f" phi={t.phi:.2f}" + (" (too persistent)" if t.persistent else "")
        return f"{t.slope:+.3g} [{t.lo:+.3g}, {t.hi:+.3g}] n={t.n}{flag}"
    m = st.seed_mean([t.slope for t in trends])
    return f"{m.estimate:+.3g} [{m.lo:+.3g}, {m.hi:+.3g}] over {len(trends)} seeds"


def _mean_cell(values: Sequence[float | None], fmt: str = ".3g") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return format(values[0], fmt)
    m = st.seed_mean(values)
    return f"{format(m.estimate, fmt)} [{format(m.lo, fmt)}, {format(m.hi, fmt)}] over {len(values)} seeds"


def _verdict_cell(v: Verdict) -> str:
    return f"{v.verdict}: {v.detail}"


def complexity_table(c: Comparison) -> Table:
    a, b = c.stats
    rows = [[axis, trend_cell([s.axes[axis] for s in a]), trend_cell([s.axes[axis] for s in b]), "reported"]
            for axis in COMPLEXITY_AXES if axis in a[0].axes]
    rows.append([f"{COMPOSITE} (the verdicts)", trend_cell([s.composite for s in a]),
                 trend_cell([s.composite for s in b]), ""])
    rows += [[v.claim, "", "", _verdict_cell(v)] for v in (c.verdicts[k] for k in CLAIMS[:3])]
    return Table("1. Program complexity: slope per step [95% interval] (composite: mean of standardised axes)",
                 ["axis", *c.roles, "verdict"], rows)


def coverage_table(c: Comparison) -> Table:
    a, b = c.stats

    def row(name: str, get, fmt: str = ".3g") -> list[str]:
        return [name, _mean_cell([get(s) for s in a], fmt), _mean_cell([get(s) for s in b], fmt), ""]

    rows = [["coverage/overall at the end (archive, seed tasks included)",
             _mean_cell([r.coverage_end for r in c.runs[0]], ".4g"),
             _mean_cell([r.coverage_end for r in c.runs[1]], ".4g"), ""],
            row("valid programs", lambda s: float(s.coverage.programs), ".4g"),
            row("cells they occupy", lambda s: float(s.coverage.cells), ".4g"),
            row(f"cells at {c.programs_compared} programs (rarefied)", lambda s: s.coverage.rarefied),
            row(f"new cells in the last third, at {c.programs_compared} programs", lambda s: s.coverage.last_third_new),
            row(f"new cells over the whole run, at {c.programs_compared} programs", lambda s: s.coverage.whole_run_new)]
    rows += [[v.claim, "", "", _verdict_cell(v)] for v in (c.verdicts[k] for k in CLAIMS[3:5])]
    return Table("2. Coverage (CVT cells of the valid programs)", ["quantity", *c.roles, "verdict"], rows)


def oscillation_cell(oscillations: Sequence[st.Oscillation]) -> str:
    if any(o.index is None for o in oscillations):
        return f"– (n={min(o.n for o in oscillations)})"
    if len(oscillations) == 1:
        o = oscillations[0]
        return (f"amplitude {o.amplitude:.3g} (period {o.period:.3g}), red-noise p={o.p_value:.3g}, phi={o.phi:.2f}, "
                f"index {o.index:+.2f} ± {o.spread:.2f}")
    return (f"index {_mean_cell([o.index for o in oscillations], '+.2f')}; Fisher p="
            f"{st.fisher_combined([o.p_value for o in oscillations]):.3g}")


def solve_rate_table(c: Comparison) -> Table:
    a, b = c.stats
    rows = [["oscillation", oscillation_cell([s.oscillation for s in a]), oscillation_cell([s.oscillation for s in b]),
             _verdict_cell(c.verdicts[CLAIMS[5]])],
            ["slope per step [95% interval]", trend_cell([s.solve_rate for s in a]),
             trend_cell([s.solve_rate for s in b]), _verdict_cell(c.verdicts[CLAIMS[6]])]]
    return Table(f"3. Student solve rate ({SOLVE_RATE})", ["quantity", *c.roles, "verdict"], rows)


def trends_table(c: Comparison) -> Table:
    a, b = c.stats
    rows = [[VALIDITY, trend_cell([s.validity for s in a]), trend_cell([s.validity for s in b])],
            [SOLVE_RATE, trend_cell([s.solve_rate for s in a]), trend_cell([s.solve_rate for s in b])]]
    return Table("4. Trends: slope per step [95% interval] (reported; verdicts above)", ["series", *c.roles], rows)


def verdict_tally(c: Comparison) -> str:
    counted = {name: v for name, v in c.verdicts.items() if name not in c.not_predicted}
    counts = {v: sum(x.verdict == v for x in counted.values()) for v in VERDICTS}
    line = f"{len(counted)} claims: " + ", ".join(f"{n} {v}" for v, n in counts.items())
    for why in dict.fromkeys(c.not_predicted.values()):  # each reason once, in order
        names = [n for n, w in c.not_predicted.items() if w == why and n in c.verdicts]
        line += (f"; reported, not counted ({why}): "
                 + ", ".join(f"{name} {c.verdicts[name].verdict}" for name in names))
    return line


def seeds_table(c: Comparison) -> Table:
    """What each run contributed to the seed-level tests: its own statistic per claim."""

    def number(value: float | None, fmt: str = "+.3g") -> str:
        return "–" if value is None else format(value, fmt)

    rows = []
    for role, infos, stats in zip(c.roles, c.runs, c.stats, strict=True):
        for info, s in zip(infos, stats, strict=True):
            rows.append([role, info.label, str(info.steps), number(s.composite.slope), number(s.solve_rate.slope),
                         number(s.coverage.rarefied, ".3g"), number(s.coverage.last_third_new, ".3g"),
                         number(s.oscillation.p_value, ".3g"), number(s.oscillation.index)])
    return Table(f"5. Per seed: each run's own statistic (cells and new cells at {c.programs_compared} programs)",
                 ["arm", "run", "steps", "complexity slope", "solve-rate slope", "cells", "new cells, last third",
                  "oscillation p", "oscillation index"], rows)


def comparison_tables(c: Comparison) -> list[Table]:
    tables = [complexity_table(c), coverage_table(c), solve_rate_table(c), trends_table(c)]
    return tables if c.seeds == (1, 1) else [*tables, seeds_table(c)]


def preamble(c: Comparison) -> list[str]:
    lines = []
    for role, infos in zip(c.roles, c.runs, strict=True):
        for r in infos:
            lines.append(f"{role} = {r.label} ({r.path}; mode {r.mode or '?'}; {r.steps} steps"
                         + ("; SYNTHETIC data, not a real run)" if r.synthetic else ")"))
    lines.append(f"seeds: {c.seeds[0]} {c.roles[0]}, {c.seeds[1]} {c.roles[1]} ("
                 + ("per-run intervals" if c.seeds == (1, 1) else "t tests across seeds") + ")")
    return [*lines, *(f"{name}: {text}" for name, text in METHOD.items()),
            f"a verdict needs >= {MIN_POINTS} finite points in each series it uses"]


def format_text(c: Comparison) -> str:
    """Plain-text report: the preamble, each table with aligned columns, the tally."""
    lines = [f"PopuLoRA signature: {c.roles[0]} vs {c.roles[1]}", *preamble(c), ""]
    for table in comparison_tables(c):
        widths = [max(len(row[i]) for row in (table.header, *table.rows)) for i in range(len(table.header))]
        lines.append(table.title)
        for row in (table.header, *table.rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        lines.append("")
    return "\n".join([*lines, verdict_tally(c)]) + "\n"


def format_markdown(c: Comparison) -> str:
    """The same report in Markdown."""
    lines = ["# PopuLoRA signature", "", *[f"- {line}" for line in preamble(c)], ""]
    for table in comparison_tables(c):
        lines += [f"## {table.title}", "", "| " + " | ".join(table.header) + " |",
                  "|" + "---|" * len(table.header)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in table.rows]
        lines.append("")
    return "\n".join([*lines, verdict_tally(c)]) + "\n"


# --- the figure ---------------------------------------------------------------------------------------------

COLORS = ("tab:blue", "black")  # the paper's: population blue, baseline black


def comparison_figure(c: Comparison, smooth: int = 1):
    """A 2 x 4 grid: the complexity axes and the composite, solve rate and validity with fitted lines (every
    seed), and cumulative cells of the valid programs against their number."""
    from matplotlib.figure import Figure

    from openrlhf_populora.analysis.plots import AXIS_LABELS

    fig = Figure(figsize=(16.0, 6.4), layout="constrained")
    axes = fig.subplots(2, 4, squeeze=False)
    panels = [(AXIS_LABELS[a], lambda s, a=a: s.axes[a], lambda r, a=a: r.axes[a]) for a in COMPLEXITY_AXES]
    panels += [("composite complexity", lambda s: s.composite, lambda r: r.composite),
               (SOLVE_RATE, lambda s: s.solve_rate, lambda r: r.solve_rate)]
    for ax, (title, values, trend) in zip(axes.flat, panels, strict=False):
        for i in range(2):
            for k, (series, stats) in enumerate(zip(c.series[i], c.stats[i], strict=True)):
                draw_series(ax, series.steps, values(series), trend(stats), COLORS[i], smooth,
                            f"{c.roles[i]} ({series.label})", SEED_MARKERS[k % len(SEED_MARKERS)])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    ax = axes.flat[-1]
    for i in range(2):
        for k, series in enumerate(c.series[i]):
            cells = series.program_cells[np.argsort(series.program_steps, kind="stable")]
            first = np.zeros(len(cells), dtype=bool)
            first[np.unique(cells, return_index=True)[1]] = True
            seen = np.cumsum(first)
            ax.plot(np.arange(1, len(cells) + 1), seen, color=COLORS[i], lw=1.4,
                    marker=SEED_MARKERS[k % len(SEED_MARKERS)], markevery=max(1, len(cells) // 8), markersize=3)
    ax.axvline(c.programs_compared, color="0.5", ls=":", lw=1)
    ax.set_title("cells occupied vs valid programs", fontsize=10)
    ax.set_xlabel(f"valid programs (dotted: {c.programs_compared}, compared)")
    ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="best")
    seeds = "" if c.seeds == (1, 1) else f" ({c.seeds[0]} vs {c.seeds[1]} seeds, one marker each)"
    fig.suptitle(f"Signature: {c.roles[0]} (blue) vs {c.roles[1]} (black){seeds}; dashed: OLS trend on raw values"
                 + (f"; lines smoothed over {smooth} steps" if smooth > 1 else ""))
    return fig


SEED_MARKERS = ("o", "s", "^", "D", "v", "P")  # one per run of an arm: seeds told apart in the figure


def draw_series(ax, xs: np.ndarray, ys: np.ndarray, trend: st.Trend, color: str, smooth: int,
                label: str | None, marker: str | None = None) -> None:
    from openrlhf_populora.analysis.plots import smooth as moving_average

    keep = np.isfinite(ys)
    if not keep.any():
        return
    ax.plot(xs[keep], moving_average(ys[keep], smooth), color=color, lw=1.4, label=label, marker=marker,
            markevery=max(1, int(keep.sum()) // 8), markersize=3)
    if trend.slope is not None:
        ax.plot(xs, trend.intercept + trend.slope * xs, color=color, lw=1.0, ls="--")
