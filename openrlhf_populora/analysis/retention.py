"""The operator retention study's directory, measures, table and figures (the paper's Figs 6, 16 and 17).

``studies/retention.py`` (``cli/retention.py``) takes a member of a run at checkpointed steps, makes a child of it
with every evolution operator, retrains each child against a frozen opponent and writes a **study directory**; this
module reads it back (``cli/report.py --retention DIR`` draws it too). Layout::

    study.json                     what was asked: run, parents, role, opponent, steps, probe size, operators,
                                   snapshots, and the table's settings (tolerance, smoothing, table steps)
    parents.json                   each parent's curves in its own run (member/<id>/<role>/all/<metric>)
    snapshots/step_NNNNNN/         what every child of that snapshot shares: the parents' weights
                                   (parents.pt) and their probe samples with their own log-probs (probe.json)
    children/step_NNNNNN/<op>/     one run directory per child, written by the runner: config.yaml,
                                   metrics.jsonl, problems.jsonl, run_meta.json, checkpoints/ (the last
                                   step's), adapters/ (the child's and the opponent's), population.json,
                                   buffers.jsonl; and child.json, and DONE once all its steps ran
    retention.md, retention.json   the table; retention_grid*.png, retention_measures.png: the figures

A child's ``metrics.jsonl`` follows the run schema (``metrics/keys.py``; the child is member ``child``, its
opponent keeps its id) plus two retention measures per parent ``i`` (0: the first parent, 1: the second):

``retention/parent<i>/logprob``          the mean per-token log-prob, under the child, of the K completions
                                         parent ``i`` sampled at the snapshot on its own role's prompts: how
                                         much of what the parent would say the child still says
``retention/parent<i>/delta_distance``   ``||sum_m (B_c A_c - B_p A_p)||`` over all LoRA modules ``m`` taken
                                         together: ``sqrt(sum_m ||dW_child,m - dW_parent,m||_F^2) /
                                         sqrt(sum_m ||dW_parent,m||_F^2)`` (0 when the child is the parent)

The record at the snapshot step S holds only these (the child as the operator made it); the records at
S + k (k = 1..N, global steps, as in the run) hold the step's game metrics, measured as every run measures
them (on step S + k's samples, i.e. before its update), and the retention measures after its update.

**The table.** For each child, the role's metric (``solve_rate`` for a student, ``validity`` for a teacher;
``teacher_reward`` is reported, not divided, since it can be negative) as a trailing mean over ``smooth``
retraining steps, at retraining steps ``at``; its fraction of ``copy_parent``'s at the same snapshot and step
(the parent retrained in the same conditions, fresh optimizer included); the **recovery step**, the first
retraining step at which the child's smoothed metric is within ``tolerance`` (relative) of copy_parent's,
``child >= ref - tolerance * |ref|`` at that step and every later one; the delta distance to the first parent at the start and the end; and
the first parent's samples' log-prob under the child, at the start against the parent's own (0 for
copy_parent) and at the end against copy_parent's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from openrlhf_populora.analysis.compare import json_safe

STUDY_FILE = "study.json"
PARENTS_FILE = "parents.json"
CHILD_FILE = "child.json"
DONE_FILE = "DONE"
PROBE_FILE = "probe.json"
PARENT_WEIGHTS_FILE = "parents.pt"
SNAPSHOTS_DIR = "snapshots"
CHILDREN_DIR = "children"
CHILD_ID = "child"  # the child's member id in its own run directory
REFERENCE = "copy_parent"  # the operator every other is compared with
# the role's metrics (member/<id>/<role>/all/<metric>): the first is the table's
ROLE_METRICS = {"teacher": ("validity", "teacher_reward"), "student": ("solve_rate",)}
TABLE_FILES = ("retention.md", "retention.json")


def logprob_key(parent: int) -> str:
    return f"retention/parent{parent}/logprob"


def distance_key(parent: int) -> str:
    return f"retention/parent{parent}/delta_distance"


def snapshot_dir(study: str | Path, step: int) -> Path:
    return Path(study) / SNAPSHOTS_DIR / f"step_{step:06d}"


def child_dir(study: str | Path, step: int, operator: str) -> Path:
    return Path(study) / CHILDREN_DIR / f"step_{step:06d}" / operator


def member_metric_key(member: str, role: str, metric: str) -> str:
    return f"member/{member}/{role}/all/{metric}"


# ------------------------------------------------------------------------------------------------- measures

def delta_distance(child: Mapping[str, Any], parent: Mapping[str, Any]) -> float | None:
    """``sqrt(sum_m ||B_c A_c - B_p A_p||_F^2 / sum_m ||B_p A_p||_F^2)`` over the LoRA modules ``m`` of two
    adapters with the same keys (any ranks), in float64 through the factors (no dense delta is formed). A
    module whose factors are bit-identical contributes exactly 0, so a copy is at distance exactly 0. None
    when the parent's delta is 0 (a fresh adapter)."""
    import torch

    from openrlhf_populora.evolution.lowrank import lora_pairs

    def inner(b1, a1, b2, a2) -> float:  # <B1 A1, B2 A2>_F = sum((B1^T B2) * (A1 A2^T))
        return float(((b1.T @ b2) * (a1 @ a2.T)).sum())

    if set(child) != set(parent):
        raise ValueError("the child's and the parent's adapters have different keys")
    num = den = 0.0
    for pair in lora_pairs(parent):
        a_p, b_p = parent[pair.a_key].double().cpu(), parent[pair.b_key].double().cpu()
        a_c, b_c = child[pair.a_key].double().cpu(), child[pair.b_key].double().cpu()
        parent_sq = inner(b_p, a_p, b_p, a_p)
        den += parent_sq
        if torch.equal(a_c, a_p) and torch.equal(b_c, b_p):
            continue
        num += max(0.0, inner(b_c, a_c, b_c, a_c) + parent_sq - 2.0 * inner(b_c, a_c, b_p, a_p))
    return math.sqrt(num / den) if den > 0 else None


def mean_token_logprob(token_logprobs: Sequence[Sequence[float]]) -> float | None:
    """The mean over every token of every sample (long samples weigh more), None when there is no token."""
    values = [v for sample in token_logprobs for v in sample]
    return float(sum(values) / len(values)) if values else None


def trailing_mean(values: Sequence[float | None], window: int) -> list[float | None]:
    """Entry k: the mean of the finite values among entries k-window+1..k (None when there is none)."""
    out: list[float | None] = []
    for k in range(len(values)):
        part = [v for v in values[max(0, k - window + 1):k + 1] if v is not None and math.isfinite(v)]
        out.append(sum(part) / len(part) if part else None)
    return out


# ------------------------------------------------------------------------------------------------- reading

@dataclass
class Child:
    """One retrained child: its settings (``child.json``) and its records by global step."""

    operator: str
    code: str
    kind: str
    snapshot: int
    path: Path
    info: dict[str, Any]
    records: dict[int, dict[str, Any]]
    finished: bool

    def series(self, key: str, steps: int) -> list[float | None]:
        """The value of ``key`` at retraining steps 0..steps (global steps snapshot..snapshot+steps)."""
        out = []
        for k in range(steps + 1):
            value = self.records.get(self.snapshot + k, {}).get(key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            out.append(float(value) if ok else None)
        return out


@dataclass
class Study:
    path: Path
    settings: dict[str, Any]
    parents: dict[str, Any]  # parents.json
    children: list[Child] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def role(self) -> str:
        return self.settings["role"]

    @property
    def steps(self) -> int:
        return int(self.settings["steps"])

    @property
    def metric(self) -> str:
        return ROLE_METRICS[self.role][0]

    def snapshots(self) -> list[int]:
        return sorted({c.snapshot for c in self.children})

    def operators(self) -> list[str]:
        """Operators with a child, in the study's order (copy_parent first)."""
        order = [REFERENCE] + [op for op in self.settings.get("operators", []) if op != REFERENCE]
        present = {c.operator for c in self.children}
        return [op for op in order if op in present] + sorted(present - set(order))

    def child(self, operator: str, snapshot: int) -> Child | None:
        for c in self.children:
            if c.operator == operator and c.snapshot == snapshot:
                return c
        return None

    def child_series(self, child: Child, metric: str) -> list[float | None]:
        return child.series(member_metric_key(child.info.get("child_id", CHILD_ID), self.role, metric), self.steps)

    def parent_curve(self, index: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """Parent ``index``'s series of ``metric`` in its own run (steps, values); empty when unknown."""
        parents = self.parents.get("parents", [])
        if index >= len(parents):
            return np.array([]), np.array([])
        points = parents[index].get("series", {}).get(metric, [])
        return (np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float))


def load_study(path: str | Path) -> Study:
    """Read a study directory. FileNotFoundError when it holds no ``study.json``; a child whose files cannot be
    read is left out with a warning."""
    from openrlhf_populora.analysis.runs import load_run

    path = Path(path)
    if not (path / STUDY_FILE).is_file():
        raise FileNotFoundError(f"{path} holds no {STUDY_FILE}: not a retention study directory "
                                f"(python -m openrlhf_populora.cli.retention writes one)")
    settings = json.loads((path / STUDY_FILE).read_text())
    parents = json.loads((path / PARENTS_FILE).read_text()) if (path / PARENTS_FILE).is_file() else {}
    study = Study(path, settings, parents)
    for directory in sorted((path / CHILDREN_DIR).glob("step_*/*")):
        if not (directory / CHILD_FILE).is_file():
            continue
        try:
            info = json.loads((directory / CHILD_FILE).read_text())
            run = load_run(directory)
        except (OSError, ValueError) as err:
            study.warnings.append(f"{directory}: unreadable ({err}), left out")
            continue
        study.warnings += [f"{directory.parent.name}/{directory.name}: {w}" for w in run.warnings]
        study.children.append(Child(info["operator"], info.get("operator_code", info["operator"]),
                                    info.get("kind", ""), int(info["snapshot"]), directory, info, run.records,
                                    (directory / DONE_FILE).is_file()))
    return study


# ------------------------------------------------------------------------------------------------- the table

def _at(values: list[float | None], k: int) -> float | None:
    return values[k] if 0 <= k < len(values) else None


def within(child: float | None, reference: float | None, tolerance: float) -> bool:
    """``child >= reference - tolerance * |reference|`` (False when either is missing)."""
    return child is not None and reference is not None and child >= reference - tolerance * abs(reference)


def recovery_step(child: Sequence[float | None], reference: Sequence[float | None], tolerance: float) -> int | None:
    """The first retraining step k >= 1 from which the child STAYS within ``tolerance`` of the reference at every
    later step where both are given (usually smoothed): ``child[j] >= reference[j] - tolerance * |reference[j]|``
    for all j >= k. None when it is not within at its last such step (a child that touches the tolerance once
    and falls back has not recovered)."""
    steps = [k for k in range(1, min(len(child), len(reference))) if child[k] is not None and reference[k] is not None]
    recovered = None
    for k in reversed(steps):
        if not within(child[k], reference[k], tolerance):
            break
        recovered = k
    return recovered


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def _difference(value: float | None, reference: float | None) -> float | None:
    return None if value is None or reference is None else value - reference


BOOTSTRAPS = 1000
CI_LEVEL = 0.95


def answers_per_step(child: Child, role: str) -> int | None:
    """How many answers (a student) or proposals (a teacher) the role's metric averages at each step, from the
    child's ``config.yaml``: solver_tasks x solver_samples x task types, or proposals_per_teacher x task types."""
    try:
        import yaml

        section = yaml.safe_load((child.path / "config.yaml").read_text()).get("populora", {})
        types = len(section["task_types"])
        if role == "student":
            return int(section["solver_tasks"]) * int(section["solver_samples"]) * types
        return int(section["proposals_per_teacher"]) * types
    except (OSError, KeyError, TypeError, AttributeError, ValueError):
        return None


def run_seed(child: Child) -> int | None:
    """The child's ``train.seed`` (its ``config.yaml``), None when unknown."""
    try:
        import yaml

        return int(yaml.safe_load((child.path / "config.yaml").read_text())["train"]["seed"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def resampled_curves(values: Sequence[float | None], answers: int | None, window: int, rng: np.random.Generator,
                     bootstraps: int = BOOTSTRAPS) -> np.ndarray | None:
    """(bootstraps x steps): each step's rate re-drawn as its ``answers`` answers resampled with replacement
    (``Binomial(answers, rate) / answers``: the bootstrap of 0/1 outcomes), then the trailing mean over
    ``window`` steps; NaN where a value is missing. None without a count of answers."""
    if not answers:
        return None
    rates = np.array([np.nan if v is None else min(max(v, 0.0), 1.0) for v in values])
    draws = rng.binomial(answers, np.nan_to_num(rates)[None, :], size=(bootstraps, len(rates))) / answers
    draws[:, np.isnan(rates)] = np.nan
    out = np.full_like(draws, np.nan)
    for k in range(len(rates)):
        part = draws[:, max(0, k - window + 1):k + 1]
        seen = np.isfinite(part).any(axis=1)
        out[seen, k] = np.nanmean(part[seen], axis=1)
    return out


def ratio_draws(child: np.ndarray | None, reference: np.ndarray | None, k: int) -> np.ndarray | None:
    """The child's resampled value at step k over the reference's (NaN where the reference is 0 or missing)."""
    if child is None or reference is None or k >= child.shape[1]:
        return None
    ref = reference[:, k]
    return np.where(ref > 0, child[:, k] / np.where(ref > 0, ref, 1.0), np.nan)


def percentile_interval(draws: np.ndarray | None, level: float = CI_LEVEL) -> list[float] | None:
    """The central ``level`` percentile interval of the finite draws (None when fewer than half are finite)."""
    if draws is None:
        return None
    finite = draws[np.isfinite(draws)]
    if len(finite) < len(draws) / 2:
        return None
    lo, hi = np.quantile(finite, [0.5 - level / 2, 0.5 + level / 2])
    return [float(lo), float(hi)]


def table_steps(steps: int, at: Sequence[int] | None) -> list[int]:
    """The table's retraining steps: ``at`` (those within 1..steps), by default 20 and the last."""
    chosen = list(at) if at else [20, steps]
    return sorted({k for k in chosen if 1 <= k <= steps})


def retention_table(study: Study, at: Sequence[int] | None = None, tolerance: float | None = None,
                    smooth: int | None = None) -> dict[str, Any]:
    """Every child's row and a per-operator summary (see the module doc); settings default to the study's."""
    s = study.settings
    tolerance = float(s.get("tolerance", 0.1) if tolerance is None else tolerance)
    smooth = int(s.get("smooth", 1) if smooth is None else smooth)
    ks = table_steps(study.steps, at if at is not None else s.get("at"))
    metrics = ROLE_METRICS[study.role]
    metric = metrics[0]
    probe_refs = _probe_references(study)
    rng = np.random.default_rng(0)
    rows, draws = [], {}  # draws: (operator, snapshot) -> {k: the ratio's bootstrap draws}
    for snapshot in study.snapshots():
        reference = study.child(REFERENCE, snapshot)
        ref_curve = trailing_mean(study.child_series(reference, metric), smooth) if reference else []
        ref_logprob = reference.series(logprob_key(0), study.steps) if reference else []
        ref_draws = (resampled_curves(study.child_series(reference, metric), answers_per_step(reference, study.role),
                                      smooth, rng) if reference else None)
        for operator in study.operators():
            child = study.child(operator, snapshot)
            if child is None:
                continue
            curves = {m: trailing_mean(study.child_series(child, m), smooth) for m in metrics}
            child_draws = (ref_draws if operator == REFERENCE else resampled_curves(
                study.child_series(child, metric), answers_per_step(child, study.role), smooth, rng))
            draws[(operator, snapshot)] = {k: ratio_draws(child_draws, ref_draws, k) for k in ks}
            distance = child.series(distance_key(0), study.steps)
            logprob = child.series(logprob_key(0), study.steps)
            done = [k for k in range(1, study.steps + 1) if child.records.get(snapshot + k)]
            last = max(done, default=0)
            rows.append({
                "operator": operator, "code": child.code, "kind": child.kind, "snapshot": snapshot,
                "finished": child.finished, "steps_done": last, "seed": run_seed(child),
                "answers_per_step": answers_per_step(child, study.role),
                "values": {m: {str(k): _at(curves[m], k) for k in ks} for m in metrics},
                "fraction_of_copy": {str(k): _ratio(_at(curves[metric], k), _at(ref_curve, k)) for k in ks},
                "fraction_of_copy_ci": {str(k): percentile_interval(draws[(operator, snapshot)][k]) for k in ks},
                "recovery_step": recovery_step(curves[metric], ref_curve, tolerance) if reference else None,
                "delta_distance": {"start": _at(distance, 0), "end": _at(distance, last)},
                "logprob_vs_parent_start": _difference(_at(logprob, 0), probe_refs.get(snapshot)),
                "logprob_vs_copy_end": _difference(_at(logprob, last), _at(ref_logprob, last)),
                "truncation_energy": child.info.get("info", {}).get("truncation_energy"),
            })
    summary = []
    for operator in study.operators():
        mine = [r for r in rows if r["operator"] == operator]
        fractions, intervals = {}, {}
        for k in ks:
            values = [r["fraction_of_copy"][str(k)] for r in mine if r["fraction_of_copy"][str(k)] is not None]
            fractions[str(k)] = float(np.mean(values)) if values else None
            intervals[str(k)] = percentile_interval(
                snapshot_mean_draws([draws[(operator, r["snapshot"])][k] for r in mine], rng))
        summary.append({"operator": operator, "code": mine[0]["code"] if mine else operator,
                        "snapshots": [r["snapshot"] for r in mine], "mean_fraction_of_copy": fractions,
                        "mean_fraction_of_copy_ci": intervals, "recovery_steps": [r["recovery_step"] for r in mine]})
    seeds = sorted({r["seed"] for r in rows if r["seed"] is not None})
    return {"role": study.role, "metric": metric, "metrics": list(metrics), "at": ks, "tolerance": tolerance,
            "smooth": smooth, "steps": study.steps, "reference": REFERENCE, "seeds": seeds,
            "bootstraps": BOOTSTRAPS, "rows": rows, "summary": summary}


def snapshot_mean_draws(per_snapshot: Sequence[np.ndarray | None], rng: np.random.Generator) -> np.ndarray | None:
    """Bootstrap draws of the mean over snapshots: each draw picks the snapshots with replacement and takes the
    mean of their own (answer-level) draws at the same index."""
    if not per_snapshot or any(d is None for d in per_snapshot):
        return None
    stacked = np.stack(per_snapshot)  # snapshots x bootstraps
    picks = rng.integers(0, len(stacked), size=stacked.shape[::-1])  # bootstraps x snapshots
    return np.nanmean(stacked[picks, np.arange(stacked.shape[1])[:, None]], axis=1)


def _probe_references(study: Study) -> dict[int, float]:
    """snapshot -> the first parent's mean per-token log-prob of its own probe samples."""
    out = {}
    for snapshot in study.snapshots():
        path = snapshot_dir(study.path, snapshot) / PROBE_FILE
        if path.is_file():
            probes = json.loads(path.read_text()).get("parents", [])
            if probes and probes[0].get("logprob") is not None:
                out[snapshot] = float(probes[0]["logprob"])
    return out


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _ci(interval: Sequence[float] | None) -> str:
    return "" if not interval else f" [{interval[0]:.2g}, {interval[1]:.2g}]"


def format_markdown(table: Mapping[str, Any]) -> str:
    metric, ks, tol = table["metric"], table["at"], table["tolerance"]
    seeds = table.get("seeds", [])
    lines = ["# Operator retention", "",
             f"Role: {table['role']}; metric: `{metric}` (trailing mean over {table['smooth']} retraining steps); "
             f"reference: `{table['reference']}`; recovery: the first retraining step from which the child's metric "
             f"stays >= copy_parent's - {tol:g} x |copy_parent's| to the last step; {table['steps']} retraining steps.",
             "",
             f"**Seeds: {len(seeds)}** ({', '.join(map(str, seeds)) or 'unknown'}): every number comes from one "
             f"run of each child. Intervals [95%]: {table.get('bootstraps', BOOTSTRAPS)} bootstrap resamples of each "
             "step's answers (a step's rate re-drawn from its own answers, child and copy_parent alike), and for "
             "the means over snapshots, of the snapshots too. They hold for this seed's children; seed-to-seed "
             "variation is not in them.", "",
             "| operator | code | snapshot | " + " | ".join(f"{metric} @{k} | ÷copy @{k}" for k in ks)
             + " | recovers at | ΔW dist. start | ΔW dist. end | Δlogp start vs parent | Δlogp end vs copy |"
             + " steps run |",
             "|---|---|---|" + "---|---|" * len(ks) + "---|---|---|---|---|---|"]
    for r in table["rows"]:
        cells = []
        for k in ks:
            ci = _ci(r.get("fraction_of_copy_ci", {}).get(str(k)))
            cells += [_fmt(r["values"][metric][str(k)]), _fmt(r["fraction_of_copy"][str(k)]) + ci]
        run = f"{r['steps_done']}" + ("" if r["finished"] else " (unfinished)")
        lines.append(f"| {r['operator']} | {r['code']} | {r['snapshot']} | " + " | ".join(cells) + " | "
                     f"{_fmt(r['recovery_step'])} | {_fmt(r['delta_distance']['start'])} | "
                     f"{_fmt(r['delta_distance']['end'])} | {_fmt(r['logprob_vs_parent_start'])} | "
                     f"{_fmt(r['logprob_vs_copy_end'])} | {run} |")
    lines += ["", "## By operator, over the snapshots", "",
              "| operator | code | snapshots | " + " | ".join(f"mean ÷copy @{k}" for k in ks) + " | recovers at |",
              "|---|---|---|" + "---|" * len(ks) + "---|"]
    for s in table["summary"]:
        fractions = " | ".join(_fmt(s["mean_fraction_of_copy"][str(k)]) + _ci(s.get("mean_fraction_of_copy_ci", {})
                                                                                 .get(str(k))) for k in ks)
        recoveries = ", ".join(_fmt(x) for x in s["recovery_steps"])
        lines.append(f"| {s['operator']} | {s['code']} | {', '.join(map(str, s['snapshots']))} | {fractions} | "
                     f"{recoveries} |")
    lines += ["", "Columns: `metric @k` the child's metric after k retraining steps; `÷copy @k` that as a fraction "
              "of copy_parent's at the same snapshot and step, with its 95% bootstrap interval; `recovers at` the "
              "retraining step from which the child stays within the tolerance (– not within at the last step); `ΔW dist.` the relative Frobenius distance of the child's summed "
              "LoRA deltas B A to the first parent's, after 0 and after all retraining steps; `Δlogp` the change in "
              "the mean per-token log-prob of the first parent's own samples (nats): at the start against the "
              "parent itself, at the end against copy_parent's child.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- figures

def grid_figure(study: Study, metric: str | None = None, smooth: int | None = None):
    """Rows: operators; columns: snapshot steps. Grey: the parent in its run (the second parent dotted);
    colour: the child on the same global-step axis; dashed black: copy_parent's child; dotted line: the
    snapshot."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from openrlhf_populora.analysis.plots import PALETTE, Skip
    from openrlhf_populora.analysis.plots import smooth as smoothed

    metric = metric or study.metric
    window = int(study.settings.get("smooth", 1) if smooth is None else smooth)
    operators, snapshots = study.operators(), study.snapshots()
    if not operators or not snapshots:
        raise Skip("the study has no child yet")
    n = study.steps
    fig = Figure(figsize=(3.6 * len(snapshots) + 1.0, 2.1 * len(operators) + 0.8), layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(operators), len(snapshots), squeeze=False, sharey=True))
    parents = [study.parent_curve(i, metric) for i in range(len(study.parents.get("parents", [])))]
    for row, operator in enumerate(operators):
        color = "black" if operator == REFERENCE else PALETTE[row % len(PALETTE)]
        for col, snapshot in enumerate(snapshots):
            ax = axes[row, col]
            for i, (xs, ys) in enumerate(parents):
                keep = xs <= snapshot + n
                if keep.any():
                    ax.plot(xs[keep], smoothed(ys[keep], window), color="0.55", lw=1.2,
                            ls="-" if i == 0 else ":", label="parent" if i == 0 else "second parent")
            reference = study.child(REFERENCE, snapshot)
            if reference is not None and operator != REFERENCE:
                _draw_child(ax, study, reference, metric, window, color="black", ls="--", lw=0.9,
                            label=REFERENCE)
            child = study.child(operator, snapshot)
            if child is not None:
                _draw_child(ax, study, child, metric, window, color=color, ls="-", lw=1.6, label="child")
            ax.axvline(snapshot, color="0.3", ls=":", lw=0.8)
            ax.set_xlim(0, snapshot + n + 0.5)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if row == 0:
                ax.set_title(f"snapshot step {snapshot}", fontsize=9)
            if col == 0:
                code = study.child(operator, snapshots[0]) or next(
                    (c for c in study.children if c.operator == operator), None)
                label = operator if code is None or code.code == operator else f"{code.code} {operator}"
                ax.set_ylabel(f"{label}\n{metric}", fontsize=8)
            if row == len(operators) - 1:
                ax.set_xlabel("global step", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=6, loc="best")
    fig.suptitle(f"Operator retention: the {study.role}'s {metric} (trailing mean over {window} steps)", fontsize=10)
    return fig


def _draw_child(ax, study: Study, child: Child, metric: str, window: int, **style) -> None:
    values = trailing_mean(study.child_series(child, metric), window)
    points = [(child.snapshot + k, v) for k, v in enumerate(values) if k >= 1 and v is not None]
    if points:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, marker="o" if len(points) <= 12 else None, ms=2.5, **style)


def measures_figure(study: Study):
    """Rows: the first parent's samples' log-prob under the child minus the parent's own, and the delta distance
    to the first parent; columns: snapshots; x: retraining steps; one line per operator."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from openrlhf_populora.analysis.plots import PALETTE, Skip

    operators, snapshots = study.operators(), study.snapshots()
    if not operators or not snapshots:
        raise Skip("the study has no child yet")
    refs = _probe_references(study)
    fig = Figure(figsize=(4.2 * len(snapshots) + 1.5, 6.0), layout="constrained")
    axes = np.atleast_2d(fig.subplots(2, len(snapshots), squeeze=False, sharex=True))
    for col, snapshot in enumerate(snapshots):
        for row, operator in enumerate(operators):
            child = study.child(operator, snapshot)
            if child is None:
                continue
            color = "black" if operator == REFERENCE else PALETTE[row % len(PALETTE)]
            label = operator if child.code == operator else f"{child.code} {operator}"
            logprob = child.series(logprob_key(0), study.steps)
            base = refs.get(snapshot)
            lp = [(k, v - base) for k, v in enumerate(logprob) if v is not None and base is not None]
            dw = [(k, v) for k, v in enumerate(child.series(distance_key(0), study.steps)) if v is not None]
            for ax, points in ((axes[0, col], lp), (axes[1, col], dw)):
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, color=color, lw=1.3, ls="--" if operator == REFERENCE else "-", label=label)
        axes[0, col].set_title(f"snapshot step {snapshot}", fontsize=9)
        axes[1, col].set_xlabel("retraining step", fontsize=8)
        axes[1, col].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].set_ylabel("Δ log-prob of the parent's samples\n(nats/token, vs the parent)", fontsize=8)
    axes[1, 0].set_ylabel("ΔW distance to the parent\n(relative Frobenius)", fontsize=8)
    axes[0, -1].legend(fontsize=6, loc="best")
    return fig


@dataclass
class RetentionResult:
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    table: dict[str, Any] | None = None


def render_retention(study_dir: str | Path, out_dir: str | Path | None = None, dpi: int = 110) -> RetentionResult:
    """Write the table (``retention.md``, ``retention.json``) and the figures (``retention_grid.png`` for the
    role's metric, ``retention_grid_<metric>.png`` for its others, ``retention_measures.png``) of the study in
    ``study_dir`` into ``out_dir`` (default: the study directory). FileNotFoundError without a study."""
    from openrlhf_populora.analysis.plots import Skip

    study = load_study(study_dir)
    result = RetentionResult(Path(out_dir) if out_dir is not None else study.path, warnings=list(study.warnings))
    result.out_dir.mkdir(parents=True, exist_ok=True)
    table = retention_table(study)
    result.table = table
    (result.out_dir / "retention.md").write_text(format_markdown(table), encoding="utf-8")
    (result.out_dir / "retention.json").write_text(json.dumps(json_safe(table), indent=1, allow_nan=False) + "\n",
                                                   encoding="utf-8")
    result.files += [result.out_dir / name for name in TABLE_FILES]
    jobs = [("retention_grid.png", lambda: grid_figure(study))]
    jobs += [(f"retention_grid_{m}.png", lambda m=m: grid_figure(study, metric=m)) for m in ROLE_METRICS[study.role][1:]]
    jobs.append(("retention_measures.png", lambda: measures_figure(study)))
    for name, draw in jobs:
        try:
            fig = draw()
        except Skip as why:
            result.skipped[name] = str(why)
            continue
        fig.savefig(result.out_dir / name, dpi=dpi)
        result.files.append(result.out_dir / name)
    return result

