"""Proposal validity end to end, through the real sandbox."""

from types import SimpleNamespace

import pytest
from task_answers import FixedSandbox, proposal

from openrlhf_populora.sandbox import Sandbox
from openrlhf_populora.tasks import Task, TaskRules, check_proposal, check_proposals, zero_triplet


@pytest.fixture(scope="module")
def sandbox(task_sandbox):
    return task_sandbox


def induction(inputs: list[str], message: str | None = "hint") -> str:
    blocks = "".join(f"```input\n{x}\n```\n" for x in inputs)
    msg = f"```message\n{message}\n```" if message is not None else ""
    return f"<think>p</think><answer>{blocks}{msg}</answer>"


def test_valid_code_o_and_code_i_proposals(sandbox):
    text = proposal("def count(s):\n    return {c: s.count(c) for c in sorted(set(s))}", "'abca'")
    for task_type in ("code_o", "code_i"):
        check = check_proposal(task_type, text, sandbox, proposer="t3", step=5)
        assert check.valid and check.reason == "ok" and check.tags_ok
        task = check.task
        assert task.task_type == task_type and task.inputs == ["'abca'"] and task.outputs == ["{'a': 2, 'b': 1, 'c': 1}"]
        assert task.proposer == "t3" and task.step == 5 and "def f(s)" in task.program
        assert Task.from_json(task.to_json()) == task


@pytest.mark.parametrize("program, inputs, reason", [
    ("import os\ndef f(x):\n    return x", "1", "banned_module:os"),
    ("def f(x):\n    return __import__('time').time()", "1", "banned_call:__import__"),
    ("def f(x):\n    return input()", "1", "banned_call:input"),
    ("def f(x):\n    return x +", "1", "program_syntax"),
    ("x = 3", "1", "program_no_function"),
    ("def f(x):\n    return x", "1)\nimport os\nf(1", "input_syntax"),
    ("def f(x):\n    return x", "len([1])", "input_not_a_value"),
    ("def f(x):\n    raise ValueError(x)", "1", "run_error"),
    ("def f(x):\n    return x", "1, 2", "run_error"),  # wrong arity
    ("def f(x):\n    return None", "1", "output_none"),
    ("def f(x):\n    return float('nan')", "1", "output_not_literal"),  # NaN never equals itself
    ("def f(x):\n    return [x, float('inf')]", "1", "output_not_literal"),
    ("def f(x):\n    return {x: object}", "1", "output_not_literal"),
    ("class A:\n    def __repr__(self):\n        return '1'\ndef f(x):\n    return A()", "1",
     "output_not_round_trip"),
    ("def f(x):\n    return 'a' * 401", "1", "output_too_long"),  # AZR truncated it to 400 chars (pitfall 5)
])
def test_invalid_proposals(sandbox, program, inputs, reason):
    check = check_proposal("code_o", proposal(program, inputs), sandbox)
    assert not check.valid and check.task is None
    assert check.reason == reason


def test_timeout_is_invalid():
    with Sandbox(workers=1, timeout_s=0.5, memory_mb=256) as sb:
        check = check_proposal("code_o", proposal("def f(x):\n    while True:\n        x += 1"), sb)
    assert not check.valid and check.reason == "timeout"


def test_memory_hog_is_invalid(sandbox):
    # AZR's executor had no memory limit: ``[0] * 10**10`` could take the node down (pitfall 1/14).
    check = check_proposal("code_o", proposal("def f(x):\n    return len([0] * (10 ** 9 * x))"), sandbox)
    assert not check.valid and check.reason == "run_memory"


def test_nondeterminism_across_separate_executions(sandbox):
    # ``time`` is banned by default; allow it here to show the two runs are separate executions.
    rules = TaskRules(banned_modules=())
    text = proposal("import time\ndef f(x):\n    return time.time_ns() % 1000003 + x")
    check = check_proposal("code_o", text, sandbox, rules=rules)
    assert not check.valid and check.reason == "nondeterministic"
    text = proposal("def f(x):\n    return object()")  # a repr with an address: never a valid output
    assert check_proposal("code_o", text, sandbox).reason in ("nondeterministic", "output_not_literal")


def test_long_outputs_allowed_up_to_the_configured_cap(sandbox):
    text = proposal("def f(x):\n    return 'a' * 401")
    check = check_proposal("code_o", text, sandbox, rules=TaskRules(max_output_chars=1000))
    assert check.valid and check.task.outputs == ["'" + "a" * 401 + "'"]  # never truncated


POINT = """
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    def __repr__(self):
        return f"Point(x={self.x!r}, y={self.y!r})"
"""


def test_custom_classes_and_helpers(sandbox):
    program = POINT + """
def shift(p, d):
    return Point(p.x + d, p.y - d)

def move(p, steps):
    for _ in range(steps):
        p = shift(p, 1)
    return p
"""
    check = check_proposal("code_o", proposal(program, "Point(1, 2), 3"), sandbox)
    assert check.valid, check.reason
    assert check.task.outputs == ["Point(x=4, y=-1)"] and check.task.meta == {"renamed_from": "move"}


def test_programs_may_import_the_standard_library(sandbox):
    program = ("import heapq\nimport json\nfrom dataclasses import dataclass\n\n@dataclass(frozen=True)\n"
               "class P:\n    x: int\n\ndef f(xs):\n    heapq.heapify(xs)\n    return P(json.loads(str(xs[0])))")
    check = check_proposal("code_o", proposal(program, "[3, 1, 2]"), sandbox)
    assert check.valid, check.reason
    assert check.task.outputs == ["P(x=1)"]


def test_unicode_and_tricky_values(sandbox):
    text = proposal("def f(s):\n    return (s.upper(), {1, 2}, frozenset(), (1+2j), b'x', -0.5)", "'héllo ✓'")
    check = check_proposal("code_o", text, sandbox)
    assert check.valid, check.reason
    assert check.task.outputs == ["('HÉLLO ✓', {1, 2}, frozenset(), (1+2j), b'x', -0.5)"]


def test_top_level_prints_are_stripped_before_running(sandbox):
    text = proposal("def f(x):\n    return x * 2\nprint(f(3))\nwhile True:\n    pass", "4")
    check = check_proposal("code_o", text, sandbox)
    assert not check.valid  # the top-level loop is a statement kept (only calls/prints are stripped)
    check = check_proposal("code_o", proposal("def f(x):\n    return x * 2\nprint(f(3))", "4"), sandbox)
    assert check.valid and "print" not in check.task.program


def test_require_tags(sandbox):
    text = proposal("def f(x):\n    return x", tags=False)
    assert check_proposal("code_o", text, sandbox).valid
    check = check_proposal("code_o", text, sandbox, rules=TaskRules(require_tags=True))
    assert not check.valid and check.reason == "format"


def test_garbage_never_raises(sandbox):
    garbage = ["", "\x00\x01", "<answer></answer>", "```python\n```", "```input\n1\n```", "💥" * 1000,
               "<answer>" * 50, "x" * 1_000_000, "```python\ndef f(x):\n    return x\n```\n```input\n```"]
    checks = check_proposals("code_i", garbage, sandbox)
    assert [c.valid for c in checks] == [False] * len(garbage)
    assert check_proposals("code_o", [], sandbox) == []
    assert check_proposals("code_o", [None], sandbox)[0].reason == "not_text"  # type: ignore[list-item]


def test_one_sandbox_batch_per_call(counting_sandbox):
    counting = counting_sandbox
    texts = [proposal(f"def f(x):\n    return x + {k}") for k in range(4)] + ["junk"]
    checks = check_proposals("code_o", texts, counting, proposer=["a", "b", "c", "d", "e"])
    assert [c.valid for c in checks] == [True] * 4 + [False]
    assert [c.task.proposer for c in checks[:4]] == ["a", "b", "c", "d"]
    assert len(counting.batches) == 1 and len(counting.batches[0]) == 4 * 2  # two runs each
    with pytest.raises(ValueError):
        check_proposals("code_o", texts, counting, proposer=["a"])


# ------------------------------------------------------------------------------------------- code_f


INPUTS = [f"'{w}'" for w in ("a", "bb", "abc", "xyzzy", "", "hello", "q", "rr", "level", "zz")]


def test_valid_induction_proposal(sandbox):
    program = Task("code_o", "def f(s):\n    return s[::-1]\n", ["'ab'"], ["'ba'"])
    check = check_proposal("code_f", induction(INPUTS, "reverse it"), sandbox, program=program, step=2)
    assert check.valid, check.reason
    task = check.task
    assert task.task_type == "code_f" and task.message == "reverse it" and task.step == 2
    assert task.inputs == INPUTS and task.outputs[3] == "'yzzyx'"
    assert task.shown == [0, 1, 2, 3, 4] and task.hidden == [5, 6, 7, 8, 9]


def test_induction_keeps_last_n_distinct_inputs(sandbox):
    program = "def f(s):\n    return len(s)\n"
    texts = induction(["'extra1'", "'extra2'"] + INPUTS + ["'a'"])  # a trailing duplicate collapses
    check = check_proposal("code_f", texts, sandbox, program=program)
    assert check.valid and check.task.inputs == INPUTS  # AZR: only the last 10 blocks count


@pytest.mark.parametrize("text, reason", [
    (induction(INPUTS[:9]), "too_few_inputs"),
    (induction(INPUTS[:5] * 2), "too_few_inputs"),  # duplicates do not count
    (induction(INPUTS, message=None), "no_message"),
    (induction(INPUTS[:9] + ["1"]), "run_error"),  # one input that crashes f invalidates the proposal
    (induction(INPUTS[:9] + ["__import__('os')"]), "input_not_a_value"),
])
def test_invalid_induction_proposals(sandbox, text, reason):
    check = check_proposal("code_f", text, sandbox, program="def f(s):\n    return s[::-1]\n")
    assert not check.valid and check.reason == reason


def test_induction_needs_its_program(sandbox):
    with pytest.raises(ValueError):
        check_proposal("code_f", induction(INPUTS), sandbox)
    checks = check_proposals("code_f", [induction(INPUTS)] * 2, sandbox,
                             programs=[zero_triplet(), "def f(s):\n    return len(s)\n"])
    assert checks[0].task.outputs == INPUTS and checks[1].task.outputs[2] == "3"


def test_indented_blocks_and_uppercase_tags(sandbox):
    text = ("Sure!\n<answer>\n    ```Python\n    def g(xs):\n        return sum(xs)\n    ```\n"
            "    ```input\n    [1, 2, 3]\n    ```\n</answer>")
    check = check_proposal("code_i", text, sandbox)
    assert check.valid, check.reason
    assert check.task.program == "def f(xs):\n    return sum(xs)\n" and check.task.outputs == ["6"]


def test_exec_time_and_provenance_are_recorded(sandbox):
    check = check_proposal("code_o", proposal("def f(x):\n    return x"), sandbox)
    assert check.exec_s > 0 and check.to_dict()["task"]["program"] == check.task.program
    source = Task("code_o", "def f(s):\n    return s[::-1]\n", ["'ab'"], ["'ba'"])
    check = check_proposal("code_f", induction(INPUTS), sandbox, program=source)
    assert check.task.meta["source"] == source.key()


@pytest.mark.parametrize("body, inputs", [
    ("def f(a, b):\n    return a * b\n\nf(3, 4)", ["3, 4"]),
    ("def area(w, h=2):\n    return w * h\n\nprint(area(5, h=3))", ["5, h=3"]),
])
def test_input_taken_from_the_programs_own_call_when_the_block_is_missing(sandbox, body, inputs):
    text = f"<answer>\n```python\n{body}\n```\n</answer>"
    check = check_proposal("code_o", text, sandbox)
    assert check.valid, check.reason
    assert check.task.inputs == inputs and "print" not in check.task.program
    assert not check_proposal("code_o", text, sandbox, rules=TaskRules(input_from_call=False)).valid


def test_input_taken_from_an_unlabelled_block_after_the_program(sandbox):
    # as SmolLM2-135M wrote it: the program, some prose, then the arguments in an unlabelled block
    text = ("Sure, here is a function:\n```python\ndef f(a, b):\n    return a * b\n```\n"
            "It multiplies.\n```\nprint('not arguments')\nx = 1\n```\n```\n4, 5\n```\nThat is all.")
    check = check_proposal("code_o", text, sandbox)
    assert check.valid, check.reason
    assert check.task.inputs == ["4, 5"] and check.task.outputs == ["20"]
    assert check_proposal("code_o", text, sandbox, rules=TaskRules(input_from_unlabelled=False)).reason == "no_input"
    called = "```python\ndef f(x):\n    return x + 1\n```\nOutput:\n```\nf(2)\n```"  # also as SmolLM2 wrote it
    assert check_proposal("code_i", called, sandbox).task.inputs == ["2"]
    # a block BEFORE the program is not its input, and a labelled block of another kind is never taken
    before = "```\n4, 5\n```\n```python\ndef f(a, b):\n    return a * b\n```\n```output\n20\n```"
    assert check_proposal("code_o", before, sandbox).reason == "no_input"


def test_a_call_with_computed_arguments_is_still_not_an_input(sandbox):
    text = "```python\ndef f(x):\n    return x\n\nf(len([1, 2]))\n```"
    assert check_proposal("code_o", text, sandbox).reason == "input_not_a_value"


# ------------------------------------------------------------------------------- exact reasons and records


LONG_INPUT = "'" + "a" * 999 + "'"  # 1001 characters: one over max_input_chars


@pytest.mark.parametrize("text, rules, expected", [
    # Catches: the format reject recording tags_ok as None instead of False.
    (proposal("def f(x):\n    return x", tags=False), TaskRules(require_tags=True),
     {"valid": False, "reason": "format", "tags_ok": False, "exec_s": 0.0, "task": None}),
    # Catches: the static rejects below losing tags_ok (False although the answer was tagged).
    ("<think>t</think><answer>no program here</answer>", None,
     {"valid": False, "reason": "no_program", "tags_ok": True, "exec_s": 0.0, "task": None}),
    (proposal("def f(x):\n    return x +"), None,
     {"valid": False, "reason": "program_syntax", "tags_ok": True, "exec_s": 0.0, "task": None}),
    # Catches: a wrong tag (or a crash) for an input over max_input_chars.
    (proposal("def f(x):\n    return x", LONG_INPUT), None,
     {"valid": False, "reason": "input_too_long", "tags_ok": True, "exec_s": 0.0, "task": None}),
])
def test_static_rejects_exact_records(text, rules, expected):
    """Catches: to_dict keys renamed ("reason", "exec_s" are what problems.jsonl holds)."""
    sb = FixedSandbox(None)
    check = check_proposal("code_o", text, sb, rules=rules)
    assert check.to_dict() == expected and sb.items == []


@pytest.mark.parametrize("result, reason", [
    (SimpleNamespace(), "run_failed"),  # no status at all
    (SimpleNamespace(status=""), "run_failed"),
    (SimpleNamespace(status="ok", value="('ok', '1'"), "run_failed"),  # unreadable value
    (SimpleNamespace(status="ok", value="('ok', '1')"), "run_failed"),  # not a 3-tuple
    (SimpleNamespace(status="error", value=None), "run_error"),
    (SimpleNamespace(status="timeout"), "timeout"),
])
def test_unreadable_sandbox_results_give_exact_reasons(result, reason):
    """Catches: "run_None" / "run_XXXX" / "run_" / "RUN_FAILED" instead of "run_failed" for a result with no
    status, an empty one, or one that cannot be read; a crash on results without ``wall_s`` (exec_s is
    then 0.0); and ``valid`` set to None instead of False for a run-stage reject."""
    check = check_proposal("code_o", proposal("def f(x):\n    return x"), FixedSandbox(result))
    assert check.valid is False and check.reason == reason and check.task is None
    assert check.tags_ok is True and check.exec_s == 0.0


@pytest.mark.parametrize("runs", [1, 2])
def test_run_count_and_exec_time(runs):
    """Catches: a one-run check failing (reading a second run that does not exist); exec_s is the sum of the
    proposal's runs."""
    sb = FixedSandbox(SimpleNamespace(status="ok", value="('ok', '7', True)", wall_s=0.25))
    for task_type in ("code_o", "code_i"):
        check = check_proposal(task_type, proposal("def f(x):\n    return x + 6"), sb,
                               rules=TaskRules(determinism_runs=runs))
        assert check.valid is True and check.reason == "ok" and check.exec_s == 0.25 * runs
        assert check.task.inputs == ["1"] and check.task.outputs == ["7"]


def test_induction_keeps_the_given_program_verbatim(sandbox):
    """The program a code_f proposer was shown is used as it is, top-level statements included (it was
    checked when it entered the buffer). Catches: stripping it again, which here drops the call that fills
    ``CACHE`` so every input fails with run_error."""
    program = "CACHE = []\nCACHE.append(5)\n\ndef f(x):\n    return x + CACHE[0]\n"
    rules = TaskRules(induction_inputs=2, induction_min_inputs=2, determinism_runs=1)
    check = check_proposal("code_f", induction(["1", "2"]), sandbox, program=program, rules=rules)
    assert check.valid, check.reason
    assert check.task.program == program and check.task.outputs == ["6", "7"] and check.task.shown == [0]
