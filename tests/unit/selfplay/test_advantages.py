import math

import pytest

from openrlhf_populora.selfplay.advantages import whiten_by_group


def test_whitening_is_per_group_against_hand_values():
    rewards = [1.0, 0.0, 1.0, 0.0, -1.0, 0.5]
    groups = [("s0", "student", "code_o")] * 4 + [("t0", "teacher", "code_o")] * 2
    adv = whiten_by_group(rewards, groups, eps=0.0)
    # group 1: mean 0.5, std 0.5 -> +1, -1, +1, -1 ; group 2: mean -0.25, std 0.75 -> -1, +1
    assert adv == pytest.approx([1.0, -1.0, 1.0, -1.0, -1.0, 1.0])


def test_groups_do_not_leak_into_each_other():
    base = whiten_by_group([1.0, 0.0, 1.0], ["a", "a", "a"])
    mixed = whiten_by_group([1.0, 0.0, 1.0, 100.0, -100.0], ["a", "a", "a", "b", "b"])
    assert mixed[:3] == pytest.approx(base)
    assert sum(mixed[3:]) == pytest.approx(0.0)


def test_constant_or_single_groups_carry_no_signal():
    assert whiten_by_group([0.7, 0.7, 0.3], ["a", "a", "b"]) == [0.0, 0.0, 0.0]


def test_each_group_has_zero_mean_unit_std():
    rewards = [0.1, 0.9, 0.4, -0.5, 0.3, 0.2, 0.8]
    groups = ["x", "x", "x", "y", "y", "y", "y"]
    adv = whiten_by_group(rewards, groups, eps=0.0)
    for g in "xy":
        vals = [a for a, gg in zip(adv, groups, strict=True) if gg == g]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        assert mean == pytest.approx(0.0, abs=1e-12) and std == pytest.approx(1.0)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="group labels"):
        whiten_by_group([1.0], ["a", "b"])
    with pytest.raises(ValueError, match="non-finite"):
        whiten_by_group([float("nan"), 1.0], ["a", "a"])


def test_a_constant_group_does_not_stop_the_groups_after_it():
    """Catches: leaving the loop over groups at the first constant group (``break`` for ``continue``)."""
    adv = whiten_by_group([0.7, 0.7, 1.0, 0.0], ["a", "a", "b", "b"])
    assert adv == pytest.approx([0.0, 0.0, 1.0, -1.0], rel=1e-5)


def test_eps_is_added_to_the_std_and_is_tiny_by_default():
    """A = (r - mean) / (std + eps). With eps 0.25 and rewards 1, 0 (std 0.5): +-0.5 / 0.75. By default the
    whitened values are +-1 to 1e-5. Catches: std - eps, and a default eps that is not negligible."""
    assert whiten_by_group([1.0, 0.0], ["a", "a"], eps=0.25) == pytest.approx([2 / 3, -2 / 3])
    assert whiten_by_group([1.0, 0.0], ["a", "a"]) == pytest.approx([1.0, -1.0], rel=1e-5)


def test_a_non_finite_reward_names_its_group_even_when_alone():
    """Catches: an error message that reads another member of the group (an IndexError on a group of one)."""
    with pytest.raises(ValueError, match="group 'g'"):
        whiten_by_group([1.0, float("inf")], ["f", "g"])
