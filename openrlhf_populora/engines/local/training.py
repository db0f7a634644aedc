"""REINFORCE++ for every adapter of a step at once: the policy loss, the LR schedule, and the passes.

**The update.** With the policy log-probs ``logp`` (at ``logprob_temperature``), the old log-probs ``old``
of the policy before the update, and the advantage ``A`` shared by every token of a response::

    ratio = exp(clamp(logp - old, -20, 20))
    loss_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    loss_a = sum_t loss_t / T_a  -  entropy_coef * sum_t H_t / T_a      (token mean over adapter a's T_a tokens)

OpenRLHF's ``PolicyLoss`` computes the first term when it imports (``policy_loss="auto"``), else the same
maths written here. Each adapter's gradient is that of its own ``loss_a`` only; it is clipped to ``max_norm``
per adapter and applied by the adapter's own AdamW, so an adapter's update is exactly what training it alone
would give, and an adapter absent from a step stays bit-identical, weights and optimizer state.

**The passes.** Micro-batches mix adapters (``MixedLoRA``: one forward for all of them, as generation does).
A micro-batch holds at most ``micro_batch_size`` responses, grouped by (adapter, prompt): with
``share_prompts`` each distinct prompt runs once, with gradients, and its responses continue from its KV
cache -- the ``n`` answers a student samples for one task share one prompt pass. The logits of a response's
first token are its prompt's last logits; the rest come from one pass over the responses. Gradients through
the shared prompt add up over its responses, so this is the same gradient as one pass per sequence.

**Epochs.** A step takes ``max_epochs`` updates of every adapter on the same trajectories (PPO epochs, like
OpenRLHF's ``--train.max_epochs``). ``old`` is the policy that sampled them, fixed for all epochs: in the first
epoch the ratio is exactly 1 and the clip cannot act; from the second on the ratio has moved and it does.
``old`` is recomputed in a no-grad pass when LoRA dropout is on (or ``old_logprobs="recompute"``); otherwise it
is bit-for-bit the first epoch's own log-probs, so that pass is reused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from openrlhf_populora.engines.base import Trajectory

# forward(input_ids, attention_mask, position_ids, past_key_values, adapters, logits_to_keep) -> model output
Forward = Callable[..., object]


def lr_factor(kind: str, update: int, warmup: int, total: int, min_ratio: float) -> float:
    """The learning-rate multiplier of update number ``update`` (0-based), as OpenRLHF's schedulers define it:
    linear warm-up from 0 over ``warmup`` updates, then constant, or a cosine from 1 down to ``min_ratio`` at
    update ``total``."""
    if update < warmup:
        return update / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (update - warmup) / (total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------- policy loss


def native_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: float,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped-ratio policy loss summed over masked tokens and divided by ``num_tokens`` (the token
    count of the adapter's whole batch, so micro-batch losses add up to the token mean), and the
    number of tokens whose ratio was clipped."""
    ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.min(surr1, surr2)
    clipped = (surr2 < surr1).float()
    return (loss * mask).sum() / num_tokens, (clipped * mask).sum()


_OPENRLHF_POLICY_LOSS: list = []  # memo of the import attempt: [class] or [exception]


def _import_openrlhf_policy_loss():
    """OpenRLHF's ``PolicyLoss`` class, or the exception its import raised (tried once per process:
    the import chain pulls deepspeed, and it needs ``flash_attn`` or a stub of it)."""
    if not _OPENRLHF_POLICY_LOSS:
        try:
            from openrlhf.models.loss import PolicyLoss

            _OPENRLHF_POLICY_LOSS.append(PolicyLoss)
        except Exception as err:  # ImportError, or anything the heavy import chain raises
            _OPENRLHF_POLICY_LOSS.append(err)
    return _OPENRLHF_POLICY_LOSS[0]


def make_policy_loss(choice: str, eps_low: float, eps_high: float) -> tuple[Callable, str]:
    """``(fn, source)``: fn(log_probs, old, adv, mask, num_tokens) -> (loss, clipped_count), where
    source is "openrlhf" (its ``PolicyLoss``, token-level) or "native" (``native_policy_loss``)."""
    if choice in ("auto", "openrlhf"):
        found = _import_openrlhf_policy_loss()
        if isinstance(found, Exception) and choice == "openrlhf":
            raise ImportError(f"policy_loss='openrlhf' but openrlhf.models.loss does not import: {found}") from found
        if not isinstance(found, Exception):
            module = found(clip_eps_low=eps_low, clip_eps_high=eps_high, token_level_loss=True)

            def openrlhf_loss(log_probs, old_log_probs, advantages, mask, num_tokens):
                loss, clip_ratio, *_ = module(
                    log_probs, old_log_probs, advantages, action_mask=mask, batch_num_tokens=num_tokens
                )
                return loss, clip_ratio * mask.sum()

            return openrlhf_loss, "openrlhf"

    def loss_fn(log_probs, old_log_probs, advantages, mask, num_tokens):
        return native_policy_loss(log_probs, old_log_probs, advantages, mask, num_tokens, eps_low, eps_high)

    return loss_fn, "native"


# ----------------------------------------------------------------------------------------- batches


def micro_batches(trajectories: Sequence[Trajectory], size: int, share_prompts: bool) -> list[list[list[int]]]:
    """Micro-batches of at most ``size`` responses, each a list of groups of trajectory indices sharing one
    (adapter, prompt) (one trajectory per group without ``share_prompts``); similar lengths together."""
    groups: dict[object, list[int]] = {}
    for i, t in enumerate(trajectories):
        groups.setdefault((t.adapter, tuple(t.prompt_ids)) if share_prompts else i, []).append(i)
    ordered = sorted(groups.values(), key=lambda g: (len(trajectories[g[0]].prompt_ids),
                                                     max(len(trajectories[i].response_ids) for i in g)))
    batches: list[list[list[int]]] = [[]]
    used = 0
    for group in ordered:
        for start in range(0, len(group), size):  # a group larger than a micro-batch is split
            part = group[start : start + size]
            if used + len(part) > size:
                batches.append([])
                used = 0
            batches[-1].append(part)
            used += len(part)
    return [b for b in batches if b]


@dataclass
class Scored:
    """Log-probs of one micro-batch's responses, row ``r`` being trajectory ``rows[r]``."""

    rows: list[int]
    logp: torch.Tensor  # (S, R)
    entropy: torch.Tensor | None  # (S, R)
    mask: torch.Tensor  # (S, R) 1.0 on response tokens


def score(forward: Forward, trajectories: Sequence[Trajectory], groups: Sequence[Sequence[int]], *, pad_id: int,
          temperature: float, entropy: str | None, device) -> Scored:
    """Response log-probs under each row's adapter: one pass over the groups' prompts (left-padded), then one
    over their responses (right-padded) continuing each prompt's KV cache. ``entropy``: None, "detached" or
    "grad" (differentiable), the per-token entropy of softmax(logits / T)."""
    prompts = [trajectories[g[0]].prompt_ids for g in groups]
    rows = [i for g in groups for i in g]
    row_group = torch.tensor([k for k, g in enumerate(groups) for _ in g], device=device)
    width_p = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width_p), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros_like(ids)
    for k, p in enumerate(prompts):
        ids[k, width_p - len(p):] = torch.tensor(p)
        prompt_mask[k, width_p - len(p):] = 1
    ids, prompt_mask = ids.to(device), prompt_mask.to(device)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    adapters = [trajectories[g[0]].adapter for g in groups]
    out = forward(ids, prompt_mask, positions, None, adapters, 1)
    first = out.logits[:, -1][row_group]  # (S, V): predicts each response's first token

    responses = [trajectories[i].response_ids for i in rows]
    width_r = max(len(r) for r in responses)
    targets = torch.full((len(rows), width_r), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width_r))
    for r, resp in enumerate(responses):
        targets[r, : len(resp)] = torch.tensor(resp)
        mask[r, : len(resp)] = 1.0
    targets, mask = targets.to(device), mask.to(device)
    # the logits of real response tokens only, as rows of one (N, V) matrix: every response's first token,
    # then the later tokens (padding never reaches the vocabulary-sized work below)
    later = mask[:, 1:].bool()
    logits = [first]
    if width_r > 1:  # the responses' own tokens, but the last, predict the rest
        past = DynamicCache(ddp_cache_data=[(k[row_group], v[row_group]) for k, v, *_ in out.past_key_values])
        lengths = prompt_mask.sum(-1)[row_group]
        attention = torch.cat([prompt_mask[row_group], mask[:, :-1].long()], dim=1)
        resp_positions = lengths[:, None] + torch.arange(width_r - 1, device=device)[None]
        rest = forward(targets[:, :-1], attention, resp_positions, past, [trajectories[i].adapter for i in rows], 0)
        logits.append(rest.logits[later])
    z = torch.cat(logits).float() / temperature  # (N, V)
    log_norm = torch.logsumexp(z, dim=-1)
    tokens = torch.cat([targets[:, 0], targets[:, 1:][later]])
    flat_logp = z.gather(-1, tokens[:, None]).squeeze(-1) - log_norm
    where = (torch.arange(len(rows), device=device), torch.zeros(len(rows), dtype=torch.long, device=device))
    later_at = later.nonzero(as_tuple=True)
    where = (torch.cat([where[0], later_at[0]]), torch.cat([where[1], later_at[1] + 1]))
    logp = torch.zeros(mask.shape, device=device).index_put(where, flat_logp)
    token_entropy = None
    if entropy is not None:
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            # H = log Z - sum_v p_v z_v, without a second vocabulary-sized log-prob tensor
            flat = log_norm - (torch.softmax(z, dim=-1) * z).sum(-1)
            token_entropy = torch.zeros(mask.shape, device=device).index_put(where, flat)
    return Scored(rows, logp, token_entropy, mask)


def accumulate_gradients(forward: Forward, trajectories: Sequence[Trajectory], batches: Sequence, *,
                         loss_fn: Callable, old: Sequence[torch.Tensor | None], entropy_coef: float, pad_id: int,
                         temperature: float, device) -> tuple[dict[str, dict[str, float]], list[torch.Tensor]]:
    """Backward every micro-batch's loss (the sum of its adapters' ``loss_a``), accumulating each adapter's
    gradient in its parameters' ``.grad``; returns per-adapter loss, entropy and clipped-token count, and the
    old log-probs each micro-batch used (``old[i]``, or this pass's own when ``old[i]`` is None)."""
    num_tokens: dict[str, float] = {}
    for t in trajectories:
        num_tokens[t.adapter] = num_tokens.get(t.adapter, 0.0) + len(t.response_ids)
    stats = {a: {"loss": 0.0, "entropy": 0.0, "clipped": 0.0} for a in num_tokens}
    entropy_grad = entropy_coef != 0
    used_old = []
    for groups, old_logp in zip(batches, old, strict=True):
        s = score(forward, trajectories, groups, pad_id=pad_id, temperature=temperature,
                  entropy="grad" if entropy_grad else "detached", device=device)
        if old_logp is None:  # first epoch, no dropout: the pre-update policy is this pass
            old_logp = s.logp.detach()
        used_old.append(old_logp)
        advantages = torch.tensor([float(trajectories[i].advantage) for i in s.rows], device=device)
        row_adapters = [trajectories[i].adapter for i in s.rows]
        total = None
        for adapter in dict.fromkeys(row_adapters):
            sel = torch.tensor([r for r, a in enumerate(row_adapters) if a == adapter], device=device)
            logp, mask = s.logp[sel], s.mask[sel]
            policy_loss, clipped = loss_fn(logp, old_logp[sel], advantages[sel][:, None].expand_as(logp), mask,
                                           num_tokens[adapter])
            entropy_mean = (s.entropy[sel] * mask).sum() / num_tokens[adapter]
            loss = policy_loss - entropy_coef * entropy_mean if entropy_grad else policy_loss
            total = loss if total is None else total + loss
            stats[adapter]["loss"] += float(loss.detach())
            stats[adapter]["entropy"] += float(entropy_mean.detach())
            stats[adapter]["clipped"] += float(clipped)
        total.backward()
    for adapter, tokens in num_tokens.items():
        stats[adapter]["num_tokens"] = tokens
    return stats, used_old


def apply_update(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, lr: float, max_norm: float,
                 stats: dict[str, float], sequences: float) -> dict[str, float]:
    """One adapter's optimizer step: clip its accumulated gradient to ``max_norm`` (``<= 0``: no clip), step its
    own AdamW at ``lr``, and return its diagnostics (``stats`` from :func:`accumulate_gradients`)."""
    if max_norm > 0:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    else:
        grads = [p.grad.norm() for p in params if p.grad is not None]
        grad_norm = float(torch.stack(grads).norm()) if grads else 0.0
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    num_tokens = stats["num_tokens"]
    return {
        "loss": stats["loss"],
        "grad_norm": grad_norm,
        "entropy": stats["entropy"],
        "clip_ratio": stats["clipped"] / num_tokens,
        "lr": lr,
        "num_tokens": num_tokens,
        "num_sequences": sequences,
        "response_length": num_tokens / sequences,
    }
