"""Teacher and student rewards: pure functions of verdicts and solve rates (no sandbox, no engine).

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
OpenRLHF's reward-file entry point, which scores completions in a sandbox with these functions, is
``openrlhf_reward.py``.
"""

from __future__ import annotations

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
    def evaluation(cls) -> RewardConfig:
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
