"""From graded samples to the paper's table and chart.

Scores are greedy pass@1 in percent. Per member: one score per benchmark (100 * passed / graded),
``code_avg`` = mean over the code benchmarks evaluated, ``math_avg`` = mean over the math benchmarks,
``overall`` = mean of the two averages (AZR's AVG = (CAvg + MAvg) / 2; the one average alone when only one
kind was evaluated).

Rows of the table (each present only when its members were evaluated):
- ``Base model``: the base with no adapter;
- ``PopuLoRA baseline (B1)``: the single-agent PopuLoRA baseline run (mean over its members, usually one);
- ``Stock OpenRLHF (B2): NAME``: one row per full fine-tuned model (``--model NAME=DIR``, e.g. what stock
  OpenRLHF's ``train_ppo_ray --ckpt.save_hf`` writes), evaluated as its own base with no adapter;
- ``Population mean``: per column, the mean over the population's members;
- ``Population best`` / ``Population worst``: the member with the highest / lowest ``overall``;
- then every member on its own row.

Member groups (``summarize``'s ``groups``, each member's ``group`` and each row's ``group`` in
``results.json``): ``base``, ``baseline`` (B1), ``stock`` (B2), ``population``.

``results.json`` holds all of it; ``results.md`` / ``results.csv`` the table; ``results.png`` a grouped bar
chart like PopuLoRA's Figure 2 (per benchmark and average: base model, B1, each B2 model, population mean with
a whisker from the worst to the best member).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from openrlhf_populora.eval.benchmarks import BENCHMARKS
from openrlhf_populora.eval.problems import CODE, MATH

AVERAGES = ("code_avg", "math_avg", "overall")
AVERAGE_TITLES = {"code_avg": "Code Avg", "math_avg": "Math Avg", "overall": "Overall"}
GROUPS = ("base", "baseline", "stock", "population")
BASE_LABEL = "Base model"
BASELINE_LABEL = "PopuLoRA baseline (B1)"
STOCK_LABEL = "Stock OpenRLHF (B2)"
POPULATION_MEAN_LABEL = "Population mean"
# row labels of results.json files written before rows carried their group
LEGACY_GROUPS = {BASE_LABEL: "base", "Baseline": "baseline", POPULATION_MEAN_LABEL: "population"}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def member_scores(records: Sequence[Mapping[str, Any]], member: str, benchmarks: Sequence[str]) -> dict[str, Any]:
    """``{"scores": {bench: pct}, "n": {bench: graded}, "code_avg", "math_avg", "overall"}`` for one member."""
    passed: dict[str, int] = {b: 0 for b in benchmarks}
    graded: dict[str, int] = {b: 0 for b in benchmarks}
    for r in records:
        if r["member"] == member and r["benchmark"] in graded:
            graded[r["benchmark"]] += 1
            passed[r["benchmark"]] += bool(r["passed"])
    scores = {b: 100.0 * passed[b] / graded[b] for b in benchmarks if graded[b]}
    return {"scores": scores, "n": graded, **averages(scores)}


def averages(scores: Mapping[str, float]) -> dict[str, float | None]:
    code = _mean([v for b, v in scores.items() if BENCHMARKS[b].kind == CODE])
    math = _mean([v for b, v in scores.items() if BENCHMARKS[b].kind == MATH])
    return {"code_avg": code, "math_avg": math, "overall": _mean([v for v in (code, math) if v is not None])}


def _row(label: str, scores: Mapping[str, float], members: Sequence[str], group: str) -> dict[str, Any]:
    return {"label": label, "group": group, "members": list(members), "scores": dict(scores), **averages(scores)}


def stock_label(name: str) -> str:
    """The table label of the full model ``--model NAME=DIR`` (the stock OpenRLHF baseline, B2)."""
    return f"{STOCK_LABEL}: {name}"


def _mean_row(label: str, table: Mapping[str, dict], names: Sequence[str], benchmarks: Sequence[str],
              group: str) -> dict:
    scores = {}
    for b in benchmarks:
        values = [table[n]["scores"][b] for n in names if b in table[n]["scores"]]
        if values:
            scores[b] = sum(values) / len(values)
    row = _row(label, scores, names, group)
    # averages of a mean row: the mean of the members' averages (equal to the averages of the mean scores
    # when every member has every benchmark)
    for key in AVERAGES:
        values = [table[n][key] for n in names if table[n][key] is not None]
        row[key] = _mean(values)
    return row


def summarize(
    records: Sequence[Mapping[str, Any]],
    groups: Mapping[str, Sequence[str]],
    benchmarks: Sequence[str],
    totals: Mapping[str, int] | None = None,
    roles: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The content of ``results.json``. ``groups`` maps ``base`` / ``baseline`` / ``stock`` / ``population`` to
    member names; ``totals`` (benchmark -> problem count) marks members whose evaluation is incomplete."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown member groups {sorted(unknown)}; use {', '.join(GROUPS)}")
    table: dict[str, dict[str, Any]] = {}
    for group in GROUPS:
        for name in groups.get(group, ()):
            entry = member_scores(records, name, benchmarks)
            entry["group"] = group
            entry["role"] = (roles or {}).get(name, group)
            entry["complete"] = all(entry["n"][b] >= (totals or {}).get(b, 0) and entry["n"][b] > 0 for b in benchmarks)
            table[name] = entry
    rows = []
    if groups.get("base"):
        rows.append(_mean_row(BASE_LABEL, table, groups["base"], benchmarks, "base"))
    if groups.get("baseline"):
        rows.append(_mean_row(BASELINE_LABEL, table, groups["baseline"], benchmarks, "baseline"))
    for name in groups.get("stock", ()):
        rows.append(_row(stock_label(name), table[name]["scores"], [name], "stock"))
    population = [n for n in groups.get("population", ()) if table[n]["overall"] is not None]
    if population:
        rows.append(_mean_row(POPULATION_MEAN_LABEL, table, population, benchmarks, "population"))
        best = max(population, key=lambda n: table[n]["overall"])
        worst = min(population, key=lambda n: table[n]["overall"])
        rows.append(_row(f"Population best ({best})", table[best]["scores"], [best], "population"))
        rows.append(_row(f"Population worst ({worst})", table[worst]["scores"], [worst], "population"))
        for name in groups.get("population", ()):
            rows.append(_row(f"{name} ({table[name]['role']})", table[name]["scores"], [name], "population"))
    return {
        "metric": "greedy pass@1 (%)",
        "benchmarks": list(benchmarks),
        "titles": {b: BENCHMARKS[b].title for b in benchmarks},
        "kinds": {b: BENCHMARKS[b].kind for b in benchmarks},
        "totals": dict(totals or {}),
        "members": table,
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------ rendering


def _columns(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, title) of every table column after the label: benchmarks, then the averages that apply."""
    benchmarks = summary["benchmarks"]
    kinds = {summary["kinds"][b] for b in benchmarks}
    cols = [(b, summary["titles"][b]) for b in benchmarks]
    if CODE in kinds:
        cols.append(("code_avg", AVERAGE_TITLES["code_avg"]))
    if MATH in kinds:
        cols.append(("math_avg", AVERAGE_TITLES["math_avg"]))
    cols.append(("overall", AVERAGE_TITLES["overall"]))
    return cols


def _cell(row: Mapping[str, Any], key: str) -> float | None:
    return row.get(key) if key in AVERAGES else row["scores"].get(key)


def table_rows(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows (one decimal; '-' for a missing value)."""
    cols = _columns(summary)
    header = ["Model", *(title for _, title in cols)]
    body = []
    for row in summary["rows"]:
        cells = [row["label"]]
        for key, _ in cols:
            value = _cell(row, key)
            cells.append("-" if value is None else f"{value:.1f}")
        body.append(cells)
    return header, body


def markdown_table(summary: Mapping[str, Any]) -> str:
    header, body = table_rows(summary)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    incomplete = [n for n, m in summary["members"].items() if not m.get("complete", True)]
    note = f"\n\nIncomplete (not every problem graded yet): {', '.join(incomplete)}." if incomplete else ""
    return "Greedy pass@1 (%).\n\n" + "\n".join(lines) + note + "\n"


def csv_table(summary: Mapping[str, Any]) -> str:
    header, body = table_rows(summary)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(body)
    return buffer.getvalue()


def bar_chart(summary: Mapping[str, Any], path: str | Path) -> Path:
    """Grouped bars per benchmark and average: base model, PopuLoRA baseline (B1), each stock OpenRLHF model
    (B2), population mean (whisker: worst to best member per column). Written with matplotlib's Agg backend
    (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = _columns(summary)
    series = []
    for group, colors in (("base", ["#bbbbbb"]), ("baseline", ["#e07b39"]),
                          ("stock", ["#55a868", "#8172b3", "#c44e52", "#937860", "#da8bc3"]),
                          ("population", ["#3b75af"])):
        chosen = [r for r in summary["rows"] if _row_group(r) == group
                  and (group != "population" or r["label"] == POPULATION_MEAN_LABEL)]
        for i, row in enumerate(chosen):
            series.append((row["label"], colors[i % len(colors)], [_cell(row, k) for k, _ in cols]))
    if not series:
        raise ValueError("nothing to plot: the summary has no base, baseline, stock or population rows")
    population = [n for n, m in summary["members"].items() if m["group"] == "population"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cols) + 2), 4.2))
    width = 0.8 / len(series)
    for s, (label, color, values) in enumerate(series):
        xs = [c + (s - (len(series) - 1) / 2) * width for c in range(len(cols))]
        heights = [v if v is not None else 0.0 for v in values]
        ax.bar(xs, heights, width, label=label, color=color)
        if label == POPULATION_MEAN_LABEL and len(population) > 1:
            lows, highs = [], []
            for (key, _), mean in zip(cols, heights, strict=True):
                member_values = [_cell(summary["members"][n], key)
                                 for n in population]
                member_values = [v for v in member_values if v is not None] or [mean]
                lows.append(mean - min(member_values))
                highs.append(max(member_values) - mean)
            ax.errorbar(xs, heights, yerr=[lows, highs], fmt="none", ecolor="black", capsize=3, linewidth=1,
                        label="worst-best member")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([title for _, title in cols], rotation=30, ha="right")
    ax.set_ylabel("greedy pass@1 (%)")
    ax.set_ylim(0, max(5.0, max((v or 0.0) for _, _, vals in series for v in vals) * 1.25))
    ax.legend(fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def _row_group(row: Mapping[str, Any]) -> str | None:
    """The member group a table row belongs to (rows of older results.json files: from the label)."""
    return row.get("group") or LEGACY_GROUPS.get(row["label"])


def write_report(summary: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json``, ``results.md``, ``results.csv`` and ``results.png`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "csv": out / "results.csv",
             "chart": out / "results.png"}
    paths["json"].write_text(json.dumps(summary, indent=2, sort_keys=False))
    paths["markdown"].write_text(markdown_table(summary))
    paths["csv"].write_text(csv_table(summary))
    bar_chart(summary, paths["chart"])
    return paths


def report_from_results(results_json: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Re-render the table and chart from an existing ``results.json``."""
    path = Path(results_json)
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} not found: run the evaluation first") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg})") from None
    for key in ("benchmarks", "titles", "kinds", "members", "rows"):
        if key not in summary:
            raise ValueError(f"{path} lacks {key!r}: not a results.json written by openrlhf_populora.eval")
    return write_report(summary, out_dir or path.parent)
