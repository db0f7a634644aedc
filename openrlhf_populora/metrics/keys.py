"""The run-directory schema: every metric key, event and problem-record field, in one place.

A run directory written by ``Tracker`` holds:

- ``metrics.jsonl``   one JSON object per step: ``{"step": int, "time": unix seconds, <key>: value, ...}``.
                      Keys are flat strings built by the helpers below; values are numbers, ``null`` (missing,
                      e.g. a NaN) or short strings. Later records for the same step override earlier ones.
- ``events.jsonl``    one object per event: ``{"step", "time", "kind", ...}``; ``kind`` is ``"evolution"``
                      (see ``EVOLUTION_FIELDS``), ``"seeding"`` or anything else the loop wants to keep.
- ``problems.jsonl``  the per-step problem archive: one object per proposal with ``PROBLEM_FIELDS``.
- ``run_meta.json``   ``{"schema": SCHEMA_VERSION, "label": ..., "mode": ..., "sessions": [...]}`` (optional for the
                      report); ``sessions``: one record per start or resume that trains, the step it started
                      from, the git commit, package versions and CPU (``metrics.provenance``).

Key families (``<tt>`` is a task type such as ``code_o``; ``all`` aggregates over task types):

===============================================  ==========================================================
``train/<metric>``                               population mean this step (``TRAIN_METRICS``)
``train/<tt>/<metric>``                          the same, for one task type
``complexity/<axis>``                            mean over this step's valid proposals (``COMPLEXITY_AXES``)
``complexity/<tt>/<axis>``                       the same, for one task type
``coverage/<name>``                              the CVT archive, cumulative (``COVERAGE_METRICS``)
``matchup/<name>``                               this step's matchups (``MATCHUP_METRICS``)
``rating/<role>/<member>/<mu|sigma>``            rating of one member after this step
``matrix/<teacher>/<student>/solve_rate``        solve rate of a student on a teacher's valid problems
``member/<member>/<role>/<tt|all>/<metric>``     one member's value (metric from any list above, or
                                                 ``coverage`` for a teacher's own archive coverage)
``sync/max_abs_logprob_diff``                    Ray engine: the largest |log-prob| difference between vLLM and
                                                 the trainer on the sync probe after this step's uploads
                                                 (per member: ``member/<id>/<role>/all/sync_logprob_diff``)
``learning/<metric>``                             mean over members of how far each has moved from the base
                                                 (``LEARNING_METRICS``; per member: ``member/<id>/<role>/all/
                                                 <metric>``, ``probe_kl`` on its role's probe)
``time/<phase>``                                 wall-clock seconds of a phase (``generate_*``,
                                                 ``execute_*``, ``train``, ``evolve``, ``step``, ...)
``population/<name>``                            ``num_teachers``, ``num_students``
``eval/<benchmark>/<metric>``                    population-mean evaluation (e.g. ``eval/humaneval/pass@1``)
``eval/member/<member>/<benchmark>/<metric>``    one member's evaluation
===============================================  ==========================================================

``<role>`` is the role *in which the value was measured*: ``teacher`` (proposing) or ``student``
(solving). The single-agent baseline member (role ``both`` in the population) therefore logs under both.
Member ids must not contain ``/`` or whitespace. Members may appear and disappear between steps
(evolution): a member's series simply starts and stops.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 1

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
PROBLEMS_FILE = "problems.jsonl"
META_FILE = "run_meta.json"

STEP = "step"
TIME = "time"
ALL = "all"
ROLES = ("teacher", "student")

# metric name -> (role it is measured in, meaning)
TRAIN_METRICS = {
    "solve_rate": ("student", "fraction of answers verified correct"),
    "format_rate": ("student", "fraction of answers that parsed (format ok)"),
    "student_reward": ("student", "mean student reward"),
    "student_response_length": ("student", "mean answer length in tokens"),
    "validity": ("teacher", "fraction of proposals that passed the validity checks"),
    "difficulty": ("teacher", "1 - solve rate of the matched students on valid proposals"),
    "teacher_reward": ("teacher", "mean teacher reward"),
    "teacher_response_length": ("teacher", "mean proposal length in tokens"),
    "policy_loss": (None, "policy-gradient loss (mean over adapters trained)"),
    "grad_norm": (None, "gradient norm before clipping"),
    "entropy": (None, "mean token entropy of the sampled responses"),
    "kl": (None, "KL to the frozen base, when computed"),
    "lr": (None, "learning rate"),
}
SYNC_KEY = "sync/max_abs_logprob_diff"
# how far each member has moved from the frozen base (metrics/learning.py), measured every populora.probe_every steps
LEARNING_METRICS = {
    "update_size": "relative Frobenius norm of the adapter's update, ||s B A|| / ||W|| over all adapted modules",
    "probe_kl": "mean per-token KL(base || member) (k3 estimate) on a fixed probe of base responses to the role's prompts",
}
SYNC_DIAGNOSTIC = "sync_logprob_diff"  # the engine's per-adapter diagnostic, and the member metric's name
COMPLEXITY_AXES = ("ast_depth", "ast_nodes", "cyclomatic", "loc", "halstead_volume")
COVERAGE_METRICS = {
    "overall": "fraction of the CVT cells holding at least one program (0..1)",
    "distinct_programs": "number of distinct programs seen (AST-normalised)",
    "num_programs": "number of programs added to the archive",
    "diversity": "effective number of occupied cells, exp(Shannon entropy of cell visits)",
    "new_cells": "cells first occupied this step",
}
MATCHUP_METRICS = {
    "student_win_rate": "fraction of this step's matchups the student won",
    "teacher_win_rate": "fraction of this step's matchups the teacher won",
    "draw_rate": "fraction drawn",
    "count": "number of matchups",
}
RATING_STATS = ("mu", "sigma")
MEMBER_COVERAGE = "coverage"  # member/<teacher>/teacher/all/coverage

# events.jsonl, kind "evolution": a member replaced by a child of one or two parents
EVOLUTION_FIELDS = {
    "replaced": "id of the member removed",
    "child": "id of the new member",
    "parents": "list of parent ids (one for a mutation, two for a crossover)",
    "operator": "operator's readable name (e.g. gaussian, svd_mean; population/operators.py)",
    "operator_code": "the same operator in the paper's numbering (M1-M6, X1-X9; the controls keep their names)",
    "role": "teacher or student",
    "truncation_energy": "fraction of the update energy kept by the rank-r re-factorisation (optional)",
}
# problems.jsonl: one proposal per line
PROBLEM_FIELDS = {
    "step": "self-play step",
    "teacher": "proposer member id",
    "task_type": "code_o, code_i or code_f",
    "program": "the program text (``code`` is accepted too)",
    "inputs": "list of input argument strings",
    "outputs": "list of output reprs",
    "valid": "bool: passed the validity checks",
    "solve_rates": "dict student id -> solve rate on this problem (optional)",
    "reward": "teacher reward (optional)",
    "complexity": "dict from program_complexity (optional; recomputed when missing)",
}


def _segment(name: str, what: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or any(c.isspace() for c in name):
        raise ValueError(f"{what} must be a non-empty string without '/' or whitespace, got {name!r}")
    return name


def _role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES} (the role the value was measured in), got {role!r}")
    return role


def train_key(metric: str, task_type: str | None = None) -> str:
    """``train/<metric>`` or ``train/<task_type>/<metric>``."""
    if metric not in TRAIN_METRICS:
        raise ValueError(f"unknown train metric {metric!r}; expected one of {', '.join(TRAIN_METRICS)}")
    return f"train/{metric}" if task_type in (None, ALL) else f"train/{_segment(task_type, 'task_type')}/{metric}"


def complexity_key(axis: str, task_type: str | None = None) -> str:
    """``complexity/<axis>`` or ``complexity/<task_type>/<axis>``."""
    if axis not in COMPLEXITY_AXES:
        raise ValueError(f"unknown complexity axis {axis!r}; expected one of {', '.join(COMPLEXITY_AXES)}")
    if task_type in (None, ALL):
        return f"complexity/{axis}"
    return f"complexity/{_segment(task_type, 'task_type')}/{axis}"


def coverage_key(name: str) -> str:
    if name not in COVERAGE_METRICS:
        raise ValueError(f"unknown coverage metric {name!r}; expected one of {', '.join(COVERAGE_METRICS)}")
    return f"coverage/{name}"


def matchup_key(name: str) -> str:
    if name not in MATCHUP_METRICS:
        raise ValueError(f"unknown matchup metric {name!r}; expected one of {', '.join(MATCHUP_METRICS)}")
    return f"matchup/{name}"


def rating_key(member_id: str, role: str, stat: str = "mu") -> str:
    """``rating/<role>/<member_id>/<mu|sigma>``."""
    if stat not in RATING_STATS:
        raise ValueError(f"rating stat must be one of {RATING_STATS}, got {stat!r}")
    return f"rating/{_role(role)}/{_segment(member_id, 'member_id')}/{stat}"


def matrix_key(teacher_id: str, student_id: str) -> str:
    """``matrix/<teacher>/<student>/solve_rate``: the student's solve rate on that teacher's problems."""
    return f"matrix/{_segment(teacher_id, 'teacher_id')}/{_segment(student_id, 'student_id')}/solve_rate"


def member_key(member_id: str, role: str, metric: str, task_type: str = ALL) -> str:
    """``member/<member_id>/<role>/<task_type>/<metric>``; ``metric`` may not contain ``/``."""
    return (f"member/{_segment(member_id, 'member_id')}/{_role(role)}/{_segment(task_type, 'task_type')}/"
            f"{_segment(metric, 'metric')}")


def learning_key(metric: str) -> str:
    if metric not in LEARNING_METRICS:
        raise ValueError(f"unknown learning metric {metric!r}; expected one of {', '.join(LEARNING_METRICS)}")
    return f"learning/{metric}"


def time_key(phase: str) -> str:
    return f"time/{_segment(phase, 'phase')}"


def eval_key(benchmark: str, metric: str = "pass@1", member_id: str | None = None) -> str:
    """``eval/<benchmark>/<metric>``, or ``eval/member/<member_id>/<benchmark>/<metric>`` for one member."""
    tail = f"{_segment(benchmark, 'benchmark')}/{_segment(metric, 'metric')}"
    if benchmark == "member":
        raise ValueError("'member' is reserved in eval keys")
    return f"eval/{tail}" if member_id is None else f"eval/member/{_segment(member_id, 'member_id')}/{tail}"


@dataclass(frozen=True)
class MemberKey:
    member_id: str
    role: str
    task_type: str
    metric: str


def parse_member_key(key: str) -> MemberKey | None:
    """The parts of a ``member/...`` key, or None when ``key`` is not one."""
    parts = key.split("/")
    if len(parts) != 5 or parts[0] != "member" or parts[2] not in ROLES:
        return None
    return MemberKey(parts[1], parts[2], parts[3], parts[4])


def parse_rating_key(key: str) -> tuple[str, str, str] | None:
    """``(role, member_id, stat)`` of a ``rating/...`` key, or None."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != "rating" or parts[1] not in ROLES or parts[3] not in RATING_STATS:
        return None
    return parts[1], parts[2], parts[3]


def parse_matrix_key(key: str) -> tuple[str, str] | None:
    """``(teacher_id, student_id)`` of a ``matrix/...`` key, or None."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != "matrix" or parts[3] != "solve_rate":
        return None
    return parts[1], parts[2]
