"""Whether the adapters learn: how far each has moved from the frozen base, in weight space and in behaviour.

Two numbers per member, logged every ``--populora.probe_every`` steps:

- ``update_size``: the relative size of the adapter's weight update over every adapted module,
  ``sqrt(sum_m ||s B_m A_m||_F^2) / sqrt(sum_m ||W_m||_F^2)``, with ``s = alpha / r`` and ``W_m`` the frozen
  base weight the module adapts. It is the Frobenius norm of the whole update relative to the whole adapted
  weight, so it does not grow with the number of modules (a sum of per-module ratios would). A fresh adapter
  (PEFT initialises ``B = 0``) has 0; LoRA fine-tunes that change behaviour typically sit around 1e-3 to 1e-2.
  ``||B A||_F`` is computed exactly from the two ``r x r`` Gram matrices, never forming ``B A``.
- ``probe_kl``: the mean per-token KL divergence of the frozen base from the member's policy,
  ``KL(base || member)``, estimated on a fixed probe of the member's own role: prompts drawn once from the
  seed tasks and one response to each sampled from the base model at step 0 (stored with the run, so every step
  and every resume scores the same tokens). Each token of a response ``y ~ base`` gives Schulman's "k3"
  estimate ``r - 1 - log r`` with ``r = p_member(y_t | .) / p_base(y_t | .)``: unbiased for the KL at that
  position (``E_base[r] = 1``) and never negative, so unlike the plain log-ratio ``-log r`` (unbiased too, but
  a probe of a few responses often gave a negative mean: -0.011 nats for a student at lr 1e-4 after one step)
  it reads as a distance even on a small probe. The mean over tokens, then over the probe's responses, is
  logged: 0 for the base itself (and a fresh adapter), > 0 for any other policy.

Pure functions: the loop gathers adapters, base norms and log-probs and passes them in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from openrlhf_populora.evolution.lowrank import lora_pairs

PEFT_PREFIX = "base_model.model."


def lowrank_fro_norm(b: Tensor, a: Tensor) -> float:
    """``||B A||_F`` from ``B`` (``d x r``) and ``A`` (``r x k``) without forming ``B A``:
    ``||B A||_F^2 = trace(A^T B^T B A) = sum((B^T B) * (A A^T))``."""
    b64, a64 = b.detach().to(torch.float64), a.detach().to(torch.float64)
    squared = float(((b64.T @ b64) * (a64 @ a64.T)).sum())
    return math.sqrt(max(squared, 0.0))


def base_weight_key(module: str) -> str:
    """The base checkpoint's key of the weight an adapter module adapts:
    ``base_model.model.model.layers.0.self_attn.q_proj`` -> ``model.layers.0.self_attn.q_proj.weight``."""
    name = module[len(PEFT_PREFIX):] if module.startswith(PEFT_PREFIX) else module
    return f"{name}.weight"


def adapted_modules(adapter: Mapping[str, Tensor]) -> list[str]:
    return [pair.module for pair in lora_pairs(adapter)]


def base_weight_norms(model_dir: str | Path, modules: Iterable[str]) -> dict[str, float]:
    """``||W||_F`` of each adapted module's base weight, read from the model directory's safetensors files
    (one tensor at a time, in float64). KeyError naming the first module with no weight in the checkpoint."""
    from safetensors import safe_open

    wanted = {module: base_weight_key(module) for module in modules}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    norms: dict[str, float] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            keys = set(handle.keys())
            for module, key in wanted.items():
                if module not in norms and key in keys:
                    norms[module] = float(torch.linalg.vector_norm(handle.get_tensor(key).to(torch.float64)))
    missing = [module for module in wanted if module not in norms]
    if missing:
        raise KeyError(f"the base checkpoint in {model_dir} has no weight {wanted[missing[0]]!r} for the adapted "
                       f"module {missing[0]!r}")
    return norms


def update_size(adapter: Mapping[str, Tensor], base_norms: Mapping[str, float], scaling: float) -> float:
    """``sqrt(sum_m ||scaling B_m A_m||_F^2) / sqrt(sum_m ||W_m||_F^2)`` over the adapter's modules."""
    num = den = 0.0
    for pair in lora_pairs(adapter):
        num += (scaling * lowrank_fro_norm(adapter[pair.b_key], adapter[pair.a_key])) ** 2
        den += base_norms[pair.module] ** 2
    if den <= 0:
        raise ValueError("the adapted base weights have zero norm")
    return math.sqrt(num) / math.sqrt(den)


def probe_kl(base: Sequence[Sequence[float]], member: Sequence[Sequence[float]]) -> float:
    """Mean over probe responses of the per-token k3 estimate ``r - 1 - log r``, ``r = p_member / p_base``
    (see the module docstring)."""
    if len(base) != len(member) or not base:
        raise ValueError(f"probe_kl needs the same non-empty set of responses ({len(base)} vs {len(member)})")
    terms = []
    for b, m in zip(base, member, strict=True):
        if len(b) != len(m) or not b:
            raise ValueError("each probe response needs one log-prob per token under both policies")
        terms.append(sum(math.expm1(y - x) - (y - x) for x, y in zip(b, m, strict=True)) / len(b))
    return sum(terms) / len(terms)
