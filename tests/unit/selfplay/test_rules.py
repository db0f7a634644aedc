"""The method's rules, each checked through the loop against values computed by hand.

One scripted step of 2 teachers + 2 students (code_o, round-robin matching, so step 1 pairs t0 with s1 and
t1 with s0), on the real local engine and the real sandbox. Each teacher writes three proposals:

    t0: x + 3 (input 4), an invalid one, the identity (input 'abc')
    t1: x * 2 (input 5), x - 1 (input 7), an invalid one

and students answer by the program and the sample index (3 samples per task, no top-ups):

    x + 3: right on sample 0 only           -> rewards  1, -0.5, -0.5   s = 1/3
    identity (and every seed task): right   -> rewards  1,  1,  1       s = 1
    x * 2: wrong but well formed            -> rewards -0.5, -0.5, -0.5 s = 0   (the unsolved task)
    x - 1: right, right, unparsable         -> rewards  1,  1, -1       s = 2/3

Each test names the broken implementation it catches (checked by breaking the code that way).
"""

from __future__ import annotations

import math
import re

import pytest
from scripted_loops import scripted_loop, tiny_config

from openrlhf_populora.engines.scripted import scripted_engine

pytestmark = pytest.mark.slow

X_PLUS_3 = ("def f(x):\n    return x + 3", "4")
X_TIMES_2 = ("def f(x):\n    return x * 2", "5")
X_MINUS_1 = ("def f(x):\n    return x - 1", "7")
IDENTITY = ("def f(x):\n    return x", "'abc'")
PROPOSALS = {"t0": [X_PLUS_3, None, IDENTITY], "t1": [X_TIMES_2, X_MINUS_1, None]}


def _proposal(adapter: str, calls: dict) -> str:
    """The teacher's next proposal, in the order of its requests (the loop asks for a teacher's in a row)."""
    k = calls.get(adapter, 0)
    calls[adapter] = k + 1
    proposal = PROPOSALS.get(adapter, [X_PLUS_3])[k % 3]
    if proposal is None:
        return "<think>hmm</think><answer>I do not know</answer>"
    program, arguments = proposal
    return f"<think>p</think><answer>\n```python\n{program}\n```\n```input\n{arguments}\n```\n</answer>"


def _answer(prompt: str, sample: int) -> str:
    program = re.search(r"```python\n(.*?)\n```", prompt, re.S).group(1).strip()
    arguments = re.search(r"```input\n(.*?)\n```", prompt, re.S).group(1)
    if program.endswith("x - 1") and sample == 2:
        return "<think>t</think><answer>no idea</answer>"  # no ```output block: a format error
    right = {"x + 3": sample == 0, "x * 2": False}.get(program[-5:], True)
    scope: dict = {}
    exec(program, scope)  # the test's own programs and the shipped seed tasks: trusted
    value = repr(eval(f"f({arguments})", scope)) if right else "-12345"
    return f"<think>t</think><answer>```output\n{value}\n```</answer>"


def _engine_class(calls: dict, trained: list) -> type:
    def policy(adapter, prompt, sample, rng):
        if "## Task: write a new Python program" in prompt:
            return _proposal(adapter, calls)
        return _answer(prompt, sample)

    class Recording(scripted_engine(policy)):
        def train_step(self, trajectories):
            trained.extend(trajectories)
            return super().train_step(trajectories)

    return Recording


def _loop(tmp_path, task_sandbox, **populora):
    calls: dict = {}
    trained: list = []
    config = tiny_config(**{"num_teachers": 2, "num_students": 2, "matchmaking": "round_robin",
                            "proposals_per_teacher": 3, "solver_tasks": 1, "solver_samples": 3, **populora})
    loop = scripted_loop(config, _engine_class(calls, trained), tmp_path, task_sandbox)
    return loop, trained


def _by_group(trajectories) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for t in trajectories:
        out.setdefault(t.group, []).append(t.advantage)
    return out


R38, R56, R89, R26 = math.sqrt(38), math.sqrt(56), math.sqrt(89), math.sqrt(26)
# whitened per (member, role, task type) by hand, A = (r - mean) / std:
#   t0 propose: r = 2/3, -1, 0        mean -1/9, std sqrt(38)/9  -> 7, -8, 1 over sqrt(38)
#   t1 propose: r = 1, 1/3, -1        mean 1/9,  std sqrt(56)/9  -> 8, 2, -10 over sqrt(56)
#   s0 solve:   r = -.5 x3, 1, 1, -1  mean -1/12, std sqrt(89)/12 -> -5 x3, 13, 13, -11 over sqrt(89)
#   s1 solve:   r = 1, -.5, -.5, 1 x3 mean 1/2,  std 1/sqrt(2)   -> 1, -2, -2, 1, 1, 1 over sqrt(2)
FAILURE_RATE_ADVANTAGES = {
    "t0/propose/code_o": [7 / R38, -8 / R38, 1 / R38],
    "t1/propose/code_o": [8 / R56, 2 / R56, -10 / R56],
    "s0/solve/code_o": [-5 / R89] * 3 + [13 / R89, 13 / R89, -11 / R89],
    "s1/solve/code_o": [1 / math.sqrt(2), -math.sqrt(2), -math.sqrt(2)] + [1 / math.sqrt(2)] * 3,
}


def test_one_step_hands_the_engine_the_hand_computed_advantages(tmp_path, task_sandbox):
    """Catches: training on the negated advantage; whitening per (role, task type) across members instead of
    per (member, role, task type); the population on learnability (t1's unsolved x * 2 would earn 0, not 1);
    every student given every teacher's tasks (the solve rates and s-groups would change)."""
    loop, trained = _loop(tmp_path, task_sandbox)
    out = loop.run_step()
    assert [(m.teacher, m.student) for m in out.matchups] == [("t0", "s1"), ("t1", "s0")]
    # each teacher's valid tasks went to its matched student only, as many samples as asked, no top-ups
    assert [pr.solve_rates for pr in out.proposals] == [
        {"s1": pytest.approx(1 / 3)}, {}, {"s1": 1.0}, {"s0": 0.0}, {"s0": pytest.approx(2 / 3)}, {}]
    assert all(a.proposal is not None for a in out.attempts)
    # the paper's teacher reward: 1 - s, so the unsolved task earns 1 and the solved one 0; invalid: -1
    assert [pr.reward for pr in out.proposals] == pytest.approx([2 / 3, -1.0, 0.0, 1.0, 1 / 3, -1.0])
    assert [a.reward for a in out.attempts] == [-0.5] * 3 + [1.0, 1.0, -1.0] + [1.0, -0.5, -0.5] + [1.0] * 3
    got = _by_group(trained)
    assert got.keys() == FAILURE_RATE_ADVANTAGES.keys()
    for group, expected in FAILURE_RATE_ADVANTAGES.items():
        assert got[group] == pytest.approx(expected, rel=1e-5), group
    # every trajectory trains the adapter of the member its group names
    assert all(t.adapter == t.group.split("/")[0] for t in trained)


def test_learnability_pays_nothing_for_an_unsolved_task(tmp_path, task_sandbox):
    """AZR's rule when asked for: s = 0 and s = 1 both earn 0. Catches: the loop ignoring the configured rule
    (always failure rate), which would pay t1's unsolved x * 2 a reward of 1."""
    loop, trained = _loop(tmp_path, task_sandbox, teacher_reward="learnability")
    out = loop.run_step()
    assert [pr.reward for pr in out.proposals] == pytest.approx([2 / 3, -1.0, 0.0, 0.0, 1 / 3, -1.0])
    # t1 propose: r = 0, 1/3, -1, mean -2/9, std sqrt(26)/9 -> 2, 5, -7 over sqrt(26)
    got = _by_group(trained)
    assert got["t1/propose/code_o"] == pytest.approx([2 / R26, 5 / R26, -7 / R26], rel=1e-5)
    assert got["t0/propose/code_o"] == pytest.approx(FAILURE_RATE_ADVANTAGES["t0/propose/code_o"], rel=1e-5)


def test_each_matchup_moves_ratings_toward_its_winner(tmp_path, task_sandbox):
    """t0's tasks were solved at a mean rate 2/3 by s1 (student win), t1's at 1/3 by s0 (teacher win). One
    TrueSkill game between two fresh players: the winner goes to 29.396, the loser to 20.604 (the textbook
    example, see test_population_ratings). Catches: teacher and student swapped in record_matchup, and any
    inverted winner."""
    loop, _ = _loop(tmp_path, task_sandbox)
    out = loop.run_step()
    assert out.games == ["student", "teacher"]
    mu = {m: loop.ratings.mu(m) for m in ("t0", "t1", "s0", "s1")}
    assert mu == pytest.approx({"t0": 20.604, "s1": 29.396, "t1": 29.396, "s0": 20.604}, abs=1e-3)
    # each game is logged at the step it was played (catches games recorded under step None or 0)
    assert {m: loop.ratings.history[m][-1]["step"] for m in mu} == {m: 1 for m in mu}


def _every_task_valid(adapter, prompt, sample, rng, calls):
    """Every proposal valid and distinct per teacher: x + n, n = 100 (t0) or 200 (t1) plus the teacher's count of
    proposals. Answers: right when n is even; when n is odd, right on even samples only (so rewards vary)."""
    if "## Task: write a new Python program" in prompt:
        k = calls.get(adapter, 0)
        calls[adapter] = k + 1
        n = 100 * (int(adapter[1:]) + 1) + k
        return (f"<think>p</think><answer>\n```python\ndef f(x):\n    return x + {n}\n```\n"
                f"```input\n{k}\n```\n</answer>")
    n = re.search(r"return x \+ (\d{3})\n", prompt)
    if n and int(n.group(1)) % 2 and sample % 2:
        return "<think>t</think><answer>```output\n-12345\n```</answer>"
    return _answer(prompt, sample)


@pytest.mark.parametrize("matchmaking", ["pfsp_hard", "round_robin"])
def test_students_only_ever_see_their_matched_teachers_tasks(tmp_path, task_sandbox, matchmaking):
    """Top-ups included: a student answers its matched teachers' tasks of this step, then tops up with tasks
    those same teachers proposed (now or earlier) and seed tasks, never another teacher's. Catches: top-ups
    drawn from the whole buffer (the other teacher's recent tasks), and every student given every teacher's
    tasks."""
    calls: dict = {}
    config = tiny_config(num_teachers=2, num_students=2, matchmaking=matchmaking, proposals_per_teacher=2,
                         solver_tasks=6, solver_samples=1, recency_window=3)
    engine = scripted_engine(lambda a, p, s, r: _every_task_valid(a, p, s, r, calls))
    loop = scripted_loop(config, engine, tmp_path, task_sandbox)
    top_ups_from_teachers = 0
    for _ in range(3):
        out = loop.run_step()
        matched = {(m.teacher, m.student) for m in out.matchups}
        assert {s for _, s in matched} == {"s0", "s1"} and {t for t, _ in matched} == {"t0", "t1"}
        for a in out.attempts:
            teachers = {t for t, s in matched if s == a.student}
            if a.proposal is not None:
                assert out.proposals[a.proposal].teacher in teachers
            else:
                assert a.task.proposer in teachers or (a.task.step == 0 and a.task.proposer == "seed"), (
                    a.student, a.task.proposer, a.task.step)
                top_ups_from_teachers += a.task.proposer in teachers
        # every matched student answered every valid task of its teachers, and only theirs
        for i, pr in enumerate(out.proposals):
            answered = {a.student for a in out.attempts if a.proposal == i}
            assert answered == {s for t, s in matched if t == pr.teacher}
        per_student = {s: sum(a.student == s for a in out.attempts) for s in ("s0", "s1")}
        assert per_student == {"s0": 6, "s1": 6}
    assert top_ups_from_teachers > 0  # the matched teachers' tasks are drawn first (recent), not only seeds


def test_a_child_starts_with_a_fresh_optimizer(tmp_path, task_sandbox):
    """Evolution after step 1 replaces one teacher and one student; at step 2 the children take their first
    Adam step (step count 1) while the survivors take their second. Catches: a child keeping the replaced
    member's Adam moments and step count."""
    calls: dict = {}
    config = tiny_config(num_teachers=2, num_students=2, proposals_per_teacher=2, solver_tasks=2,
                         solver_samples=2)
    config.populora.evolution.enabled = True
    config.populora.evolution.evolve_every = 1
    config.populora.evolution.replace_fraction = 0.5
    config.populora.evolution.min_age = 0
    engine = scripted_engine(lambda a, p, s, r: _every_task_valid(a, p, s, r, calls))
    loop = scripted_loop(config, engine, tmp_path, task_sandbox)
    first = loop.run_step()
    slots = {e["slot"] for e in first.evolution}
    assert len(slots) == 2 and set(first.trained) == {"t0", "t1", "s0", "s1"}
    optimizers = loop.engine._optimizers
    assert all(not optimizers[slot].state for slot in slots)  # the replaced member's moments are gone
    loop.p.evolution.enabled = False  # no second event: step 2's optimizer states stay to be read
    second = loop.run_step()
    assert set(second.trained) == {"t0", "t1", "s0", "s1"}
    steps = {name: {int(s["step"]) for s in opt.state.values()} for name, opt in optimizers.items()}
    assert steps == {name: {1} if name in slots else {2} for name in ("t0", "t1", "s0", "s1")}


def test_a_student_whose_teacher_wrote_no_valid_task_tops_up_with_seed_tasks(tmp_path, task_sandbox):
    """t1 writes only invalid proposals, so s0 (matched with t1 at step 1) has no task of its teacher: asked for 14
    tasks, it answers the 12 code_o seed tasks, all there is for it, and none of t0's. Catches: a student without
    matched tasks skipped (no top-ups), and topping up from another teacher's tasks (s0 would get t0's two)."""
    calls: dict = {}

    def policy(adapter, prompt, sample, rng):
        if adapter == "t1" and "## Task: write a new Python program" in prompt:
            return "<think>hmm</think><answer>I do not know</answer>"
        return _every_task_valid(adapter, prompt, sample, rng, calls)

    config = tiny_config(num_teachers=2, num_students=2, matchmaking="round_robin", proposals_per_teacher=2,
                         solver_tasks=14, solver_samples=1)
    loop = scripted_loop(config, scripted_engine(policy), tmp_path, task_sandbox)
    out = loop.run_step()
    assert [(m.teacher, m.student) for m in out.matchups] == [("t0", "s1"), ("t1", "s0")]
    s0 = [a for a in out.attempts if a.student == "s0"]
    assert len(s0) == 12 and all(a.proposal is None and a.task.proposer == "seed" for a in s0)
    assert len({a.task.key() for a in s0}) == 12
    s1 = [a for a in out.attempts if a.student == "s1"]
    assert len(s1) == 14 and {a.task.proposer for a in s1} <= {"t0", "seed"}
    assert sum(a.proposal is not None for a in s1) == 2


def test_zero_advantage_samples_are_left_out_when_asked_and_only_they(tmp_path, task_sandbox):
    """A group with one reward value has advantage 0 everywhere: no policy gradient, so with
    --populora.skip_zero_advantage (the default) its samples are not trained; every other sample is. Catches:
    the filter testing another value than 0 (zero-advantage samples trained, they change each adapter's token
    normalisation), and zero-advantage samples dropped when the flag is off."""
    from types import SimpleNamespace

    from openrlhf_populora.engines.base import Completion
    from openrlhf_populora.selfplay.loop import Attempt

    loop, _ = _loop(tmp_path, task_sandbox)

    def attempt(student: str, reward: float, token: int) -> Attempt:
        return Attempt(student, student, SimpleNamespace(task_type="code_o"),
                       Completion(student, [1], [token], "answer", True), None, reward=reward)

    # s0: rewards 1, 1 (one value: advantages 0, 0); s1: rewards 1, -1 (advantages +-1 / (1 + 1e-6))
    attempts = [attempt("s0", 1.0, 5), attempt("s0", 1.0, 6), attempt("s1", 1.0, 7), attempt("s1", -1.0, 8)]
    a = 1 / (1 + 1e-6)
    kept = loop._trajectories([], attempts)
    assert [(t.group, t.response_ids, t.advantage) for t in kept] == [
        ("s1/solve/code_o", [7], pytest.approx(a, abs=1e-15)), ("s1/solve/code_o", [8], pytest.approx(-a, abs=1e-15))]
    loop.p.skip_zero_advantage = False
    kept = loop._trajectories([], attempts)
    assert [(t.response_ids, t.advantage) for t in kept] == [
        ([5], 0.0), ([6], 0.0), ([7], pytest.approx(a, abs=1e-15)), ([8], pytest.approx(-a, abs=1e-15))]
