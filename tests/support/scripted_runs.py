"""The self-play loop on the real local engine with a scripted policy, for the loop's end-to-end tests.

``ScriptedEngine`` is the tiny model's local engine (real training, real adapters) whose completions come from
``scripted_answer``: teachers write small arithmetic programs, students solve them with a fixed accuracy each.
``run_config`` is a 2-teacher, 2-student, 2-step run with an evolution event after step 1; ``scripted_build``
maps it onto the engine through the CLI's own composition (``build.build_engine``).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import torch

from openrlhf_populora.config import Config
from openrlhf_populora.engines.local import LocalEngineConfig
from openrlhf_populora.engines.scripted import scripted_engine

ACCURACY = {"s0": 0.9, "s1": 0.3, "s2": 0.6, "s3": 0.6, "b0": 0.5}  # how often each student answers right


def scripted_answer(adapter: str, prompt: str, rng: random.Random) -> str:
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


class ScriptedEngine(scripted_engine(lambda adapter, prompt, sample, rng: scripted_answer(adapter, prompt, rng))):
    """The real engine, with completions scripted instead of sampled (training and adapters are real)."""

    trained: list = []  # every trajectory handed to train_step, across engines (tests read it)

    def train_step(self, trajectories):
        ScriptedEngine.trained.extend(trajectories)
        return super().train_step(trajectories)


def run_config(run_dir: Path, **populora) -> Config:
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


def scripted_build(config: Config) -> ScriptedEngine:
    from openrlhf_populora.build import build_engine
    from openrlhf_populora.models.embedded import resolve_model

    real = build_engine(config)  # the CLI's own mapping of flags onto the engine config
    real.close()
    return ScriptedEngine(LocalEngineConfig(**{**real.config.__dict__,
                                               "model_name_or_path": resolve_model("tiny")}))


def adapter_weights(run_dir: Path, member: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapters" / member / "adapter_model.safetensors"))
