"""Attention for the local engine: torch's SDPA, except one-token decode steps, which skip the KV copy.

With grouped-query attention (Qwen2.5-0.5B: 14 query heads share 2 KV heads), transformers' ``sdpa`` path
repeats the whole KV cache once per query group before every call whenever there is a padding mask, and
torch's CPU kernel for a single query is slow: on this project's 2-core CPU the attention of one decode step
of 12 rows took 30% of the step. A decode step needs only ``softmax(q K^T / sqrt(d) + mask) V`` for one query
per row, so ``decode_attention`` computes that with two batched matmuls over the query groups, reading the
cache in place. Longer queries (prefill, training) go to transformers' own SDPA function unchanged.

The implementation is registered with transformers' ``AttentionInterface`` under ``populora_sdpa``
(with SDPA's own mask builder), and a model opts in with ``use_decode_attention(model)``.
"""

from __future__ import annotations

import torch

NAME = "populora_sdpa"


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of queries ``(B, Hq, q, d)`` over ``key``/``value`` ``(B, Hkv, L, d)``; returns
    ``((B, q, Hq, d), None)`` like transformers' attention functions. ``q > 1`` goes to SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    if q_len != 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, groups, dim)  # query head h reads KV head h // groups, as repeat_kv does
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # (B, Hkv, groups, L)
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, -length:]  # (B or 1, 1, 1, L): broadcast over heads and groups
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # (B, Hkv, groups, d)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_attention(model) -> bool:
    """Switch a model loaded with ``attn_implementation="sdpa"`` to ``populora_sdpa``; False when it cannot
    (the model does not dispatch attention through transformers' ``AttentionInterface``)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not model._can_set_attn_implementation():
        return False
    register()
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
