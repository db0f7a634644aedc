"""Batched decoding of many rows, each with its own adapter, prompt and seed, on one model.

1. **Prefill once per distinct prompt.** Rows with the same (adapter, prompt) -- the ``n`` samples of one
   request -- share one prefill (``share_prefill``): the prompt is run alone, without padding, and its KV
   cache and last logits are copied to each of its rows. Prompts are prefilled one at a time, so no compute
   goes to padding (batching distinct prompts would pad them to the longest).
2. **Decode rows together.** Distinct prompts, longest first, are packed into batches of at most
   ``batch_size`` rows; each batch's caches are left-padded to a common width and decoded one token per
   step with the KV cache. Rows that stop (EOS) leave the batch.

Every row samples with its own ``torch.Generator`` seeded by the caller, so a row's tokens do not depend on
which rows share its batch, nor on whether its prefill was shared: at a fixed seed, and greedily, sharing
gives the same tokens as prefilling every row alone (the tests check it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from openrlhf_populora.engines.base import SamplingParams
from openrlhf_populora.engines.local.sampling import sample_next_tokens

# forward(input_ids, attention_mask, position_ids, past_key_values, adapters) -> model output (logits of the
# last position, past_key_values)
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache | None, Sequence[str]], object]


@dataclass
class Prefill:
    """One prompt run alone: its last position's logits ``(V,)`` and per-layer ``(keys, values)`` ``(1, H, L, d)``."""

    logits: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    length: int


def prefill(forward: Forward, prompt: Sequence[int], adapter: str, device) -> Prefill:
    ids = torch.tensor([list(prompt)], device=device)
    ones = torch.ones_like(ids)
    positions = torch.arange(len(prompt), device=device)[None]
    out = forward(ids, ones, positions, None, [adapter])
    layers = [(keys, values) for keys, values, *_ in out.past_key_values]
    return Prefill(out.logits[0, -1], layers, len(prompt))


def batch_cache(prefills: Sequence[Prefill], device) -> tuple[DynamicCache, torch.Tensor]:
    """The KV cache of a batch whose row ``i`` continues ``prefills[i]``, left-padded to the longest, and
    its attention mask ``(B, width)``."""
    width = max(p.length for p in prefills)
    mask = torch.zeros((len(prefills), width), dtype=torch.long, device=device)
    for row, p in enumerate(prefills):
        mask[row, width - p.length:] = 1
    layers = []
    for layer in range(len(prefills[0].layers)):
        keys0, values0 = prefills[0].layers[layer]
        shape = (len(prefills), keys0.shape[1], width, keys0.shape[3])
        keys, values = keys0.new_zeros(shape), values0.new_zeros(shape)
        for row, p in enumerate(prefills):
            k, v = p.layers[layer]
            keys[row, :, width - p.length:] = k[0]
            values[row, :, width - p.length:] = v[0]
        layers.append((keys, values))
    return DynamicCache(ddp_cache_data=layers), mask


def pack(prompts: Sequence[Sequence[int]], adapters: Sequence[str], batch_size: int, share_prefill: bool
         ) -> list[list[tuple[int, list[int]]]]:
    """Decode batches: lists of (prefill row, rows continuing it), longest prompts first, at most
    ``batch_size`` rows each. With ``share_prefill`` rows of equal (adapter, prompt) share one prefill."""
    groups: dict[object, list[int]] = {}
    for row, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        key = (adapter, tuple(prompt)) if share_prefill else row
        groups.setdefault(key, []).append(row)
    ordered = sorted(groups.values(), key=lambda rows: -len(prompts[rows[0]]))
    batches: list[list[tuple[int, list[int]]]] = [[]]
    used = 0
    for rows in ordered:
        for start in range(0, len(rows), batch_size):  # a group larger than a batch is split (and prefilled again)
            part = rows[start : start + batch_size]
            if used + len(part) > batch_size:
                batches.append([])
                used = 0
            batches[-1].append((part[0], part))
            used += len(part)
    return [b for b in batches if b]


def generate_rows(forward: Forward, prompts: Sequence[Sequence[int]], adapters: Sequence[str], seeds: Sequence[int],
                  params: SamplingParams, *, stop_ids: set[int], batch_size: int, share_prefill: bool = True,
                  device="cpu") -> list[tuple[list[int], bool]]:
    """(response ids, stopped on EOS) for every row."""
    results: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
    for batch in pack(prompts, adapters, batch_size, share_prefill):
        prefills = {first: prefill(forward, prompts[first], adapters[first], device) for first, _ in batch}
        rows = [row for _, members in batch for row in members]
        per_row = [prefills[first] for first, members in batch for _ in members]
        decoded = _decode(forward, per_row, [adapters[r] for r in rows], [seeds[r] for r in rows], params,
                          stop_ids, device)
        for row, result in zip(rows, decoded, strict=True):
            results[row] = result
    return results


def _decode(forward: Forward, prefills: Sequence[Prefill], adapters: Sequence[str], seeds: Sequence[int],
            params: SamplingParams, stop_ids: set[int], device) -> list[tuple[list[int], bool]]:
    cache, mask = batch_cache(prefills, device)
    positions = torch.tensor([[p.length] for p in prefills], device=device)  # of the next token
    generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
    logits = torch.stack([p.logits for p in prefills])
    alive = list(range(len(prefills)))  # original row index of each batch row
    names = list(adapters)
    responses: list[list[int]] = [[] for _ in prefills]
    finished = [False] * len(prefills)
    for step in range(params.max_new_tokens):
        tokens = sample_next_tokens(logits, params.temperature, params.top_p, [generators[r] for r in alive])
        for row, token in zip(alive, tokens.tolist(), strict=True):
            responses[row].append(token)
            finished[row] = token in stop_ids
        keep = [k for k, row in enumerate(alive) if not finished[row]]
        if not keep or step == params.max_new_tokens - 1:
            break
        if len(keep) < len(alive):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, positions, tokens = mask[index], positions[index], tokens[index]
            alive, names = [alive[k] for k in keep], [names[k] for k in keep]
        mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
        out = forward(tokens[:, None], mask, positions, cache, names)
        logits = out.logits[:, -1, :]
        positions = positions + 1
    return [(responses[r], finished[r]) for r in range(len(prefills))]
