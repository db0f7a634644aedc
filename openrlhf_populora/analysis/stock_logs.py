"""Reading a stock OpenRLHF run (baseline B2, ``openrlhf.cli.train_ppo_ray``) for the report.

Stock OpenRLHF 0.11.2 given ``--logger.tensorboard_dir T`` writes ``T/<run_name>/events.out.tfevents.*``:
one scalar per logged key and global step (1, 2, ...), tagged ``train/<key>`` (and ``eval/<key>`` for its
evaluations). A run argument of the report that is a directory without ``metrics.jsonl`` is read as such a
run when it holds event files directly, under ``tensorboard/<run_name>/`` (what the stock launch script
writes: ``OUT/tensorboard/<name>/``) or under ``<run_name>/``.

Every scalar is kept under its own tag behind a ``stock/`` prefix (``train/reward`` -> ``stock/train/reward``,
``train/timing/step_total`` -> ``stock/train/timing/step_total``): the prefix keeps upstream's keys out of
the PopuLoRA families (``train/<tt>/<metric>`` would otherwise read as a task type). Only quantities that
mean the same thing as a PopuLoRA key are *also* exposed under that key (``STOCK_KEY_MAP``):

- ``train/correct`` -> ``train/solve_rate``: the plugin's reward file logs the fraction of the sampled answers
  whose ``Verdict.correct`` holds, which is a student's solve rate (``selfplay/summary.py``);
- ``train/format_ok`` -> ``train/format_rate``: the fraction of the sampled answers whose ``Verdict.format_ok``
  holds, the student format rate;
- ``train/response_length`` -> ``train/student_response_length``: the mean number of generated answer tokens.

Deliberately *not* mapped: ``train/reward`` (upstream's logged reward can be reshaped after the reward file,
e.g. by its overlong/length penalty, and ``POPULORA_REWARD_MODE`` changes the scale, so it is not
``train/student_reward``), ``train/policy_loss``, ``train/actor_grad_norm``, ``train/kl`` (upstream's PPO loss
and its DeepSpeed gradient norm are other estimators than PopuLoRA's per-adapter diagnostics) and
``train/timing/step_total`` (in upstream's synchronous trainer the sum of its timed phases, not a step's
wall-clock ``time/step``).
They stay readable under ``stock/train/...`` (e.g. in ``RunData.series``).
"""

from __future__ import annotations

import math
from pathlib import Path

from openrlhf_populora.analysis.runs import RunData
from openrlhf_populora.metrics.keys import METRICS_FILE, train_key

EVENT_GLOB = "events.out.tfevents.*"
STOCK_PREFIX = "stock/"
STOCK_LABEL = "stock OpenRLHF"
STOCK_MODE = "stock"
# stock TensorBoard tag -> PopuLoRA key of the same quantity (see the module docstring)
STOCK_KEY_MAP = {
    "train/correct": train_key("solve_rate"),
    "train/format_ok": train_key("format_rate"),
    "train/response_length": train_key("student_response_length"),
}


def _has_events(directory: Path) -> bool:
    return directory.is_dir() and any(p.is_file() for p in directory.glob(EVENT_GLOB))


def find_event_dir(path: str | Path) -> Path | None:
    """The directory holding a stock run's event files under ``path``, or None when there is none.

    Looked for in ``path`` itself, then in ``path/tensorboard/<run_name>/``, then in ``path/<run_name>/``.
    Raises ``ValueError`` when one level holds several run directories with event files (which one is meant
    cannot be guessed: give that directory instead).
    """
    path = Path(path)
    if _has_events(path):
        return path
    for parent in (path / "tensorboard", path):
        if not parent.is_dir():
            continue
        found = sorted(d for d in parent.iterdir() if _has_events(d))
        if len(found) > 1:
            raise ValueError(f"{path}: several TensorBoard runs ({', '.join(str(d) for d in found)}); "
                             "give one of them as the run directory")
        if found:
            return found[0]
    return None


def is_stock_run(path: str | Path) -> bool:
    """True for a directory without ``metrics.jsonl`` that holds stock OpenRLHF event files."""
    path = Path(path)
    return path.is_dir() and not (path / METRICS_FILE).exists() and find_event_dir(path) is not None


def read_scalars(event_dir: str | Path) -> dict[int, dict[str, float]]:
    """``step -> {tag: value}`` of every finite scalar in ``event_dir``'s event files (a later write wins)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    accumulator = EventAccumulator(str(event_dir), size_guidance={SCALARS: 0})  # 0: keep every point
    accumulator.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in accumulator.Tags().get(SCALARS, []):
        for event in sorted(accumulator.Scalars(tag), key=lambda e: e.wall_time):
            value = float(event.value)
            if math.isfinite(value):
                out.setdefault(int(event.step), {})[tag] = value
    return out


def stock_records(scalars: dict[int, dict[str, float]]) -> dict[int, dict[str, float | int]]:
    """Report records from ``read_scalars``: ``stock/<tag>`` for every tag, plus ``STOCK_KEY_MAP``'s keys."""
    records: dict[int, dict[str, float | int]] = {}
    for step in sorted(scalars):
        record: dict[str, float | int] = {"step": step}
        for tag, value in scalars[step].items():
            record[STOCK_PREFIX + tag] = value
            if tag in STOCK_KEY_MAP:
                record[STOCK_KEY_MAP[tag]] = value
        records[step] = record
    return records


def load_stock_run(path: str | Path, label: str | None = None) -> RunData:
    """Load a stock OpenRLHF run directory as ``RunData`` (mode ``"stock"``, label ``"stock OpenRLHF"``).

    Raises ``FileNotFoundError`` when ``path`` holds no event files and ``ValueError`` when it holds several
    runs; an unreadable event file only costs its values (a warning).
    """
    path = Path(path)
    event_dir = find_event_dir(path)
    if event_dir is None:
        raise FileNotFoundError(f"no {METRICS_FILE} and no TensorBoard event files ({EVENT_GLOB}) in {path}")
    warnings: list[str] = []
    try:
        scalars = read_scalars(event_dir)
    except Exception as err:  # a truncated or foreign event file
        warnings.append(f"{event_dir}: event files unreadable ({type(err).__name__}: {err})")
        scalars = {}
    records = stock_records(scalars)
    tags = {tag for values in scalars.values() for tag in values}
    missing = sorted(tag for tag in STOCK_KEY_MAP if tag not in tags)
    if records and missing:
        warnings.append(f"stock run without {', '.join(missing)} (the plugin's reward file logs them): "
                        f"no {', '.join(STOCK_KEY_MAP[t] for t in missing)}")
    return RunData(path=path, label=label or STOCK_LABEL, mode=STOCK_MODE, records=records, events=[],
                   warnings=warnings)
