"""The pass@1 table across seeds, from one ``cli.evaluate`` output directory per seed (``results.json`` and the
graded ``samples.jsonl``).

Rows that mean the same thing in every seed are matched: the base model, B1, each stock model, each ``--arm``'s
solver, the population's means, its best student and teacher and its worst member (a best may be another member
in each seed). Each matched row gets its mean over seeds, an interval over problems, each seed's number, and its
paired difference from the base model and from B1 (seed k's row against seed k's B1), with the problems gained
and lost summed over seeds. How each number is made: docs/usage.md, "The pass@1 table across seeds".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from openrlhf_populora.eval.benchmarks import read_jsonl
from openrlhf_populora.eval.report import (
    AVERAGE_TITLES,
    AVERAGES,
    BASE_LABEL,
    BASELINE_LABEL,
    CONFIDENCE,
    N_RESAMPLES,
    averages,
)

BOOTSTRAP_SEED = 0
HEADLINE = "overall"  # the average the per-seed numbers and the differences are given in


class SeedTable(NamedTuple):
    where: str  # the directory it was read from
    benchmarks: list[str]
    titles: dict[str, str]
    kinds: dict[str, str]
    rows: dict[str, list[str]]  # row key -> the members it averages, in this seed
    outcomes: dict[str, dict[str, dict[str, bool]]]  # member -> benchmark -> problem id -> passed


def row_key(row: Mapping[str, Any]) -> str | None:
    """What a row of one seed's ``results.json`` is, in words that hold in every seed; None for the rows of
    single members (named differently in each seed) and of untrained ones."""
    group, kind, label = row.get("group"), row.get("kind"), str(row["label"])
    if group == "base":
        return BASE_LABEL
    if group == "baseline":
        return BASELINE_LABEL if kind == "mean" else None
    if group == "stock":
        return label
    if group == "arm":  # members are stored as <arm name>-<member id>; ids hold no '-'
        return None if "untrained" in label else str(row["members"][0]).rsplit("-", 1)[0]
    if group == "population" and kind == "mean":
        return label.split(" (")[0]  # "Population mean, students (2)": the count is not part of what it is
    if group == "population" and kind in ("best", "worst"):
        return " ".join(label.split()[:2])  # "Best student s4 (picked on ...)" -> "Best student"
    return None


def load_seed(directory: str | Path) -> SeedTable:
    """One seed's evaluation: its rows by key and every graded outcome behind them."""
    directory = Path(directory)
    results_path, samples_path = directory / "results.json", directory / "samples.jsonl"
    for path in (results_path, samples_path):
        if not path.is_file():
            raise ValueError(f"{path} not found: pass the output directories of cli.evaluate (one per seed)")
    results = json.loads(results_path.read_text())
    rows: dict[str, list[str]] = {}
    labels: dict[str, str] = {}
    for row in results["rows"]:
        key = row_key(row)
        if key is None:
            continue
        if key in rows:  # e.g. an --arm with two solvers: which of them is "the arm" in another seed is unknown
            raise ValueError(f"{results_path}: rows {labels[key]!r} and {row['label']!r} both stand for {key!r}; "
                             "the table across seeds matches one row per arm (evaluate one solver per --arm)")
        rows[key], labels[key] = list(row["members"]), str(row["label"])
    wanted = {m for members in rows.values() for m in members}
    outcomes: dict[str, dict[str, dict[str, bool]]] = {}
    for _, record in read_jsonl(samples_path):
        if record["member"] in wanted and record["benchmark"] in results["benchmarks"]:
            outcomes.setdefault(record["member"], {}).setdefault(record["benchmark"], {})[
                str(record["problem_id"])] = bool(record["passed"])
    return SeedTable(str(directory), list(results["benchmarks"]), dict(results["titles"]), dict(results["kinds"]),
                     rows, outcomes)


def _shared_problems(seeds: Sequence[SeedTable], keys: Sequence[str]) -> dict[str, list[str]]:
    """Per benchmark, the problems every member of every matched row was graded on, in every seed."""
    problems: dict[str, list[str]] = {}
    for bench in seeds[0].benchmarks:
        common: set[str] | None = None
        for seed in seeds:
            for key in keys:
                for member in seed.rows[key]:
                    graded = set(seed.outcomes.get(member, {}).get(bench, {}))
                    common = graded if common is None else common & graded
        if not common:
            raise ValueError(f"no {bench} problem was graded for every row's members in every seed: finish the "
                             "evaluations first (cli.evaluate resumes)")
        problems[bench] = sorted(common)
    return problems


def _passes(seed: SeedTable, members: Sequence[str], bench: str, problems: Sequence[str]) -> np.ndarray:
    """The row's pass rate per problem in one seed: the mean over its members (0 or 1 for a single member)."""
    return np.mean([[seed.outcomes[m][bench][p] for p in problems] for m in members], axis=0)


def combine(seeds: Sequence[SeedTable], confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES,
            random_seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """The across-seeds table (``results.json``'s content): rows matched by ``row_key``, each with its mean over
    seeds per benchmark and average, a percentile-bootstrap interval over problems (one draw of each
    benchmark's problems for every row and seed, so differences are paired), each seed's number, and its
    difference from the base and from B1 with the problems gained and lost."""
    if len(seeds) < 2:
        raise ValueError("the table across seeds needs at least two seeds' evaluations")
    first = seeds[0]
    for seed in seeds[1:]:
        if seed.benchmarks != first.benchmarks:
            raise ValueError(f"{seed.where} has benchmarks {seed.benchmarks}, {first.where} {first.benchmarks}: "
                             "evaluate every seed on the same ones")
    keys = [k for k in first.rows if all(k in s.rows for s in seeds)]
    missing = sorted({k for s in seeds for k in s.rows} - set(keys))
    problems = _shared_problems(seeds, keys)
    rng = np.random.default_rng(random_seed)
    draws = {b: rng.integers(0, len(ps), size=(n_resamples, len(ps))) for b, ps in problems.items()}
    tail = 100 * (1 - confidence) / 2

    # per row and benchmark: problems x seeds pass rates
    rates = {k: {b: np.stack([_passes(s, s.rows[k], b, ps) for s in seeds], axis=1) for b, ps in problems.items()}
             for k in keys}

    def summary(per_problem: Mapping[str, np.ndarray]) -> tuple[dict[str, float], dict[str, list[float]]]:
        """Point values and intervals (x100) of per-problem numbers (mean over seeds already taken)."""
        points = {b: 100 * float(v.mean()) for b, v in per_problem.items()}
        boots = {b: 100 * v[draws[b]].mean(axis=1) for b, v in per_problem.items()}
        values = {**points, **{k: float(v) for k, v in averages(points).items() if v is not None}}
        spreads = {**boots, **{k: v for k, v in averages(boots).items() if v is not None}}
        intervals = {k: [float(np.percentile(v, tail)), float(np.percentile(v, 100 - tail))]
                     for k, v in spreads.items()}
        return values, intervals

    def paired(key: str, against: str) -> dict[str, Any]:
        diff = {b: rates[key][b].mean(axis=1) - rates[against][b].mean(axis=1) for b in problems}
        values, intervals = summary(diff)
        out: dict[str, Any] = {"against": against, "delta": values[HEADLINE], "interval": intervals[HEADLINE]}
        if all(len(s.rows[key]) == 1 and len(s.rows[against]) == 1 for s in seeds):
            mine = np.concatenate([rates[key][b] for b in problems])  # problems x seeds, 0/1
            theirs = np.concatenate([rates[against][b] for b in problems])
            out["gained"] = int(((mine == 1) & (theirs == 0)).sum())
            out["lost"] = int(((mine == 0) & (theirs == 1)).sum())
        return out

    rows = []
    for key in keys:
        values, intervals = summary({b: r.mean(axis=1) for b, r in rates[key].items()})
        per_seed = [float(averages({b: 100 * rates[key][b][:, i].mean() for b in problems})[HEADLINE])
                    for i in range(len(seeds))]
        row: dict[str, Any] = {"label": key, "members": [s.rows[key] for s in seeds], "values": values,
                               "intervals": intervals, "per_seed": per_seed}
        for name, against in (("vs_base", BASE_LABEL), ("vs_b1", BASELINE_LABEL)):
            if against in keys and key != against:
                row[name] = paired(key, against)
        rows.append(row)
    return {
        "metric": "greedy pass@1 (%), mean over seeds",
        "seeds": [s.where for s in seeds],
        "benchmarks": first.benchmarks,
        "titles": first.titles,
        "kinds": first.kinds,
        "problems": {b: len(ps) for b, ps in problems.items()},
        "confidence": confidence,
        "n_resamples": n_resamples,
        "headline": HEADLINE,
        "rows": rows,
        "rows_not_in_every_seed": missing,
    }


def _number(value: float, interval: Sequence[float] | None) -> str:
    return f"{value:.1f}" + (f" [{interval[0]:.1f}, {interval[1]:.1f}]" if interval else "")


def _versus(cell: Mapping[str, Any] | None) -> str:
    if not cell:
        return ""
    text = f"{cell['delta']:+.1f} [{cell['interval'][0]:+.1f}, {cell['interval'][1]:+.1f}]"
    if "gained" in cell:
        text += f", +{cell['gained']} / -{cell['lost']}"
    return text


def markdown(table: Mapping[str, Any]) -> str:
    """The table and its notes, as Markdown."""
    columns = list(table["benchmarks"]) + [k for k in AVERAGES if any(k in r["values"] for r in table["rows"])]
    titles = {**table["titles"], **AVERAGE_TITLES}
    headline = AVERAGE_TITLES[table["headline"]]
    n = len(table["seeds"])
    header = ["Model", *(f"{titles[c]} (n={table['problems'][c]})" if c in table["problems"] else titles[c]
                         for c in columns),
              f"{headline}, per seed", f"vs base: Δ {headline}, +gained / -lost", f"vs B1: Δ {headline}, +gained / -lost"]
    lines = [f"Greedy pass@1 (%), mean over {n} seeds.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table["rows"]:
        cells = [row["label"], *(_number(row["values"][c], row["intervals"].get(c)) if c in row["values"] else ""
                                 for c in columns),
                 ", ".join(f"{v:.1f}" for v in row["per_seed"]), _versus(row.get("vs_base")), _versus(row.get("vs_b1"))]
        lines.append("| " + " | ".join(cells) + " |")
    confidence = 100 * table["confidence"]
    lines += ["", f"Brackets: {confidence:g}% percentile-bootstrap intervals over problems ({table['n_resamples']:,} "
              "resamples; each benchmark's problems resampled on their own, the same draw for every row and seed; a "
              "difference resamples the per-problem differences, so it is paired). They do not include how much "
              "seeds differ: the per-seed column shows that.",
              "", f"Per seed: the row's {headline} in each seed, in the order of the seeds below. A best or worst row "
              "is that seed's pick (picked on the benchmarks themselves: optimistic or pessimistic).",
              "", f"vs base, vs B1: the row's {headline} minus the base model's, or minus B1's of the same seed, with "
              "its paired interval; for rows of one member per seed, the problems it solves that the other does "
              f"not (+) and the reverse (-), summed over the {n} seeds (a problem counts once per seed).",
              "", "n: the problems every row's members were graded on in every seed.",
              "", "Seeds: " + ", ".join(f"`{s}`" for s in table["seeds"]) + "."]
    if table["rows_not_in_every_seed"]:
        lines += ["", "Rows not in every seed, left out: " + ", ".join(table["rows_not_in_every_seed"]) + "."]
    return "\n".join(lines) + "\n"


def chart(table: Mapping[str, Any], path: str | Path) -> Path:
    """One bar per row (its headline average over seeds, with its interval), and each seed's number as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table["rows"]
    key = table["headline"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.2))
    xs = np.arange(len(rows))
    values = [r["values"][key] for r in rows]
    low = [r["values"][key] - r["intervals"][key][0] for r in rows]
    high = [r["intervals"][key][1] - r["values"][key] for r in rows]
    ax.bar(xs, values, 0.6, color="#7fb1de", yerr=[low, high], capsize=3, ecolor="black")
    for x, row in zip(xs, rows, strict=True):
        ax.scatter([x] * len(row["per_seed"]), row["per_seed"], color="#1f3f66", s=12, zorder=3)
    ax.set_xticks(xs)
    ax.set_xticklabels([r["label"] for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(f"greedy pass@1 (%), {AVERAGE_TITLES[key]}")
    ax.set_title(f"mean over {len(table['seeds'])} seeds ({100 * table['confidence']:g}% intervals over problems); "
                 "dots: each seed", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def write(table: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """``results.json``, ``results.md`` and ``results.png`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    paths["json"].write_text(json.dumps(table, indent=1) + "\n")
    paths["md"].write_text(markdown(table))
    paths["png"] = chart(table, out / "results.png")
    return paths
