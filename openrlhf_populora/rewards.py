"""Teacher and student rewards (pure functions), and ``reward_func`` for OpenRLHF's ``--reward.remote_url``.

Student (solver) reward for one answer, AZR's format-aware rule (paper Eq. 6)::

    r = correct          if the answer is correct                      (AZR: 1)
        wrong            if well formatted but wrong                   (AZR: -0.5)
        format_error     if no answer of the right kind could be parsed (AZR: -1)

Teacher (proposer) reward for one proposal with solve rate s (mean correctness of the matched students'
answers to it)::

    invalid proposal                 -> invalid_proposal                          (AZR: -1)
    mode "failure_rate" (PopuLoRA)   -> 1 - s          (the paper's rule: a fully solved task earns 0)
    mode "learnability" (AZR Eq. 4)  -> 1 - s if 0 < s < 1 else 0
    with ``remap_zero`` (off by default), a valid proposal whose reward above is exactly 0 gets
    ``zero_reward`` instead: AZR's code does that with -0.5, departing from its paper.

The baseline (one adapter in both roles) uses the same functions with mode "learnability": AZR's rules.
"""

# No ``from __future__ import annotations`` here: OpenRLHF loads this file with spec_from_file_location
# without registering it in sys.modules, and @dataclass with string annotations then fails.
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

TEACHER_MODES = ("failure_rate", "learnability")


@dataclass
class RewardConfig:
    """Every reward constant: AZR's format penalties, and the papers' teacher rule (no remap of 0)."""

    correct: float = field(default=1.0, metadata={"help": "student reward of a correct answer"})
    wrong: float = field(default=-0.5, metadata={"help": "student reward of a well-formed wrong answer (AZR)"})
    format_error: float = field(default=-1.0, metadata={"help": "student reward of an answer that does not parse (AZR)"})
    invalid_proposal: float = field(default=-1.0, metadata={"help": "teacher reward of an invalid proposal (AZR)"})
    remap_zero: bool = field(default=False, metadata={
        "help": "give a valid proposal whose teacher reward is exactly 0 (fully solved) zero_reward instead, as AZR's "
                "code does; off: the paper's rule"})
    zero_reward: float = field(default=-0.5, metadata={"help": "the reward remap_zero gives (AZR's code: -0.5)"})

    def validate(self) -> None:
        for name, value in asdict(self).items():
            if name == "remap_zero":
                if not isinstance(value, bool):
                    raise TypeError(f"RewardConfig.remap_zero must be a bool, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise ValueError(f"RewardConfig.{name} must be a finite number, got {value!r}")
        if not self.correct > self.wrong:
            raise ValueError(f"RewardConfig: correct ({self.correct}) must exceed wrong ({self.wrong})")

    @classmethod
    def evaluation(cls) -> "RewardConfig":
        """Plain accuracy: 1 if correct, else 0 (AZR's validation rewards)."""
        return cls(correct=1.0, wrong=0.0, format_error=0.0)


def student_reward(verdict, cfg: RewardConfig | None = None) -> float:
    """Reward of one solver answer from its ``Verdict`` (``.format_ok``, ``.correct``)."""
    cfg = cfg or RewardConfig()
    if verdict.correct:
        return float(cfg.correct)
    return float(cfg.wrong if verdict.format_ok else cfg.format_error)


def solve_rate(verdicts: Sequence) -> float:
    """Fraction of correct answers (the ``s`` of a teacher reward). Raises on an empty list."""
    if not verdicts:
        raise ValueError("solve_rate of no answers is undefined")
    return sum(bool(v.correct) for v in verdicts) / len(verdicts)


def teacher_reward(check, solve_rate: float | None, cfg: RewardConfig | None = None,
                   mode: str = "failure_rate") -> float:
    """Reward of one proposal from its ``ProposalCheck`` (``.valid``; a bool also works) and solve rate."""
    cfg = cfg or RewardConfig()
    if mode not in TEACHER_MODES:
        raise ValueError(f"teacher reward mode must be one of {TEACHER_MODES}, got {mode!r}")
    valid = check if isinstance(check, bool) else bool(check.valid)
    if not valid:
        return float(cfg.invalid_proposal)
    if solve_rate is None or isinstance(solve_rate, bool) or not 0.0 <= float(solve_rate) <= 1.0:
        raise ValueError(f"a valid proposal needs a solve rate in [0, 1], got {solve_rate!r}")
    s = float(solve_rate)
    if mode == "failure_rate":
        r = 1.0 - s
    else:
        r = 1.0 - s if 0.0 < s < 1.0 else 0.0
    if r == 0.0 and cfg.remap_zero:
        return float(cfg.zero_reward)
    return r


# ---------------------------------------------------------------------------------------- reward_func
# OpenRLHF 0.11.2 loads this file with --reward.remote_url path/to/rewards.py and calls
# reward_func([query], [prompt], [label]) per sample in a thread. An exception there leaves the sample's
# reward None and drops the rewards of its whole micro-batch, so reward_func never raises.
#
# Environment knobs: POPULORA_REWARD_MODE=train|eval (shaped AZR rewards, or 1/0 accuracy),
# POPULORA_SANDBOX_WORKERS (2), POPULORA_SANDBOX_TIMEOUT_S (5), POPULORA_SANDBOX_MEMORY_MB (512).

_SANDBOX = None
_SANDBOX_LOCK = threading.Lock()


def _shared_sandbox():
    global _SANDBOX
    with _SANDBOX_LOCK:
        if _SANDBOX is None:
            from openrlhf_populora.sandbox import Sandbox

            _SANDBOX = Sandbox(workers=int(os.environ.get("POPULORA_SANDBOX_WORKERS", "2")),
                               timeout_s=float(os.environ.get("POPULORA_SANDBOX_TIMEOUT_S", "5")),
                               memory_mb=int(os.environ.get("POPULORA_SANDBOX_MEMORY_MB", "512")))
        return _SANDBOX


def _task_from_label(label):
    from openrlhf_populora.tasks import Task

    data = json.loads(label) if isinstance(label, (str, bytes)) else label
    if isinstance(data, dict) and "task" in data and "program" not in data:
        data = data["task"]
    return Task.from_dict(data)


def _response_of(query, prompt) -> str:
    """The completion inside ``query`` (= decoded prompt + response): the text after the prompt, else after
    the prompt's last 64 characters (decoding may change the prompt's start), else the whole query."""
    if not isinstance(query, str):
        return ""
    if isinstance(prompt, str) and prompt.strip():
        at = query.find(prompt)
        if at >= 0:
            return query[at + len(prompt):]
        tail = prompt.rstrip()[-64:]
        at = query.rfind(tail)
        if at >= 0:
            return query[at + len(tail):]
    return query


def _as_tensor(values: list[float]):
    """OpenRLHF wants a tensor (``torch.tensor([t])`` of a 1-element tensor keeps shape [1]; of a list it
    would be [1, 1]). torch is imported here only, lazily; without torch a list is returned."""
    try:
        import torch
    except Exception:  # pragma: no cover - torch is installed wherever OpenRLHF runs
        return list(values)
    return torch.tensor(values, dtype=torch.float32)


def score_completions(queries, prompts, labels, *, sandbox=None, cfg: RewardConfig | None = None) -> dict:
    """``reward_func`` with plain lists: {"rewards", "scores" (1/0 correctness), "extra_logs"}. Never raises."""
    n = len(queries) if isinstance(queries, (list, tuple)) else 0
    cfg = cfg or (RewardConfig.evaluation() if os.environ.get("POPULORA_REWARD_MODE") == "eval"
                  else RewardConfig())
    rewards, scores = [0.0] * n, [0.0] * n
    logs = {"format_ok": 0.0, "correct": 0.0, "reward_errors": 0.0}
    try:
        from openrlhf_populora.tasks import Verdict, verify_answers

        prompts = list(prompts) if isinstance(prompts, (list, tuple)) else []
        labels = list(labels) if isinstance(labels, (list, tuple)) else []
        tasks, responses, where, errors = [], [], [], 0
        for i in range(n):
            try:
                task = _task_from_label(labels[i])
            except Exception:
                errors += 1
                continue
            tasks.append(task)
            responses.append(_response_of(queries[i], prompts[i] if i < len(prompts) else ""))
            where.append(i)
        verdicts: list = []
        if tasks:
            try:
                verdicts = verify_answers(tasks, responses, sandbox or _shared_sandbox())
            except Exception:
                errors += len(tasks)
                verdicts, where = [], []
        for i, verdict in zip(where, verdicts, strict=True):
            if not isinstance(verdict, Verdict):
                continue
            rewards[i] = student_reward(verdict, cfg)
            scores[i] = 1.0 if verdict.correct else 0.0
            logs["format_ok"] += verdict.format_ok / max(n, 1)
            logs["correct"] += verdict.correct / max(n, 1)
        logs["reward_errors"] = float(errors)
    except Exception:
        logs["reward_errors"] = float(n)
    return {"rewards": rewards, "scores": scores, "extra_logs": logs}


def reward_func(queries, prompts, labels, **kwargs):
    """OpenRLHF reward file entry point: label = a task as JSON (or ``{"task": {...}}``).

    Returns ``{"rewards": Tensor[n], "scores": Tensor[n], "extra_logs": {name: float}}``; a label that is
    not a task, or a sandbox failure, scores 0.0 and counts in ``extra_logs["reward_errors"]``.
    """
    try:
        out = score_completions(queries, prompts, labels)
        return {"rewards": _as_tensor(out["rewards"]), "scores": _as_tensor(out["scores"]),
                "extra_logs": out["extra_logs"]}
    except Exception:  # pragma: no cover - score_completions already never raises
        return {"rewards": _as_tensor([0.0]), "scores": _as_tensor([0.0]), "extra_logs": {"reward_errors": 1.0}}
