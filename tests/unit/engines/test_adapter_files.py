"""The adapter payload (``engines/adapter_files.py``): PEFT's saved format, validated, loadable by
``PeftModel.from_pretrained`` with outputs identical to the training engine's adapter."""

from __future__ import annotations

import json

import pytest
import torch

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.engines.adapter_files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    adapter_modules,
    adapter_rank,
    lora_config_dict,
    read_peft_adapter,
    write_peft_adapter,
)
from openrlhf_populora.engines.local import LocalEngine
from openrlhf_populora.models.tiny import build_tiny_model

# the tiny model's tests: fp32, every linear layer, seed 0 (Config's defaults: auto dtype, q/k/v/o, 42)
TEST_ENGINE = {"dtype": "fp32", "lora_target_modules": "all-linear", "seed": 0}


def engine_config(**overrides):
    """The local engine's config from Config's defaults (the one source), the tiny-model test defaults, then
    ``overrides``."""
    return local_engine_config(Config(), **{**TEST_ENGINE, **overrides})


def _engine_with_adapters(names, rank=4, targets="all-linear"):
    model, tokenizer = build_tiny_model(seed=0)
    engine = LocalEngine(engine_config(lora_rank=rank, lora_alpha=8, lora_target_modules=targets,
                                           policy_loss="native"), model=model, tokenizer=tokenizer)
    gen = torch.Generator().manual_seed(1)
    for name in names:
        engine.add_adapter(name)
        weights = engine.get_adapter(name)
        # B starts at zero (the adapter is a no-op): perturb it so each adapter changes the outputs
        weights = {k: v + 0.3 * torch.randn(v.shape, generator=gen) if ".lora_B." in k else v
                   for k, v in weights.items()}
        engine.set_adapter(name, weights)
    return engine


@pytest.fixture(scope="module")
def engine():
    return _engine_with_adapters(["t0", "s1"])


def test_config_dict_is_what_peft_loads():
    from peft import LoraConfig

    config = lora_config_dict(8, 16, ["v_proj", "q_proj", "q_proj"], 0.05, "some/model")
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["peft_type"] == "LORA"
    assert lora_config_dict(4, 8, ["all-linear"])["target_modules"] == "all-linear"
    loaded = LoraConfig.from_peft_type(**config)
    assert (loaded.r, loaded.lora_alpha, loaded.lora_dropout) == (8, 16, 0.05)
    assert set(loaded.target_modules) == {"q_proj", "v_proj"} and loaded.task_type == "CAUSAL_LM"
    for bad in ({"r": 0}, {"alpha": 0}, {"dropout": 1.0}, {"target_modules": []}):
        kwargs = {"r": 4, "alpha": 8, "target_modules": ["q_proj"], **bad}
        with pytest.raises(ValueError):
            lora_config_dict(**kwargs)


def test_payload_has_peft_keys_and_resolves_all_linear(engine, tmp_path):
    tensors = engine.get_adapter("t0")
    out = write_peft_adapter(tmp_path / "t0", tensors, lora_config_dict(4, 8, "all-linear"))
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    saved, config = read_peft_adapter(out)
    assert saved.keys() == tensors.keys()
    assert all(torch.equal(saved[k], tensors[k]) for k in tensors)
    assert all(k.startswith("base_model.model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in saved)
    # "all-linear" becomes the wrapped module names, as peft saves it after wrapping a model
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert json.loads((out / CONFIG_FILE).read_text())["r"] == 4
    assert adapter_rank(tensors) == 4 and len(adapter_modules(tensors)) == 14  # 7 projections x 2 layers


def test_a_peft_config_dict_is_accepted(engine, tmp_path):
    from peft import LoraConfig, PeftConfig

    config = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules={"q_proj", "v_proj"}).to_dict()
    tensors = {k: v for k, v in engine.get_adapter("t0").items() if ".q_proj." in k or ".v_proj." in k}
    out = write_peft_adapter(tmp_path / "p", tensors, config)
    loaded = PeftConfig.from_pretrained(str(out))
    assert loaded.peft_type == "LORA" and loaded.r == 4 and set(loaded.target_modules) == {"q_proj", "v_proj"}


def test_dtype_cast(engine, tmp_path):
    out = write_peft_adapter(tmp_path / "bf16", engine.get_adapter("t0"), lora_config_dict(4, 8, "all-linear"),
                             dtype=torch.bfloat16)
    saved, _ = read_peft_adapter(out)
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}


def test_peft_from_pretrained_reproduces_the_engine_adapter(engine, tmp_path):
    from peft import PeftModel

    ids = torch.tensor([engine.encode("def add(a, b):\n    return a + b")])
    config = lora_config_dict(4, 8, "all-linear", base_model_name_or_path="tiny")
    base, _ = build_tiny_model(seed=0)  # bit-identical to the engine's base
    loaded = None
    with torch.no_grad():
        base_logits = base(ids).logits
        for name in ("t0", "s1"):
            path = write_peft_adapter(tmp_path / name, engine.get_adapter(name), config)
            if loaded is None:
                loaded = PeftModel.from_pretrained(base, str(path), adapter_name=name)
            else:
                loaded.load_adapter(str(path), adapter_name=name)
        loaded.eval()
        for name in ("t0", "s1"):
            loaded.set_adapter(name)
            engine.peft.set_adapter(name)
            expected = engine.peft(ids).logits
            got = loaded(ids).logits
            assert torch.allclose(got, expected, atol=1e-6, rtol=0), name
            assert not torch.allclose(got, base_logits, atol=1e-3)  # the adapter does change the outputs
        engine.peft.eval()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: {}, "no adapter tensors"),
        (lambda t: {**t, "base_model.model.lm_head.weight": torch.zeros(2, 2)}, "not a LoRA key"),
        (lambda t: {k.replace(".lora_A.", ".lora_A.default."): v for k, v in t.items()}, "not a LoRA key"),
        (lambda t: {k: v for k, v in t.items() if ".layers.0.self_attn.q_proj.lora_B" not in k}, "no lora_B"),
        (lambda t: {k: (v[:2] if ".layers.0.self_attn.q_proj.lora_A" in k else v) for k, v in t.items()},
         "disagree on the rank"),
        (lambda t: {k: (v[:2] if ".layers.0.self_attn.q_proj.lora_A" in k else
                        v[:, :2] if ".layers.0.self_attn.q_proj.lora_B" in k else v) for k, v in t.items()},
         "different LoRA ranks"),
        (lambda t: {k: v.flatten() for k, v in t.items()}, "2-D"),
    ],
)
def test_validation_errors(engine, tmp_path, mutate, message):
    with pytest.raises(ValueError, match=message):
        write_peft_adapter(tmp_path / "x", mutate(engine.get_adapter("t0")), lora_config_dict(4, 8, "all-linear"))
    assert not (tmp_path / "x" / WEIGHTS_FILE).exists()


def test_config_rank_must_match(engine, tmp_path):
    with pytest.raises(ValueError, match="r=8 but the tensors have rank 4"):
        write_peft_adapter(tmp_path / "x", engine.get_adapter("t0"), lora_config_dict(8, 8, "all-linear"))
    with pytest.raises(ValueError, match="no 'target_modules'"):
        write_peft_adapter(tmp_path / "x", engine.get_adapter("t0"), {"r": 4, "lora_alpha": 8})
