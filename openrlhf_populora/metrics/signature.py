"""The paper's signature (Figs 3, 4, 9, 11), measured: a population run against a baseline run.

Claims, each with a verdict ``holds`` / ``does not hold`` / ``not enough steps``:

- complexity: each ``complexity/<axis>`` rises in the population (slope CI above 0) and falls in the
  baseline (slope CI below 0), one claim per run and axis;
- coverage: the population's ``coverage/overall`` ends higher than the baseline's, and the population
  still adds cells (``coverage/new_cells`` > 0) in the last third of its steps;
- solve rate: the population's ``train/solve_rate`` oscillates more than the baseline's, and the
  baseline's rises (slope CI above 0);
- validity and solve-rate trends of both runs are reported; the paper makes no claim on them beyond the above.

Statistics (pure numpy over the raw series; smoothing is for figures only):

- ``fit_trend``: ordinary least squares slope per step with a two-sided 95% t-based confidence interval
  (slope +- t(0.975, n - 2) * standard error; the residuals are treated as independent).
- ``oscillation``: a sinusoid is fitted jointly with a linear trend (least squares), i.e. the spectral
  peak of the residual off that trend, over periods of ``span / k`` steps for ``k`` = 1.5, 2, 2.5, ... up to
  ``n / 2`` (at least one and a half cycles within the run). The measure is the largest fitted amplitude, in
  the series' units, with its period. Its p-value comes from the same statistic on the residuals randomly
  permuted (``OSCILLATION_PERMUTATIONS`` times, seeded): small when the residual has temporal structure that
  noise would not give. A strongly curved trend (a fast rise that saturates) leaks into the slowest
  periods; that biases the baseline's measure up, i.e. against the paper's claim.
- A verdict needs ``MIN_POINTS`` steps with a finite value in every series it uses; below that, or when a
  series is missing, it is ``not enough steps``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from openrlhf_populora.metrics.keys import COMPLEXITY_AXES, complexity_key, coverage_key, train_key
from openrlhf_populora.metrics.runs import RunData

HOLDS = "holds"
DOES_NOT_HOLD = "does not hold"
NOT_ENOUGH = "not enough steps"
MIN_POINTS = 10
CI_LEVEL = 0.95
MIN_CYCLES = 1.5
OSCILLATION_PERMUTATIONS = 999
OSCILLATION_ALPHA = 0.05
SEED = 0
SOLVE_RATE = train_key("solve_rate")
VALIDITY = train_key("validity")
TREND_KEYS = (VALIDITY, SOLVE_RATE)
SLOPE_METHOD = f"ordinary least squares slope per step, {CI_LEVEL:.0%} t-based CI (Student t, n-2 df)"
OSCILLATION_METHOD = (f"largest amplitude of a sinusoid fitted jointly with a linear trend, periods span/k for "
                      f"k = {MIN_CYCLES}, {MIN_CYCLES + 0.5}, ... n/2; p-value from {OSCILLATION_PERMUTATIONS} "
                      f"permutations of the residual (seed {SEED})")


# --- statistics over arrays ----------------------------------------------------------------------------

def finite_pairs(xs: Sequence[float], ys: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The (x, y) pairs where both are finite, as float arrays."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    keep = np.isfinite(xs) & np.isfinite(ys)
    return xs[keep], ys[keep]


def ols_line(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float]:
    """``(slope, intercept)`` of the least-squares line through the points (``xs`` not all equal)."""
    xc = xs - xs.mean()
    slope = float(xc @ (ys - ys.mean()) / (xc @ xc))
    return slope, float(ys.mean() - slope * xs.mean())


def t_quantile(probability: float, df: int) -> float:
    from scipy.stats import t  # scipy comes with ribs; imported here because it is slow to import

    return float(t.ppf(probability, df))


@dataclass(frozen=True)
class Trend:
    """A least-squares trend: ``n`` finite points; the rest is None when ``n < 3``."""

    n: int
    slope: float | None = None
    lo: float | None = None
    hi: float | None = None
    intercept: float | None = None


def fit_trend(xs: Sequence[float], ys: Sequence[float], level: float = CI_LEVEL) -> Trend:
    """OLS slope of ``ys`` over ``xs`` with a two-sided t-based confidence interval at ``level``."""
    xs, ys = finite_pairs(xs, ys)
    n = len(xs)
    if n < 3 or np.ptp(xs) == 0:
        return Trend(n)
    slope, intercept = ols_line(xs, ys)
    residual = ys - (intercept + slope * xs)
    xc = xs - xs.mean()
    stderr = math.sqrt(float(residual @ residual) / (n - 2) / float(xc @ xc))
    half = t_quantile(0.5 + level / 2, n - 2) * stderr
    return Trend(n, slope, slope - half, slope + half, intercept)


@dataclass(frozen=True)
class Oscillation:
    """The dominant oscillation around a linear trend: ``n`` finite points; the rest is None when too few."""

    n: int
    amplitude: float | None = None
    period: float | None = None
    p_value: float | None = None


def oscillation_periods(xs: np.ndarray) -> np.ndarray:
    """Candidate periods in steps: ``span / k`` for ``k = MIN_CYCLES, +0.5, ... n/2`` (span = n spacings)."""
    n = len(xs)
    span = float(np.ptp(xs)) * n / (n - 1)
    cycles = np.arange(MIN_CYCLES, n / 2 + 1e-9, 0.5)
    return span / cycles


def sinusoid_amplitudes(xs: np.ndarray, columns: np.ndarray, period: float) -> np.ndarray:
    """Amplitude of a sinusoid of ``period`` fitted jointly with a line to each column of ``columns``."""
    xc = xs - xs.mean()
    angle = 2 * np.pi * xc / period
    design = np.column_stack([np.ones_like(xc), xc, np.cos(angle), np.sin(angle)])
    coef = np.linalg.pinv(design)[2:] @ columns
    return np.hypot(coef[0], coef[1])


def oscillation(xs: Sequence[float], ys: Sequence[float], permutations: int = OSCILLATION_PERMUTATIONS,
                seed: int = SEED) -> Oscillation:
    """The largest sinusoid amplitude around a linear trend, its period and a permutation p-value."""
    xs, ys = finite_pairs(xs, ys)
    n = len(xs)
    periods = oscillation_periods(xs) if n >= 6 and np.ptp(xs) > 0 else np.empty(0)
    if not len(periods):
        return Oscillation(n)
    slope, intercept = ols_line(xs, ys)
    residual = ys - (intercept + slope * xs)
    shuffled = np.random.default_rng(seed).permuted(np.tile(residual, (permutations, 1)), axis=1)
    columns = np.column_stack([residual, shuffled.T])
    amplitudes = np.stack([sinusoid_amplitudes(xs, columns, p) for p in periods])  # periods x columns
    best = amplitudes.max(axis=0)
    tolerance = 1e-12 * max(1.0, float(best[0]))
    p_value = (1 + int(np.sum(best[1:] >= best[0] - tolerance))) / (permutations + 1)
    return Oscillation(n, float(best[0]), float(periods[int(np.argmax(amplitudes[:, 0]))]), p_value)


def steps_adding(values: Sequence[float]) -> int:
    """How many of ``values`` (new cells per step) are above 0."""
    return int(np.sum(np.asarray(values, dtype=float) > 0))


def last_third(values: Sequence[float]) -> np.ndarray:
    """The last ``ceil(n / 3)`` values."""
    values = np.asarray(values, dtype=float)
    return values[len(values) - math.ceil(len(values) / 3):]


@dataclass(frozen=True)
class CoverageSummary:
    """Coverage at the end of a run and how many of its steps added new CVT cells."""

    points: int  # finite coverage/overall values
    overall_end: float | None
    distinct_end: float | None
    new_cell_points: int  # finite coverage/new_cells values
    steps_adding: int
    last_third_points: int
    last_third_adding: int


# --- verdicts ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    claim: str
    verdict: str
    detail: str


def _num(value: float | None, fmt: str = "+.3g") -> str:
    return "–" if value is None else format(value, fmt)


def _too_few(*counts: int) -> str | None:
    """The reason a verdict cannot be given, or None when every series has ``MIN_POINTS`` values."""
    low = min(counts)
    return None if low >= MIN_POINTS else f"{low} finite points < {MIN_POINTS}"


def trend_verdict(claim: str, trend: Trend, direction: int) -> Verdict:
    """``direction`` +1: the CI lies above 0; -1: below 0."""
    reason = _too_few(trend.n)
    if reason:
        return Verdict(claim, NOT_ENOUGH, reason)
    ci = f"slope {_num(trend.slope)}, CI [{_num(trend.lo)}, {_num(trend.hi)}]"
    ok = trend.lo > 0 if direction > 0 else trend.hi < 0
    where = "above" if direction > 0 else "below"
    return Verdict(claim, HOLDS if ok else DOES_NOT_HOLD, f"{ci} {'' if ok else 'not '}{where} 0")


def greater_verdict(claim: str, first: float | None, second: float | None, counts: tuple[int, int]) -> Verdict:
    reason = _too_few(*counts) or ("a value is missing" if first is None or second is None else None)
    if reason:
        return Verdict(claim, NOT_ENOUGH, reason)
    ok = first > second
    return Verdict(claim, HOLDS if ok else DOES_NOT_HOLD, f"{first:.4g} {'>' if ok else '<='} {second:.4g}")


def oscillation_verdict(claim: str, first: Oscillation, second: Oscillation) -> Verdict:
    """Holds when the first run's amplitude is larger and its own permutation p-value is below alpha."""
    reason = _too_few(first.n, second.n)
    if reason:
        return Verdict(claim, NOT_ENOUGH, reason)
    larger = first.amplitude > second.amplitude
    significant = first.p_value < OSCILLATION_ALPHA
    detail = (f"amplitude {first.amplitude:.3g} (p={first.p_value:.3g}) {'>' if larger else '<='} "
              f"{second.amplitude:.3g} (p={second.p_value:.3g})")
    if larger and not significant:
        detail += f"; p >= {OSCILLATION_ALPHA}: not distinguishable from noise"
    return Verdict(claim, HOLDS if larger and significant else DOES_NOT_HOLD, detail)


def still_adding_verdict(claim: str, coverage: CoverageSummary) -> Verdict:
    reason = _too_few(coverage.new_cell_points)
    if reason:
        return Verdict(claim, NOT_ENOUGH, reason)
    ok = coverage.last_third_adding > 0
    return Verdict(claim, HOLDS if ok else DOES_NOT_HOLD,
                   f"{coverage.last_third_adding} of the last {coverage.last_third_points} steps added cells")


# --- one run, then the comparison ----------------------------------------------------------------------

def coverage_summary(run: RunData) -> CoverageSummary:
    _, overall = run.series(coverage_key("overall"))
    _, distinct = run.series(coverage_key("distinct_programs"))
    _, new = run.series(coverage_key("new_cells"))
    tail = last_third(new)
    return CoverageSummary(len(overall), float(overall[-1]) if len(overall) else None,
                           float(distinct[-1]) if len(distinct) else None, len(new), steps_adding(new),
                           len(tail), steps_adding(tail))


@dataclass(frozen=True)
class RunInfo:
    label: str
    path: str
    mode: str | None
    steps: int
    first_step: int | None
    last_step: int | None
    synthetic: bool = False  # written by metrics.synthetic: not a real run


def run_info(run: RunData) -> RunInfo:
    steps = run.steps
    return RunInfo(run.label, str(run.path), run.mode, len(steps), steps[0] if steps else None,
                   steps[-1] if steps else None, run.synthetic)


@dataclass
class Comparison:
    """Every number and verdict; index 0 of each pair is the population (or A), 1 the baseline (or B)."""

    roles: tuple[str, str]
    runs: tuple[RunInfo, RunInfo]
    complexity: dict[str, tuple[Trend, Trend]]
    coverage: tuple[CoverageSummary, CoverageSummary]
    oscillation: tuple[Oscillation, Oscillation]
    trends: dict[str, tuple[Trend, Trend]]
    verdicts: dict[str, Verdict] = field(default_factory=dict)

    def pair(self, items: Sequence[Any]) -> dict[str, Any]:
        """``{role: fields}`` for a pair of dataclasses."""
        return {role: asdict(item) for role, item in zip(self.roles, items, strict=True)}

    def to_dict(self) -> dict[str, Any]:
        pair = self.pair
        return {
            "method": {"slope": SLOPE_METHOD, "ci_level": CI_LEVEL, "oscillation": OSCILLATION_METHOD,
                       "oscillation_alpha": OSCILLATION_ALPHA, "min_points": MIN_POINTS},
            "roles": {"population": self.roles[0], "baseline": self.roles[1]},
            "runs": pair(self.runs),
            "complexity": {axis: pair(trends) for axis, trends in self.complexity.items()},
            "coverage": pair(self.coverage),
            "solve_rate_oscillation": pair(self.oscillation),
            "trends": {key: pair(trends) for key, trends in self.trends.items()},
            "verdicts": {name: asdict(v) for name, v in self.verdicts.items()},
        }


def series_trend(run: RunData, key: str) -> Trend:
    return fit_trend(*run.series(key))


def signature_verdicts(comparison: Comparison) -> dict[str, Verdict]:
    """The paper's claims on a comparison, keyed by a stable id (role names only in the claim text)."""
    first, second = comparison.roles
    out = {}
    for axis, (a, b) in comparison.complexity.items():
        out[f"complexity/{axis}/population_rises"] = trend_verdict(f"{first} {axis} rises", a, +1)
        out[f"complexity/{axis}/baseline_falls"] = trend_verdict(f"{second} {axis} falls", b, -1)
    cov_a, cov_b = comparison.coverage
    out["coverage/population_ends_higher"] = greater_verdict(
        f"{first} coverage at the end > {second}'s", cov_a.overall_end, cov_b.overall_end, (cov_a.points, cov_b.points))
    out["coverage/population_still_adding"] = still_adding_verdict(
        f"{first} still adds cells in the last third", cov_a)
    out["solve_rate/population_oscillates_more"] = oscillation_verdict(
        f"{first} solve rate oscillates more than {second}'s", *comparison.oscillation)
    out["solve_rate/baseline_rises"] = trend_verdict(f"{second} solve rate rises",
                                                     comparison.trends[SOLVE_RATE][1], +1)
    return out


def compare_runs(first: RunData, second: RunData, roles: tuple[str, str] = ("population", "baseline"),
                 permutations: int = OSCILLATION_PERMUTATIONS, seed: int = SEED) -> Comparison:
    """Every statistic and verdict of the signature, ``first`` in the population's place."""
    runs = (first, second)
    comparison = Comparison(
        roles=roles,
        runs=(run_info(first), run_info(second)),
        complexity={axis: tuple(series_trend(r, complexity_key(axis)) for r in runs) for axis in COMPLEXITY_AXES},
        coverage=(coverage_summary(first), coverage_summary(second)),
        oscillation=tuple(oscillation(*r.series(SOLVE_RATE), permutations=permutations, seed=seed) for r in runs),
        trends={key: tuple(series_trend(r, key) for r in runs) for key in TREND_KEYS},
    )
    comparison.verdicts = signature_verdicts(comparison)
    return comparison


# --- tables: the same rows for plain text and Markdown -------------------------------------------------

@dataclass(frozen=True)
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]


def trend_cell(trend: Trend) -> str:
    if trend.slope is None:
        return f"– (n={trend.n})"
    return f"{trend.slope:+.3g} [{trend.lo:+.3g}, {trend.hi:+.3g}] n={trend.n}"


def _claimed(verdict: Verdict) -> str:
    return f"{verdict.claim}: {verdict.verdict}"


def complexity_table(c: Comparison) -> Table:
    first, second = c.roles
    rows = [[axis, trend_cell(a), trend_cell(b), c.verdicts[f"complexity/{axis}/population_rises"].verdict,
             c.verdicts[f"complexity/{axis}/baseline_falls"].verdict] for axis, (a, b) in c.complexity.items()]
    return Table("1. Program complexity: slope per step [95% CI] of complexity/AXIS",
                 ["axis", first, second, f"{first} rises", f"{second} falls"], rows)


def coverage_table(c: Comparison) -> Table:
    a, b = c.coverage
    v = c.verdicts
    rows = [
        ["coverage/overall at the end", _num(a.overall_end, ".4g"), _num(b.overall_end, ".4g"),
         _claimed(v["coverage/population_ends_higher"])],
        ["coverage/distinct_programs at the end", _num(a.distinct_end, ".4g"), _num(b.distinct_end, ".4g"), ""],
        ["steps with coverage/new_cells > 0", f"{a.steps_adding}/{a.new_cell_points}",
         f"{b.steps_adding}/{b.new_cell_points}", ""],
        ["... of them in the last third", f"{a.last_third_adding}/{a.last_third_points}",
         f"{b.last_third_adding}/{b.last_third_points}", _claimed(v["coverage/population_still_adding"])],
    ]
    return Table("2. Coverage", ["quantity", *c.roles, "verdict"], rows)


def oscillation_cell(o: Oscillation) -> str:
    if o.amplitude is None:
        return f"– (n={o.n})"
    return f"{o.amplitude:.3g} (period {o.period:.3g}, p={o.p_value:.3g}) n={o.n}"


def solve_rate_table(c: Comparison) -> Table:
    a, b = c.trends[SOLVE_RATE]
    rows = [["oscillation amplitude (period in steps, p)", *map(oscillation_cell, c.oscillation),
             _claimed(c.verdicts["solve_rate/population_oscillates_more"])],
            ["slope per step [95% CI]", trend_cell(a), trend_cell(b), _claimed(c.verdicts["solve_rate/baseline_rises"])]]
    return Table(f"3. Student solve rate ({SOLVE_RATE})", ["quantity", *c.roles, "verdict"], rows)


def trends_table(c: Comparison) -> Table:
    rows = [[key, trend_cell(a), trend_cell(b)] for key, (a, b) in c.trends.items()]
    return Table("4. Trends: slope per step [95% CI] (reported; verdicts above)", ["series", *c.roles], rows)


def verdict_tally(c: Comparison) -> str:
    counts = {v: sum(x.verdict == v for x in c.verdicts.values()) for v in (HOLDS, DOES_NOT_HOLD, NOT_ENOUGH)}
    return f"{len(c.verdicts)} claims: " + ", ".join(f"{n} {v}" for v, n in counts.items())


def comparison_tables(c: Comparison) -> list[Table]:
    return [complexity_table(c), coverage_table(c), solve_rate_table(c), trends_table(c)]


def preamble(c: Comparison) -> list[str]:
    runs = [f"{role} = {r.label} ({r.path}; mode {r.mode or '?'}; {r.steps} steps"
            + ("; SYNTHETIC data, not a real run)" if r.synthetic else ")")
            for role, r in zip(c.roles, c.runs, strict=True)]
    return [*runs, f"slopes: {SLOPE_METHOD}", f"oscillation: {OSCILLATION_METHOD}",
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


# --- the figure ----------------------------------------------------------------------------------------

COLORS = ("tab:blue", "black")  # the paper's: population blue, baseline black


def comparison_figure(first: RunData, second: RunData, c: Comparison, smooth: int = 1):
    """A 2 x 4 grid: the complexity axes, solve rate and validity with fitted lines, and coverage."""
    from matplotlib.figure import Figure

    from openrlhf_populora.metrics.plots import AXIS_LABELS

    fig = Figure(figsize=(16.0, 6.4), layout="constrained")
    axes = fig.subplots(2, 4, squeeze=False)
    panels = [(complexity_key(a), AXIS_LABELS[a], c.complexity[a]) for a in COMPLEXITY_AXES]
    panels += [(key, key, c.trends[key]) for key in (SOLVE_RATE, VALIDITY)]
    panels.append((coverage_key("overall"), "coverage/overall", None))
    for ax, (key, title, trends) in zip(axes.flat, panels, strict=True):
        for i, run in enumerate((first, second)):
            draw_series(ax, run, key, f"{c.roles[i]} ({run.label})", COLORS[i], smooth,
                        trends[i] if trends else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"Signature: {c.roles[0]} (blue) vs {c.roles[1]} (black); dashed: OLS trend on raw values"
                 + (f"; lines smoothed over {smooth} steps" if smooth > 1 else ""))
    return fig


def draw_series(ax, run: RunData, key: str, label: str, color: str, smooth: int, trend: Trend | None) -> None:
    from openrlhf_populora.metrics.plots import smooth as moving_average

    xs, ys = run.series(key)
    if not len(xs):
        return
    ax.plot(xs, moving_average(ys, smooth), color=color, lw=1.6, label=label)
    if trend is not None and trend.slope is not None:
        ax.plot(xs, trend.intercept + trend.slope * xs, color=color, lw=1.0, ls="--")
