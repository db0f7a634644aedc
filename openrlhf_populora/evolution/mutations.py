"""Mutations: one parent adapter in, one same-rank child out. Every operator is seeded.

Notation per module: ``delta = B A`` with thin SVD ``U S V^T`` (computed exactly from the factors, see
``lowrank.svd_form``); ``std(X)`` is the standard deviation of the entries of tensor ``X``; ``N`` is standard
normal noise drawn from the operator's seeded generator. Operators that work in SVD form return balanced
factors ``B = U sqrt(S)``, ``A = sqrt(S) V^T`` (same delta up to the mutation, different gauge).

The paper's codes (``population/operators.py``) and the parameters, whose defaults are the fields of
``population.OperatorParams`` (``--populora.evolution.params.<operator>_<param>``):

- ``copy_parent`` (control): the child equals the parent.
- M1 ``gaussian(scale)``: ``X <- X + scale * std(X) * N`` for every A and B tensor. A tensor of zeros
  (e.g. a freshly initialised B) has std 0 and is left unchanged.
- M2 ``layer_gaussian(scale, fraction)``: the same noise on the modules of a random subset of
  ``max(1, round(fraction * L))`` of the ``L`` transformer layers; the other layers are copied.
- M3 ``sv_lognormal(sigma)``: ``S <- S * exp(sigma * N)`` per singular value, same singular vectors.
- M4 ``subspace_rotation(angle)``: tilt ``U`` (and ``V``) towards random directions orthogonal to it:
  ``U <- qr(U + angle * G)`` where each column of ``G`` is a unit-norm random direction in the orthogonal
  complement of ``span(U)`` (sign fixed so the new basis stays close to ``U``); ``S`` is unchanged, so the
  delta keeps its Frobenius norm while its singular subspaces turn by about ``angle`` radians.
- M5 ``drop_components(p)``: zero each singular component independently with probability ``p`` (the
  top component of a module is kept if all would be dropped).
- M6 ``rescale(sigma, factor=None)``: ``delta <- c * delta`` with one ``c = exp(sigma * N)`` for the whole
  adapter (or a given ``c = factor``), applied as ``sqrt(c)`` on both factors.

The parameters' ranges are checked by ``population.operator_params`` before an operator runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from openrlhf_populora.evolution.lowrank import LoraPair, compute_dtype, from_svd, svd_form

Adapter = Mapping[str, Tensor]


def _normal(shape: tuple[int, ...], gen: torch.Generator, like: Tensor) -> Tensor:
    """Seeded noise drawn on the CPU (the same numbers on every device), moved next to ``like``."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.randn(shape, generator=gen, dtype=dtype).to(device=like.device, dtype=like.dtype)


def _uniform(shape: tuple[int, ...], gen: torch.Generator, like: Tensor) -> Tensor:
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.rand(shape, generator=gen, dtype=dtype).to(device=like.device, dtype=like.dtype)


def _noisy(x: Tensor, scale: float, gen: torch.Generator) -> Tensor:
    work = x.to(compute_dtype(x.dtype))
    std = float(work.std()) if work.numel() > 1 else 0.0
    return torch.add(work, _normal(tuple(x.shape), gen, work), alpha=scale * std).to(x.dtype)


def _per_module(parent: Adapter, pairs: list[LoraPair],
                fn: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
    """Apply ``fn(B, A) -> (B', A')`` (in the compute dtype) to every module, in order."""
    child = {}
    for pair in pairs:
        a, b = parent[pair.a_key], parent[pair.b_key]
        new_b, new_a = fn(b.to(compute_dtype(b.dtype)), a.to(compute_dtype(a.dtype)))
        child[pair.a_key], child[pair.b_key] = new_a.to(a.dtype), new_b.to(b.dtype)
    return {key: child[key] for key in parent}


def copy_parent(parent: Adapter, pairs: list[LoraPair], gen: torch.Generator,
                info: dict) -> dict[str, Tensor]:
    return {key: tensor.clone() for key, tensor in parent.items()}


def gaussian(parent: Adapter, pairs: list[LoraPair], gen: torch.Generator, info: dict,
             scale: float) -> dict[str, Tensor]:
    return {key: _noisy(tensor, scale, gen) for key, tensor in parent.items()}


def layer_gaussian(parent: Adapter, pairs: list[LoraPair], gen: torch.Generator, info: dict,
                   scale: float, fraction: float) -> dict[str, Tensor]:
    layers = list(dict.fromkeys(pair.layer for pair in pairs))
    count = max(1, round(fraction * len(layers)))
    chosen = {layers[i] for i in torch.randperm(len(layers), generator=gen)[:count].tolist()}
    info["mutated_layers"] = sorted(chosen, key=layers.index)
    child = {key: tensor.clone() for key, tensor in parent.items()}
    for pair in pairs:
        if pair.layer in chosen:
            child[pair.a_key] = _noisy(parent[pair.a_key], scale, gen)
            child[pair.b_key] = _noisy(parent[pair.b_key], scale, gen)
    return child


def sv_lognormal(parent: Adapter, pairs: list[LoraPair], gen: torch.Generator, info: dict,
                 sigma: float) -> dict[str, Tensor]:
    def fn(b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        u, s, v = svd_form(b, a)
        return from_svd(u, s * torch.exp(sigma * _normal(tuple(s.shape), gen, s)), v)

    return _per_module(parent, pairs, fn)


def _tilt(u: Tensor, angle: float, gen: torch.Generator) -> Tensor:
    g = _normal(tuple(u.shape), gen, u)
    if u.shape[0] <= u.shape[1]:  # no room to turn: the subspace is (at least) the whole space
        return u
    g = g - u @ (u.T @ g)
    g = g / g.norm(dim=0, keepdim=True).clamp_min(torch.finfo(g.dtype).tiny)
    q, r = torch.linalg.qr(u + angle * g)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1
    return q * signs


def subspace_rotation(parent: Adapter, pairs: list[LoraPair], gen: torch.Generator, info: dict,
                      angle: float) -> dict[str, Tensor]:
    def fn(b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        u, s, v = svd_form(b, a)
        return from_svd(_tilt(u, angle, gen), s, _tilt(v, angle, gen))

    return _per_module(parent, pairs, fn)


def drop_components(parent: Adapter, pairs: list[LoraPair], gen: torch.Generator, info: dict,
                    p: float) -> dict[str, Tensor]:
    dropped = [0, 0]

    def fn(b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        u, s, v = svd_form(b, a)
        keep = _uniform(tuple(s.shape), gen, s) >= p
        if not bool(keep.any()):
            keep[0] = True
        dropped[0] += int((~keep).sum())
        dropped[1] += keep.numel()
        return from_svd(u, s * keep, v)

    child = _per_module(parent, pairs, fn)
    info["dropped_fraction"] = dropped[0] / max(dropped[1], 1)
    return child


def rescale(parent: Adapter, pairs: list[LoraPair], gen: torch.Generator, info: dict,
            sigma: float, factor: float | None = None) -> dict[str, Tensor]:
    if factor is None:
        factor = math.exp(sigma * float(torch.randn((), generator=gen, dtype=torch.float64)))
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"rescale: factor must be finite and > 0, got {factor}")
    info["factor"] = factor
    root = math.sqrt(factor)
    return {key: (tensor.to(compute_dtype(tensor.dtype)) * root).to(tensor.dtype)
            for key, tensor in parent.items()}


MUTATIONS: dict[str, Callable[..., dict[str, Tensor]]] = {
    "copy_parent": copy_parent,
    "gaussian": gaussian,
    "layer_gaussian": layer_gaussian,
    "sv_lognormal": sv_lognormal,
    "subspace_rotation": subspace_rotation,
    "drop_components": drop_components,
    "rescale": rescale,
}
