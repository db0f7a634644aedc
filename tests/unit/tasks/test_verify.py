"""Answer verification end to end through the real sandbox: right, wrong, malformed, tricky equality,
reward hacks, injection and garbage."""

import builtins

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from task_answers import FixedSandbox

from openrlhf_populora.sandbox import ExecResult, Sandbox
from openrlhf_populora.tasks import Task, TaskRules, check_proposal, verify_answer, verify_answers


@pytest.fixture(scope="module")
def sandbox(task_sandbox):
    return task_sandbox


def out(value: str) -> str:
    return f"<think>thinking</think>\n<answer>\n```output\n{value}\n```\n</answer>"


def inp(args: str) -> str:
    return f"<think>thinking</think>\n<answer>\n```input\n{args}\n```\n</answer>"


def prog(source: str) -> str:
    return f"<think>thinking</think>\n<answer>\n```python\n{source}\n```\n</answer>"


def triplet(task_type, program, inputs, outputs):
    return Task(task_type, program, [inputs], [outputs])


def verdicts(sandbox, task, completions, fast_literals=True):
    got = verify_answers([task] * len(completions), completions, sandbox, fast_literals=fast_literals)
    return [(v.format_ok, v.correct) for v in got]


OK, WRONG, BAD = (True, True), (True, False), (False, False)

# ------------------------------------------------------------------------------------------- code_o


def test_code_o_right_wrong_malformed(sandbox):
    task = triplet("code_o", "def f(s):\n    return sorted(set(s))\n", "'banana'", "['a', 'b', 'n']")
    assert verdicts(sandbox, task, [
        out("['a', 'b', 'n']"), out("['a','b','n']  "), out("['a', 'n', 'b']"), out("('a', 'b', 'n')"),
        "", "no answer here", out("['a', 'b'"), "```output\n['a', 'b', 'n']\n```",
    ]) == [OK, OK, WRONG, WRONG, BAD, BAD, BAD, OK]
    v = verify_answer(task, out("['a', 'b', 'n']"), sandbox)
    assert v.tags_ok and v.reason == "correct" and v.answer == "['a', 'b', 'n']"


@pytest.mark.parametrize("gold, pred, expected", [
    ("{1, 2, 3}", "{3, 2, 1}", OK),  # sets compare by value
    ("{1, 2, 3}", "[1, 2, 3]", WRONG),  # set vs list
    ("(1, 2)", "[1, 2]", WRONG),  # tuple vs list
    ("1", "1.0", OK),  # 1 == 1.0 (Python value equality, as AZR)
    ("1", "True", OK),
    ("0.30000000000000004", "0.3", WRONG),  # no float tolerance
    ("{'a': [1, (2,)]}", "{'a': [1, (2,)]}", OK),
    ("'héllo ✓'", "'héllo ✓'", OK),
    ("'héllo ✓'", "'hello'", WRONG),
    ("frozenset({1})", "frozenset({1})", OK),
    ("frozenset({1})", "{1}", OK),  # frozenset == set in Python
])
@pytest.mark.parametrize("fast_literals", [True, False])
def test_code_o_tricky_equality(sandbox, gold, pred, expected, fast_literals):
    # the in-process fast path on builtin literals and the sandbox agree on every case
    task = triplet("code_o", "def f(x):\n    return x\n", "0", gold)
    assert verdicts(sandbox, task, [out(pred)], fast_literals) == [expected]


def test_code_o_custom_class_with_eq_in_program_scope(sandbox):
    program = """
class Money:
    def __init__(self, cents):
        self.cents = cents
    def __eq__(self, other):
        return isinstance(other, Money) and self.cents == other.cents
    def __repr__(self):
        return f"Money({self.cents})"

def f(a, b):
    return Money(a + b)
"""
    task = triplet("code_o", program, "2, 3", "Money(5)")
    assert verdicts(sandbox, task, [out("Money(5)"), out("Money(6)"), out("5")]) == [OK, WRONG, WRONG]
    # a class the program defines but the gold output does not use may not be constructed
    plain = triplet("code_o", program + "\ndef g():\n    pass\n", "1, 1", "2")
    assert verdicts(sandbox, plain, [out("Money(2)")]) == [BAD]


def test_code_o_long_output(sandbox):
    gold = "'" + "ab" * 300 + "'"
    task = triplet("code_o", "def f(n):\n    return 'ab' * n\n", "300", gold)
    assert verdicts(sandbox, task, [out(gold), out(gold[:-2] + "'")]) == [OK, WRONG]


def test_reward_hack_calling_f_is_not_credited(sandbox):
    # AZR evaluates the predicted output with the program in scope, so ``f('x')`` is credited there.
    task = triplet("code_o", "def f(s):\n    return s[::-1] * 3\n", "'abc'", "'cbacbacba'")
    assert verdicts(sandbox, task, [out("f('abc')"), out("f(*['abc'])"), out("'cba' * 3"), out("eval('1')")]) \
        == [BAD] * 4


def test_reward_hack_always_equal_object_is_not_credited(sandbox):
    task = triplet("code_o", "def f(x):\n    return x + 1\n", "1", "2")
    hacks = [
        "type('A', (), {'__eq__': lambda self, other: True})()",
        "__import__('types').SimpleNamespace(__eq__=lambda *a: True)",
        "[x for x in [2]][0]",
        "(lambda: 2)()",
        "2 if True else 3",
    ]
    assert verdicts(sandbox, task, [out(h) for h in hacks]) == [BAD] * len(hacks)


# ------------------------------------------------------------------------------------------- code_i


def test_code_i_any_input_giving_the_output_is_correct(sandbox):
    task = triplet("code_i", "def f(a, b):\n    return a * b\n", "3, 4", "12")
    assert verdicts(sandbox, task, [
        inp("3, 4"), inp("2, 6"), inp("b=12, a=1"), inp("1, 11"), inp("'x', 12"), inp("12"), "nothing",
    ]) == [OK, OK, OK, WRONG, WRONG, WRONG, BAD]


def test_code_i_answered_as_code_is_read_exactly(sandbox):
    """What the 0.5B instruct model writes instead of an ```input block (benchmarks/format_rate.py): a ```python
    block with one call of f, or assignments to f's parameters. Read as exactly those arguments; anything else
    in such a block stays malformed. Catches the fallback missing (all BAD), a call of another function read as
    f's (``input(3, 4)``), assignments to other names or to a subset of the parameters, and an assignment's
    value taken without the literal check."""
    task = triplet("code_i", "def f(a, b):\n    return a * b\n", "3, 4", "12")
    assert verdicts(sandbox, task, [
        prog("f(3, 4)"), prog("print(f(2, 6))"), prog("b = 12\na = 1"), prog("a = 1\nb = 11"),
        prog("input(3, 4)"), prog("x = 3\ny = 4"), prog("a = 12"), prog("a = 3\nb = 4\nprint(f(a, b))"),
        prog("a = len('abc')\nb = 4"), prog("f(3, 4)\nf(2, 6)"),
    ]) == [OK, OK, OK, WRONG, BAD, BAD, BAD, BAD, BAD, BAD]
    no_fallback = TaskRules(answer_from_code=False)
    assert not verify_answer(task, prog("f(3, 4)"), sandbox, rules=no_fallback).format_ok


def test_code_o_answered_as_code_must_be_the_value_alone(sandbox):
    """A ```python block holding only the value is the answer; one holding a computation is not. Catches the
    fallback missing and a python block's code being accepted as a value."""
    task = triplet("code_o", "def f(x):\n    return x + 1\n", "3", "4")
    assert verdicts(sandbox, task, [prog("4"), prog("5"), prog("f(3)"), prog("3 + 1"), prog("x = 4")]) \
        == [OK, WRONG, BAD, BAD, BAD]


def test_code_i_injection_is_never_executed(sandbox, tmp_path):
    marker = tmp_path / "pwned"
    task = triplet("code_i", "def f(x):\n    return x\n", "1", "1")
    attacks = [
        f"1)\nopen({str(marker)!r}, 'w').write('x')\nf(1",
        f"1); open({str(marker)!r}, 'w'); (1",
        f"__import__('os').system('touch {marker}')",
        "*[1]",
        "x:=1",
    ]
    assert verdicts(sandbox, task, [inp(a) for a in attacks]) == [BAD] * len(attacks)
    assert not marker.exists()


def test_code_i_always_equal_input_is_not_credited(sandbox):
    task = triplet("code_i", "def f(x):\n    return x\n", "5", "5")
    assert verdicts(sandbox, task, [inp("type('A', (), {'__eq__': lambda s, o: True})()")]) == [BAD]


def test_code_i_program_classes_in_inputs(sandbox):
    program = "class P:\n    def __init__(self, x):\n        self.x = x\n\ndef f(p):\n    return p.x * 2\n"
    task = triplet("code_i", program, "P(x=3)", "6")
    assert verdicts(sandbox, task, [inp("P(3)"), inp("P(x=4)")]) == [OK, WRONG]


def test_code_i_hanging_input_only_fails_itself():
    task = triplet("code_i", "def f(n):\n    while n != 0:\n        n -= 2\n    return 0\n", "4", "0")
    with Sandbox(workers=1, timeout_s=0.5, memory_mb=256) as sb:
        got = verify_answers([task] * 3, [inp("3"), inp("6"), inp("2")], sb)
    assert [(v.format_ok, v.correct) for v in got] == [WRONG, OK, OK]
    assert got[0].reason == "run_timeout"


# ------------------------------------------------------------------------------------------- code_f


def _induction(sandbox):
    inputs = "".join(f"```input\n{x}\n```\n" for x in ["[3, 1, 2]", "[]", "[5]", "[2, 2]", "[9, 0, 4, 1]",
                                                       "[1, 2, 3]", "[7, 7, 1]", "[-1, 5]", "[0]", "[4, 3, 2, 1]"])
    text = f"<answer>{inputs}```message\nsomething about order\n```</answer>"
    check = check_proposal("code_f", text, sandbox, program="def f(xs):\n    return sorted(xs)[::2]\n")
    assert check.valid
    return check.task


def test_code_f_must_reproduce_all_hidden_pairs(sandbox):
    task = _induction(sandbox)
    assert verdicts(sandbox, task, [
        prog("def f(xs):\n    return sorted(xs)[::2]"),
        prog("def helper(xs):\n    return sorted(xs)\n\ndef solve(xs):\n    return helper(xs)[0::2]"),
        prog("def f(xs):\n    return sorted(xs)"),  # matches some pairs only
        prog("def f(xs):\n    return [x for i, x in enumerate(sorted(xs)) if i % 2 == 0] if len(xs) < 4 else []"),
        prog("def f(xs):\n    raise ValueError"),
        "no code", prog("def f(:"),
    ]) == [OK, OK, WRONG, WRONG, WRONG, BAD, BAD]


def test_code_f_hacks_are_not_credited(sandbox):
    task = _induction(sandbox)
    hacks = [
        "class A:\n    def __eq__(self, o):\n        return True\ndef f(xs):\n    return A()",
        "class A(list):\n    def __eq__(self, o):\n        return True\ndef f(xs):\n    return A()",
        "import sys\ndef f(xs):\n    return sys._getframe(1).f_locals",  # no gold data in its process
        "import builtins\nbuiltins.repr = lambda o: '[1]'\ndef f(xs):\n    return xs",
    ]
    assert verdicts(sandbox, task, [prog(h) for h in hacks]) == [WRONG] * len(hacks)


def test_code_f_unicode_and_custom_class_outputs(sandbox):
    w_class = ("class W:\n    def __init__(self, text):\n        self.text = text\n"
               "    def __eq__(self, other):\n        return isinstance(other, W) and self.text == other.text\n"
               "    def __repr__(self):\n        return f'W(text={self.text!r})'\n")
    program = w_class + "def f(s):\n    return W(s.title())\n"
    words = ["'ça va'", "'über'", "'naïve'", "'ß'", "'x'", "'a b'"]
    text = "<answer>" + "".join(f"```input\n{w}\n```" for w in words) + "```message\ntitle\n```</answer>"
    rules = TaskRules(induction_inputs=6, induction_min_inputs=6)
    check = check_proposal("code_f", text, sandbox, program=program, rules=rules)
    assert check.valid, check.reason
    assert check.task.outputs[0] == "W(text='Ça Va')" and check.task.hidden == [3, 4, 5]
    own = w_class + "def f(s):\n    return W(' '.join(w.capitalize() for w in s.split(' ')))"
    plain = "def f(s):\n    return s.title()"
    assert verdicts(sandbox, check.task, [prog(own), prog(plain)]) == [OK, WRONG]


# ------------------------------------------------------------------------------------------- all types


def test_identical_answers_share_one_execution(counting_sandbox):
    task = triplet("code_i", "def f(x):\n    return x * 2\n", "3", "6")
    counting = counting_sandbox
    got = verify_answers([task] * 8, [inp("3")] * 6 + [inp("4"), inp(" 3 ")], counting)
    assert [v.correct for v in got] == [True] * 6 + [False, True]
    assert len(counting.batches) == 1 and len(counting.batches[0]) == 2
    assert len({code for code, _ in counting.batches[0]}) == 1  # one program exec, one fork per answer
    assert verify_answers([], [], counting) == [] and len(counting.batches) == 1


def test_code_o_builtin_literals_need_no_sandbox_job(counting_sandbox):
    task = triplet("code_o", "def f(x):\n    return x * 2\n", "3", "6")
    counting = counting_sandbox
    got = verify_answers([task] * 3, [out("6"), out("6.0"), out("7")], counting)
    assert [v.correct for v in got] == [True, True, False] and counting.batches == []
    got = verify_answers([task] * 3, [out("6"), out("6.0"), out("7")], counting, fast_literals=False)
    assert [v.correct for v in got] == [True, True, False] and len(counting.batches[0]) == 3


def test_mixed_batch_is_one_sandbox_call(sandbox, counting_sandbox):
    t_o = triplet("code_o", "def f(x):\n    return -x\n", "1", "-1")
    t_i = t_o.retyped("code_i")
    t_f = _induction(sandbox)
    counting = counting_sandbox
    got = verify_answers([t_o, t_i, t_f], [out("-1"), inp("1"), prog("def f(xs):\n    return sorted(xs)[::2]")],
                         counting)
    assert [v.correct for v in got] == [True, True, True] and len(counting.batches) == 1


def test_garbage_completions_never_raise(sandbox):
    task = triplet("code_o", "def f(x):\n    return x\n", "1", "1")
    garbage = ["", "\x00", "<answer>", "</answer><answer>", "```output", "```output\n```", "💥" * 10_000,
               "<answer>```output\n1\n```" * 1000, "x" * 1_000_000, "```output\n" + "[" * 5000 + "\n```",
               "<answer>```output\n1\n```</answer> trailing <answer>```output\n2\n```"]
    for task_type in ("code_o", "code_i", "code_f"):
        t = task if task_type != "code_f" else _induction(sandbox)
        t = t.retyped(task_type) if task_type == "code_i" else t
        got = verify_answers([t] * len(garbage), garbage, sandbox)
        assert len(got) == len(garbage) and all(isinstance(v.correct, bool) for v in got)
    assert verify_answers([task], [None], sandbox)[0].reason == "not_text"  # type: ignore[list-item]
    with pytest.raises(ValueError):
        verify_answers([task], [], sandbox)


def test_no_model_text_is_evaluated_in_this_process(sandbox, monkeypatch):
    """Pitfall 2: AZR ``eval``s answers in the trainer. Here eval/exec are poisoned in this process and
    verification still works, because everything runs in the sandbox or is only parsed."""
    task = triplet("code_o", "def f(x):\n    return {x: [x]}\n", "1", "{1: [1]}")
    t_f = _induction(sandbox)

    def poisoned(*args, **kwargs):
        raise AssertionError("model text evaluated in the trainer process")

    monkeypatch.setattr(builtins, "eval", poisoned)
    monkeypatch.setattr(builtins, "exec", poisoned)
    got = verify_answers([task, task.retyped("code_i"), t_f],
                         [out("{1: [1]}"), inp("1"), prog("def f(xs):\n    return sorted(xs)[::2]")], sandbox)
    assert [v.correct for v in got] == [True, True, True]


values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, -0.0, 1.0, 0.5, 1e300]),
              st.sampled_from(["", "a", "é"]), st.sampled_from([b"", b"a"]), st.sampled_from([1j, (1 + 0j)])),
    lambda inner: st.one_of(st.lists(inner, max_size=2), st.tuples(inner), st.frozensets(st.integers(0, 2), max_size=2),
                            st.sets(st.integers(0, 2), max_size=2), st.dictionaries(st.integers(0, 2), inner, max_size=2)),
    max_leaves=5)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gold=values, pred=values)
def test_fast_literal_path_agrees_with_the_sandbox(sandbox, gold, pred):
    task = triplet("code_o", "def f(x):\n    return x\n", "0", repr(gold))
    answers = [out(repr(pred)), out(repr(gold))]
    assert verdicts(sandbox, task, answers, True) == verdicts(sandbox, task, answers, False)


# ------------------------------------------------------------------------------------------- verdict fields

TAGGED_TWO_LINES = "<think>t</think>\n<answer>\ntwo\nlines\n</answer>"


@pytest.mark.parametrize("task_type, completion, rules, reason, tags_ok", [
    ("code_o", None, TaskRules(), "not_text", False),
    ("code_o", "```output\n1\n```", TaskRules(require_tags=True), "format", False),
    ("code_o", TAGGED_TWO_LINES, TaskRules(), "no_output", True),
    ("code_i", TAGGED_TWO_LINES, TaskRules(), "no_input", True),
    ("code_o", out("f(1)"), TaskRules(), "not_a_value", True),
])
def test_malformed_answer_verdicts_exactly(task_type, completion, rules, reason, tags_ok):
    """What lands in problems.jsonl for a malformed answer: the reason tag, ``correct`` exactly False (not None:
    summaries take float() of it) and the completion's own tags_ok. Catches correct=None for not_text/format,
    the tag "FORMAT", tags_ok dropped (or None) on no_<kind> and on a ParseError, and to_dict's keys renamed."""
    task = triplet(task_type, "def f(x):\n    return x\n", "1", "1")
    v = verify_answers([task], [completion], None, rules=rules)[0]  # no answer to run: the sandbox is not used
    assert v.to_dict() == {"format_ok": False, "correct": False, "reason": reason, "tags_ok": tags_ok,
                           "answer": None, "exec_s": 0.0}


def test_entry_parameters_are_those_of_f_not_of_an_earlier_definition(sandbox):
    """Assignments answering code_i are matched to ``f``'s parameters. Catches the entry found by `isinstance(...)
    or name == "f"`: the helper ``g`` before ``f`` taken as the entry (x = 1 then reads as malformed), and a
    top-level statement before ``f`` raising AttributeError."""
    helper_first = "def g(a, b):\n    return a + b\n\ndef f(x):\n    return g(x, 1)\n"
    constant_first = "K = 1\n\ndef f(x):\n    return x + K\n"
    for program in (helper_first, constant_first):
        v = verify_answer(triplet("code_i", program, "1", "2"), prog("x = 1"), sandbox)
        assert (v.format_ok, v.correct, v.reason, v.answer) == (True, True, "correct", "1")


def test_verify_answer_runs_its_sandbox_and_reads_the_last_program(sandbox):
    """Catches verify_answer not handing its sandbox on (an answer that must run then raises), code_f taking the
    FIRST ```python block (a draft) instead of the last, and a finished run with other values not tagged
    "wrong"."""
    task = _induction(sandbox)
    draft, final = "def f(xs):\n    return xs", "def f(xs):\n    return sorted(xs)[::2]"
    two = f"<think>t</think>\n<answer>\n```python\n{draft}\n```\n```python\n{final}\n```\n</answer>"
    v = verify_answer(task, two, sandbox)
    assert (v.format_ok, v.correct, v.reason, v.tags_ok) == (True, True, "correct", True)
    v = verify_answer(task, prog(draft), sandbox)
    assert (v.format_ok, v.correct, v.reason) == (True, False, "wrong")


@pytest.mark.parametrize("result, correct, reason, exec_s", [
    (ExecResult("ok", "True", wall_s=0.5), True, "correct", 0.5),
    (ExecResult("ok", "False", wall_s=0.25), False, "wrong", 0.25),
    (ExecResult("timeout", wall_s=2.0), False, "run_timeout", 2.0),
    (ExecResult("error", error="ValueError: x", wall_s=0.125), False, "run_error", 0.125),
    (None, False, "run_failed", 0.0),  # a result without status or wall_s (outside the Executor protocol)
])
def test_sandbox_result_to_verdict(result, correct, reason, exec_s):
    """How one sandbox result becomes the verdict of a parsed code_i answer. Catches the "ok" status not
    recognised (a wrong answer tagged "run_ok"), and missing status/wall_s read without their defaults
    (AttributeError instead of run_failed with exec_s 0.0)."""
    task = triplet("code_i", "def f(x):\n    return x\n", "1", "1")
    v = verify_answers([task], [inp("1")], FixedSandbox(result))[0]
    assert v.to_dict() == {"format_ok": True, "correct": correct, "reason": reason, "tags_ok": True,
                           "answer": "1", "exec_s": exec_s}
