"""Reading run directories back: tolerant of crashes, older versions and missing keys.

``load_run(path)`` never raises on bad content: unreadable lines (a crash mid-write, a foreign line) are
skipped and reported in ``RunData.warnings``; everything else is still used. Series come back as numpy
arrays over the steps where the key has a finite number.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from openrlhf_populora.metrics.keys import (
    ALL,
    EVENTS_FILE,
    META_FILE,
    METRICS_FILE,
    PROBLEMS_FILE,
    STEP,
    parse_matrix_key,
    parse_member_key,
    parse_rating_key,
)

Series = tuple[np.ndarray, np.ndarray]  # (steps, values)


def read_jsonl(path: Path, warnings: list[str] | None) -> list[dict[str, Any]]:
    """The objects of a JSONL file that carry an integer ``step``; a damaged line is skipped with a message in
    ``warnings``, or raises ``ValueError`` naming it where ``warnings`` is None."""
    if not path.exists():
        return []
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            last = number == len(lines) and not line.endswith("\n")
            _damaged(warnings, path, number, "truncated last line (crash?)" if last else "not valid JSON")
            continue
        step = obj.get(STEP) if isinstance(obj, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            _damaged(warnings, path, number, "no integer 'step'")
            continue
        out.append(obj)
    return out


def _damaged(warnings: list[str] | None, path: Path, number: int, what: str) -> None:
    if warnings is None:
        raise ValueError(f"{path} line {number}: {what}. Fix: repair or remove that line.")
    warnings.append(f"{path.name} line {number}: {what}, skipped")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass
class RunData:
    """One run directory, loaded. ``records``: step -> merged record (later lines override earlier)."""

    path: Path
    label: str
    mode: str | None
    records: dict[int, dict[str, Any]]
    events: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)
    synthetic: bool = False  # written by analysis.synthetic (``run_meta.json`` says so): not a real run
    _problems: list[dict[str, Any]] | None = None
    _keys: set[str] | None = None

    @property
    def steps(self) -> list[int]:
        return sorted(self.records)

    @property
    def is_baseline(self) -> bool:
        if self.mode is not None:
            return self.mode == "baseline"
        return "baseline" in self.label.lower()

    def keys(self) -> set[str]:
        """Every key of every record (computed once; ``records`` is not meant to change after loading)."""
        if self._keys is None:
            self._keys = set()
            for record in self.records.values():
                self._keys.update(record)
        return self._keys

    def has(self, key: str) -> bool:
        return any(_number(r.get(key)) is not None for r in self.records.values())

    def series(self, key: str) -> Series:
        xs, ys = [], []
        for step in self.steps:
            value = _number(self.records[step].get(key))
            if value is not None:
                xs.append(step)
                ys.append(value)
        return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)

    def member_series(self, role: str, metric: str, task_type: str = ALL) -> dict[str, Series]:
        """``member_id -> series`` of ``member/<id>/<role>/<task_type>/<metric>``."""
        ids = sorted({p.member_id for p in map(parse_member_key, self.keys()) if p is not None
                      and p.role == role and p.metric == metric and p.task_type == task_type})
        out = {}
        for member in ids:
            s = self.series(f"member/{member}/{role}/{task_type}/{metric}")
            if len(s[0]):
                out[member] = s
        return out

    def task_types(self) -> list[str]:
        found = {p.task_type for p in map(parse_member_key, self.keys()) if p is not None and p.task_type != ALL}
        for key in self.keys():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "train":
                found.add(parts[1])
        return sorted(found)

    def rating_series(self, role: str, stat: str = "mu") -> dict[str, Series]:
        ids = sorted({p[1] for p in map(parse_rating_key, self.keys()) if p and p[0] == role and p[2] == stat})
        return {m: self.series(f"rating/{role}/{m}/{stat}") for m in ids}

    def matrix_steps(self) -> list[int]:
        return [s for s in self.steps if any(parse_matrix_key(k) and _number(v) is not None
                                             for k, v in self.records[s].items())]

    def matrix_at(self, step: int) -> dict[tuple[str, str], float]:
        out = {}
        for key, value in self.records.get(step, {}).items():
            parsed, number = parse_matrix_key(key), _number(value)
            if parsed and number is not None:
                out[parsed] = number
        return out

    def member_lifetimes(self) -> dict[str, tuple[str, int, int]]:
        """``member_id -> (role, first step, last step)`` from member and rating keys."""
        spans: dict[str, list] = {}
        for step in self.steps:
            for key in self.records[step]:
                parsed = parse_member_key(key)
                role_id = (parsed.role, parsed.member_id) if parsed else None
                if role_id is None:
                    rating = parse_rating_key(key)
                    role_id = (rating[0], rating[1]) if rating else None
                if role_id is None:
                    continue
                role, member = role_id
                span = spans.setdefault(member, [role, step, step])
                span[1], span[2] = min(span[1], step), max(span[2], step)
        return {m: (r, a, b) for m, (r, a, b) in spans.items()}

    def evolution_events(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind", "evolution") == "evolution" and "child" in e]

    def problems(self) -> list[dict[str, Any]]:
        """The per-step problem archive (read on first use)."""
        if self._problems is None:
            self._problems = read_jsonl(self.path / PROBLEMS_FILE, self.warnings)
        return self._problems

    def between(self, first: int, last: int | None = None) -> RunData:
        """The run as if it held only steps ``first``..``last`` (both included; ``last`` None: to its end): its
        metrics, events and problems of those steps. What a statistic reads from it (a slope, the programs'
        cells, which of them are new) then sees that window alone, as it would see a run of those steps."""
        def inside(step: int) -> bool:
            return step >= first and (last is None or step <= last)

        return RunData(path=self.path, label=self.label, mode=self.mode,
                       records={s: r for s, r in self.records.items() if inside(s)},
                       events=[e for e in self.events if inside(e[STEP])], warnings=self.warnings,
                       synthetic=self.synthetic, _problems=[p for p in self.problems() if inside(p[STEP])])


def _mode_from_config(path: Path) -> str | None:
    config = path / "config.yaml"
    if not config.exists():
        return None
    try:
        import yaml

        data = yaml.safe_load(config.read_text())
    except Exception:
        return None
    if isinstance(data, dict):
        section = data.get("populora", data)
        if isinstance(section, dict) and isinstance(section.get("mode"), str):
            return section["mode"]
    return None


def load_run(path: str | Path, label: str | None = None) -> RunData:
    """Load a run directory. Raises ``FileNotFoundError`` only when ``path`` is not a directory."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {path} does not exist")
    warnings: list[str] = []
    meta: dict[str, Any] = {}
    if (path / META_FILE).exists():
        try:
            meta = json.loads((path / META_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            warnings.append(f"{META_FILE}: unreadable, ignored")
        if not isinstance(meta, dict):
            meta = {}
    if not (path / METRICS_FILE).exists():
        warnings.append(f"no {METRICS_FILE} in {path}")
    records: dict[int, dict[str, Any]] = defaultdict(dict)
    for obj in read_jsonl(path / METRICS_FILE, warnings):
        records[obj[STEP]].update(obj)
    events = read_jsonl(path / EVENTS_FILE, warnings)
    mode = meta.get("mode") if isinstance(meta.get("mode"), str) else _mode_from_config(path)
    name = label or (meta.get("label") if isinstance(meta.get("label"), str) else None) or path.name
    return RunData(path=path, label=name, mode=mode, records=dict(records), events=events, warnings=warnings,
                   synthetic=meta.get("synthetic") is True)
