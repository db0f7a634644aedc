"""OpenRLHF's reward file: scores, bad labels, never raising (hypothesis fuzz), loading the way upstream loads it."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openrlhf_populora import openrlhf_reward as reward_file
from openrlhf_populora.openrlhf_reward import reward_func, score_completions
from openrlhf_populora.sandbox import Sandbox
from openrlhf_populora.tasks import Task


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2, timeout_s=2.0, memory_mb=256) as sb:
        yield sb


TASK = Task("code_o", "def f(x):\n    return [x] * 2\n", ["'a'"], ["['a', 'a']"])
PROMPT = "<|user|>predict<|assistant|>"


def test_reward_func_scores_a_student_completion(sandbox, monkeypatch):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    right = PROMPT + "<think>x</think><answer>```output\n['a', 'a']\n```</answer><|end|>"
    wrong = PROMPT + "<answer>```output\n['a']\n```</answer>"
    out = reward_func([right], [PROMPT], [TASK.to_json()])
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert isinstance(out["rewards"], torch.Tensor) and out["rewards"].shape == (1,)
    assert torch.tensor([out["rewards"]]).shape == (1,)  # what OpenRLHF does with it
    assert out["rewards"].tolist() == [1.0] and out["scores"].tolist() == [1.0]
    out = reward_func([wrong, "junk", right], [PROMPT] * 3, [TASK.to_json()] * 2 + [json.dumps({"task": TASK.to_dict()})])
    assert out["rewards"].tolist() == [-0.5, -1.0, 1.0] and out["scores"].tolist() == [0.0, 0.0, 1.0]
    assert out["extra_logs"]["reward_errors"] == 0.0 and all(isinstance(v, float) for v in out["extra_logs"].values())


def test_reward_func_prompt_answer_example_is_not_the_answer(sandbox, monkeypatch):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    prompt = "example: <answer>```output\n['a', 'a']\n```</answer> now you:"
    out = reward_func([prompt + " no idea"], [prompt], [TASK.to_json()])
    assert out["rewards"].tolist() == [-1.0]


def test_prompt_found_by_its_tail_when_decoding_changed_its_start(sandbox, monkeypatch):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    prompt = "Example: <answer>```output\n['a', 'a']\n```</answer>\n" + "Now predict the output of f('a')." * 3
    query = "<bos>" + prompt.replace("Example", "EXAMPLE") + " I do not know."
    out = reward_func([query], [prompt], [TASK.to_json()])
    assert out["rewards"].tolist() == [-1.0]  # the prompt's example answer is not taken as the answer


def test_bad_labels_score_zero_and_are_counted(sandbox):
    out = score_completions(["a", "b", "c"], ["", "", ""], ["not json", json.dumps({"task_type": "code_o"}), None],
                            sandbox=sandbox)
    assert out["rewards"] == [0.0, 0.0, 0.0] and out["extra_logs"]["reward_errors"] == 3.0


def test_eval_mode_gives_accuracy(sandbox, monkeypatch):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    monkeypatch.setenv("POPULORA_REWARD_MODE", "eval")
    out = reward_func(["junk", "<answer>```output\n['a', 'a']\n```</answer>"], ["", ""], [TASK.to_json()] * 2)
    assert out["rewards"].tolist() == [0.0, 1.0]


def test_sandbox_failure_does_not_raise(monkeypatch):
    class Broken:
        def run(self, jobs):
            raise RuntimeError("sandbox down")

    monkeypatch.setattr(reward_file, "_SANDBOX", Broken())
    out = reward_func(["<answer>```input\n'a'\n```</answer>"], [""], [TASK.retyped("code_i").to_json()])
    assert out["rewards"].tolist() == [0.0] and out["extra_logs"]["reward_errors"] == 1.0


labels = st.one_of(st.text(max_size=50), st.just(TASK.to_json()), st.just(TASK.retyped("code_i").to_json()),
                   st.none(), st.integers(), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
completions = st.one_of(
    st.text(max_size=300),
    st.builds(lambda v: f"<answer>```output\n{v}\n```</answer>", st.text(max_size=60)),
    st.builds(lambda v: f"<answer>```input\n{v}\n```</answer>", st.text(max_size=60)),
    st.sampled_from(["<answer>", "</answer>", "```output\n['a', 'a']\n```", "```input\n'a'\n```"]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(st.tuples(completions, st.one_of(st.text(max_size=20), st.none()), labels), max_size=4))
def test_reward_func_never_raises(sandbox, monkeypatch, data):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    queries = [q for q, _, _ in data]
    out = reward_func(queries, [p for _, p, _ in data], [lab for _, _, lab in data])
    assert out["rewards"].shape == (len(data),) and out["scores"].shape == (len(data),)
    assert all(r in (1.0, -0.5, -1.0, 0.0) for r in out["rewards"].tolist())


@settings(max_examples=15, deadline=None)
@given(queries=st.one_of(st.none(), st.text(max_size=10), st.lists(st.none(), max_size=3)),
       prompts=st.one_of(st.none(), st.integers()), labels=st.one_of(st.none(), st.lists(st.integers(), max_size=3)))
def test_reward_func_never_raises_on_wrong_types(queries, prompts, labels):
    out = reward_func(queries, prompts, labels)
    assert set(out) == {"rewards", "scores", "extra_logs"}


def test_reward_file_loads_the_way_openrlhf_loads_it(sandbox, monkeypatch):
    """OpenRLHF 0.11.2 (utils/agent.py) loads --reward.remote_url *.py via spec_from_file_location without
    registering the module in sys.modules."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reward_func", reward_file.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_SANDBOX", sandbox)
    out = module.reward_func([PROMPT + "<answer>```output\n['a', 'a']\n```</answer>"], [PROMPT], [TASK.to_json()])
    assert out["rewards"].tolist() == [1.0]
