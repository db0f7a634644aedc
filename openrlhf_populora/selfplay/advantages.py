"""REINFORCE++ advantages, whitened per group (TRR++ applied per population member).

AZR's Task-Relative REINFORCE++ whitens rewards separately for each (task type, role) pair. With a
population, every adapter is its own policy, so the groups are (member, role, task type):

    A_i = (r_i - mean_g) / (std_g + eps),   g = group of sample i

With gamma = 1 and no per-token KL, the return of every response token equals the sequence reward, so a
per-sequence advantage is exact. Unlike verl's token-level ``masked_whiten`` (which weighs long responses
more in the mean and std), each sequence counts once here. A group whose rewards are all equal (or that
holds one sample) carries no learning signal: its advantages are 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence


def whiten_by_group(rewards: Sequence[float], groups: Sequence[Hashable], eps: float = 1e-6) -> list[float]:
    """Whiten ``rewards`` within each group; returns advantages in input order."""
    if len(rewards) != len(groups):
        raise ValueError(f"{len(rewards)} rewards but {len(groups)} group labels")
    members: dict[Hashable, list[int]] = defaultdict(list)
    for index, group in enumerate(groups):
        members[group].append(index)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        values = [float(rewards[i]) for i in indices]
        if any(not math.isfinite(v) for v in values):
            raise ValueError(f"non-finite reward in group {groups[indices[0]]!r}: {values}")
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if std < eps:
            continue
        for i, v in zip(indices, values, strict=True):
            advantages[i] = (v - mean) / (std + eps)
    return advantages
