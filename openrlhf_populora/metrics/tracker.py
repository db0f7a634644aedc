"""The run tracker: ``metrics.jsonl`` (always), TensorBoard and Weights & Biases (optional), with one set of keys.

Files in ``run_dir`` (schema in ``keys.py``): ``metrics.jsonl`` (one object per ``log`` call),
``problems.jsonl`` (``log_problems``), ``events.jsonl`` (``log_event``) and ``run_meta.json``. Every file
is opened in append mode and flushed after each write, so a crash loses at most the line being written;
a file that ends in such a partial line gets a newline before the next record.

TensorBoard uses the ``tensorboard`` package's own event writer (no torch); W&B is imported lazily and
works in offline mode (``{"mode": "offline"}``). Both receive the numeric values of ``log`` under the same
keys as ``metrics.jsonl``, every ``logging_steps``-th step (``--logger.logging_steps``, as in OpenRLHF);
strings and missing values go to the JSONL only, which gets every step.
"""

from __future__ import annotations

import json
import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from openrlhf_populora.durable import replace_text
from openrlhf_populora.metrics.keys import (
    EVENTS_FILE,
    META_FILE,
    METRICS_FILE,
    PROBLEMS_FILE,
    SCHEMA_VERSION,
    STEP,
    TIME,
)


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


def clean_value(key: str, value: Any) -> float | int | str | bool | None:
    """A JSON-safe scalar: numbers (numpy scalars too), bools, strings; NaN/inf and None become None."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()  # numpy / array scalars
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r}: expected a number, bool, str or None, got {type(value).__name__}")


def _jsonable(value: Any) -> Any:
    """Recursively JSON-safe (problem records and events): NaN/inf -> None, unknown objects -> repr."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(float(value)) else None
    if isinstance(value, (bool, str)):  # numpy bools / strings after .item()
        return value
    if hasattr(value, "tolist"):  # numpy arrays
        return _jsonable(value.tolist())
    if hasattr(value, "__dataclass_fields__"):
        return _jsonable({name: getattr(value, name) for name in value.__dataclass_fields__})
    return repr(value)


class _JsonlAppender:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = None

    def write(self, obj: dict) -> None:
        if self.file is None:
            needs_newline = False
            if self.path.exists() and self.path.stat().st_size > 0:
                with open(self.path, "rb") as f:
                    f.seek(-1, 2)
                    needs_newline = f.read(1) != b"\n"
            self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run)
            if needs_newline:
                self.file.write("\n")
        self.file.write(json.dumps(obj, allow_nan=False, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def truncate_after(self, step: int, drop: Callable[[dict], bool] | None = None) -> int:
        """Drop records with ``step > step``, those ``drop`` picks, and unreadable lines; returns how many lines
        were dropped."""
        self.close()
        if not self.path.exists():
            return 0
        kept, dropped = [], 0
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    obj = json.loads(line)
                    ok = isinstance(obj, dict) and isinstance(obj.get(STEP), int) and obj[STEP] <= step and \
                        not (drop is not None and drop(obj))
                except json.JSONDecodeError:
                    ok = False
                if ok:
                    kept.append(line if line.endswith("\n") else line + "\n")
                elif line.strip():
                    dropped += 1
        replace_text(self.path, "".join(kept))  # durably: a resume that rewrote it must not be undone by a crash
        return dropped


class _TensorBoard:
    """Scalars through tensorboard's event-file writer (the package, not torch.utils.tensorboard)."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as err:
            raise ImportError("--logger.tensorboard_dir needs the `tensorboard` package (pip install tensorboard)"
                              ) from err
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._event, self._summary = Event, Summary
        self.writer = EventFileWriter(str(logdir))

    def log(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        self.writer.add_event(self._event(wall_time=wall_time, step=step, summary=self._summary(value=values)))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _wandb_init(settings: Mapping[str, Any], run_dir: Path):
    import wandb

    settings = {k: v for k, v in settings.items() if v is not None}
    key = settings.pop("key", None)
    if "org" in settings:
        settings.setdefault("entity", settings.pop("org"))
    if "run_name" in settings:
        settings.setdefault("name", settings.pop("run_name"))
    settings.setdefault("dir", str(run_dir))
    Path(settings["dir"]).mkdir(parents=True, exist_ok=True)
    if key and settings.get("mode", "online") == "online":
        wandb.login(key=key)
    return wandb.init(**settings)


class Tracker:
    """Writes a run directory. ``tensorboard_dir``: also write TensorBoard scalars there. ``wandb``: also log
    to W&B, with these ``wandb.init`` settings (``project``, ``entity``/``org``, ``group``, ``name``/
    ``run_name``, ``mode`` (``online``/``offline``/``disabled``), ``config``, ``key``, ``dir`` (default
    ``run_dir``), ...). ``meta`` is merged into ``run_meta.json`` (e.g. ``{"label": ..., "mode": ...}``).
    ``logging_steps``: TensorBoard and W&B get the steps that are multiples of it (``metrics.jsonl`` all)."""

    def __init__(self, run_dir: str | Path, tensorboard_dir: str | Path | None = None,
                 wandb: Mapping[str, Any] | None = None, meta: Mapping[str, Any] | None = None,
                 logging_steps: int = 1) -> None:
        if isinstance(logging_steps, bool) or not isinstance(logging_steps, int) or logging_steps < 1:
            raise ValueError(f"logging_steps must be an int >= 1, got {logging_steps!r}")
        self.logging_steps = logging_steps
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = _JsonlAppender(self.run_dir / METRICS_FILE)
        self._problems = _JsonlAppender(self.run_dir / PROBLEMS_FILE)
        self._events = _JsonlAppender(self.run_dir / EVENTS_FILE)
        self._write_meta(meta or {})
        self._tb = _TensorBoard(tensorboard_dir) if tensorboard_dir else None
        self._wandb = _wandb_init(wandb, self.run_dir) if wandb else None
        self.last: dict[str, Any] = {}  # the last record passed to log()
        self.closed = False

    def _write_meta(self, meta: Mapping[str, Any]) -> None:
        path = self.run_dir / META_FILE
        current: dict[str, Any] = {}
        if path.exists():
            try:
                current = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                current = {}
        current.update(_jsonable(dict(meta)))
        current["schema"] = SCHEMA_VERSION
        current.setdefault("created", time.time())
        self._replace_meta(current)

    def _replace_meta(self, meta: Mapping[str, Any]) -> None:
        """Write ``run_meta.json`` whole, durably (a crash leaves the old one, sessions and all)."""
        replace_text(self.run_dir / META_FILE, json.dumps(meta, indent=1))

    def add_session(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` (``metrics.provenance``: code, packages, machine, the step it starts from) to
        ``run_meta.json``'s ``sessions``: one per start or resume (the runner skips a resume with no step left to
        train), never truncated by a resume."""
        path = self.run_dir / META_FILE
        current = json.loads(path.read_text())
        current.setdefault("sessions", []).append({**_jsonable(dict(record)), TIME: time.time()})
        self._replace_meta(current)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Tracker is closed")

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one step record ``{"step", "time", **metrics}`` and send numeric values to TB / W&B."""
        self._check_open()
        step = _check_step(step)
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a mapping of key -> value, got {type(metrics).__name__}")
        wall = time.time()
        record: dict[str, Any] = {STEP: step, TIME: wall}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key:
                raise TypeError(f"metric keys must be non-empty strings, got {key!r}")
            if key in (STEP, TIME):
                raise ValueError(f"{key!r} is reserved in a step record")
            record[key] = clean_value(key, value)
        self._metrics.write(record)
        scalars = {k: float(v) for k, v in record.items() if step % self.logging_steps == 0
                   and k not in (STEP, TIME) and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None and scalars:
            self._tb.log(step, scalars, wall)
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=step)
        self.last = record
        return record

    def log_problems(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Append this step's proposals to ``problems.jsonl`` (fields: ``keys.PROBLEM_FIELDS``)."""
        self._check_open()
        step = _check_step(step)
        for i, record in enumerate(records):
            if not isinstance(record, Mapping):
                raise TypeError(f"problem record {i} must be a mapping, got {type(record).__name__}")
            self._problems.write({**_jsonable(record), STEP: step})

    def log_event(self, step: int, event: Mapping[str, Any]) -> None:
        """Append an event (``{"kind": "evolution", "replaced", "child", "parents", "operator", ...}``)."""
        self._check_open()
        step = _check_step(step)
        if not isinstance(event, Mapping):
            raise TypeError(f"event must be a mapping, got {type(event).__name__}")
        self._events.write({**_jsonable(event), STEP: step, TIME: time.time()})

    def truncate_after(self, step: int, forget_events: str | None = None) -> dict[str, int]:
        """Forget records after ``step`` (resuming from a checkpoint at ``step``) and, with ``forget_events``, the
        events of that kind logged at ``step`` too (the checkpoint does not hold the work they record); rewrites
        each file once and returns the lines dropped per file."""
        self._check_open()
        step = _check_step(step)
        drop = None if forget_events is None else (lambda e: e[STEP] == step and e.get("kind") == forget_events)
        return {self._metrics.path.name: self._metrics.truncate_after(step),
                self._problems.path.name: self._problems.truncate_after(step),
                self._events.path.name: self._events.truncate_after(step, drop=drop)}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for appender in (self._metrics, self._problems, self._events):
            appender.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_postfix(metrics: Mapping[str, Any]) -> dict[str, str]:
    """Short tqdm postfix: solve rate, validity and coverage of a step record (``-`` when missing)."""
    def fmt(key: str, digits: int) -> str:
        value = metrics.get(key)
        return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"

    return {"solve": fmt("train/solve_rate", 2), "valid": fmt("train/validity", 2),
            "cover": fmt("coverage/overall", 4)}
