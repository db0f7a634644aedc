"""The report's figures, one function each; they return a matplotlib ``Figure`` or raise ``Skip(reason)``.

Conventions (the paper's): the baseline is black, population runs are coloured; a population is drawn as
its mean (bold) with the per-member spread (min..max over the members alive at each step, shaded).
``smooth`` is a trailing moving-average window in steps (1 = raw). Figures are built with the
object-oriented API (no pyplot state, Agg only).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from openrlhf_populora.analysis.runs import RunData, Series
from openrlhf_populora.metrics.complexity import program_complexity
from openrlhf_populora.metrics.keys import (
    ALL,
    COMPLEXITY_AXES,
    MEMBER_COVERAGE,
    complexity_key,
    coverage_key,
    learning_key,
    matchup_key,
    train_key,
)

PALETTE = ("tab:blue", "tab:red", "tab:green", "tab:purple", "tab:brown", "tab:cyan", "tab:olive", "tab:pink")
ROLE_COLORS = {"teacher": "tab:orange", "student": "tab:blue"}
AXIS_LABELS = {
    "ast_depth": "AST depth", "ast_nodes": "AST nodes", "cyclomatic": "cyclomatic complexity",
    "loc": "lines of code", "halstead_volume": "Halstead volume",
}


def natural_key(name: str) -> list:
    """Sort ``t2`` before ``t10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class Skip(Exception):
    """This figure cannot be drawn from the data at hand (the message says why)."""


SYNTHETIC_MARK = "SYNTHETIC DATA: not a real run"


def mark_synthetic(fig: Figure) -> None:
    """Stamp a figure drawn from synthetic runs, across its middle, so it cannot pass for a measurement."""
    fig.text(0.5, 0.5, SYNTHETIC_MARK, ha="center", va="center", rotation=20, fontsize=22, color="red",
             alpha=0.35, weight="bold", zorder=1000)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average over ``window`` points (fewer at the start); ``window <= 1`` is the identity."""
    values = np.asarray(values, dtype=float)
    if window <= 1 or len(values) == 0:
        return values
    csum = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def run_colors(runs: Sequence[RunData]) -> list[str]:
    colors, k = [], 0
    for run in runs:
        if run.is_baseline:
            colors.append("black")
        else:
            colors.append(PALETTE[k % len(PALETTE)])
            k += 1
    return colors


def _figure(rows: int, cols: int, width: float = 4.2, height: float = 3.2) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(max(width * cols, 5.0), height * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).reshape(rows, cols)
    return fig, axes


def _no_data(ax, what: str = "no data") -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _mean_of(members: dict[str, Series]) -> tuple[Series, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """Mean over members at each step and the (steps, min, max) band (None with fewer than two members)."""
    steps = np.unique(np.concatenate([s[0] for s in members.values()]))
    grid = np.full((len(members), len(steps)), np.nan)
    for row, (xs, ys) in enumerate(members.values()):
        grid[row, np.searchsorted(steps, xs)] = ys
    mean = np.nanmean(grid, axis=0)
    band = (steps, np.nanmin(grid, axis=0), np.nanmax(grid, axis=0)) if len(members) > 1 else None
    return (steps, mean), band


def population_series(run: RunData, key: str | None, roles: Sequence[str], metric: str,
                      task_type: str = ALL) -> tuple[Series | None, tuple | None]:
    """A run's mean series for ``key`` (falling back to the members' mean) and its per-member band."""
    members: dict[str, Series] = {}
    for role in roles:
        for member, series in run.member_series(role, metric, task_type).items():
            members[f"{role}:{member}"] = series
    mean, band = _mean_of(members) if members else (None, None)
    if key is not None and run.has(key):
        mean = run.series(key)
    return mean, band


def metric_panel(ax, runs: Sequence[RunData], colors: Sequence[str], key: str | None, roles: Sequence[str],
                 metric: str, window: int, task_type: str = ALL, scale: float = 1.0) -> bool:
    """Draw every run's mean (line) and member spread (shade) on ``ax``; False when nothing was drawn."""
    drawn = False
    for run, color in zip(runs, colors, strict=True):
        mean, band = population_series(run, key, roles, metric, task_type)
        if band is not None:
            steps, lo, hi = band
            ax.fill_between(steps, smooth(lo, window) * scale, smooth(hi, window) * scale, color=color,
                            alpha=0.18, linewidth=0)
        if mean is not None and len(mean[0]):
            ax.plot(mean[0], smooth(mean[1], window) * scale, color=color, lw=1.8, label=run.label)
            drawn = True
    return drawn


def _finish(fig: Figure, axes: np.ndarray, drawn: list[bool], what: str, runs: Sequence[RunData]) -> Figure:
    if not any(drawn):
        raise Skip(f"no {what} in any run")
    for ax, ok in zip(axes.flat, drawn, strict=True):
        if not ok:
            _no_data(ax)
    first = next(ax for ax, ok in zip(axes.flat, drawn, strict=True) if ok)
    if len(runs) > 1 or any(not r.is_baseline for r in runs):
        first.legend(fontsize=8, loc="best")
    return fig


def _panels(runs: Sequence[RunData], window: int, specs: list[tuple], title: str, what: str,
            cols: int | None = None) -> Figure:
    """One panel per spec ``(key, roles, metric, task_type, ylabel, ylim, scale)``."""
    colors = run_colors(runs)
    cols = cols or len(specs)
    rows = -(-len(specs) // cols)
    fig, axes = _figure(rows, cols)
    for extra in axes.flat[len(specs):]:  # a grid with a spare cell: drop it
        fig.delaxes(extra)
    axes = np.asarray(axes.flat[: len(specs)])
    drawn = []
    for ax, (key, roles, metric, task_type, ylabel, ylim, scale) in zip(axes, specs, strict=True):
        ok = metric_panel(ax, runs, colors, key, roles, metric, window, task_type, scale)
        drawn.append(ok)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        if ylim is not None:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _finish(fig, axes, drawn, what, runs)


def training_dynamics(runs: Sequence[RunData], window: int = 1) -> Figure:
    """Paper Fig. 3: solver solve/format rate, teacher difficulty/validity."""
    specs = [
        (train_key("solve_rate"), ["student"], "solve_rate", ALL, "student solve rate", (0, 1), 1.0),
        (train_key("format_rate"), ["student"], "format_rate", ALL, "student format rate", (0, 1), 1.0),
        (train_key("difficulty"), ["teacher"], "difficulty", ALL, "problem difficulty (1 - solve rate)", (0, 1), 1.0),
        (train_key("validity"), ["teacher"], "validity", ALL, "teacher validity rate", (0, 1), 1.0),
    ]
    return _panels(runs, window, specs, "Training dynamics: mean with per-member spread", "solve/validity keys")


def complexity(runs: Sequence[RunData], window: int = 1) -> Figure:
    """Paper Fig. 4: complexity of the valid proposals along every axis."""
    specs = [(complexity_key(a), ["teacher"], a, ALL, AXIS_LABELS[a], None, 1.0) for a in COMPLEXITY_AXES]
    return _panels(runs, window, specs, "Program complexity of valid proposals", "complexity keys", cols=3)


def coverage(runs: Sequence[RunData], window: int = 1) -> Figure:
    """Paper Fig. 9: CVT coverage (%) with per-teacher coverage (thin), distinct programs, diversity."""
    colors = run_colors(runs)
    fig, axes = _figure(1, 3)
    drawn = [False, False, False]
    for run, color in zip(runs, colors, strict=True):
        xs, ys = run.series(coverage_key("overall"))
        if len(xs):
            axes[0, 0].plot(xs, smooth(ys, window) * 100, color=color, lw=1.8, label=run.label)
            drawn[0] = True
        for mx, my in run.member_series("teacher", MEMBER_COVERAGE).values():
            axes[0, 0].plot(mx, smooth(my, window) * 100, color=color, lw=0.7, alpha=0.45, ls="--")
        for i, name in ((1, "distinct_programs"), (2, "diversity")):
            xs, ys = run.series(coverage_key(name))
            if len(xs):
                axes[0, i].plot(xs, smooth(ys, window), color=color, lw=1.8, label=run.label)
                drawn[i] = True
    for ax, ylabel in zip(axes.flat, ("coverage (% of CVT cells)", "distinct programs",
                                      "diversity (effective cells)"), strict=True):
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.suptitle("Problem-space coverage (dashed: per teacher)")
    return _finish(fig, axes, drawn, "coverage keys", runs)


def task_types(runs: Sequence[RunData], window: int = 1) -> Figure:
    """Paper Fig. 10: solve rate and validity per task type (one row per type)."""
    found = {t for run in runs for t in run.task_types()}
    types = [t for t in AZR_TASK_ORDER if t in found] + sorted(found - set(AZR_TASK_ORDER))
    if not types:
        raise Skip("no per-task-type keys in any run")
    specs = []
    for tt in types:
        specs.append((train_key("solve_rate", tt), ["student"], "solve_rate", tt, f"{tt}: solve rate", (0, 1), 1.0))
        specs.append((train_key("validity", tt), ["teacher"], "validity", tt, f"{tt}: validity", (0, 1), 1.0))
    return _panels(runs, window, specs, "Per task type", "per-task-type keys", cols=2)


def response_length(runs: Sequence[RunData], window: int = 1) -> Figure:
    """Paper Fig. 19: response length of students (answers) and teachers (proposals)."""
    specs = [
        (train_key("student_response_length"), ["student"], "student_response_length", ALL,
         "student response length (tokens)", None, 1.0),
        (train_key("teacher_response_length"), ["teacher"], "teacher_response_length", ALL,
         "teacher response length (tokens)", None, 1.0),
    ]
    return _panels(runs, window, specs, "Response length", "response-length keys")


def diagnostics(runs: Sequence[RunData], window: int = 1) -> Figure:
    """Paper Fig. 18: training diagnostics (mean over adapters, spread over members of both roles)."""
    names = {"policy_loss": "policy loss", "grad_norm": "gradient norm", "entropy": "entropy", "kl": "KL",
             "lr": "learning rate"}
    specs = [(train_key(m), ["teacher", "student"], m, ALL, label, None, 1.0) for m, label in names.items()]
    return _panels(runs, window, specs, "Training diagnostics", "training diagnostics", cols=3)


def learning(runs: Sequence[RunData], window: int = 1) -> Figure:
    """Whether the adapters move (metrics/learning.py), beside the format rates that change first: each
    member's update size and probe KL from the base per role, and the students' format rate and the teachers'
    validity per task type."""
    found = {t for run in runs for t in run.task_types()}
    types = [t for t in AZR_TASK_ORDER if t in found] + sorted(found - set(AZR_TASK_ORDER))
    specs = [
        (learning_key("update_size"), ["teacher", "student"], "update_size", ALL, "update size ||sBA|| / ||W||",
         None, 1.0),
        (None, ["teacher"], "probe_kl", ALL, "teacher probe KL from base (nats/token)", None, 1.0),
        (None, ["student"], "probe_kl", ALL, "student probe KL from base (nats/token)", None, 1.0),
    ]
    for tt in types:
        specs.append((train_key("format_rate", tt), ["student"], "format_rate", tt, f"{tt}: student format rate",
                      (0, 1), 1.0))
        specs.append((train_key("validity", tt), ["teacher"], "validity", tt, f"{tt}: teacher validity", (0, 1), 1.0))
    return _panels(runs, window, specs, "Learning: distance from the base, and the format rates", "learning keys",
                   cols=3)


AZR_TASK_ORDER = ("code_o", "code_i", "code_f")
PHASE_GROUPS = ("generate", "execute", "train", "evolve")


def timing(runs: Sequence[RunData], window: int = 1) -> Figure:
    """Wall-clock seconds per phase (stacked), one panel per run with ``time/*`` keys."""
    timed = []
    for run in runs:
        phases = sorted(k.split("/", 1)[1] for k in run.keys() if k.startswith("time/") and k != "time/step")
        if phases or run.has("time/step"):
            timed.append((run, phases))
    if not timed:
        raise Skip("no time/* keys in any run")
    fig, axes = _figure(1, len(timed), width=5.0)
    for ax, (run, phases) in zip(axes.flat, timed, strict=True):
        steps = np.asarray(run.steps, dtype=float)
        groups: dict[str, np.ndarray] = {}
        for phase in phases:
            group = next((g for g in PHASE_GROUPS if phase.startswith(g)), "other")
            values = [run.records[s].get(f"time/{phase}") for s in run.steps]
            numeric = np.array([v if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0
                                for v in values], dtype=float)
            groups[group] = groups.get(group, np.zeros(len(steps))) + np.nan_to_num(numeric)
        if groups:
            names = [g for g in (*PHASE_GROUPS, "other") if g in groups]
            ax.stackplot(steps, *[smooth(groups[g], window) for g in names], labels=names, alpha=0.8)
            ax.legend(fontsize=8, loc="upper left")
        else:
            xs, ys = run.series("time/step")
            ax.plot(xs, smooth(ys, window), color="black", label="step")
        ax.set_title(run.label)
        ax.set_xlabel("training step")
        ax.set_ylabel("seconds per step")
        ax.grid(alpha=0.3)
    fig.suptitle("Wall-clock per phase")
    return fig


def ratings(run: RunData, window: int = 1) -> Figure:
    """Paper Fig. 5: rating mu per adapter (thin) with role mean (bold); matchup outcomes (lead shaded)."""
    by_role = {role: run.rating_series(role, "mu") for role in ("teacher", "student")}
    if not any(by_role.values()):
        raise Skip(f"{run.label}: no rating/* keys (a single-agent run has no ratings)")
    fig, axes = _figure(1, 3)
    for ax, role in zip(axes.flat[:2], ("teacher", "student"), strict=True):
        members = {m: s for m, s in by_role[role].items() if len(s[0])}
        if not members:
            _no_data(ax)
            continue
        for member, (xs, ys) in members.items():
            ax.plot(xs, smooth(ys, window), color=ROLE_COLORS[role], lw=0.8, alpha=0.4)
            ax.annotate(member, (xs[-1], smooth(ys, window)[-1]), fontsize=7, color="dimgrey")
        (mx, my), _ = _mean_of(members)
        ax.plot(mx, smooth(my, window), color=ROLE_COLORS[role], lw=2.4, label=f"{role} mean")
        ax.set_title(f"{role}s: rating μ per adapter")
        ax.set_xlabel("training step")
        ax.set_ylabel("rating μ")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes.flat[2]
    sx, sy = run.series(matchup_key("student_win_rate"))
    tx, ty = run.series(matchup_key("teacher_win_rate"))
    if len(sx) and len(tx):
        ax.plot(sx, smooth(sy, window), color=ROLE_COLORS["student"], lw=1.8, label="student perspective")
        ax.plot(tx, smooth(ty, window), color=ROLE_COLORS["teacher"], lw=1.8, label="teacher perspective")
        common, si, ti = np.intersect1d(sx, tx, return_indices=True)
        s_s, t_s = smooth(sy, window)[si], smooth(ty, window)[ti]
        ax.fill_between(common, s_s, t_s, where=s_s >= t_s, color=ROLE_COLORS["student"], alpha=0.15)
        ax.fill_between(common, s_s, t_s, where=s_s < t_s, color=ROLE_COLORS["teacher"], alpha=0.15)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax.set_title("matchup outcomes: who leads")
        ax.set_xlabel("training step")
        ax.set_ylabel("fraction of matchups won")
        ax.grid(alpha=0.3)
    else:
        _no_data(ax, "no matchup keys")
    fig.suptitle(f"{run.label}: ratings and arms race")
    return fig


def solve_matrix(run: RunData, snapshots: int = 5) -> Figure:
    """Paper Fig. 12: teacher x student solve-rate matrices at evenly spaced steps (+ one colour bar)."""
    steps = run.matrix_steps()
    if not steps:
        raise Skip(f"{run.label}: no matrix/* keys")
    picks = sorted({steps[int(round(i))] for i in np.linspace(0, len(steps) - 1, min(snapshots, len(steps)))})
    fig, axes = _figure(1, len(picks), width=3.6, height=3.4)
    image = None
    for ax, step in zip(axes.flat, picks, strict=True):
        cells = run.matrix_at(step)
        teachers = sorted({t for t, _ in cells}, key=natural_key)
        students = sorted({s for _, s in cells}, key=natural_key)
        grid = np.full((len(teachers), len(students)), np.nan)
        for (t, s), value in cells.items():
            grid[teachers.index(t), students.index(s)] = value
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(students)), students, fontsize=7, rotation=45)
        ax.set_yticks(range(len(teachers)), teachers, fontsize=7)
        if grid.size <= 100:
            for (i, j), value in np.ndenumerate(grid):
                if np.isfinite(value):
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6,
                            color="white" if value < 0.5 else "black")
        ax.set_title(f"step {step}")
        ax.set_xlabel("student")
        ax.set_ylabel("teacher")
    fig.colorbar(image, ax=list(axes.flat), label="solve rate", shrink=0.9)
    fig.suptitle(f"{run.label}: student solve rate on each teacher's problems")
    return fig


def lineage(run: RunData) -> Figure:
    """Evolution lineage: each member's lifetime as a bar; arrows from parents to children (operator)."""
    spans = run.member_lifetimes()
    events = run.evolution_events()
    for event in events:  # members that only appear in events (no metrics yet) still get a row
        step = int(event["step"])
        role = event.get("role") if event.get("role") in ROLE_COLORS else "student"
        if isinstance(event.get("child"), str) and event["child"] not in spans:
            spans[event["child"]] = (role, step, step)
    if len(spans) < 2 and not events:
        raise Skip(f"{run.label}: no members or evolution events to draw")
    order = sorted(spans, key=lambda m: (spans[m][0] != "teacher", spans[m][1], natural_key(m)))
    row = {m: i for i, m in enumerate(order)}
    fig, axes = _figure(1, 1, width=9.0, height=max(3.0, 0.32 * len(order) + 1.2))
    ax = axes[0, 0]
    for member in order:
        role, first, last = spans[member]
        ax.hlines(row[member], first, last, color=ROLE_COLORS.get(role, "grey"), lw=6, alpha=0.75)
    for event in events:
        child, step = event.get("child"), int(event["step"])
        parents = event.get("parents") or []
        operator = str(event.get("operator", "?"))
        color = "tab:purple" if len(parents) > 1 else "tab:green"
        for parent in parents:
            if parent in row and child in row:
                ax.annotate("", xy=(step, row[child]), xytext=(step, row[parent]),
                            arrowprops={"arrowstyle": "->", "color": color, "lw": 1.0})
                ax.plot([step], [row[parent]], marker="o", color=color, ms=4)
        if child in row:
            energy = event.get("truncation_energy")
            note = operator + (f" ({energy:.2f})" if isinstance(energy, (int, float)) else "")
            ax.text(step, row[child] - 0.25, " " + note, fontsize=7, color=color, va="bottom")
        replaced = event.get("replaced")
        if replaced in row:
            ax.plot([spans[replaced][2]], [row[replaced]], marker="x", color="black", ms=6)
    ax.set_yticks(range(len(order)), order, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("training step")
    ax.set_ylabel("member")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=ROLE_COLORS["teacher"], lw=6, label="teacher"),
               Line2D([], [], color=ROLE_COLORS["student"], lw=6, label="student"),
               Line2D([], [], color="tab:green", label="mutation (1 parent)"),
               Line2D([], [], color="tab:purple", label="crossover (2 parents)"),
               Line2D([], [], color="black", marker="x", ls="", label="replaced")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, axis="x")
    ax.set_title(f"{run.label}: evolution lineage (operator, truncation energy)")
    return fig


# --- Figure 8: example problems -----------------------------------------------------------------------

MAX_SNIPPET_LINES = 14


def _valid_by_step(run: RunData) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for record in run.problems():
        code = record.get("program", record.get("code"))
        if record.get("valid") is True and isinstance(code, str) and code.strip():
            out.setdefault(record["step"], []).append(record)
    return out


def median_problem(records: list[dict]) -> tuple[dict, dict]:
    """The median-complexity problem (by AST nodes, ties by text) among those with at most
    ``MAX_SNIPPET_LINES`` lines of code (all of them when none is that short), with its complexity."""
    scored = []
    for record in records:
        code = record.get("program", record.get("code"))
        c = record.get("complexity") if isinstance(record.get("complexity"), dict) else program_complexity(code)
        if isinstance(c.get("ast_nodes"), (int, float)):
            scored.append((c["ast_nodes"], code, record, c))
    if not scored:
        raise ValueError("no parsable problem")
    short = [s for s in scored if isinstance(s[3].get("loc"), (int, float)) and s[3]["loc"] <= MAX_SNIPPET_LINES]
    pool = sorted(short or scored, key=lambda s: (s[0], s[1]))
    _, _, record, c = pool[len(pool) // 2]
    return record, c


def _snippet(record: dict, c: dict, width: int = 64) -> str:
    code = record.get("program", record.get("code"))
    lines = code.rstrip().splitlines()
    if len(lines) > MAX_SNIPPET_LINES + 4:
        lines = lines[:MAX_SNIPPET_LINES + 3] + ["..."]
    lines = [ln if len(ln) <= width else ln[: width - 3] + "..." for ln in lines]
    io = []
    for name in ("inputs", "outputs"):
        value = record.get(name)
        if isinstance(value, list) and value:
            text = str(value[0])
            io.append(f"# {name[:-1]}: {text if len(text) <= width - 12 else text[: width - 15] + '...'}")
    stats = ", ".join(f"{k}={int(c[k])}" for k in ("ast_depth", "ast_nodes", "cyclomatic", "loc")
                      if isinstance(c.get(k), (int, float)))
    return "\n".join(lines + io + [f"# {stats}"])


def example_problems(runs: Sequence[RunData], rows: int = 4) -> Figure:
    """Paper Fig. 8: one median-complexity valid problem per run at evenly spaced matched steps."""
    per_run = [(run, _valid_by_step(run)) for run in runs]
    per_run = [(run, by_step) for run, by_step in per_run if by_step]
    if not per_run:
        raise Skip("no valid problems in any problems.jsonl")
    common = sorted(set.intersection(*(set(b) for _, b in per_run)))
    candidates = common or sorted(per_run[0][1])
    picks = sorted({candidates[int(round(i))] for i in np.linspace(0, len(candidates) - 1,
                                                                  min(rows, len(candidates)))})
    chosen = {}
    for j, (run, by_step) in enumerate(per_run):
        for i, step in enumerate(picks):
            nearest = min(by_step, key=lambda s, t=step: (abs(s - t), s))
            record, c = median_problem(by_step[nearest])
            chosen[i, j] = (run, nearest, record, _snippet(record, c))
    heights = [max(chosen[i, j][3].count("\n") + 1 for j in range(len(per_run))) for i in range(len(picks))]
    fig = Figure(figsize=(6.4 * len(per_run), sum(0.15 * h + 0.55 for h in heights) + 0.4), layout="constrained")
    axes = fig.subplots(len(picks), len(per_run), squeeze=False, gridspec_kw={"height_ratios": heights})
    for (i, j), (run, nearest, record, text) in chosen.items():
        ax = axes[i, j]
        ax.set_xticks([])
        ax.set_yticks([])
        title = f"{run.label} · step {nearest}"
        title += "".join(f" · {x}" for x in (record.get("task_type"), record.get("teacher")) if isinstance(x, str))
        ax.set_title(title, fontsize=9, loc="left")
        ax.text(0.01, 0.97, text, transform=ax.transAxes, va="top", ha="left", family="monospace", fontsize=8)
    fig.suptitle("Median-complexity valid problem at matched steps")
    return fig
