"""The protocol every engine implements: the only thing the self-play loop knows about engines.

An engine holds one frozen base model and N named LoRA adapters of the same rank and target modules.
It generates text per adapter, trains adapters on scored trajectories, and reads/writes adapter tensors.
Nothing here is AZR-specific: prompts arrive as rendered text, rewards arrive as advantages.

Two implementations:
- ``engines.local.LocalEngine``: transformers + peft in one process (CPU or one GPU), the embedded default.
- ``engines.ray``: OpenRLHF 0.11.2's Ray trainer with vLLM multi-LoRA rollouts and DeepSpeed training.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # engines import torch; the protocol itself does not need it
    from torch import Tensor

BASE_ADAPTER = "__base__"  # request name for the frozen base model with no adapter active


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy decoding."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None  # engines derive per-request seeds from it when given


@dataclass(frozen=True)
class GenerationRequest:
    """Generate ``n`` completions of ``prompt`` (already rendered text) with adapter ``adapter``."""

    adapter: str
    prompt: str
    n: int = 1


@dataclass
class Completion:
    """One sampled completion."""

    adapter: str
    prompt_ids: list[int]
    response_ids: list[int]  # generated tokens, EOS included when generation stopped on it
    text: str  # decoded response, special tokens skipped
    finished: bool  # True when generation stopped on EOS, False when cut at max_new_tokens


@dataclass
class Trajectory:
    """One scored sequence to learn from.

    ``advantage`` is a scalar for the whole response (REINFORCE++ with gamma = 1 and no per-token KL:
    every response token gets the same advantage). The loop computes and whitens it; engines only apply it.
    """

    adapter: str
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    group: str = ""  # the advantage's whitening group, e.g. "t0/propose/code_o" ("" = the adapter's own)


def render_chat(tokenizer, user_text: str, chat_template: bool = True) -> str:
    """One user message -> prompt text: the tokenizer's chat template with the generation prompt, or raw text."""
    if not chat_template:
        return user_text
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; use chat_template=False")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
    )


@runtime_checkable
class Engine(Protocol):
    """What the self-play loop needs from an engine."""

    def adapter_names(self) -> list[str]:
        """Names of the adapters the engine holds, in creation order."""
        ...

    def add_adapter(self, name: str, weights: Mapping[str, Tensor] | None = None) -> None:
        """Create adapter ``name``: freshly initialised (PEFT's init: A random, B zero) or from ``weights``."""
        ...

    def render_prompt(self, user_text: str, chat_template: bool = True) -> str:
        """Turn one user message into the prompt text the model sees (chat template or raw text)."""
        ...

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        """One list of ``request.n`` completions per request, in request order.

        Requests naming different adapters may be batched together in one forward pass.
        """
        ...

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
        """One policy-gradient update for every adapter that appears in ``trajectories``.

        Adapters that do not appear are left bit-identical (weights and optimizer state).
        Returns per-adapter diagnostics, e.g. ``{"t0": {"loss": ..., "grad_norm": ..., "entropy": ..., "lr": ...}}``.
        """
        ...

    def get_adapter(self, name: str) -> dict[str, Tensor]:
        """A CPU copy of the adapter's LoRA tensors, keyed like PEFT's saved state dict
        (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``)."""
        ...

    def set_adapter(self, name: str, weights: Mapping[str, Tensor]) -> None:
        """Overwrite an adapter's tensors (same keys and shapes) and reset its optimizer state."""
        ...

    def save_adapter(self, name: str, path: str) -> None:
        """Write the adapter in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``),
        loadable by ``PeftModel.from_pretrained`` and by vLLM ``--lora-modules``."""
        ...

    def save_state(self, path: str) -> None:
        """Everything needed to resume training exactly: every adapter and its optimizer state."""
        ...

    def load_state(self, path: str) -> None:
        """Restore what ``save_state`` wrote (adapters are created when missing)."""
        ...

    def close(self) -> None:
        """Release workers, processes and memory."""
        ...
