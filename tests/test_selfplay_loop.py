"""The self-play loop end to end on the tiny model: population and baseline runs, evolution, ratings, resume.

The engine is the real ``LocalEngine`` (real adapters, real REINFORCE++ updates, real evolution on adapter
tensors); only the *text* of completions is scripted, because these tests need deterministic proposals and
answers of known correctness. A random tiny model writes no valid programs. The sandbox is real.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from openrlhf_populora.config import Config
from openrlhf_populora.engines.local import LocalEngineConfig
from openrlhf_populora.engines.scripted import scripted_engine
from openrlhf_populora.selfplay.runner import run

pytestmark = pytest.mark.slow

ACCURACY = {"s0": 0.9, "s1": 0.3, "s2": 0.6, "s3": 0.6, "b0": 0.5}  # how often each student answers right


def _scripted_answer(adapter: str, prompt: str, rng: random.Random) -> str:
    """A deterministic policy: teachers write small arithmetic programs, students solve them with
    a per-student accuracy. Everything is parsed from the prompt with regular expressions."""
    if "## Task: write a new Python program" in prompt:
        if rng.random() < 0.25:
            return "<think>hmm</think><answer>I do not know</answer>"  # an invalid proposal
        k, x = rng.randint(1, 9), rng.randint(0, 20)
        op = rng.choice(["+", "*"])
        return f"<think>plan</think>\n<answer>\n```python\ndef f(x):\n    return x {op} {k}\n```\n```input\n{x}\n```\n</answer>"
    if "## Task: design" in prompt:
        inputs = "".join(f"```input\n{rng.randint(0, 99) * 10 + i}\n```\n" for i in range(10))
        return f"<think>p</think><answer>{inputs}```message\nsome arithmetic\n```</answer>"
    right = rng.random() < ACCURACY.get(adapter, 0.5)
    program = re.search(r"return x ([+*]) (\d+)", prompt)
    op, k = (program.group(1), int(program.group(2))) if program else (None, 0)
    apply = (lambda v: v + k if op == "+" else v * k) if op else (lambda v: v)
    if "## Task: predict the output" in prompt:
        value = re.search(r"```input\n(.*?)\n```", prompt).group(1)
        guess = repr(apply(int(value))) if value.isdigit() else value
        return f"<think>t</think><answer>```output\n{guess if right else '-12345'}\n```</answer>"
    if "## Task: find an input" in prompt:
        value = re.search(r"```output\n(.*?)\n```", prompt).group(1)
        guess = value
        if op and value.lstrip("-").isdigit():
            guess = str(int(value) - k) if op == "+" else str(int(value) // k)
        return f"<think>t</think><answer>```input\n{guess if right else '-12345'}\n```</answer>"
    if "## Task: write the function" in prompt:
        pairs = re.findall(r"```input_\d+\n(-?\d+)\n```\n```output_\d+\n(-?\d+)\n```", prompt)
        body = "return x"
        if pairs:
            (i0, o0), (i1, o1) = pairs[0], pairs[1]
            i0, o0, i1, o1 = int(i0), int(o0), int(i1), int(o1)
            body = f"return x + {o0 - i0}" if o1 - i1 == o0 - i0 else f"return x * {o0 // i0 if i0 else 1}"
        return f"<think>t</think><answer>```python\ndef f(x):\n    {body if right else 'return 0'}\n```</answer>"
    return "no idea"


class ScriptedEngine(scripted_engine(lambda adapter, prompt, sample, rng: _scripted_answer(adapter, prompt, rng))):
    """The real engine, with completions scripted instead of sampled (training and adapters are real)."""

    trained: list = []  # every trajectory handed to train_step, across engines (tests read it)

    def train_step(self, trajectories):
        ScriptedEngine.trained.extend(trajectories)
        return super().train_step(trajectories)


def _config(run_dir: Path, **populora) -> Config:
    config = Config()
    config.actor.model_name_or_path = "tiny"
    config.actor.adam.lr = 1e-3
    config.ds.lora.rank = 4
    config.rollout.max_new_tokens = 64
    config.ckpt.output_dir = str(run_dir)
    config.train.seed = 7
    p = config.populora
    p.num_teachers, p.num_students, p.total_steps = 2, 2, 2
    p.proposals_per_teacher, p.solver_tasks, p.solver_samples, p.references = 3, 2, 2, 1
    p.seed_tasks, p.seed_max_rounds = 3, 2
    p.evolution.evolve_every = 1  # an event after step 1; none after step 2, the last
    p.evolution.replace_fraction = 0.5
    p.report = False
    for key, value in populora.items():
        setattr(p, key, value)
    config.validate()
    return config


def _build(config: Config) -> ScriptedEngine:
    from openrlhf_populora.build import build_engine
    from openrlhf_populora.models.embedded import resolve_model

    real = build_engine(config)  # the CLI's own mapping of flags onto the engine config
    real.close()
    return ScriptedEngine(LocalEngineConfig(**{**real.config.__dict__,
                                               "model_name_or_path": resolve_model("tiny")}))


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "time" and not k.startswith("time/")}


class _RecordingBar:
    """Stands in for tqdm to record what the progress bar shows."""

    descriptions: list[str] = []

    def __init__(self, *args, **kwargs):
        pass

    def set_description(self, text):
        _RecordingBar.descriptions.append(text)

    def update(self, n):
        pass

    def set_postfix(self, values):
        pass

    def close(self):
        pass


def test_population_run_end_to_end(tmp_path, monkeypatch):
    import openrlhf_populora.selfplay.runner as runner

    monkeypatch.setattr(runner, "tqdm", _RecordingBar)
    ScriptedEngine.trained.clear()
    run_dir = tmp_path / "pop"
    config = _config(run_dir)
    assert run(config, _build, progress=False) == 0

    # the progress bar names each phase of each step, in order
    phases = [d.removeprefix("self-play [").removesuffix("]") for d in _RecordingBar.descriptions]
    order = ["match", "propose", "check", "solve", "verify", "train", "evolve", "probe"]
    assert phases == order * 2
    # every trajectory carries its whitening group: member/role/task type, of the member in that adapter slot
    groups = {t.group for t in ScriptedEngine.trained}
    assert groups and all(len(g.split("/")) == 3 for g in groups)
    assert {g.split("/")[1] for g in groups} == {"propose", "solve"}
    assert {g.split("/")[2] for g in groups} <= set(config.populora.task_types)
    assert all(t.group.split("/")[0][0] == t.adapter[0] for t in ScriptedEngine.trained)  # t* teach, s* solve

    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    first = records[0]
    assert 0 < first["train/validity"] < 1  # the script writes some invalid proposals
    assert 0 < first["train/solve_rate"] < 1
    assert first["train/format_rate"] == 1.0
    for tt in config.populora.task_types:
        assert first[f"train/{tt}/solve_rate"] is not None
    assert any(k.startswith("matrix/t") for k in first)
    assert first["coverage/overall"] > 0 and first["complexity/ast_nodes"] > 0
    assert first["train/grad_norm"] > 0  # adapters really trained
    # the learning diagnostics: every living member, in its role, each step; the mean over members
    for record in records:
        sizes = {tuple(k.split("/")[1:3]): v for k, v in record.items() if k.endswith("/all/update_size")}
        kls = {tuple(k.split("/")[1:3]): v for k, v in record.items() if k.endswith("/all/probe_kl")}
        assert sizes.keys() == kls.keys()
        assert sorted(role for _, role in sizes) == ["student"] * 2 + ["teacher"] * 2  # each living member once
        assert all(v >= 0 for v in [*sizes.values(), *kls.values()])
        assert record["learning/update_size"] > 0 and record["time/probe"] > 0

    # ratings moved away from the prior, and evolution at step k=1 replaced members with children; the last step
    # (2) made none: they would never have trained
    population = json.loads((run_dir / "population.json").read_text())["members"]
    children = [m for m in population if m["operator"] != "init"]
    assert children and all(m["birth_step"] == 1 and m["parents"] for m in children)
    retired = [m for m in population if m["retired_step"] == 1]
    assert len(retired) == len(children)
    mus = [v for k, v in records[-1].items() if k.startswith("rating/") and k.endswith("/mu")]
    assert any(abs(mu - 25.0) > 1e-6 for mu in mus)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["kind"] for e in events} == {"seeding", "evolution"}

    # every living member's adapter loads with PEFT, and problems were archived with verdicts
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from openrlhf_populora.models.embedded import resolve_model

    alive = [m for m in population if m["retired_step"] is None]
    assert sorted(p.name for p in (run_dir / "adapters").iterdir()) == sorted(m["id"] for m in alive)
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"))
    PeftModel.from_pretrained(base, str(run_dir / "adapters" / alive[0]["id"]))
    problems = [json.loads(line) for line in (run_dir / "problems.jsonl").read_text().splitlines()]
    assert {p["step"] for p in problems} == {1, 2} and any(p["valid"] for p in problems)


def test_baseline_run_end_to_end(tmp_path):
    run_dir = tmp_path / "baseline"
    config = _config(run_dir, mode="baseline", teacher_reward="learnability")
    assert run(config, _build, progress=False) == 0
    records = _records(run_dir)
    assert len(records) == 2 and records[0]["train/validity"] > 0
    assert not any(k.startswith("rating/") or k.startswith("matrix/") for k in records[0])
    population = json.loads((run_dir / "population.json").read_text())["members"]
    assert [m["id"] for m in population] == ["b0"]  # no evolution for the single agent
    assert (run_dir / "adapters" / "b0" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_the_learning_probe_reads_a_hub_id_models_base_from_the_hf_cache(tmp_path, monkeypatch):
    """``--actor.model_name_or_path org/name`` (a hub id, as lib.sh's default names the 7B model) reaches the
    learning probe, which reads the base weights' norms from the model's files: here from an HF cache under
    ``HF_HOME``, offline. The same model as ``tiny``, so the update sizes equal a ``tiny`` run's. Catches: the
    probe refusing hub ids (every cluster run died after seeding and one step)."""
    from hf_cache import cache_model
    from huggingface_hub import constants

    from openrlhf_populora.models.embedded import resolve_model

    home = tmp_path / "hf"
    cache_model(home, "org/tiny-coder", Path(resolve_model("tiny")))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))  # what HF_HOME gives at import
    sizes = []
    for name, model in (("hub", "org/tiny-coder"), ("tiny", "tiny")):
        config = _config(tmp_path / name, mode="baseline", total_steps=1)
        config.actor.model_name_or_path = model
        assert run(config, _build, progress=False) == 0
        sizes.append({k: v for k, v in _records(tmp_path / name)[-1].items() if k.endswith("/update_size")})
    assert sizes[0] and sizes[0] == sizes[1] and all(v > 0 for v in sizes[0].values())


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    def config_for(run_dir, steps):  # an event at step 3: the second leg retires members the first exported
        config = _config(run_dir, total_steps=steps)
        config.populora.evolution.evolve_every = 3
        return config

    # the first leg ends at step 2, where no event is due: a run's last step never evolves, so a leg ending at
    # an evolution step would skip the event that the uninterrupted run makes there
    straight = tmp_path / "straight"
    config = config_for(straight, 4)
    assert run(config, _build, progress=False) == 0

    resumed = tmp_path / "resumed"
    first_leg = config_for(resumed, 2)
    assert run(first_leg, _build, progress=False) == 0
    second_leg = config_for(resumed, 4)
    second_leg.ckpt.load_enable = True
    assert run(second_leg, _build, progress=False) == 0

    a, b = _records(straight), _records(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert _comparable(x) == pytest.approx(_comparable(y), rel=1e-6, abs=1e-9)
    # the run directory holds the living members' adapters only, also after a resume (a member retired in the
    # second leg had been exported by the first)
    assert sorted(p.name for p in (resumed / "adapters").iterdir()) == sorted(
        p.name for p in (straight / "adapters").iterdir())
    for member in json.loads((straight / "population.json").read_text())["members"]:
        if member["retired_step"] is None:
            sa = _adapter(straight, member["id"])
            sb = _adapter(resumed, member["id"])
            assert sa.keys() == sb.keys()
            assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)


def _adapter(run_dir: Path, member: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapters" / member / "adapter_model.safetensors"))
