"""Append-only, resumable store of graded samples: ``samples.jsonl`` plus ``settings.json``.

One JSON line per (member, benchmark, problem_id):
``{"member", "benchmark", "problem_id", "passed", "status", "detail", "prompt", "completion", "finished"}``.
Lines are flushed and fsynced as they are written, so after an interruption the file holds every graded
sample; a final line cut off mid-write is dropped on reopening (that sample is simply redone). Reopening
skips every key already present: an interrupted evaluation continues where it stopped.

``settings.json`` records what the samples depend on (prompt templates, generation length, base model, and a
SHA-256 of every member's adapter weights; for a full model evaluated on its own, ``--model``, one of its
weights, config and tokenizer files, prefixed ``model:``). Reopening with different settings, or with a member
whose adapter or model changed, raises instead of mixing incomparable samples, except that a store opened with
``regrade`` accepts new grading settings (``GRADING_KEYS``: the test time limit, the code sanitizer) and takes new
grades for every stored sample (``replace_grades``; ``cli.evaluate --regrade``). Members are merged: a later
invocation into the same directory may add members (a full model beside a run evaluated earlier, say) and
reuses every stored sample of the members it shares.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from openrlhf_populora.durable import replace_text

Key = tuple[str, str, str]  # (member, benchmark, problem_id)
SAMPLE_FIELDS = ("member", "benchmark", "problem_id", "passed")
# settings that change how a stored completion is graded, not what was generated: ``--regrade`` may change them
GRADING_KEYS = ("per_test_timeout_s", "code_sanitizer")
GRADE_FIELDS = ("passed", "status", "detail")
# settings added after stores were first written: what a settings.json without the key was written under
IMPLIED_BY_ABSENCE = {"code_sanitizer": "none"}
# settings recorded only since a later version, with no value to imply: a settings.json without one takes this
# invocation's, with a warning (the samples stored before cannot say what they were generated under)
RECORDED_LATER = ("dtype", "engine", "device")
REGRADING = "regrading"  # in settings.json while a regrade rewrites the samples


class ResultStore:
    """Graded samples on disk under ``directory`` (created when missing)."""

    def __init__(self, directory: str | Path, settings: dict[str, Any], regrade: bool = False,
                 read_only: bool = False) -> None:
        """``regrade``: the grading settings (``GRADING_KEYS``) may differ from the stored ones; the caller grades
        the stored samples again and hands the grades to ``replace_grades``, which records the new settings.
        ``read_only`` (a report on a store another process may be writing): nothing on disk changes. The
        settings are checked against the stored ones but not written (a store that does not exist keeps them in
        memory), a partial last line is skipped, not truncated, and ``append`` refuses."""
        if read_only and regrade:
            raise ValueError("a read-only store cannot be regraded")
        self.directory = Path(directory)
        self.samples_path = self.directory / "samples.jsonl"
        self.settings_path = self.directory / "settings.json"
        self.regrade = regrade
        self.read_only = read_only
        if not read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.settings = self._reconcile_settings(settings)
        self._records: dict[Key, dict[str, Any]] = {}
        self._load()

    # settings ----------------------------------------------------------------------------------------
    def _reconcile_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        fix = f"Fix: pass a new --out directory, or delete {self.directory} to start over."
        if self.settings_path.exists():
            try:
                old = json.loads(self.settings_path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{self.settings_path} is not valid JSON ({exc.msg}). {fix}") from None
            if old.pop(REGRADING, False) and not self.regrade:
                raise ValueError(f"{self.directory}: a --regrade was interrupted (its samples may carry the new "
                                 "grades, its settings the old ones). Fix: rerun with --regrade.")
            for key, value in settings.items():
                if key in RECORDED_LATER and key not in old:
                    warnings.warn(f"{self.settings_path} does not record {key!r} (written before it was): taking "
                                  f"this invocation's, {value!r}, for the samples already stored", stacklevel=3)
                stored = old.get(key, IMPLIED_BY_ABSENCE.get(key, value))
                if key == "members" or stored == value or (self.regrade and key in GRADING_KEYS):
                    continue
                hint = (" Or, since only how the stored completions are graded changed, rerun with --regrade "
                        "to grade them again." if key in GRADING_KEYS else "")
                raise ValueError(f"{self.settings_path}: setting {key!r} was {stored!r} for the samples already "
                                 f"stored, now {value!r}. {fix}{hint}")
            members = dict(old.get("members", {}))
            for name, digest in settings.get("members", {}).items():
                if name in members and members[name] != digest:
                    what = ("model (weights, config or tokenizer)" if str(digest).startswith("model:")
                            or str(members[name]).startswith("model:") else "adapter weights")
                    raise ValueError(
                        f"{self.settings_path}: the {what} of member {name!r} changed since its samples "
                        f"were stored. {fix}"
                    )
                members[name] = digest
            merged = {**old, **settings, "members": members}
        else:
            merged = dict(settings)
        if not (self.regrade or self.read_only):  # a regrade records them once the samples carry their grades
            self._write_settings(merged)
        return merged

    def _write_settings(self, settings: dict[str, Any]) -> None:
        replace_text(self.settings_path, json.dumps(settings, indent=2, sort_keys=True))

    # samples -----------------------------------------------------------------------------------------
    def _load(self) -> None:
        if not self.samples_path.exists():
            return
        data = self.samples_path.read_bytes()
        complete_end = data.rfind(b"\n") + 1
        if complete_end < len(data) and not self.read_only:  # an interrupted write: dropped, it will be redone
            warnings.warn(f"{self.samples_path}: dropping a partial last line (interrupted write)", stacklevel=2)
            with open(self.samples_path, "r+b") as handle:
                handle.truncate(complete_end)
        for lineno, line in enumerate(data[:complete_end].decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{self.samples_path}:{lineno}: corrupt sample line ({exc.msg}). Fix: delete that line "
                    "(the sample is redone) or start over in a new --out directory."
                ) from None
            if not isinstance(record, dict) or any(f not in record for f in SAMPLE_FIELDS):
                raise ValueError(f"{self.samples_path}:{lineno}: a sample needs the fields {', '.join(SAMPLE_FIELDS)}")
            self._records[self.key(record)] = record

    @staticmethod
    def key(record: dict[str, Any]) -> Key:
        return (str(record["member"]), str(record["benchmark"]), str(record["problem_id"]))

    def has(self, member: str, benchmark: str, problem_id: str) -> bool:
        return (member, benchmark, problem_id) in self._records

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """Write new samples durably (a key already stored is an error: samples are never overwritten)."""
        if self.read_only:
            raise RuntimeError(f"{self.directory} was opened read-only")
        lines = []
        for record in records:
            key = self.key(record)
            if key in self._records:
                raise ValueError(f"sample {key} is already stored in {self.samples_path}")
            self._records[key] = record
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        if not lines:
            return
        with open(self.samples_path, "a", encoding="utf-8") as handle:
            handle.write("".join(lines))
            handle.flush()
            os.fsync(handle.fileno())

    def replace_grades(self, grades: dict[Key, dict[str, Any]]) -> None:
        """(A store opened with ``regrade``) give the stored samples ``grades`` (``GRADE_FIELDS`` per key): mark
        ``settings.json`` as regrading, rewrite ``samples.jsonl`` whole (a new file, fsynced, renamed over the old
        one), then write the new settings without the mark. Interrupted anywhere in between, the store is refused
        until ``--regrade`` grades its samples again, so no table mixes two graders' verdicts."""
        if not self.regrade:
            raise RuntimeError("replace_grades needs a store opened with regrade=True")
        unknown = [key for key in grades if key not in self._records]
        if unknown:
            raise KeyError(f"no stored sample {unknown[0]} in {self.samples_path}")
        for key, grade in grades.items():
            self._records[key] = {**self._records[key], **{f: grade[f] for f in GRADE_FIELDS}}
        self._write_settings({**self.settings, REGRADING: True})  # until the end: refused without --regrade
        replace_text(self.samples_path,
                     "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self._records.values()))
        self._write_settings(self.settings)
        self.regrade = False

    def records(self) -> list[dict[str, Any]]:
        return list(self._records.values())

    def __len__(self) -> int:
        return len(self._records)
