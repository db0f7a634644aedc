"""LoRA weight-space evolution: mutations and crossovers that make same-rank children from parent adapters.

Adapters are PEFT-format state dicts of ``lora_A`` (``r x in``) / ``lora_B`` (``out x r``) tensors sharing
one rank, one set of target modules and one ``alpha / r`` scaling. Children keep the parents' keys, shapes,
dtype, device and rank. Torch only; no engine.

    from openrlhf_populora.evolution import MUTATIONS, CROSSOVERS, mutate, crossover
    child = crossover("svd_mean", [sd_a, sd_b], weights=[0.5, 0.5], seed=0)
    child = mutate("gaussian", sd_a, seed=0, scale=0.1)     # or mutate("M1", ...): the paper's code

Operators are named by their readable name or the paper's code (``population/operators.py``); a parameter not
given takes its default from ``population.OperatorParams``, and every value is range-checked first.

Pass ``info={}`` to receive what the operator measured (``truncation_energy``: the fraction of the combined
delta's squared Frobenius norm lost when re-factoring to rank r, 0 for operators that do not re-factor).
``apply_action`` runs one planned ``population.EvolutionAction`` and returns ``(child, info)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from openrlhf_populora.evolution.crossovers import CROSSOVERS
from openrlhf_populora.evolution.lowrank import check_adapters, lora_pairs
from openrlhf_populora.evolution.mutations import MUTATIONS
from openrlhf_populora.population.operators import (
    TWO_PARENT_ONLY,
    canonical_operator,
    operator_code,
    operator_kind,
    operator_params,
)

__all__ = ["CROSSOVERS", "MUTATIONS", "apply_action", "crossover", "lora_pairs", "mutate"]


def _generator(seed: int) -> torch.Generator:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    return torch.Generator().manual_seed(seed)


def mutate(name: str, parent: Mapping[str, Tensor], seed: int = 0, info: dict | None = None,
           **params: Any) -> dict[str, Tensor]:
    """A mutated copy of ``parent`` by operator ``name`` (see ``evolution.mutations``)."""
    name = canonical_operator(name)
    if name not in MUTATIONS:
        raise ValueError(f"{name!r} is a crossover, not a mutation; mutations: {', '.join(MUTATIONS)}")
    params = operator_params(name, params)
    pairs = check_adapters([parent])
    out: dict[str, Any] = {}
    child = MUTATIONS[name](parent, pairs, _generator(seed), out, **params)
    out.setdefault("truncation_energy", 0.0)
    if info is not None:
        info.update(out)
    return child


def _normalised(weights: Sequence[float] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0 / n] * n
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise ValueError(f"got {len(weights)} weights for {n} parents")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {weights}")
    return [w / sum(weights) for w in weights]


def crossover(name: str, parents: Sequence[Mapping[str, Tensor]], weights: Sequence[float] | None = None,
              seed: int = 0, info: dict | None = None, **params: Any) -> dict[str, Tensor]:
    """A child of ``parents`` by operator ``name`` (see ``evolution.crossovers``); parents best first."""
    name = canonical_operator(name)
    if name not in CROSSOVERS:
        raise ValueError(f"{name!r} is a mutation, not a crossover; crossovers: {', '.join(CROSSOVERS)}")
    params = operator_params(name, params)
    if isinstance(parents, Mapping) or len(parents) < 2:
        raise ValueError(f"crossover {name!r} needs a list of >= 2 parent adapters")
    if name in TWO_PARENT_ONLY and len(parents) != 2:
        raise ValueError(f"crossover {name!r} takes exactly 2 parents, got {len(parents)}")
    pairs = check_adapters(parents)
    out: dict[str, Any] = {}
    child = CROSSOVERS[name](list(parents), pairs, _normalised(weights, len(parents)), _generator(seed), out,
                             **params)
    if info is not None:
        info.update(out)
    return child


def apply_action(action: Any, parent_state_dicts: Sequence[Mapping[str, Tensor]] | Mapping[str, Any]
                 ) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Run one ``population.EvolutionAction``: returns the child's tensors and an info dict for the lineage.

    ``parent_state_dicts`` is a list aligned with ``action.parents`` (best first), or a mapping from member id
    or adapter slot to state dict. Nothing is written anywhere: the engine installs the child in
    ``action.slot`` and resets that slot's optimizer state.
    """
    if isinstance(parent_state_dicts, Mapping) and not any("lora_" in str(k) for k in parent_state_dicts):
        parents = []
        for member, slot in zip(action.parents, action.parent_adapters, strict=True):
            if member in parent_state_dicts:
                parents.append(parent_state_dicts[member])
            elif slot in parent_state_dicts:
                parents.append(parent_state_dicts[slot])
            else:
                raise ValueError(f"no state dict for parent {member!r} (adapter {slot!r})")
    else:
        single = isinstance(parent_state_dicts, Mapping)
        parents = [parent_state_dicts] if single else list(parent_state_dicts)
    if len(parents) != len(action.parents):
        raise ValueError(f"action {action.operator!r} names {len(action.parents)} parents, "
                         f"got {len(parents)} state dicts")
    info: dict[str, Any] = {}
    if operator_kind(action.operator) == "mutation":
        child = mutate(action.operator, parents[0], seed=action.seed, info=info, **dict(action.params))
    else:
        child = crossover(action.operator, parents, seed=action.seed, info=info, **dict(action.params))
    info.update(operator=action.operator, operator_code=operator_code(action.operator), seed=action.seed,
                parents=list(action.parents))
    return child, info
