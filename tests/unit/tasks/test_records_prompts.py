"""Task records (JSON round trip, validation, seeds) and the prompt builders."""

import json

import pytest

from openrlhf_populora.tasks import (
    COMPACT_TEMPLATES,
    TASK_TYPES,
    PromptTemplates,
    Task,
    TaskRules,
    proposer_prompt,
    render_raw,
    solver_prompt,
    zero_induction_task,
    zero_triplet,
)


def _induction_task():
    return Task("code_f", "def f(a):\n    return a * 2\n", ["1", "2", "3", "4"], ["2", "4", "6", "8"],
                message="doubles", shown=[0, 1], proposer="t1", step=7, meta={"parent": "abc"})


def test_task_types():
    assert TASK_TYPES == ("code_o", "code_i", "code_f")


def test_json_round_trip():
    for task in (zero_triplet(), zero_triplet("code_i"), zero_induction_task(), _induction_task()):
        again = Task.from_json(task.to_json())
        assert again == task and again.key() == task.key()
        json.dumps(task.to_dict())  # plain JSON


def test_key_ignores_provenance_but_not_content():
    a = zero_triplet()
    b = Task.from_dict({**a.to_dict(), "proposer": "other", "step": 99})
    c = Task.from_dict({**a.to_dict(), "inputs": ["'Hi'"], "outputs": ["'Hi'"]})
    assert a.key() == b.key() != c.key()
    assert a.key() != a.retyped("code_i").key()


def test_validation_errors():
    with pytest.raises(ValueError):
        Task("code_x", "def f(x): return x", ["1"], ["1"])
    with pytest.raises(ValueError):
        Task("code_o", "def f(x): return x", ["1", "2"], ["1", "2"])
    with pytest.raises(ValueError):
        Task("code_f", "def f(x): return x", ["1", "2"], ["1", "2"], shown=[0, 1])  # nothing hidden
    with pytest.raises(ValueError):
        Task("code_f", "def f(x): return x", ["1", "2"], ["1"], shown=[0])
    with pytest.raises(ValueError):
        Task("code_o", "  ", ["1"], ["1"])
    with pytest.raises(ValueError):
        Task.from_dict({"task_type": "code_o", "program": "def f(x): return x", "inputs": ["1"], "outputs": ["1"],
                        "surprise": 1})
    with pytest.raises(TypeError):
        Task("code_o", "def f(x): return x", "1", "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Task.from_dict(["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        zero_triplet("code_f")
    with pytest.raises(ValueError):
        _induction_task().retyped("code_o")


def test_seeds():
    z = zero_triplet()
    assert z.program == "def f(x):\n    return x\n" and z.inputs == ["'Hello world'"] == z.outputs
    ind = zero_induction_task()
    assert len(ind.inputs) == 6 and ind.shown == [0, 1, 2] and ind.hidden == [3, 4, 5]


def test_triplet_proposer_prompt_has_references_format_and_banned_words():
    refs = [zero_triplet(), Task("code_o", "def f(a, b):\n    return a + b\n", ["1, 2"], ["3"])]
    text = proposer_prompt("code_o", refs)
    assert "<snippet_0>" in text and "<snippet_1>" in text and "</snippet_1>" in text
    assert "```python\ndef f(a, b):" in text and "```input\n1, 2\n```" in text and "```output\n3\n```" in text
    assert "<think>" in text and "<answer>" in text
    assert ", ".join(dict.fromkeys(TaskRules().prompt_banned_words)) in text and text.count("datetime") == 1
    assert "(none)" in proposer_prompt("code_i", [])


def test_difficulty_criterion_fixed_with_azr_parity_flag():
    # AZR's abduction prompt talks about predicting the output and its deduction prompt about the input
    # (pitfall 7). Ours describe the solver's real job; the flag restores AZR's swap.
    assert "predicting the output from the input" in proposer_prompt("code_o", [])
    assert "finding an input from the output" in proposer_prompt("code_i", [])
    assert "finding an input from the output" in proposer_prompt("code_o", [], azr_swapped_difficulty=True)
    assert "predicting the output from the input" in proposer_prompt("code_i", [], azr_swapped_difficulty=True)


def test_induction_proposer_prompt_shows_one_program_and_asks_for_n_inputs():
    program = Task("code_i", "def f(s):\n    return s[::-1]\n", ["'ab'"], ["'ba'"])
    text = proposer_prompt("code_f", [], program=program, rules=TaskRules(induction_inputs=4,
                                                                           induction_min_inputs=4))
    assert "return s[::-1]" in text and "Exactly 4 ```input blocks" in text and "```message" in text
    assert proposer_prompt("code_f", [program]) == proposer_prompt("code_f", [], program=program)
    with pytest.raises(ValueError):
        proposer_prompt("code_f", [])


def test_solver_prompts():
    z = zero_triplet()
    assert "```input\n'Hello world'\n```" in solver_prompt(z) and "```output" in solver_prompt(z)
    zi = z.retyped("code_i")
    assert "```output\n'Hello world'\n```" in solver_prompt(zi)
    ind = _induction_task()
    text = solver_prompt(ind)
    assert "doubles" in text and "```input_0\n1\n```" in text and "```output_1\n4\n```" in text
    assert "return a * 2" not in text  # the program stays hidden
    assert "```input_2" not in text and "6" not in text.split("### Rules")[0]  # hidden pairs stay hidden


def test_templates_swappable_and_raw_rendering():
    custom = PromptTemplates(solve_output="OUT $program | $input | $answer_format")
    assert solver_prompt(zero_triplet(), custom).startswith("OUT def f(x):")
    raw = render_raw("question?")
    assert raw.endswith("User: question?\nAssistant: <think>") and "<answer>" in raw


def test_compact_templates_are_short_and_keep_the_answer_format():
    refs, ind = [zero_triplet()] * 3, _induction_task()
    texts = [proposer_prompt("code_o", refs, templates=COMPACT_TEMPLATES),
             proposer_prompt("code_i", refs, templates=COMPACT_TEMPLATES),
             proposer_prompt("code_f", [], program=zero_triplet(), templates=COMPACT_TEMPLATES),
             solver_prompt(zero_triplet(), COMPACT_TEMPLATES), solver_prompt(zero_triplet().retyped("code_i"),
                                                                             COMPACT_TEMPLATES),
             solver_prompt(ind, COMPACT_TEMPLATES)]
    for compact, full in zip(texts, [proposer_prompt("code_o", refs), proposer_prompt("code_i", refs),
                                     proposer_prompt("code_f", [], program=zero_triplet()),
                                     solver_prompt(zero_triplet()), solver_prompt(zero_triplet().retyped("code_i")),
                                     solver_prompt(ind)], strict=True):
        assert len(compact) < len(full) and "<answer>" in compact and "```" in compact
    assert "<snippet_2>" in texts[0] and "10 different inputs" in texts[2] and "return a * 2" not in texts[5]


def test_compact_proposer_references_show_only_what_a_proposal_contains():
    from openrlhf_populora.tasks import COMPACT_TEMPLATES, DEFAULT_TEMPLATES, proposer_prompt, zero_triplet

    ref = zero_triplet("code_o")
    compact = proposer_prompt("code_o", [ref], templates=COMPACT_TEMPLATES)
    default = proposer_prompt("code_o", [ref], templates=DEFAULT_TEMPLATES)
    assert "```input\n'Hello world'\n```" in compact and "```output" not in compact
    assert "```output\n'Hello world'\n```" in default  # AZR shows the references' outputs


@pytest.mark.parametrize("shown", [[0, 3], [-1, 0], [5]])
def test_code_f_shown_index_out_of_range_is_rejected(shown):
    """Catches: an off-by-one range check (``i > len(inputs)``) that accepts index ``len(inputs)``, a pair that
    does not exist, as shown."""
    with pytest.raises(ValueError, match="out of range"):
        Task("code_f", "def f(x): return x", ["1", "2", "3"], ["1", "2", "3"], shown=shown)


def test_key_accepts_any_text_a_json_record_can_hold():
    """Catches: a key hashed from non-ASCII-escaped JSON: a lone surrogate (``"\\ud800"`` in a JSON file loads
    as one) then makes ``key()`` raise UnicodeEncodeError, so the buffers cannot hold the task."""
    task = Task.from_json(json.dumps({"task_type": "code_o", "program": "def f(x):\n    return x\n",
                                      "inputs": ["'\ud800'"], "outputs": ["'\ud800'"]}))
    assert task.inputs == ["'\ud800'"]
    assert len(task.key()) == 40 and task.key() != zero_triplet().key()


def test_retyped_copies_meta():
    """Catches: ``retyped`` sharing the original's ``meta`` dict (editing one task's meta edits the other's)."""
    task = Task("code_o", "def f(x):\n    return x\n", ["1"], ["1"], meta={"parent": "p"})
    other = task.retyped("code_i")
    other.meta["parent"] = "q"
    assert task.meta == {"parent": "p"} and other.meta == {"parent": "q"}


def test_seed_tasks_exactly():
    """Catches: any change to AZR's seed tasks (their pairs, the induction message, the ``seed`` provenance)."""
    program = "def f(x):\n    return x\n"
    for task_type in ("code_o", "code_i"):
        assert zero_triplet(task_type).to_dict() == {
            "task_type": task_type, "program": program, "inputs": ["'Hello world'"], "outputs": ["'Hello world'"],
            "message": "", "shown": [0], "proposer": "seed", "step": 0, "meta": {}}
    inputs = ["'Hello world'", "1", "[1, 2, 3]", "{'a': 1}", "(1, 'b')", "True"]
    assert zero_induction_task().to_dict() == {
        "task_type": "code_f", "program": program, "inputs": inputs, "outputs": inputs,
        "message": "Return the input unchanged.", "shown": [0, 1, 2], "proposer": "seed", "step": 0, "meta": {}}


@pytest.mark.parametrize("task_type,sentence", [
    ("code_o", "is shown the program and the input will have to work out the output by reasoning"),
    ("code_i", "is shown the program and the output will have to work out an input that produces it by reasoning"),
], ids=["code_o", "code_i"])
def test_triplet_proposer_prompt_says_what_the_solver_sees_and_the_timeout(task_type, sentence):
    """Catches: a proposer prompt that describes the wrong (or garbled) solver view, or that loses the timeout
    (``$timeout`` rendered as ``None``)."""
    text = proposer_prompt(task_type, [], timeout_s=2.5)
    assert sentence in text and "- It finishes within 2.5 seconds.\n" in text
    assert "- It finishes within 10 seconds.\n" in proposer_prompt(task_type, [])
