"""Reward tables for every branch of the pure reward functions."""


import pytest

from openrlhf_populora.rewards import RewardConfig, solve_rate, student_reward, teacher_reward
from openrlhf_populora.tasks import ProposalCheck, Verdict, zero_triplet

VALID, INVALID = ProposalCheck(True, "ok", zero_triplet()), ProposalCheck(False, "no_program")


@pytest.mark.parametrize("format_ok, correct, expected", [(True, True, 1.0), (True, False, -0.5),
                                                          (False, False, -1.0)])
def test_student_reward_table(format_ok, correct, expected):
    assert student_reward(Verdict(format_ok, correct)) == expected
    assert student_reward(Verdict(format_ok, correct), RewardConfig.evaluation()) == float(correct)
    custom = RewardConfig(correct=2.0, wrong=0.25, format_error=-3.0)
    assert student_reward(Verdict(format_ok, correct), custom) == {1.0: 2.0, -0.5: 0.25, -1.0: -3.0}[expected]


@pytest.mark.parametrize("s, failure_rate, learnability", [(0.0, 1.0, 0.0), (1 / 8, 7 / 8, 7 / 8), (1.0, 0.0, 0.0)])
def test_teacher_reward_default_is_the_papers_rule(s, failure_rate, learnability):
    # the paper: a teacher's reward is its matched students' failure rate, so a fully solved task earns 0
    assert RewardConfig().remap_zero is False
    assert teacher_reward(VALID, s) == pytest.approx(failure_rate)
    assert teacher_reward(VALID, s, mode="learnability") == pytest.approx(learnability)


@pytest.mark.parametrize("s, failure_rate, learnability", [
    (0.0, 1.0, -0.5),  # AZR's code: s = 0 -> raw 0 -> remapped to -0.5 (its paper says 0)
    (1 / 8, 7 / 8, 7 / 8),
    (0.5, 0.5, 0.5),
    (1.0, -0.5, -0.5),
])
def test_teacher_reward_with_azrs_remap(s, failure_rate, learnability):
    cfg = RewardConfig(remap_zero=True)
    assert teacher_reward(VALID, s, cfg) == pytest.approx(failure_rate)
    assert teacher_reward(VALID, s, cfg, mode="learnability") == pytest.approx(learnability)


def test_invalid_proposal_gets_format_penalty_whatever_the_solve_rate():
    for mode in ("failure_rate", "learnability"):
        assert teacher_reward(INVALID, None, mode=mode) == -1.0
        assert teacher_reward(INVALID, 0.3, mode=mode) == -1.0
        assert teacher_reward(False, None, RewardConfig(invalid_proposal=-2.0), mode=mode) == -2.0
    assert teacher_reward(True, 0.25) == 0.75


def test_teacher_reward_rejects_bad_arguments():
    with pytest.raises(ValueError):
        teacher_reward(VALID, None)
    with pytest.raises(ValueError):
        teacher_reward(VALID, 1.5)
    with pytest.raises(ValueError):
        teacher_reward(VALID, 0.5, mode="elo")


def test_solve_rate():
    assert solve_rate([Verdict(True, True), Verdict(True, False), Verdict(False, False), Verdict(True, True)]) == 0.5
    with pytest.raises(ValueError):
        solve_rate([])


def test_reward_config_validation():
    RewardConfig().validate()
    RewardConfig.evaluation().validate()
    for bad in (RewardConfig(correct=-1.0), RewardConfig(wrong=float("nan")), RewardConfig(format_error="x")):
        with pytest.raises(ValueError):
            bad.validate()
    with pytest.raises(TypeError):
        RewardConfig(remap_zero=1).validate()


def test_bad_arguments_are_named_in_the_error():
    """Catches: error messages that lose what was wrong (mutation testing, scripts/mutation.sh)."""
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'elo'"):
        teacher_reward(VALID, 0.5, mode="elo")
    with pytest.raises(ValueError, match=r"needs a solve rate in \[0, 1\], got 1.5"):
        teacher_reward(VALID, 1.5)
    with pytest.raises(ValueError, match="^solve_rate of no answers is undefined$"):
        solve_rate([])
    with pytest.raises(TypeError, match="remap_zero must be a bool, got 1"):
        RewardConfig(remap_zero=1).validate()
    with pytest.raises(ValueError, match="RewardConfig.wrong must be a finite number, got nan"):
        RewardConfig(wrong=float("nan")).validate()


def test_a_right_answer_must_earn_more_than_a_wrong_one():
    """correct == wrong would make every answer's advantage 0. Catches: >= for > in the check."""
    with pytest.raises(ValueError, match=r"correct \(0.5\) must exceed wrong \(0.5\)"):
        RewardConfig(correct=0.5, wrong=0.5).validate()
