"""Next-token choice: greedy, or a draw from the temperature-scaled, top-p-truncated distribution.

Each row draws with its own ``torch.Generator``, so a row's tokens do not depend on the rows beside it.
Top-p needs the probabilities in descending order up to the nucleus; a full sort of a 152k vocabulary per
row per step cost ~30 ms on 2 CPU cores, so the nucleus is looked for among the ``TOP_K`` most likely tokens
first. Where they hold at least ``top_p`` of the mass (nearly always) the nucleus lies inside them and the
result is exactly the full sort's; otherwise the row falls back to the full sort.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TOP_K = 1024


def _nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every sorted probability after the smallest prefix whose mass reaches ``top_p``."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays


def sample_next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """One token per row of ``logits`` (B, V): argmax when ``temperature == 0``, else a draw from
    softmax(logits / T) restricted to the smallest set of tokens whose probability reaches ``top_p``."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])
    k = min(TOP_K, probs.shape[-1])
    top_probs, top_ids = probs.topk(k, dim=-1)  # descending
    inside = top_probs.sum(dim=-1) >= top_p
    tokens = []
    for i, g in enumerate(generators):
        if inside[i]:
            kept, ids = _nucleus(top_probs[i], top_p), top_ids[i]
        else:
            sorted_probs, ids = probs[i].sort(descending=True)
            kept = _nucleus(sorted_probs, top_p)
        tokens.append(ids[torch.multinomial(kept, 1, generator=g)])
    return torch.cat(tokens)
