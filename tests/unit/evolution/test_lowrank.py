"""Exact crossover maths: equality with a dense SVD, gauge invariance, balanced factors, truncation energy."""

import pytest
import torch

from openrlhf_populora.evolution import crossover, lora_pairs
from openrlhf_populora.evolution.lowrank import check_adapters, svd_form

SHAPES = {"self_attn.q_proj": (48, 40), "self_attn.v_proj": (16, 40), "mlp.down_proj": (40, 64)}


def _adapter(seed, rank=4, layers=2, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(layers):
        for module, (out, inp) in SHAPES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            sd[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen).to(dtype)
            sd[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen).to(dtype)
    return sd


def _delta(sd, pair):
    return sd[pair.b_key].double() @ sd[pair.a_key].double()


def _best_rank_r(matrix, rank):
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank], s


def _rel(x, y):
    return float((x - y).norm() / y.norm())


@pytest.mark.parametrize("weights", [None, [0.3, 0.7], [0.2, 0.5, 0.3]])
def test_svd_mean_equals_dense_best_rank_r(weights):
    n = 3 if weights and len(weights) == 3 else 2
    parents = [_adapter(seed) for seed in range(n)]
    info = {}
    child = crossover("svd_mean", parents, weights=weights, seed=0, info=info)
    w = weights or [1.0 / n] * n
    kept = total = 0.0
    for pair in lora_pairs(child):
        mixed = sum(wi * _delta(p, pair) for wi, p in zip(w, parents, strict=True))
        best, s = _best_rank_r(mixed, 4)
        assert s[3] - s[4] > 1e-3 * s[0]  # a clear gap, so the best rank-4 approximation is unique
        assert _rel(_delta(child, pair), best) < 1e-5
        kept += float(s[:4].square().sum())
        total += float(s.square().sum())
    assert info["truncation_energy"] == pytest.approx(1 - kept / total, rel=1e-4)
    assert 0 < info["max_module_truncation_energy"] < 1


def test_gauge_invariance():
    a, b = _adapter(0), _adapter(1)
    gen = torch.Generator().manual_seed(5)
    regauged = dict(a)
    for pair in lora_pairs(a):
        r = torch.randn(4, 4, generator=gen, dtype=torch.float64) + 3 * torch.eye(4, dtype=torch.float64)
        regauged[pair.b_key] = (a[pair.b_key].double() @ r).float()
        regauged[pair.a_key] = (torch.linalg.inv(r) @ a[pair.a_key].double()).float()
    child = crossover("svd_mean", [a, b], seed=0)
    child_regauged = crossover("svd_mean", [regauged, b], seed=0)
    for pair in lora_pairs(a):
        assert _rel(_delta(regauged, pair), _delta(a, pair)) < 1e-5  # the same adapter
        assert _rel(_delta(child_regauged, pair), _delta(child, pair)) < 1e-5
    # averaging an adapter with its own re-parametrisation gives the adapter back exactly...
    same = crossover("svd_mean", [a, regauged], seed=0)
    naive = crossover("linear_0_5", [a, regauged], seed=0)
    errors = [_rel(_delta(same, p), _delta(a, p)) for p in lora_pairs(a)]
    naive_errors = [_rel(_delta(naive, p), _delta(a, p)) for p in lora_pairs(a)]
    assert max(errors) < 1e-5
    # ...while the naive factor average does not
    assert min(naive_errors) > 0.1


def test_linear_0_5_differs_from_the_delta_average():
    a, b = _adapter(0), _adapter(1)
    naive = crossover("linear_0_5", [a, b], seed=0)
    errors = []
    for pair in lora_pairs(a):
        target = (_delta(a, pair) + _delta(b, pair)) / 2
        errors.append(_rel(_delta(naive, pair), target))
        assert torch.equal(naive[pair.a_key], (a[pair.a_key] + b[pair.a_key]) / 2)
    assert min(errors) > 0.3  # about 0.7 for random factors (landscape.md section 5)


def test_factors_are_balanced_and_orthogonal():
    child = crossover("svd_mean", [_adapter(0), _adapter(1)], seed=0)
    for pair in lora_pairs(child):
        b, a = child[pair.b_key].double(), child[pair.a_key].double()
        gram_b, gram_a = b.T @ b, a @ a.T
        assert torch.allclose(gram_b, gram_a, rtol=1e-4, atol=1e-4 * float(gram_b.norm()))
        assert torch.allclose(gram_b, torch.diag(torch.diagonal(gram_b)), atol=1e-4 * float(gram_b.norm()))


def test_identical_parents_lose_no_energy_and_zero_parents_are_fine():
    a = _adapter(0)
    info = {}
    child = crossover("svd_mean", [a, a], seed=0, info=info)
    assert info["truncation_energy"] < 1e-6
    for pair in lora_pairs(a):
        assert _rel(_delta(child, pair), _delta(a, pair)) < 1e-5
    zeros = {k: torch.zeros_like(v) for k, v in a.items()}  # PEFT init has B = 0: delta 0
    info = {}
    child = crossover("svd_mean", [zeros, zeros], seed=0, info=info)
    assert all(torch.count_nonzero(v) == 0 for v in child.values()) and info["truncation_energy"] == 0.0


def test_float64_and_bfloat16_inputs():
    a64, b64 = _adapter(0, dtype=torch.float64), _adapter(1, dtype=torch.float64)
    child = crossover("svd_mean", [a64, b64], seed=0)
    for pair in lora_pairs(a64):
        best, _ = _best_rank_r((_delta(a64, pair) + _delta(b64, pair)) / 2, 4)
        assert child[pair.a_key].dtype == torch.float64
        assert _rel(_delta(child, pair), best) < 1e-10
    a16, b16 = _adapter(0, dtype=torch.bfloat16), _adapter(1, dtype=torch.bfloat16)
    child = crossover("svd_mean", [a16, b16], seed=0)
    assert all(v.dtype == torch.bfloat16 for v in child.values())


def test_svd_form_is_exact():
    a = _adapter(3)
    for pair in lora_pairs(a):
        u, s, v = svd_form(a[pair.b_key].double(), a[pair.a_key].double())
        assert _rel((u * s) @ v.T, _delta(a, pair)) < 1e-10
        assert torch.allclose(u.T @ u, torch.eye(4, dtype=torch.float64), atol=1e-10)


def test_key_pairing():
    a = _adapter(0)
    pairs = lora_pairs(a)
    assert len(pairs) == 2 * len(SHAPES)
    assert {p.layer for p in pairs} == {"0", "1"}
    # in-memory PEFT keys carry the adapter name
    named = {k.replace(".weight", ".t0.weight"): v for k, v in a.items()}
    assert len(lora_pairs(named)) == len(pairs)
    child = crossover("svd_mean", [named, named], seed=0)
    assert list(child) == list(named)


def test_bad_adapters():
    a, b = _adapter(0), _adapter(1)
    with pytest.raises(ValueError, match="lora_B"):
        lora_pairs({k: v for k, v in a.items() if "v_proj.lora_B" not in k})
    with pytest.raises(ValueError, match="not a lora_A"):
        lora_pairs({**a, "base_model.model.lm_head.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="rank"):
        lora_pairs({**a, "x.lora_A.weight": torch.zeros(8, 3), "x.lora_B.weight": torch.zeros(3, 8)})
    with pytest.raises(ValueError, match="different keys"):
        check_adapters([a, {k: v for k, v in b.items() if "layers.1." not in k}])
    with pytest.raises(ValueError, match="shape"):
        check_adapters([a, _adapter(1, rank=8)])
    bad = dict(b)
    bad[next(iter(bad))] = bad[next(iter(bad))].clone().fill_(float("nan"))
    with pytest.raises(ValueError, match="NaN"):
        crossover("svd_mean", [a, bad], seed=0)
    inf = dict(b)
    key = list(inf)[3]
    inf[key] = inf[key].clone()
    inf[key][0, 0] = float("inf")
    with pytest.raises(ValueError, match="parent 1.*NaN or Inf"):
        crossover("svd_mean", [a, inf], seed=0)
    with pytest.raises(ValueError, match="float64"):
        check_adapters([a, _adapter(1, dtype=torch.float64)])


def test_modules_narrower_than_the_stacked_rank_are_padded():
    # out = 3 < rank 4: the merged delta has rank <= 3, the child keeps rank-4 factors (one zero component)
    gen = torch.Generator().manual_seed(0)
    parents = [{"m.lora_A.weight": torch.randn(4, 10, generator=gen),
                "m.lora_B.weight": torch.randn(3, 4, generator=gen)} for _ in range(2)]
    info = {}
    child = crossover("svd_mean", parents, seed=0, info=info)
    assert child["m.lora_B.weight"].shape == (3, 4) and child["m.lora_A.weight"].shape == (4, 10)
    mixed = sum(p["m.lora_B.weight"].double() @ p["m.lora_A.weight"].double() for p in parents) / 2
    got = child["m.lora_B.weight"].double() @ child["m.lora_A.weight"].double()
    assert _rel(got, mixed) < 1e-5 and info["truncation_energy"] < 1e-6
