"""End to end: a tiny model with two adapters in a run directory, evaluated on a handful of HumanEval problems
by the command line (local engine, real Sandbox), then resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from paths import EVAL_DATA

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.cli.evaluate import main
from openrlhf_populora.config import Config
from openrlhf_populora.engines.base import GenerationRequest, SamplingParams
from openrlhf_populora.engines.local import LocalEngine
from openrlhf_populora.eval.benchmarks import load_benchmark
from openrlhf_populora.eval.prompts import render_prompt
from openrlhf_populora.population.members import Population

# the tiny model's tests: fp32, every linear layer, seed 0 (Config's defaults: auto dtype, q/k/v/o, 42)
TEST_ENGINE = {"dtype": "fp32", "lora_target_modules": "all-linear", "seed": 0}


def engine_config(**overrides):
    """The local engine's config from Config's defaults (the one source), the tiny-model test defaults, then
    ``overrides``."""
    return local_engine_config(Config(), **{**TEST_ENGINE, **overrides})

pytestmark = pytest.mark.slow
MAX_NEW = 12


def engine_for(model_dir: str, rank: int = 4) -> LocalEngine:
    return LocalEngine(engine_config(model_name_or_path=model_dir, lora_rank=rank, lora_alpha=2 * rank,
                                         lora_target_modules=["q_proj", "v_proj"], policy_loss="native"))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny random Qwen2 (built in code) saved as a local HF directory."""
    from openrlhf_populora.models.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """What training leaves behind: config.yaml, population.json, adapters/<member>/ in PEFT format.
    The two adapters get random (non-zero) LoRA weights so that each member generates differently."""
    root = tmp_path_factory.mktemp("run")
    # trained on raw prompts: --code-template auto must pick azr although the tiny model has a chat template
    (root / "config.yaml").write_text(yaml.safe_dump({"actor": {"model_name_or_path": tiny_model_dir},
                                                      "populora": {"chat_template": False}}))
    population = Population.create(1, 1)
    population.save(root / "population.json")
    engine = engine_for(tiny_model_dir)
    gen = torch.Generator().manual_seed(7)
    for member in population.alive():
        engine.add_adapter(member.id)
        weights = {k: torch.randn(v.shape, generator=gen) for k, v in engine.get_adapter(member.id).items()}
        engine.set_adapter(member.id, weights)
        engine.save_adapter(member.id, str(root / "adapters" / member.id))
    return root


def samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_evaluate_two_adapters_and_the_base_then_resume(run_dir, tiny_model_dir, capsys):
    args = ["--run", str(run_dir), "--benchmarks", "humaneval,gsm8k", "--data-dir", str(EVAL_DATA), "--base",
            "--max-new-tokens", str(MAX_NEW), "--batch-size", "4", "--sandbox-workers", "1"]
    assert main([*args, "--limit", "2"]) == 0
    out = run_dir / "eval"
    first = samples(out)
    assert sorted((s["member"], s["benchmark"], s["problem_id"]) for s in first) == sorted(
        [(m, "humaneval", f"HumanEval/{i}") for m in ("base", "t0", "s0") for i in range(2)]
        + [(m, "gsm8k", f"line{i}") for m in ("base", "t0", "s0") for i in (1, 2)])
    # a random tiny model solves nothing: every sample graded, none passes
    assert all(s["passed"] is False for s in first)
    assert all(s["status"] != "ok" for s in first if s["benchmark"] == "humaneval")  # code did not run clean

    # each member was generated with its own adapter, from the azr prompt that auto chose for this run:
    # regenerate s0's and the base's answers directly
    printed = capsys.readouterr().out
    assert "prompt templates: code azr, math azr_boxed" in printed
    assert json.loads((out / "settings.json").read_text())["code_template"] == "azr"
    problem = load_benchmark("humaneval", limit=1)[0]
    prompt = render_prompt(problem, "azr")
    engine = engine_for(tiny_model_dir)
    from safetensors.torch import load_file

    engine.add_adapter("s0", load_file(str(run_dir / "adapters" / "s0" / "adapter_model.safetensors")))
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    direct = engine.generate([GenerationRequest("s0", prompt), GenerationRequest("__base__", prompt)], params)
    stored = {s["member"]: s["completion"] for s in first if s["problem_id"] == "HumanEval/0"}
    assert stored["s0"] == direct[0][0].text and stored["base"] == direct[1][0].text
    assert len({stored["s0"], stored["t0"], stored["base"]}) == 3  # the adapters change the output

    results = json.loads((out / "results.json").read_text())
    assert set(results["members"]) == {"base", "t0", "s0"}
    assert results["members"]["s0"]["scores"] == {"humaneval": 0.0, "gsm8k": 0.0}
    assert results["members"]["s0"]["n"] == {"humaneval": 2, "gsm8k": 2}
    assert results["members"]["s0"]["code_avg"] == 0.0 and results["members"]["s0"]["math_avg"] == 0.0
    labels = [row["label"] for row in results["rows"]]
    assert labels == ["Base model", "Population mean, students (1)", "Population mean, teachers (1)",
                      "Population mean, all members (2)",
                      "Worst member t0 (picked on these benchmarks: pessimistic; tied with s0)",  # the first listed
                      "t0 (teacher)", "s0 (student)"]
    for name in ("results.md", "results.csv", "results.png", "settings.json"):
        assert (out / name).is_file()
    assert "| Population mean, all members (2) | 0.0 [0.0, 65.8] |" in printed  # 0 of 2 for both: Wilson's

    # resume with more problems: only the new (member, problem) pairs are generated
    assert main([*args, "--limit", "3"]) == 0
    second = samples(out)
    assert second[:len(first)] == first
    assert sorted((s["member"], s["problem_id"]) for s in second[len(first):]) == [  # gsm8k has only 2
        ("base", "HumanEval/2"), ("s0", "HumanEval/2"), ("t0", "HumanEval/2")]
    assert main([*args, "--limit", "3"]) == 0
    assert len(samples(out)) == len(second)  # nothing left to do

    # a selection benchmark is graded for the population's members only, and stays out of the table
    # (catches: --select-on generating nothing, or grading the base model on it too)
    assert main([*args, "--limit", "3", "--select-on", "mbpp_plus"]) == 0
    third = samples(out)[len(second):]
    assert sorted((s["member"], s["benchmark"]) for s in third) == [("s0", "mbpp_plus")] * 2 + [("t0", "mbpp_plus")] * 2
    assert json.loads((out / "results.json").read_text())["benchmarks"] == ["humaneval", "gsm8k"]

    # changing what a sample means is refused instead of mixing results
    with pytest.raises(SystemExit) as exc:
        main([*args, "--limit", "3", "--max-new-tokens", "99"])
    assert exc.value.code == 2
    assert "setting 'max_new_tokens' was 12" in capsys.readouterr().err


def test_bad_runs_exit_with_a_clear_error(tmp_path, run_dir, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    with pytest.raises(SystemExit) as exc:
        main(["--run", str(empty)])
    assert exc.value.code == 2 and "has no adapters" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exc:
        main(["--run", str(run_dir), "--benchmarks", "gsm8k", "--data-dir", str(tmp_path)])
    assert exc.value.code == 2 and "gsm8k.jsonl" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exc:
        main(["--run", str(run_dir), "--baseline", str(tmp_path / "missing")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_prompts_that_fill_the_context_fail_without_stopping_the_evaluation():
    from openrlhf_populora.eval.generation import EngineBackend
    from openrlhf_populora.models.tiny import build_tiny_model

    model, tokenizer = build_tiny_model(seed=0)
    model.config.max_position_embeddings = positions = 64  # a short context keeps the test fast
    engine = LocalEngine(engine_config(policy_loss="native"), model=model, tokenizer=tokenizer)
    backend = EngineBackend(engine)  # the tiny tokenizer is one token per byte
    outputs = backend.generate([("__base__", "x" * (positions - 3)), ("__base__", "y" * positions),
                                ("__base__", "def f():")], 8)
    assert len(outputs[0][0]) <= 3  # only the 3 positions left (one byte per token: at most 3 characters)
    assert outputs[1] == ("", False)  # no room at all: an empty (failing) completion
    assert outputs[2] == backend.generate([("__base__", "def f():")], 8)[0]  # others are unaffected
