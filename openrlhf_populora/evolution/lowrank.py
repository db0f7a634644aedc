"""Exact low-rank algebra on LoRA adapters, never materialising a ``d x k`` matrix.

An adapter is a PEFT-format state dict: for each adapted module, ``<module>.lora_A.weight`` (``r x k``) and
``<module>.lora_B.weight`` (``d x r``). The module's weight update is ``delta = s * B A`` with the same
scaling ``s = alpha / r`` for every member of a population, so ``s`` cancels out of every operator here and
we work with ``B A`` directly.

**Joint basis.** For parents ``(B_i, A_i)`` of one module, QR-factor the stacked factors:
``[B_1 ... B_n] = Q_b R_b`` (``d x nr``) and ``[A_1; ...; A_n]^T = Q_a R_a`` (``k x nr``). Every parent's
delta lies in ``span(Q_b) x span(Q_a)``, so ``B_i A_i = Q_b C_i Q_a^T`` with the small **core**
``C_i = (Q_b^T B_i)(A_i Q_a)`` (``nr x nr``). The map ``C -> Q_b C Q_a^T`` is an isometry (Frobenius norms and
inner products are preserved), so any linear combination of deltas is a linear combination of cores.

**Re-factoring to rank r.** With ``C = U S V^T`` (SVD of the small core), the best rank-``r`` approximation
of ``Q_b C Q_a^T`` (Eckart-Young) is ``(Q_b U_r) S_r (Q_a V_r)^T``. We return balanced factors
``B = Q_b U_r sqrt(S_r)``, ``A = sqrt(S_r) V_r^T Q_a^T`` (so ``B^T B = A A^T = S_r``) and the truncation
energy ``1 - sum(S_r^2) / sum(S^2)``, the fraction of the delta's squared Frobenius norm that was lost.
Cost per module: ``O((d + k) (nr)^2)`` instead of ``O(d k min(d, k))`` for a dense SVD.

Arithmetic runs in float32 (float64 when the inputs are float64); results are cast back to the input dtype.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])(?P<name>\.[^.]+)?\.weight$")
_LAYER = re.compile(r"\.layers?\.(\d+)\.")


@dataclass(frozen=True)
class LoraPair:
    """The two keys of one adapted module; ``layer`` groups modules of one transformer layer."""

    module: str
    a_key: str
    b_key: str
    layer: str


def lora_pairs(state_dict: Mapping[str, Tensor]) -> list[LoraPair]:
    """Pair every ``lora_A`` key with its ``lora_B`` key (PEFT saved keys, or in-memory keys with an adapter
    name such as ``lora_A.default.weight``). ValueError for any other key, a missing partner, non-2-D or
    non-floating tensors, or inconsistent ranks."""
    if not isinstance(state_dict, Mapping) or not state_dict:
        raise ValueError("an adapter must be a non-empty mapping of key -> tensor")
    halves: dict[str, dict[str, str]] = {}
    for key, tensor in state_dict.items():
        match = _LORA_KEY.match(key)
        if match is None:
            raise ValueError(f"key {key!r} is not a lora_A / lora_B weight; only plain LoRA adapters "
                             "are supported")
        if not isinstance(tensor, Tensor) or tensor.ndim != 2 or not tensor.is_floating_point():
            raise ValueError(f"{key!r} must be a 2-D floating-point tensor")
        module = match["module"] + (match["name"] or "")
        halves.setdefault(module, {})[match["factor"]] = key
    pairs, ranks = [], set()
    for module, keys in halves.items():
        if set(keys) != {"A", "B"}:
            missing = "lora_B" if "B" not in keys else "lora_A"
            raise ValueError(f"module {module!r} has no {missing} weight")
        a, b = state_dict[keys["A"]], state_dict[keys["B"]]
        if a.shape[0] != b.shape[1]:
            raise ValueError(f"module {module!r}: lora_A is {tuple(a.shape)} but lora_B is {tuple(b.shape)}; "
                             "expected A (r x in) and B (out x r)")
        ranks.add(a.shape[0])
        layer = _LAYER.search(module)
        pairs.append(LoraPair(module, keys["A"], keys["B"], layer.group(1) if layer else module))
    if len(ranks) > 1:
        raise ValueError(f"all modules of an adapter must share one rank, got ranks {sorted(ranks)}")
    return pairs


def check_adapters(adapters: Sequence[Mapping[str, Tensor]]) -> list[LoraPair]:
    """Validate parents: same keys, shapes, dtype and rank; finite values. Returns the module pairs."""
    if len(adapters) == 0:
        raise ValueError("no parent adapters given")
    pairs = lora_pairs(adapters[0])
    first = adapters[0]
    for index, adapter in enumerate(adapters):
        if index and set(adapter) != set(first):
            extra, missing = sorted(set(adapter) - set(first)), sorted(set(first) - set(adapter))
            raise ValueError(f"parent {index} has different keys than parent 0: extra {extra[:3]}, "
                             f"missing {missing[:3]}")
        for key, tensor in adapter.items():
            if not isinstance(tensor, Tensor):
                raise ValueError(f"parent {index}: {key!r} is not a tensor")
            if tensor.shape != first[key].shape:
                raise ValueError(f"parent {index}: {key!r} has shape {tuple(tensor.shape)}, parent 0 has "
                                 f"{tuple(first[key].shape)} (different rank or target module?)")
            if tensor.dtype != first[key].dtype:
                raise ValueError(f"parent {index}: {key!r} is {tensor.dtype}, "
                                 f"parent 0 has {first[key].dtype}")
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"parent {index}: {key!r} contains NaN or Inf")
    return pairs


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Basis:
    """``[B_1 ... B_n] = Q_b R_b`` and ``[A_1; ...; A_n]^T = Q_a R_a`` for one module's parents.

    ``qb`` (``d x m``) and ``qa`` (``k x m'``) are orthonormal bases of the parents' column and row spaces.
    """

    qb: Tensor
    rb: Tensor
    qa: Tensor
    ra: Tensor
    widths: list[int]

    def cores(self) -> list[Tensor]:
        """Each parent's core ``C_i = (Q_b^T B_i)(A_i Q_a) = R_b[:, i] R_a[:, i]^T`` (column blocks of R)."""
        out, start = [], 0
        for width in self.widths:
            out.append(self.rb[:, start:start + width] @ self.ra[:, start:start + width].T)
            start += width
        return out


def joint_basis(bs: Sequence[Tensor], as_: Sequence[Tensor]) -> Basis:
    """QR of the stacked factors (inputs already in the compute dtype); no ``d x k`` matrix is formed."""
    qb, rb = torch.linalg.qr(torch.cat(list(bs), dim=1))
    qa, ra = torch.linalg.qr(torch.cat(list(as_), dim=0).T)
    return Basis(qb, rb, qa, ra, [b.shape[1] for b in bs])


def factor_core(basis: Basis, core: Tensor, rank: int) -> tuple[Tensor, Tensor, float, float]:
    """Balanced rank-``rank`` factors of ``Q_b core Q_a^T``; returns ``(B, A, kept, total)`` energies."""
    u, s, vh = torch.linalg.svd(core, full_matrices=False)
    k = min(rank, s.shape[0])
    root = s[:k].clamp_min(0).sqrt()
    b = (basis.qb @ u[:, :k]) * root
    a = root[:, None] * (vh[:k] @ basis.qa.T)
    if k < rank:  # fewer directions than the rank: pad with zero components
        b = torch.cat([b, b.new_zeros(b.shape[0], rank - k)], dim=1)
        a = torch.cat([a, a.new_zeros(rank - k, a.shape[1])], dim=0)
    energy = s.square()
    return b, a, float(energy[:k].sum()), float(energy.sum())


def svd_form(b: Tensor, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD of one module's ``B A`` without forming it: ``(U (d x r), S (r), V (k x r))``.

    When ``d`` or ``k`` is smaller than ``r``, the missing components are zero columns with ``S = 0``."""
    basis = joint_basis([b], [a])
    u, s, vh = torch.linalg.svd(basis.cores()[0], full_matrices=False)
    u, v = basis.qb @ u, basis.qa @ vh.T
    missing = b.shape[1] - s.shape[0]
    if missing > 0:
        u = torch.cat([u, u.new_zeros(u.shape[0], missing)], dim=1)
        v = torch.cat([v, v.new_zeros(v.shape[0], missing)], dim=1)
        s = torch.cat([s, s.new_zeros(missing)])
    # canonical signs (the largest entry of each left singular vector is positive), so that operators that
    # act on singular vectors give the same child whichever SVD implementation (CPU, GPU) ran
    signs = torch.sign(u.gather(0, u.abs().argmax(dim=0, keepdim=True)))
    signs[signs == 0] = 1
    return u * signs, s, v * signs


def from_svd(u: Tensor, s: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Balanced factors ``B = U sqrt(S)``, ``A = sqrt(S) V^T``."""
    root = s.clamp_min(0).sqrt()
    return u * root, root[:, None] * v.T


class EnergyLog:
    """Accumulates truncation energy over modules into an ``info`` dict."""

    def __init__(self) -> None:
        self.kept = 0.0
        self.total = 0.0
        self.worst = (0.0, "")

    def add(self, module: str, kept: float, total: float) -> None:
        self.kept += kept
        self.total += total
        lost = 1.0 - kept / total if total > 0 else 0.0
        if lost > self.worst[0]:
            self.worst = (lost, module)

    def write(self, info: dict) -> None:
        info["truncation_energy"] = max(0.0, 1.0 - self.kept / self.total) if self.total > 0 else 0.0
        info["max_module_truncation_energy"] = max(0.0, self.worst[0])
        info["worst_module"] = self.worst[1]
