"""A learning-rate sweep read side by side: reward gain, format rates, and how far the adapters moved.

    python benchmarks/lr_sweep.py runs/lr-calibration/lr* --out results/lr-calibration

For each run directory (its ``config.yaml`` gives the learning rate) it prints and writes (``sweep.md``,
``sweep.json``, ``sweep.png``):

- the students' reward and solve rate, and the teachers' reward, as the mean of the last ``--window`` steps minus
  the mean of the first ``--window`` (the gain), with the first-window level;
- the students' format rate at the start and the end;
- the last measured update size (``learning/update_size``) and probe KL from the base, per role.

and picks the learning rate with the largest student-reward gain among those that stay sane: the last probe KL
in either role at most ``--max-kl`` nats per token, and neither the students' format rate nor the teachers'
validity down by more than ``--max-format-drop``. The gain of one short seed is noisy (the step-to-step SD of the students' reward is
printed beside it): read the curves, not only the pick.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openrlhf_populora.analysis.runs import load_run  # noqa: E402


def _lr(run_dir: Path) -> float:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return float(config["actor"]["adam"]["lr"])


def _window_mean(values: np.ndarray, first: bool, window: int) -> float:
    part = values[:window] if first else values[-window:]
    part = part[~np.isnan(part)]
    return float(part.mean()) if len(part) else math.nan


def _role_mean(run, role: str, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """The mean over members of a role, at each step the metric was measured."""
    series = run.member_series(role, metric)
    if not series:
        return np.array([]), np.array([])
    steps = np.unique(np.concatenate([xs for xs, _ in series.values()]))
    grid = np.full((len(series), len(steps)), np.nan)
    for row, (xs, ys) in enumerate(series.values()):
        grid[row, np.searchsorted(steps, xs)] = ys
    return steps, np.nanmean(grid, axis=0)


def _load(run_dir: Path, steps: int | None):
    """The run, cut to its first ``steps`` steps (runs stopped at different steps compare on the same span)."""
    run = load_run(run_dir)
    if steps is not None:
        run.records = {s: r for s, r in run.records.items() if s <= steps}
    return run


def summarize(run_dir: Path, window: int, steps: int | None = None) -> dict:
    run = _load(run_dir, steps)
    row: dict = {"run": str(run_dir), "lr": _lr(run_dir), "steps": len(run.steps)}
    for key, name in (("train/student_reward", "student_reward"), ("train/solve_rate", "solve_rate"),
                      ("train/teacher_reward", "teacher_reward"), ("train/format_rate", "format_rate"),
                      ("train/validity", "validity")):
        _, ys = run.series(key)
        ys = np.asarray(ys, dtype=float)
        row[f"{name}_first"] = _window_mean(ys, True, window)
        row[f"{name}_last"] = _window_mean(ys, False, window)
        # the two windows must not overlap, or the gain is partly a run's own noise compared with itself
        row[f"{name}_gain"] = row[f"{name}_last"] - row[f"{name}_first"] if len(ys) >= 2 * window else math.nan
        row[f"{name}_sd"] = float(np.nanstd(np.diff(ys)) / math.sqrt(2)) if len(ys) > 2 else math.nan
    _, sizes = run.series("learning/update_size")
    row["update_size_last"] = float(sizes[-1]) if len(sizes) else math.nan
    for role in ("teacher", "student"):
        _, kl = _role_mean(run, role, "probe_kl")
        row[f"{role}_probe_kl_last"] = float(kl[-1]) if len(kl) else math.nan
    return row


def choose(rows: list[dict], max_kl: float, max_format_drop: float) -> tuple[dict | None, dict[float, str]]:
    """The sane run with the largest student-reward gain, and why each other run was not picked."""
    why: dict[float, str] = {}
    sane = []
    for row in rows:
        kl = max(row["teacher_probe_kl_last"], row["student_probe_kl_last"])
        if math.isnan(row["student_reward_gain"]):
            why[row["lr"]] = f"too few steps ({row['steps']}) for a gain"
        elif not kl <= max_kl:
            why[row["lr"]] = f"probe KL {kl:.3g} > {max_kl:g} nats/token"
        elif row["format_rate_gain"] < -max_format_drop:
            why[row["lr"]] = f"the students' format rate fell by {-row['format_rate_gain']:.2f}"
        elif row["validity_gain"] < -max_format_drop:
            why[row["lr"]] = f"the teachers' validity fell by {-row['validity_gain']:.2f}"
        else:
            sane.append(row)
    pick = max(sane, key=lambda r: r["student_reward_gain"], default=None)
    for row in sane:
        if row is not pick:
            why[row["lr"]] = f"smaller student-reward gain ({row['student_reward_gain']:+.3f})"
    return pick, why


def figure(run_dirs: list[Path], out: Path, steps: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("train/student_reward", "student reward"), ("train/solve_rate", "student solve rate"),
              ("train/format_rate", "student format rate"), ("train/teacher_reward", "teacher reward"),
              ("learning/update_size", "update size ||sBA|| / ||W||"), (("student", "probe_kl"),
                                                                       "student probe KL (nats/token)"),
              (("teacher", "probe_kl"), "teacher probe KL (nats/token)"), ("train/validity", "teacher validity")]
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.4), constrained_layout=True)
    for run_dir in sorted(run_dirs, key=_lr):
        run = _load(run_dir, steps)
        for ax, (key, label) in zip(axes.flat, panels, strict=True):
            xs, ys = _role_mean(run, *key) if isinstance(key, tuple) else run.series(key)
            if len(xs):
                ax.plot(xs, ys, marker="o", ms=3, label=f"lr {_lr(run_dir):g}")
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    for ax in (axes.flat[4], axes.flat[5], axes.flat[6]):
        if ax.lines:
            ax.set_yscale("symlog", linthresh=1e-4)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Learning-rate sweep (one seed each; mean over members)")
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--window", type=int, default=3, help="steps averaged at the start and at the end")
    parser.add_argument("--max-kl", type=float, default=0.5)
    parser.add_argument("--max-format-drop", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=None, help="read only the first N steps of every run")
    args = parser.parse_args(argv)
    rows = sorted((summarize(r, args.window, args.steps) for r in args.runs), key=lambda r: r["lr"])
    pick, why = choose(rows, args.max_kl, args.max_format_drop)
    lines = [f"| lr | steps | student reward (first {args.window} -> gain, step SD) | solve rate gain | "
             "teacher reward gain | format rate first -> last | validity first -> last | update size | "
             "probe KL teacher / student |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | {r['steps']} | {r['student_reward_first']:+.3f} -> {r['student_reward_gain']:+.3f} "
            f"(SD {r['student_reward_sd']:.3f}) | {r['solve_rate_gain']:+.3f} | {r['teacher_reward_gain']:+.3f} | "
            f"{r['format_rate_first']:.2f} -> {r['format_rate_last']:.2f} | "
            f"{r['validity_first']:.2f} -> {r['validity_last']:.2f} | {r['update_size_last']:.2e} | "
            f"{r['teacher_probe_kl_last']:.3g} / {r['student_probe_kl_last']:.3g} |")
    verdict = (f"pick: lr {pick['lr']:g} (the largest student-reward gain with probe KL <= {args.max_kl:g} and the "
               f"format rate and validity down by at most {args.max_format_drop:g})" if pick else "pick: none is sane")
    lines += ["", verdict] + [f"- lr {lr:g}: {reason}" for lr, reason in sorted(why.items())]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.md").write_text(text + "\n")
    (args.out / "sweep.json").write_text(json.dumps({"rows": rows, "pick": pick and pick["lr"],
                                                     "why_not": {str(k): v for k, v in why.items()}}, indent=1))
    figure(args.runs, args.out / "sweep.png", args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
