"""Problem-space coverage: a CVT archive (``ribs.archives.CVTArchive``) over program descriptors.

Every valid proposal is mapped to a point in ``[0, 1]^6`` (``DESCRIPTORS``); each coordinate is
``min(log1p(x) / log1p(hi), 1)`` of a raw value ``x >= 0``:

=================  ======  ===========================================================
descriptor          hi      raw value
=================  ======  ===========================================================
``ast_depth``       30      AST depth (``complexity.program_complexity``)
``ast_nodes``       1000    AST node count
``cyclomatic``      50      McCabe cyclomatic complexity
``loc``             200     source lines of code
``input_size``      1000    characters of the input text (all inputs joined)
``output_size``     1000    characters of the output text (all outputs joined)
=================  ======  ===========================================================

The log scale spreads out the small programs self-play produces. The centroids of the ``cells`` (4096)
Voronoi cells come from k-means on uniform samples drawn with a fixed ``seed`` (``centroids_for``); they
are saved as ``centroids.npy`` with the run and reused on load, so coverage of different runs and seeds
is comparable (use the same seed, or pass the same ``centroids.npy``).

Statistics (cumulative):

- ``coverage()``            occupied cells / cells, overall or for one teacher's programs;
- ``distinct_programs()``   distinct programs by ``ast.dump`` of the parsed program (whitespace and comments
                            do not count);
- ``diversity()``           exp(H) with H the Shannon entropy of how the added programs fall over cells:
                            the number of equally used cells that would give the same entropy.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from openrlhf_populora.metrics.complexity import program_complexity
from openrlhf_populora.metrics.keys import MEMBER_COVERAGE, coverage_key, member_key

DESCRIPTORS = (
    ("ast_depth", 30.0),
    ("ast_nodes", 1000.0),
    ("cyclomatic", 50.0),
    ("loc", 200.0),
    ("input_size", 1000.0),
    ("output_size", 1000.0),
)
DEFAULT_CELLS = 4096
STATE_VERSION = 1
_CENTROID_CACHE: dict[tuple[int, int, int, int], np.ndarray] = {}


def _cache_dir() -> Path:
    root = os.environ.get("POPULORA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "openrlhf_populora")
    return Path(root)


def centroids_for(cells: int = DEFAULT_CELLS, seed: int = 0, dims: int = len(DESCRIPTORS),
                  samples: int | None = None, cache: bool = True) -> np.ndarray:
    """CVT centroids in ``[0, 1]^dims``: k-means (ribs ``k_means_centroids``) on ``samples`` uniform points.

    Deterministic in ``(cells, seed, dims, samples)``. ``samples`` defaults to ``5 * cells`` (seconds for
    4096 cells; more samples give more even cells but cost minutes). With ``cache`` the result is kept
    in-process and in ``$POPULORA_CACHE_DIR`` (default ``~/.cache/openrlhf_populora``) as an ``.npy`` file;
    ``cache=False`` always recomputes.
    """
    if cells < 2:
        raise ValueError(f"cells must be >= 2, got {cells}")
    samples = 5 * cells if samples is None else int(samples)
    if samples < cells:
        raise ValueError(f"samples ({samples}) must be >= cells ({cells})")
    key = (cells, seed, dims, samples)
    path = _cache_dir() / f"cvt_cells{cells}_seed{seed}_dims{dims}_samples{samples}.npy"
    if cache and key in _CENTROID_CACHE:
        return _CENTROID_CACHE[key].copy()
    if cache and path.exists():
        try:
            points = np.load(path)
            if points.shape == (cells, dims):
                _CENTROID_CACHE[key] = points
                return points.copy()
        except (OSError, ValueError):
            pass  # a broken cache file: recompute below
    from ribs.archives import k_means_centroids

    points, _ = k_means_centroids(centroids=cells, ranges=[(0.0, 1.0)] * dims, samples=samples, seed=seed)
    points = np.asarray(points, dtype=np.float64)
    if cache:
        _CENTROID_CACHE[key] = points
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, points)
            tmp.replace(path)
        except OSError:
            pass  # a read-only home: the in-process cache still helps
    return points.copy()


def _scale(value: float | None, hi: float) -> float:
    if value is None or not math.isfinite(value):
        raise ValueError("missing descriptor value")
    return min(math.log1p(max(value, 0.0)) / math.log1p(hi), 1.0)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value)
    return str(value)


def _fields(item: Any) -> tuple[str, str, str, Mapping | None]:
    """``(code, inputs text, outputs text, complexity or None)`` of a program string, dict or Task-like."""
    if isinstance(item, str):
        return item, "", "", None
    if isinstance(item, Mapping):
        code = item.get("program", item.get("code"))
        inputs = item.get("inputs", item.get("input"))
        outputs = item.get("outputs", item.get("output"))
        complexity = item.get("complexity")
    elif hasattr(item, "program"):
        code = item.program
        inputs, outputs, complexity = getattr(item, "inputs", None), getattr(item, "outputs", None), None
    else:
        raise TypeError(f"archive items are program strings, dicts with 'program'/'code', or Task-like "
                        f"objects with .program; got {type(item).__name__}")
    if not isinstance(code, str):
        raise TypeError(f"program must be a str, got {type(code).__name__}")
    return code, _text(inputs), _text(outputs), complexity


def program_descriptor(code: str, inputs: Any = None, outputs: Any = None,
                       complexity: Mapping | None = None) -> np.ndarray | None:
    """The ``[0, 1]^6`` descriptor of one program (see the module docstring); None if it does not parse."""
    c = complexity if complexity is not None else program_complexity(code)
    raw = {**{k: c.get(k) for k in ("ast_depth", "ast_nodes", "cyclomatic", "loc")},
           "input_size": float(len(_text(inputs))), "output_size": float(len(_text(outputs)))}
    try:
        return np.array([_scale(raw[name], hi) for name, hi in DESCRIPTORS])
    except ValueError:
        return None


def program_fingerprint(code: str) -> str:
    """Identity of a program up to formatting: sha1 of ``ast.dump`` (of the stripped text if unparsable)."""
    try:
        text = ast.dump(ast.parse(code))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        text = "\n".join(line.rstrip() for line in code.strip().splitlines())
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).hexdigest()


class CoverageArchive:
    """CVT coverage of the programs a run has produced, overall and per teacher.

    Create with ``CoverageArchive.create(directory, seed=0)`` (writes ``centroids.npy`` there, or reuses the
    one already there) and persist with ``save(directory)`` / ``CoverageArchive.load(directory)``.
    """

    def __init__(self, centroids: np.ndarray, seed: int = 0) -> None:
        centroids = np.asarray(centroids, dtype=np.float64)
        if centroids.ndim != 2 or centroids.shape[1] != len(DESCRIPTORS) or centroids.shape[0] < 2:
            raise ValueError(f"centroids must have shape (cells >= 2, {len(DESCRIPTORS)}), got {centroids.shape}")
        from ribs.archives import CVTArchive

        self.seed = seed
        self.centroids = centroids
        self.archive = CVTArchive(solution_dim=1, centroids=centroids, ranges=[(0.0, 1.0)] * len(DESCRIPTORS))
        self.visits = np.zeros(len(centroids), dtype=np.int64)  # programs added per cell
        self.teacher_cells: dict[str, set[int]] = {}
        self.programs: set[str] = set()
        self.teacher_programs: dict[str, set[str]] = {}
        self.num_programs = 0
        self._new_cells = 0  # since the last metrics() call

    @property
    def cells(self) -> int:
        return len(self.centroids)

    # ---------------------------------------------------------------------------------------------
    # construction and persistence

    @classmethod
    def create(cls, directory: str | Path | None = None, seed: int = 0, cells: int = DEFAULT_CELLS,
               centroids: str | Path | np.ndarray | None = None) -> CoverageArchive:
        """A new, empty archive. Centroids: ``centroids`` if given, else ``directory/centroids.npy`` if it
        exists, else computed from ``seed``. With a ``directory`` the centroids are saved there."""
        directory = Path(directory) if directory is not None else None
        if centroids is not None:
            points = np.load(centroids) if isinstance(centroids, (str, Path)) else np.asarray(centroids)
        elif directory is not None and (directory / "centroids.npy").exists():
            points = np.load(directory / "centroids.npy")
        else:
            points = centroids_for(cells, seed)
        archive = cls(points, seed=seed)
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            np.save(directory / "centroids.npy", archive.centroids)
        return archive

    def save(self, directory: str | Path) -> None:
        """Write ``centroids.npy`` and ``state.json`` (visits, per-teacher cells, program fingerprints)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / "centroids.npy", self.centroids)
        state = {
            "version": STATE_VERSION, "seed": self.seed, "cells": self.cells, "num_programs": self.num_programs,
            "visits": {str(i): int(v) for i, v in enumerate(self.visits) if v},
            "teacher_cells": {t: sorted(c) for t, c in self.teacher_cells.items()},
            "programs": sorted(self.programs),
            "teacher_programs": {t: sorted(p) for t, p in self.teacher_programs.items()},
        }
        tmp = directory / "state.json.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(directory / "state.json")

    @classmethod
    def load(cls, directory: str | Path) -> CoverageArchive:
        """The archive saved in ``directory`` (centroids alone give an empty archive)."""
        directory = Path(directory)
        if not (directory / "centroids.npy").exists():
            raise FileNotFoundError(f"no coverage archive in {directory} (centroids.npy missing)")
        state_path = directory / "state.json"
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        if state and state.get("version") != STATE_VERSION:
            raise ValueError(f"{state_path}: unsupported archive state version {state.get('version')!r}")
        archive = cls(np.load(directory / "centroids.npy"), seed=int(state.get("seed", 0)))
        for cell, count in state.get("visits", {}).items():
            archive.visits[int(cell)] = int(count)
        archive.teacher_cells = {t: set(c) for t, c in state.get("teacher_cells", {}).items()}
        archive.programs = set(state.get("programs", []))
        archive.teacher_programs = {t: set(p) for t, p in state.get("teacher_programs", {}).items()}
        archive.num_programs = int(state.get("num_programs", 0))
        occupied = np.flatnonzero(archive.visits)
        if len(occupied):  # each centroid lies in its own cell: re-inserting them restores the occupancy
            archive._insert(archive.centroids[occupied])
        return archive

    # ---------------------------------------------------------------------------------------------
    # adding programs

    def _insert(self, descriptors: np.ndarray) -> np.ndarray:
        n = len(descriptors)
        self.archive.add(np.zeros((n, 1)), np.zeros(n), descriptors)
        return np.asarray(self.archive.index_of(descriptors), dtype=np.int64)

    def add(self, items: Sequence[Any] | np.ndarray, teacher: str | Sequence[str | None] | None = None
            ) -> dict[str, int]:
        """Add programs and return ``{"added", "skipped", "new_cells", "new_programs", "batch_cells"}``.

        ``items``: program strings, dicts with ``program``/``code`` (+ optional ``inputs``, ``outputs``,
        ``complexity``), Task-like objects with ``.program``/``.inputs``/``.outputs``, or an ``(n, 6)`` array
        of descriptors already in ``[0, 1]`` (no program identity then). ``teacher``: one id for all items,
        one per item, or None. Unparsable programs are skipped (counted in ``skipped``).
        """
        n_items = len(items)
        teachers = [teacher] * n_items if teacher is None or isinstance(teacher, str) else list(teacher)
        if len(teachers) != n_items:
            raise ValueError(f"got {len(teachers)} teachers for {n_items} items")
        rows, owners, fingerprints = [], [], []
        if isinstance(items, np.ndarray):
            if items.ndim != 2 or items.shape[1] != len(DESCRIPTORS):
                raise ValueError(f"descriptor array must have shape (n, {len(DESCRIPTORS)}), got {items.shape}")
            if n_items and (not np.all(np.isfinite(items)) or items.min() < 0 or items.max() > 1):
                raise ValueError("descriptors must be finite and within [0, 1]")
            rows, owners, fingerprints = list(items), teachers, [None] * n_items
        else:
            for item, owner in zip(items, teachers, strict=True):
                code, inputs, outputs, complexity = _fields(item)
                descriptor = program_descriptor(code, inputs, outputs, complexity)
                if descriptor is None:
                    continue
                rows.append(descriptor)
                owners.append(owner)
                fingerprints.append(program_fingerprint(code))
        result = {"added": len(rows), "skipped": n_items - len(rows), "new_cells": 0, "new_programs": 0,
                  "batch_cells": 0}
        if not rows:
            return result
        before = int(np.count_nonzero(self.visits))
        cells = self._insert(np.asarray(rows, dtype=np.float64))
        np.add.at(self.visits, cells, 1)
        result["new_cells"] = int(np.count_nonzero(self.visits)) - before
        result["batch_cells"] = len(set(cells.tolist()))
        self._new_cells += result["new_cells"]
        self.num_programs += len(rows)
        for cell, owner, fp in zip(cells.tolist(), owners, fingerprints, strict=True):
            if fp is not None and fp not in self.programs:
                self.programs.add(fp)
                result["new_programs"] += 1
            if owner is not None:
                self.teacher_cells.setdefault(owner, set()).add(cell)
                if fp is not None:
                    self.teacher_programs.setdefault(owner, set()).add(fp)
        return result

    # ---------------------------------------------------------------------------------------------
    # statistics

    def coverage(self, teacher: str | None = None) -> float:
        """Fraction of cells occupied, by all programs or by one teacher's (0.0 for an unknown teacher)."""
        if teacher is None:
            return float(self.archive.stats.num_elites) / self.cells
        return len(self.teacher_cells.get(teacher, ())) / self.cells

    def coverage_by_teacher(self) -> dict[str, float]:
        return {t: self.coverage(t) for t in sorted(self.teacher_cells)}

    def distinct_programs(self, teacher: str | None = None) -> int:
        if teacher is None:
            return len(self.programs)
        return len(self.teacher_programs.get(teacher, ()))

    def diversity(self) -> float:
        """exp(Shannon entropy) of the distribution of added programs over cells (0.0 when empty)."""
        total = self.visits.sum()
        if total == 0:
            return 0.0
        p = self.visits[self.visits > 0] / total
        return float(np.exp(-(p * np.log(p)).sum()))

    def metrics(self, teachers: Sequence[str] | None = None) -> dict[str, float]:
        """Flat metric keys for the tracker: ``coverage/*`` plus ``member/<t>/teacher/all/coverage`` for
        ``teachers`` (default: every teacher seen). ``coverage/new_cells`` counts cells first occupied since
        the previous call."""
        out = {
            coverage_key("overall"): self.coverage(),
            coverage_key("distinct_programs"): float(self.distinct_programs()),
            coverage_key("num_programs"): float(self.num_programs),
            coverage_key("diversity"): self.diversity(),
            coverage_key("new_cells"): float(self._new_cells),
        }
        self._new_cells = 0
        for t in (sorted(self.teacher_cells) if teachers is None else teachers):
            out[member_key(t, "teacher", MEMBER_COVERAGE)] = self.coverage(t)
        return out

    def cell_counts(self) -> Counter:
        return Counter({int(i): int(v) for i, v in enumerate(self.visits) if v})
