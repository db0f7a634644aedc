"""From graded samples to the paper's table and chart, each number with its interval and problem count.

``summarize`` turns the store's graded samples into ``results.json``'s content (scores per member, the table's
rows: base, B1, B2, the population's means, best and worst, every member); ``write_report`` writes it with the
table (``results.md``, ``results.csv``) and the bar chart (``results.png``). How each number and interval is
computed, and what each row means: docs/usage.md, "The pass@1 table".
"""

from __future__ import annotations

import csv
import io
import json
import warnings
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from openrlhf_populora.eval.benchmarks import BENCHMARKS
from openrlhf_populora.eval.problems import CODE, MATH

AVERAGES = ("code_avg", "math_avg", "overall")
AVERAGE_TITLES = {"code_avg": "Code Avg", "math_avg": "Math Avg", "overall": "Overall"}
GROUPS = ("base", "baseline", "stock", "arm", "population")
BASE_LABEL = "Base model"
BASELINE_LABEL = "PopuLoRA baseline (B1)"
STOCK_LABEL = "Stock OpenRLHF (B2)"
POPULATION_MEAN_LABEL = "Population mean"  # the mean rows' labels start with it
# the population's roles: a table row each (mean, best); "both" is the baseline agent's, a solver
ROLE_GROUPS = {"students": ("student", "both"), "teachers": ("teacher",)}
ROLE_NOUNS = {"students": "student", "teachers": "teacher", "members": "member"}
CONFIDENCE = 0.95
N_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
# row labels of results.json files written before rows carried their group
LEGACY_GROUPS = {BASE_LABEL: "base", "Baseline": "baseline", POPULATION_MEAN_LABEL: "population"}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _outcomes(records: Sequence[Mapping[str, Any]], benchmarks: Sequence[str]) -> dict[str, dict[str, dict[str, bool]]]:
    """member -> benchmark -> problem id -> passed."""
    out: dict[str, dict[str, dict[str, bool]]] = {}
    wanted = set(benchmarks)
    for r in records:
        if r["benchmark"] in wanted:
            out.setdefault(str(r["member"]), {}).setdefault(r["benchmark"], {})[str(r["problem_id"])] = bool(r["passed"])
    return out


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


def stock_label(name: str) -> str:
    """The table label of the full model ``--model NAME=DIR`` (the stock OpenRLHF baseline, B2)."""
    return f"{STOCK_LABEL}: {name}"


# ------------------------------------------------------------------------------------------ intervals


def wilson_interval(passed: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Wilson's binomial interval for ``passed`` of ``n``, in percent (None when n == 0)."""
    if n <= 0:
        return None
    from scipy.stats import binomtest

    ci = binomtest(int(passed), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return 100.0 * float(ci.low), 100.0 * float(ci.high)


def _average_statistic(kinds: Sequence[str], key: str):
    """The statistic ``key`` (``code_avg`` | ``math_avg`` | ``overall``) of per-benchmark samples (one array per
    benchmark, of per-problem pass rates), vectorised along ``axis`` as scipy's bootstrap wants it."""
    code = [i for i, k in enumerate(kinds) if k == CODE]
    math = [i for i, k in enumerate(kinds) if k == MATH]

    def statistic(*samples, axis=-1):
        means = [100.0 * np.mean(s, axis=axis) for s in samples]
        parts = []
        if key in ("code_avg", "overall") and code:
            parts.append(sum(means[i] for i in code) / len(code))
        if key in ("math_avg", "overall") and math:
            parts.append(sum(means[i] for i in math) / len(math))
        return sum(parts) / len(parts)

    return statistic


def bootstrap_interval(samples: Sequence[Sequence[float]], kinds: Sequence[str], key: str,
                       confidence: float = CONFIDENCE, n_resamples: int = N_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """Percentile bootstrap interval, in percent, of ``key`` over benchmarks whose per-problem pass rates are
    ``samples`` (one array per benchmark, of kind ``kinds[i]``): each benchmark's problems resampled on their own
    (``scipy.stats.bootstrap`` with ``paired=False``). None when a benchmark has fewer than two problems."""
    if not samples or any(len(s) < 2 for s in samples):
        return None
    from scipy.stats import bootstrap

    data = tuple(np.asarray(s, dtype=float) for s in samples)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all-equal samples (every problem passed, say) give a zero-width interval
        result = bootstrap(data, _average_statistic(kinds, key), paired=False, vectorized=True,
                           n_resamples=n_resamples, confidence_level=confidence, method="percentile",
                           rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def _or_wilson(ci: tuple[float, float] | None, value: float, n: int,
               confidence: float) -> tuple[float, float] | None:
    """A bootstrap interval, or, when it has no width (no resample can move the number: every problem of its
    benchmarks answered alike by every member of the row), Wilson's interval for ``value`` % of ``n`` problems."""
    if ci is None or ci[1] - ci[0] > 1e-9:
        return ci
    return wilson_interval(round(value * n / 100.0), n, confidence)


# ------------------------------------------------------------------------------------------ rows


def _row(label: str, group: str, kind: str, names: Sequence[str], outcomes: Mapping[str, Any],
         benchmarks: Sequence[str], confidence: float, n_resamples: int) -> dict[str, Any]:
    """A table row over members ``names``: per benchmark, the mean pass@1 on the problems all of them were graded
    on, its interval and ``n``; then the averages, each with its interval and ``n``."""
    scores: dict[str, float] = {}
    n: dict[str, int] = {}
    intervals: dict[str, list[float] | None] = {}
    samples: dict[str, np.ndarray] = {}
    for b in benchmarks:
        graded = [outcomes.get(name, {}).get(b, {}) for name in names]
        common = sorted(set.intersection(*(set(g) for g in graded))) if graded else []
        if not common:
            continue
        rates = np.array([[g[p] for p in common] for g in graded], dtype=float).mean(axis=0)
        samples[b], n[b] = rates, len(common)
        scores[b] = 100.0 * float(rates.mean())
        if len(names) == 1:
            ci = wilson_interval(int(rates.sum()), len(common), confidence)
        else:
            ci = _or_wilson(bootstrap_interval([rates], [BENCHMARKS[b].kind], "overall", confidence, n_resamples),
                            scores[b], len(common), confidence)
        intervals[b] = list(ci) if ci else None
    row: dict[str, Any] = {"label": label, "group": group, "kind": kind, "members": list(names),
                           "scores": scores, **averages(scores)}
    for key in AVERAGES:
        parts = [b for b in samples if key == "overall" or BENCHMARKS[b].kind == (CODE if key == "code_avg" else MATH)]
        if row[key] is None or not parts:
            continue
        n[key] = sum(n[b] for b in parts)
        if len(parts) == 1:
            intervals[key] = intervals[parts[0]]
        else:
            ci = bootstrap_interval([samples[b] for b in parts], [BENCHMARKS[b].kind for b in parts], key,
                                    confidence, n_resamples)
            ci = _or_wilson(ci, row[key], n[key], confidence)
            intervals[key] = list(ci) if ci else None
    row["n"], row["intervals"] = n, intervals
    return row


def _ranking_scores(names: Sequence[str], outcomes: Mapping[str, Any],
                    benchmarks: Sequence[str]) -> dict[str, Fraction] | None:
    """Each member's Overall, exactly (fractions: equal scores tie, whatever the float rounding), on the problems
    every one of ``names`` was graded on, benchmark by benchmark: members graded on different problems (an
    evaluation still running) are ranked on the same ones. None when they share no problem."""
    common = {}
    for b in benchmarks:
        shared = set.intersection(*(set(outcomes.get(n, {}).get(b, {})) for n in names))
        if shared:
            common[b] = sorted(shared)
    if not common:
        return None

    def overall(name: str) -> Fraction:  # the table's Overall (``averages``), on fractions
        return averages({b: Fraction(sum(bool(outcomes[name][b][p]) for p in ids), len(ids))
                         for b, ids in common.items()})["overall"]

    return {n: overall(n) for n in names}


def _pick(names: Sequence[str], scores: Mapping[str, Fraction], best: bool) -> tuple[str, list[str]]:
    """The member with the highest (``best``) or lowest score, and the others tied with it; the first listed
    stands for a tie."""
    target = max(scores[n] for n in names) if best else min(scores[n] for n in names)
    tied = [n for n in names if scores[n] == target]
    return tied[0], tied[1:]


def summarize(
    records: Sequence[Mapping[str, Any]],
    groups: Mapping[str, Sequence[str]],
    benchmarks: Sequence[str],
    totals: Mapping[str, int] | None = None,
    roles: Mapping[str, str] | None = None,
    untrained: Mapping[str, str] | None = None,
    select_on: Sequence[str] | None = None,
    confidence: float = CONFIDENCE,
    n_resamples: int = N_RESAMPLES,
) -> dict[str, Any]:
    """The content of ``results.json``.

    ``groups`` maps ``base`` / ``baseline`` / ``stock`` / ``arm`` / ``population`` to member names; ``totals`` (benchmark
    -> problem count) marks members whose evaluation is incomplete; ``roles`` gives each member's role;
    ``untrained`` (member -> why) names population members kept out of the means and the bests; ``select_on``
    names benchmarks, not in ``benchmarks``, on which the best of each role is picked (default: on
    ``benchmarks`` themselves, labelled optimistic)."""
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"unknown member groups {sorted(unknown)}; use {', '.join(GROUPS)}")
    select_on = list(select_on or [])
    overlap = sorted(set(select_on) & set(benchmarks))
    if overlap:
        raise ValueError(f"selection benchmarks {overlap} are also table benchmarks: a best picked on the "
                         "benchmark it is reported on is optimistic; select on benchmarks not in the table")
    untrained = dict(untrained or {})
    roles = dict(roles or {})
    outcomes = _outcomes(records, benchmarks)
    table: dict[str, dict[str, Any]] = {}
    for group in GROUPS:
        for name in groups.get(group, ()):
            entry = member_scores(records, name, benchmarks)
            own = _row(name, group, "member", [name], outcomes, benchmarks, confidence, n_resamples)
            entry["intervals"] = own["intervals"]  # (entry["n"]: graded problems per benchmark; rows carry the rest)
            entry["group"] = group
            entry["role"] = roles.get(name, group)
            entry["trained"] = name not in untrained
            entry["complete"] = all(entry["n"][b] >= (totals or {}).get(b, 0) and entry["n"][b] > 0 for b in benchmarks)
            table[name] = entry

    def row(label: str, group: str, kind: str, names: Sequence[str]) -> dict[str, Any]:
        return _row(label, group, kind, names, outcomes, benchmarks, confidence, n_resamples)

    rows = []
    if groups.get("base"):
        rows.append(row(BASE_LABEL, "base", "mean", groups["base"]))
    baseline = [n for n in groups.get("baseline", ()) if n not in untrained]
    if baseline:
        rows.append(row(BASELINE_LABEL, "baseline", "mean", baseline))
    for name in groups.get("baseline", ()):  # evaluated with --include-untrained: shown, never averaged
        if name in untrained:
            rows.append(row(f"{name} (baseline, untrained: {untrained[name]})", "baseline", "member", [name]))
    for name in groups.get("stock", ()):
        rows.append(row(stock_label(name), "stock", "member", [name]))
    for name in groups.get("arm", ()):  # another arm's solvers (cli.evaluate --arm), one row each, never averaged
        note = f", untrained: {untrained[name]}" if name in untrained else ""
        rows.append(row(f"{name} ({table[name]['role']}{note})", "arm", "member", [name]))
    population = list(groups.get("population", ()))
    trained = [n for n in population if n not in untrained and table[n]["overall"] is not None]

    def group_of(name: str) -> str:
        """The role group a member is averaged and picked in: a key of ``ROLE_GROUPS``, else ``members``."""
        return next((key for key, roles_in in ROLE_GROUPS.items() if table[name]["role"] in roles_in), "members")

    by_role = {key: [n for n in trained if group_of(n) == key] for key in ROLE_GROUPS}
    for key, names in by_role.items():
        if names:
            rows.append(row(f"{POPULATION_MEAN_LABEL}, {key} ({len(names)})", "population", "mean", names))
    if trained and all(set(trained) != set(names) for names in by_role.values()):
        rows.append(row(f"{POPULATION_MEAN_LABEL}, all members ({len(trained)})", "population", "mean", trained))
    # members of no known role (bare --adapter directories) get a best of their own
    by_role["members"] = [n for n in trained if group_of(n) == "members"]
    selection = _selection(records, select_on, confidence, n_resamples)
    pick_benchmarks = select_on or list(benchmarks)
    pick_outcomes = _outcomes(records, select_on) if select_on else outcomes
    totals = dict(totals or {})

    # members to evaluate that have no graded sample yet: a best or worst picked without them may change
    ungraded = [n for n in population if n not in untrained and table[n]["overall"] is None]

    def picked_on(names: Sequence[str], key: str | None) -> tuple[dict[str, Fraction], str]:
        """Each member's score that picks a best (among role group ``key``) or the worst (``key`` None: every
        role), and how it was picked."""
        missing = [n for n in names if not any(pick_outcomes.get(n, {}).get(b) for b in pick_benchmarks)]
        if select_on and missing:
            raise ValueError(f"members {missing} have no graded sample on the selection benchmarks "
                             f"{', '.join(select_on)}")
        scores = _ranking_scores(names, pick_outcomes, pick_benchmarks)
        if scores is None:
            raise ValueError(f"members {list(names)} share no graded problem on {', '.join(pick_benchmarks)}: "
                             "nothing to pick a best or a worst on")
        how = (f"picked on {', '.join(BENCHMARKS[b].title for b in select_on)}" if select_on
               else "picked on these benchmarks")
        partial = [n for n in names if any(len(pick_outcomes.get(n, {}).get(b, {})) < totals.get(b, 0)
                                           for b in pick_benchmarks)]
        waiting = [n for n in ungraded if key is None or group_of(n) == key]
        if partial:  # ranked on the problems graded so far: the pick may change
            how += "; provisional: not every problem graded"
        elif waiting:
            how += f"; provisional: {', '.join(waiting)} not graded yet"
        return scores, how

    def label(title: str, name: str, tied: list[str], how: str) -> str:
        return f"{title} {name} ({how}" + (f"; tied with {', '.join(tied)})" if tied else ")")

    for key, names in by_role.items():
        if len(names) < 2:
            continue
        picked, how = picked_on(names, key)
        best, tied = _pick(names, picked, best=True)
        rows.append(row(label(f"Best {ROLE_NOUNS[key]}", best, tied, how + ("" if select_on else ": optimistic")),
                        "population", "best", [best]))
    if len(trained) >= 2:  # the paper's floor: the weakest trained member, of any role
        picked, how = picked_on(trained, None)
        worst, tied = _pick(trained, picked, best=False)
        rows.append(row(label("Worst member", worst, tied, how + ("" if select_on else ": pessimistic")),
                        "population", "worst", [worst]))
    for name in population:
        note = f", untrained: {untrained[name]}" if name in untrained else ""
        rows.append(row(f"{name} ({table[name]['role']}{note})", "population", "member", [name]))
    base = list(groups.get("base", ()))
    if len(base) == 1:  # each single model against the base model, on the problems both answered
        for r in rows:
            if len(r["members"]) == 1 and r["members"][0] != base[0]:
                r["vs_base"] = paired_against(outcomes, r["members"][0], base[0], benchmarks)
    return {
        "metric": "greedy pass@1 (%)",
        "confidence": confidence,
        "n_resamples": n_resamples,
        "benchmarks": list(benchmarks),
        "titles": {b: BENCHMARKS[b].title for b in benchmarks},
        "kinds": {b: BENCHMARKS[b].kind for b in benchmarks},
        "totals": dict(totals or {}),
        "selection": selection["summary"],
        "untrained": untrained,
        "members": table,
        "rows": rows,
    }


def paired_against(outcomes: Mapping[str, Any], member: str, base: str,
                   benchmarks: Sequence[str]) -> dict[str, Any]:
    """``member`` against ``base`` on every problem of ``benchmarks`` both were graded on: how many it solves that
    the base does not (``gained``) and the reverse (``lost``), and McNemar's exact two-sided p (a binomial test of
    the discordant pairs). Overlapping intervals say little here: both answer the same problems."""
    from scipy.stats import binomtest

    gained = lost = shared = 0
    for b in benchmarks:
        mine, theirs = outcomes.get(member, {}).get(b, {}), outcomes.get(base, {}).get(b, {})
        for problem in set(mine) & set(theirs):
            shared += 1
            gained += bool(mine[problem]) and not theirs[problem]
            lost += bool(theirs[problem]) and not mine[problem]
    p = float(binomtest(gained, gained + lost).pvalue) if gained + lost else 1.0
    return {"gained": gained, "lost": lost, "problems": shared, "p": p}


def _selection(records: Sequence[Mapping[str, Any]], select_on: Sequence[str], confidence: float,
               n_resamples: int) -> dict[str, Any]:
    """Each member's ``overall`` on the selection benchmarks, and what results.json says about the choice."""
    if not select_on:
        return {"overall": {}, "summary": {"benchmarks": [], "held_out": False}}
    members = sorted({str(r["member"]) for r in records if r["benchmark"] in set(select_on)})
    scores = {m: member_scores(records, m, select_on) for m in members}
    return {"overall": {m: s["overall"] for m, s in scores.items()},
            "summary": {"benchmarks": list(select_on), "held_out": True,
                        "titles": {b: BENCHMARKS[b].title for b in select_on},
                        "scores": {m: {**s["scores"], "overall": s["overall"]} for m, s in scores.items()}}}


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


def _column_n(summary: Mapping[str, Any]) -> dict[str, int]:
    """The problems behind each column: a benchmark's problem count (``totals``, else the most any row has), and
    their sum over the benchmarks of an average."""
    totals = summary.get("totals") or {}
    n: dict[str, int] = {}
    for b in summary["benchmarks"]:
        n[b] = int(totals.get(b) or max((r.get("n", {}).get(b, 0) for r in summary["rows"]), default=0))
    for key in AVERAGES:
        parts = [b for b in summary["benchmarks"] if key == "overall"
                 or summary["kinds"][b] == (CODE if key == "code_avg" else MATH)]
        n[key] = sum(n[b] for b in parts)
    return n


def _format(row: Mapping[str, Any], key: str, column_n: int | None) -> str:
    """``55.5 [47.9, 62.9]``; ``(n=12)`` added when the number rests on fewer problems than its column's."""
    value = _cell(row, key)
    if value is None:
        return "-"
    text = f"{value:.1f}"
    interval = (row.get("intervals") or {}).get(key)
    if interval:
        text += f" [{interval[0]:.1f}, {interval[1]:.1f}]"
    n = (row.get("n") or {}).get(key)
    if n is not None and column_n is not None and n != column_n:
        text += f" (n={n})"
    return text


def table_rows(summary: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and formatted rows: one decimal, the interval in brackets; '-' for a missing value. A column's
    title carries its problem count, a cell its own when it differs (an incomplete evaluation)."""
    cols = _columns(summary)
    column_n = _column_n(summary)
    header = ["Model", *(f"{title} (n={column_n[key]})" if column_n[key] else title for key, title in cols)]
    body = [[row["label"], *(_format(row, key, column_n[key] or None) for key, _ in cols)] for row in summary["rows"]]
    if any(row.get("vs_base") for row in summary["rows"]):
        header.append("vs base: +gained / -lost (McNemar p)")
        for cells, row in zip(body, summary["rows"], strict=True):
            paired = row.get("vs_base")
            cells.append(f"+{paired['gained']} / -{paired['lost']} (p={paired['p']:.2g})" if paired else "")
    return header, body


def _notes(summary: Mapping[str, Any]) -> list[str]:
    notes = []
    if any(row.get("intervals") for row in summary["rows"]):
        confidence = 100 * summary.get("confidence", CONFIDENCE)
        resamples = summary.get("n_resamples", N_RESAMPLES)
        notes.append(f"Brackets: {confidence:g}% intervals. One member on one benchmark: Wilson's binomial interval "
                     f"over its n problems. Averages over benchmarks and means over members: a percentile bootstrap "
                     f"over problems ({resamples:,} resamples; each benchmark's problems resampled on their own, one "
                     "draw for every member of a row, since they answer the same problems).")
        notes.append("A mean over members resamples problems with the members fixed: its interval does not include "
                     "how much members, or seeds of a run, differ from one another.")
        notes.append("n: the problems a number rests on (a mean over members: the problems each of them answered).")
    present = [key for key, _ in _columns(summary) if key in ("code_avg", "math_avg")]
    if present:
        what = {"code_avg": "Code Avg: the unweighted mean of the code benchmarks' pass@1 (AZR's CAvg)",
                "math_avg": "Math Avg: the unweighted mean of the math benchmarks' pass@1 (AZR's MAvg)"}
        notes.append("; ".join(what[key] for key in present) + ", not pooled over problems. Overall: "
                     + ("the mean of the two (AZR's AVG)." if len(present) == 2 else "the same average."))
    if any(row.get("vs_base") for row in summary["rows"]):
        notes.append("vs base: on the problems both answered, how many the model solves that the base model does "
                     "not (+) and the reverse (-), with McNemar's exact two-sided p: the paired test, since both "
                     "answer the same problems (their intervals overlap even when one is better on many).")
    picks = [row for row in summary["rows"] if row.get("kind") in ("best", "worst")]
    selection = summary.get("selection") or {}
    if picks and selection.get("held_out"):
        titles = ", ".join((selection.get("titles") or {}).get(b, b) for b in selection["benchmarks"])
        notes.append(f"Best and worst rows: the member of the role with the highest Overall, and the member with "
                     f"the lowest, on {titles}, a benchmark not in this table, so their numbers here are not biased "
                     "by the choice.")
    elif picks:
        notes.append("Best and worst rows: the member of the role with the highest Overall on these same "
                     "benchmarks, and the member with the lowest. The maximum of several noisy scores is biased "
                     "upward and the minimum downward: read them as optimistic and pessimistic (cli.evaluate "
                     "--select-on BENCH picks on a separate benchmark instead). Their intervals are those of a "
                     "member named in advance: they do not account for the choice.")
    if picks:
        notes.append("Members are ranked on the problems all of them were graded on, by exact score; a tie names "
                     "every tied member and shows the first listed.")
    samples = summary.get("samples") or {}
    limits = summary.get("limit") or {}
    for bench in summary["benchmarks"]:
        title = summary.get("titles", {}).get(bench, bench)
        sample, limit = samples.get(bench), limits.get(bench)
        fixed = (f"a fixed sample of {sample['size']} of its {sample['of']} problems, the {sample['size']} whose "
                 f"SHA-256 of '{bench}/<problem id>' is smallest (cli.evaluate --sample), the same on every machine"
                 if sample else None)
        if limit and limit["size"] < (sample["size"] if sample else limit["of"]):
            notes.append(f"{title}: the first {limit['size']} (in the benchmark's order, --limit) of "
                         + (fixed if fixed else f"its {limit['of']} problems: not a random sample") + ".")
        elif fixed:
            notes.append(f"{title}: {fixed}.")
    untrained = summary.get("untrained") or {}
    if untrained:
        listed = "; ".join(f"{name} ({why})" for name, why in untrained.items())
        notes.append(f"Untrained members, left out of every mean and best: {listed}.")
    incomplete = [n for n, m in summary["members"].items() if not m.get("complete", True)]
    if incomplete:
        notes.append(f"Incomplete (not every problem graded yet): {', '.join(incomplete)}.")
    return notes


def markdown_table(summary: Mapping[str, Any]) -> str:
    header, body = table_rows(summary)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    notes = _notes(summary)
    return "Greedy pass@1 (%).\n\n" + "\n".join(lines) + ("\n\n" + "\n\n".join(notes) if notes else "") + "\n"


def csv_table(summary: Mapping[str, Any]) -> str:
    """One line per row: the label, then per column its value, interval ends and problem count."""
    cols = _columns(summary)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["Model", *(f"{title}{suffix}" for _, title in cols for suffix in ("", " low", " high", " n"))])

    def number(value: float | None) -> str:
        return "" if value is None else f"{value:.1f}"

    for row in summary["rows"]:
        cells = [row["label"]]
        for key, _ in cols:
            interval = (row.get("intervals") or {}).get(key) or (None, None)
            n = (row.get("n") or {}).get(key)
            cells += [number(_cell(row, key)), number(interval[0]), number(interval[1]), "" if n is None else str(n)]
        writer.writerow(cells)
    return buffer.getvalue()


def _is_mean_row(row: Mapping[str, Any]) -> bool:
    """A row the chart draws: a group's mean, a stock model or another arm's solver (older results.json files: by
    label)."""
    kind = row.get("kind")
    if kind is not None:
        return kind == "mean" or _row_group(row) in ("stock", "arm")
    return _row_group(row) != "population" or row["label"] == POPULATION_MEAN_LABEL


CHART_COLORS = {"base": ["#bbbbbb"], "baseline": ["#e07b39"],
                "stock": ["#55a868", "#8172b3", "#c44e52", "#937860", "#da8bc3"],
                "arm": ["#8c8c3c", "#c9a227", "#6b4c9a", "#2a9d8f"], "population": ["#3b75af", "#7fb1de", "#1f3f66"]}


def chart_rows(summary: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], str]]:
    """The rows the chart draws, in its order (by group, as ``CHART_COLORS``), each with its bar colour."""
    drawn = []
    for group, colors in CHART_COLORS.items():
        chosen = [r for r in summary["rows"] if _row_group(r) == group and _is_mean_row(r)]
        drawn += [(row, colors[i % len(colors)]) for i, row in enumerate(chosen)]
    return drawn


def bar_chart(summary: Mapping[str, Any], path: str | Path) -> Path:
    """Grouped bars per benchmark and average: base model, PopuLoRA baseline (B1), each stock OpenRLHF model
    (B2) and the population's means (students, teachers, all members), each with its interval as a whisker; a
    bar resting on fewer problems than its column's (an unfinished evaluation) is hatched. Written with
    matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = _columns(summary)
    column_n = _column_n(summary)
    series = []
    for row, color in chart_rows(summary):
        partial = [bool(column_n[k]) and (row.get("n") or {}).get(k, column_n[k]) != column_n[k] for k, _ in cols]
        series.append((row["label"], color, [_cell(row, k) for k, _ in cols],
                       [(row.get("intervals") or {}).get(k) for k, _ in cols], partial))
    if not series:
        raise ValueError("nothing to plot: the summary has no base, baseline, stock, arm or population rows")
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cols) + 2), 4.2))
    width = 0.8 / len(series)
    top = 0.0
    for s, (label, color, values, intervals, partial) in enumerate(series):
        xs = [c + (s - (len(series) - 1) / 2) * width for c in range(len(cols))]
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=label, color=color)
        for bar, cut in zip(bars, partial, strict=True):
            if cut:  # rests on fewer problems than its column: an evaluation not finished
                bar.set_hatch("///")
                bar.set_edgecolor("black")
        whiskers = [(x, h, ci) for x, h, ci in zip(xs, heights, intervals, strict=True) if ci]
        if whiskers:
            ax.errorbar([x for x, _, _ in whiskers], [h for _, h, _ in whiskers],
                        yerr=[[max(0.0, h - ci[0]) for _, h, ci in whiskers],
                              [max(0.0, ci[1] - h) for _, h, ci in whiskers]],
                        fmt="none", ecolor="black", capsize=2, linewidth=0.8)
        top = max([top, *heights, *(ci[1] for _, _, ci in whiskers)])
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([title for _, title in cols], rotation=30, ha="right")
    confidence = 100 * summary.get("confidence", CONFIDENCE)
    ax.set_ylabel(f"greedy pass@1 (%), {confidence:g}% intervals")
    if any(any(p) for *_, p in series):
        ax.set_title("hatched: fewer problems graded than the column's (incomplete)", fontsize=8)
    ax.set_ylim(0, max(5.0, top * 1.15))
    ax.legend(fontsize=7, frameon=False)
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
