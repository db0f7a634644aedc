"""Crossovers: two or more parent adapters in, one same-rank child out. Every operator is seeded.

Per module, parent ``i`` has delta ``D_i = B_i A_i`` and core ``C_i`` in the parents' joint basis
(``D_i = Q_b C_i Q_a^T``, see ``lowrank.py``). Operators marked (exact) combine the deltas exactly and
re-factor the result to the best rank-``r`` approximation (QR + small SVD, never a ``d x k`` matrix); the
energy lost by that truncation is reported in ``info["truncation_energy"]``. Mixing weights ``w`` default to
equal and are normalised to sum to 1. Parents are ordered best first where it matters. The paper's codes are
given first (``population/operators.py``); parameter defaults are the fields of ``population.OperatorParams``
(``--populora.evolution.params.<operator>_<param>``), their ranges checked by ``population.operator_params``.

- ``linear_0_5`` (control): ``A = sum w_i A_i``, ``B = sum w_i B_i``. This mixes factors, not deltas, and is
  mathematically wrong (``B A`` gains the cross terms ``B_i A_j``); kept as the paper's control.
- X1 ``svd_mean`` (exact): ``D = sum w_i D_i``.
- X2 ``svd_fitness(temperature, fitness=None)`` (exact): ``svd_mean`` with ``w = softmax(fitness / T)``
  (``fitness`` are the parents' selection scores, their rating's mu by default; without it, the given or equal weights).
- X3 ``layer_swap``: each transformer layer's modules (their A and B together) are copied from one parent,
  drawn with probabilities ``w``. No re-factoring.
- X4 ``ties(density)`` (exact re-factoring): TIES-merging on the cores: keep each ``C_i``'s top ``density``
  fraction of entries by magnitude, elect a sign per entry ``sign(sum w_i C_i)``, and take the weighted mean
  of the kept entries that agree with it. Applied to core coordinates (an isometric rotation of the deltas),
  not to the dense deltas, so it never forms ``d x k`` matrices.
- X5 ``dare(p)`` (exact re-factoring): DARE on the cores: drop each entry of each ``C_i`` with probability
  ``p``, rescale the survivors by ``1 / (1 - p)``, then ``sum w_i C_i``.
- X6 ``sv_splice(top)``: the child's delta is parent 0's top ``h`` singular components plus parent 1's top
  ``r - h`` components (``h = top``, or ``r // 2`` when ``top`` is None). No re-factoring.
- X7 ``extrapolate(lam)`` (exact): ``D = D_0 + lam (D_0 - D_1)``: past the better parent 0, away from
  parent 1.
- X8 ``slerp(t)`` (exact): spherical interpolation ``D = sin((1-t) theta)/sin(theta) D_0 +
  sin(t theta)/sin(theta) D_1`` with ``cos(theta) = <D_0, D_1> / (|D_0| |D_1|)`` per module (Frobenius
  inner product, computed on the cores); ``t = w_1`` when ``t`` is None; linear when the deltas are
  (anti)parallel or zero.
- X9 ``task_arithmetic(lam)`` (exact): ``D = lam * sum_i D_i``, task arithmetic's sum of task vectors: each
  parent's whole update is kept (a mean would halve two specialists'), ``lam`` scales the sum. Weights ``w``
  are not used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from openrlhf_populora.evolution.lowrank import (
    Basis,
    EnergyLog,
    LoraPair,
    compute_dtype,
    factor_core,
    from_svd,
    joint_basis,
    svd_form,
)

Adapter = Mapping[str, Tensor]
CoreFn = Callable[[list[Tensor], Basis], Tensor]


def _exact(parents: Sequence[Adapter], pairs: list[LoraPair], info: dict,
           combine: CoreFn) -> dict[str, Tensor]:
    """For every module: joint basis, ``core = combine(cores, basis)``, re-factor to rank r; log energy."""
    first = parents[0]
    log = EnergyLog()
    child: dict[str, Tensor] = {}
    for pair in pairs:
        dtype = compute_dtype(first[pair.a_key].dtype)
        bs = [p[pair.b_key].to(dtype) for p in parents]
        as_ = [p[pair.a_key].to(dtype) for p in parents]
        basis = joint_basis(bs, as_)
        cores = basis.cores()
        b, a, kept, total = factor_core(basis, combine(cores, basis), as_[0].shape[0])
        log.add(pair.module, kept, total)
        child[pair.b_key] = b.to(first[pair.b_key].dtype)
        child[pair.a_key] = a.to(first[pair.a_key].dtype)
    log.write(info)
    return {key: child[key] for key in first}


def _weighted_sum(cores: list[Tensor], weights: Sequence[float]) -> Tensor:
    return sum(w * c for w, c in zip(weights, cores, strict=True))


def linear_0_5(parents, pairs, weights, gen, info) -> dict[str, Tensor]:
    info["truncation_energy"] = 0.0
    out = {}
    for key in parents[0]:
        dtype = compute_dtype(parents[0][key].dtype)
        out[key] = _weighted_sum([p[key].to(dtype) for p in parents], weights).to(parents[0][key].dtype)
    return out


def svd_mean(parents, pairs, weights, gen, info) -> dict[str, Tensor]:
    return _exact(parents, pairs, info, lambda cores, basis: _weighted_sum(cores, weights))


def svd_fitness(parents, pairs, weights, gen, info, temperature: float,
                fitness: Sequence[float] | None = None) -> dict[str, Tensor]:
    if fitness is not None:
        if len(fitness) != len(parents) or not all(math.isfinite(f) for f in fitness):
            raise ValueError(f"svd_fitness: need one finite fitness per parent, got {list(fitness)}")
        top = max(fitness)
        exps = [math.exp((f - top) / temperature) for f in fitness]
        weights = [e / sum(exps) for e in exps]
    info["weights"] = list(weights)
    return svd_mean(parents, pairs, weights, gen, info)


def layer_swap(parents, pairs, weights, gen, info) -> dict[str, Tensor]:
    layers = list(dict.fromkeys(pair.layer for pair in pairs))
    probs = torch.tensor(weights, dtype=torch.float64)
    picks = torch.multinomial(probs, len(layers), replacement=True, generator=gen).tolist()
    source = dict(zip(layers, picks, strict=True))
    info["truncation_energy"] = 0.0
    info["layer_sources"] = [source[layer] for layer in layers]
    child = {}
    for pair in pairs:
        parent = parents[source[pair.layer]]
        child[pair.a_key], child[pair.b_key] = parent[pair.a_key].clone(), parent[pair.b_key].clone()
    return {key: child[key] for key in parents[0]}


def _trim(core: Tensor, density: float) -> Tensor:
    keep = max(1, math.ceil(density * core.numel()))
    threshold = core.abs().flatten().kthvalue(core.numel() - keep + 1).values
    return core * (core.abs() >= threshold)


def ties(parents, pairs, weights, gen, info, density: float) -> dict[str, Tensor]:
    def combine(cores: list[Tensor], basis: Basis) -> Tensor:
        trimmed = [_trim(c, density) for c in cores]
        sign = torch.sign(_weighted_sum(trimmed, weights))
        num = torch.zeros_like(cores[0])
        den = torch.zeros_like(cores[0])
        for w, c in zip(weights, trimmed, strict=True):
            agree = (torch.sign(c) == sign) & (c != 0)
            num += w * c * agree
            den += w * agree
        return torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))

    return _exact(parents, pairs, info, combine)


def dare(parents, pairs, weights, gen, info, p: float) -> dict[str, Tensor]:
    def combine(cores: list[Tensor], basis: Basis) -> Tensor:
        kept = []
        for c in cores:
            mask = torch.rand(tuple(c.shape), generator=gen, dtype=torch.float64) >= p
            kept.append(c * mask.to(device=c.device, dtype=c.dtype) / (1.0 - p))
        return _weighted_sum(kept, weights)

    return _exact(parents, pairs, info, combine)


def sv_splice(parents, pairs, weights, gen, info, top: int | None) -> dict[str, Tensor]:
    first, second = parents
    rank = first[pairs[0].a_key].shape[0]
    h = rank // 2 if top is None else top
    if not 0 <= h <= rank:
        raise ValueError(f"sv_splice: top must be in [0, {rank}], got {h}")
    info["truncation_energy"] = 0.0
    child = {}
    for pair in pairs:
        dtype = compute_dtype(first[pair.a_key].dtype)
        u0, s0, v0 = svd_form(first[pair.b_key].to(dtype), first[pair.a_key].to(dtype))
        u1, s1, v1 = svd_form(second[pair.b_key].to(dtype), second[pair.a_key].to(dtype))
        b, a = from_svd(torch.cat([u0[:, :h], u1[:, :rank - h]], 1), torch.cat([s0[:h], s1[:rank - h]]),
                        torch.cat([v0[:, :h], v1[:, :rank - h]], 1))
        child[pair.b_key] = b.to(first[pair.b_key].dtype)
        child[pair.a_key] = a.to(first[pair.a_key].dtype)
    return {key: child[key] for key in first}


def extrapolate(parents, pairs, weights, gen, info, lam: float) -> dict[str, Tensor]:
    return _exact(parents, pairs, info, lambda cores, basis: (1 + lam) * cores[0] - lam * cores[1])


def slerp(parents, pairs, weights, gen, info, t: float | None) -> dict[str, Tensor]:
    t = weights[1] if t is None else t

    def combine(cores: list[Tensor], basis: Basis) -> Tensor:
        c0, c1 = cores
        n0, n1 = float(c0.norm()), float(c1.norm())
        if n0 == 0 or n1 == 0:
            return (1 - t) * c0 + t * c1
        cos = max(-1.0, min(1.0, float((c0 * c1).sum()) / (n0 * n1)))
        theta = math.acos(cos)
        if math.sin(theta) < 1e-6:
            return (1 - t) * c0 + t * c1
        return (math.sin((1 - t) * theta) * c0 + math.sin(t * theta) * c1) / math.sin(theta)

    return _exact(parents, pairs, info, combine)


def task_arithmetic(parents, pairs, weights, gen, info, lam: float) -> dict[str, Tensor]:
    return _exact(parents, pairs, info, lambda cores, basis: lam * sum(cores))


CROSSOVERS: dict[str, Callable[..., dict[str, Tensor]]] = {
    "linear_0_5": linear_0_5,
    "svd_mean": svd_mean,
    "svd_fitness": svd_fitness,
    "layer_swap": layer_swap,
    "ties": ties,
    "dare": dare,
    "sv_splice": sv_splice,
    "extrapolate": extrapolate,
    "slerp": slerp,
    "task_arithmetic": task_arithmetic,
}
