"""Every mutation and crossover: keys, shapes, dtype, rank, seeding, semantics; bad input; apply_action."""

import math

import pytest
import torch

from openrlhf_populora.evolution import CROSSOVERS, MUTATIONS, apply_action, crossover, lora_pairs, mutate
from openrlhf_populora.population import (
    CROSSOVER_NAMES,
    MUTATION_NAMES,
    OPERATOR_CODES,
    EvolutionConfig,
    Population,
    apply_plan,
    make_ratings,
    plan_evolution,
)

SHAPES = {"self_attn.q_proj": (32, 24), "self_attn.k_proj": (8, 24), "mlp.up_proj": (40, 24)}
RANK = 4
RANDOM_MUTATIONS = set(MUTATION_NAMES) - {"copy_parent"}
RANDOM_CROSSOVERS = {"layer_swap", "dare"}


def _adapter(seed, layers=3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(layers):
        for module, (out, inp) in SHAPES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            sd[f"{prefix}.lora_A.weight"] = (0.1 * torch.randn(RANK, inp, generator=gen)).to(dtype)
            sd[f"{prefix}.lora_B.weight"] = (0.1 * torch.randn(out, RANK, generator=gen)).to(dtype)
    return sd


def _delta(sd, pair):
    return sd[pair.b_key].double() @ sd[pair.a_key].double()


def _rel(x, y):
    return float((x - y).norm() / y.norm())


def _same(x, y):
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_registries_match_the_names_population_plans_with():
    assert tuple(MUTATIONS) == MUTATION_NAMES
    assert tuple(CROSSOVERS) == CROSSOVER_NAMES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", MUTATION_NAMES)
def test_mutation_keeps_structure_and_is_seeded(name, dtype):
    parent = _adapter(0, dtype=dtype)
    original = {k: v.clone() for k, v in parent.items()}
    child = mutate(name, parent, seed=1)
    assert list(child) == list(parent)
    assert all(child[k].shape == parent[k].shape and child[k].dtype == dtype for k in parent)
    assert all(bool(torch.isfinite(v).all()) for v in child.values())
    assert _same(parent, original)  # the parent is not modified
    assert _same(child, mutate(name, parent, seed=1))
    if name in RANDOM_MUTATIONS:
        assert not _same(child, mutate(name, parent, seed=2))
        assert not _same(child, parent)
    else:
        assert _same(child, parent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CROSSOVER_NAMES)
def test_crossover_keeps_structure_and_is_seeded(name, dtype):
    parents = [_adapter(0, dtype=dtype), _adapter(1, dtype=dtype)]
    child = crossover(name, parents, seed=1)
    assert list(child) == list(parents[0])
    assert all(child[k].shape == parents[0][k].shape and child[k].dtype == dtype for k in child)
    assert all(bool(torch.isfinite(v).all()) for v in child.values())
    assert _same(child, crossover(name, parents, seed=1))
    if name in RANDOM_CROSSOVERS:
        assert any(not _same(child, crossover(name, parents, seed=s)) for s in range(2, 6))


def test_every_operator_runs_with_defaults_and_reports_truncation_energy():
    a, b = _adapter(0), _adapter(1)
    for name in MUTATION_NAMES:
        info = {}
        mutate(name, a, seed=0, info=info)
        assert info["truncation_energy"] == 0.0
    for name in CROSSOVER_NAMES:
        info = {}
        crossover(name, [a, b], seed=0, info=info)
        assert 0.0 <= info["truncation_energy"] < 1.0


def test_gaussian_scale_follows_tensor_std():
    parent = _adapter(0)
    child = mutate("gaussian", parent, seed=0, scale=0.1)
    # the noise, divided by scale * std of its own tensor, is standard normal (pooled over all tensors)
    pooled = torch.cat([((child[k] - t) / (0.1 * t.std())).flatten() for k, t in parent.items()])
    assert float(pooled.std()) == pytest.approx(1.0, rel=0.1)
    assert abs(float(pooled.mean())) < 0.1
    zeros = {k: torch.zeros_like(v) for k, v in parent.items()}
    assert _same(mutate("gaussian", zeros, seed=0), zeros)  # std 0: nothing to scale


def test_layer_gaussian_touches_only_the_chosen_layers():
    parent = _adapter(0)
    info = {}
    child = mutate("layer_gaussian", parent, seed=4, info=info, fraction=0.34)
    assert len(info["mutated_layers"]) == 1
    for pair in lora_pairs(parent):
        changed = not torch.equal(child[pair.a_key], parent[pair.a_key])
        assert changed == (pair.layer in info["mutated_layers"])


def test_sv_lognormal_keeps_singular_vectors():
    parent = _adapter(0)
    child = mutate("sv_lognormal", parent, seed=0, sigma=0.3)
    for pair in lora_pairs(parent):
        before, after = _delta(parent, pair), _delta(child, pair)
        u, _, vh = torch.linalg.svd(before, full_matrices=False)
        proj = u[:, :RANK].T @ after @ vh[:RANK].T  # diagonal if the singular vectors are unchanged
        assert torch.allclose(proj, torch.diag(torch.diagonal(proj)), atol=1e-5 * float(proj.norm()))
        assert _rel(after, before) > 1e-3


def test_subspace_rotation_keeps_singular_values_and_turns_subspaces_by_about_angle():
    parent = _adapter(0)
    child = mutate("subspace_rotation", parent, seed=0, angle=0.05)
    for pair in lora_pairs(parent):
        before, after = _delta(parent, pair), _delta(child, pair)
        s0 = torch.linalg.svdvals(before)[:RANK]
        s1 = torch.linalg.svdvals(after)[:RANK]
        assert torch.allclose(s0, s1, rtol=1e-4)
        u0 = torch.linalg.svd(before)[0][:, :RANK]
        u1 = torch.linalg.svd(after)[0][:, :RANK]
        cosines = torch.linalg.svdvals(u0.T @ u1)  # cosines of the principal angles
        if before.shape[0] > RANK:
            assert 0.02 < float(torch.arccos(cosines.clamp(max=1)).max()) < 0.15


def test_drop_components_and_rescale():
    parent = _adapter(0)
    info = {}
    child = mutate("drop_components", parent, seed=0, info=info, p=0.5)
    assert 0 < info["dropped_fraction"] < 1
    for pair in lora_pairs(parent):
        s0 = torch.linalg.svdvals(_delta(parent, pair))[:RANK]
        s1 = torch.linalg.svdvals(_delta(child, pair))[:RANK]
        kept = s1[s1 > 1e-6 * s0[0]]
        assert all(float((s0 - k).abs().min()) < 1e-4 * float(s0[0]) for k in kept)  # a subset of s0
    info = {}
    child = mutate("rescale", parent, seed=0, info=info, factor=2.5)
    assert info["factor"] == 2.5
    for pair in lora_pairs(parent):
        assert _rel(_delta(child, pair), 2.5 * _delta(parent, pair)) < 1e-5


def test_layer_swap_copies_whole_layers():
    a, b = _adapter(0), _adapter(1)
    info = {}
    child = crossover("layer_swap", [a, b], seed=3, info=info)
    for pair in lora_pairs(a):
        source = [a, b][info["layer_sources"][int(pair.layer)]]
        assert torch.equal(child[pair.a_key], source[pair.a_key])
        assert torch.equal(child[pair.b_key], source[pair.b_key])
    assert _same(crossover("layer_swap", [a, b], weights=[1.0, 0.0], seed=3), a)


def test_exact_combinations_match_their_formulas():
    a, b = _adapter(0), _adapter(1)
    pairs = lora_pairs(a)

    def check(child, target_of, rank=RANK):
        for pair in pairs:
            target = target_of(_delta(a, pair), _delta(b, pair))
            u, s, vh = torch.linalg.svd(target, full_matrices=False)
            best = (u[:, :rank] * s[:rank]) @ vh[:rank]
            assert _rel(_delta(child, pair), best) < 1e-4

    check(crossover("extrapolate", [a, b], seed=0, lam=0.5), lambda x, y: x + 0.5 * (x - y))
    check(crossover("dare", [a, b], seed=0, p=0.0), lambda x, y: (x + y) / 2)
    check(crossover("ties", [a, a], seed=0, density=1.0), lambda x, y: x)
    check(crossover("svd_fitness", [a, b], seed=0, fitness=[3.0, 1.0], temperature=1.0),
          lambda x, y: (math.e**2 * x + y) / (math.e**2 + 1))

    def slerp(x, y, t=0.3):
        theta = math.acos(float((x * y).sum() / (x.norm() * y.norm())))
        return (math.sin((1 - t) * theta) * x + math.sin(t * theta) * y) / math.sin(theta)

    check(crossover("slerp", [a, b], seed=0, t=0.3), slerp)
    same = crossover("slerp", [a, a], seed=0)  # parallel deltas: falls back to the linear blend
    assert all(_rel(_delta(same, pair), _delta(a, pair)) < 1e-5 for pair in pairs)


def test_dare_rescales_what_it_keeps_by_one_over_one_minus_p(monkeypatch):
    """DARE at p > 0: each parent's kept core entries are divided by 1 - p before the weighted sum. The Bernoulli
    draws are scripted: parent 0's entries all kept (draw 1 >= p), parent 1's all dropped (draw 0 < p), so with
    equal weights and p = 0.75 the child's delta is exactly 0.5 D_0 / 0.25 = 2 D_0 (rank r, nothing truncated).
    Catches: DARE without its 1 / (1 - p) rescale (the child would be 0.5 D_0)."""
    a, b = _adapter(0), _adapter(1)
    pairs = lora_pairs(a)
    draws = []

    def scripted_rand(size, generator=None, dtype=None):
        draws.append(1.0 if len(draws) % 2 == 0 else 0.0)  # one draw per parent, parent 0 first
        return torch.full(tuple(size), draws[-1], dtype=dtype)

    monkeypatch.setattr(torch, "rand", scripted_rand)
    child = crossover("dare", [a, b], seed=0, p=0.75)
    monkeypatch.undo()
    assert len(draws) == 2 * len(pairs)
    for pair in pairs:
        assert _rel(_delta(child, pair), 2 * _delta(a, pair)) < 1e-5


def test_task_arithmetic_is_the_scaled_sum_of_the_deltas():
    a, b = _adapter(0), _adapter(1)
    pairs = lora_pairs(a)
    info = {}
    child = crossover("task_arithmetic", [a, b], seed=0, info=info, lam=0.8)
    for pair in pairs:  # the best rank-r approximation of 0.8 (Da + Db): two rank-r deltas sum to rank 2r
        u, s, vh = torch.linalg.svd(0.8 * (_delta(a, pair) + _delta(b, pair)), full_matrices=False)
        assert _rel(_delta(child, pair), (u[:, :RANK] * s[:RANK]) @ vh[:RANK]) < 1e-4
    assert 0 < info["truncation_energy"] < 1
    # exact where the sum keeps rank r: a parent with itself is 2 Da, nothing truncated; the default lam is 1
    info = {}
    doubled = crossover("task_arithmetic", [a, a], seed=0, info=info)
    assert info["truncation_energy"] < 1e-6
    assert all(_rel(_delta(doubled, pair), 2 * _delta(a, pair)) < 1e-5 for pair in pairs)
    # not a mean: the default differs from svd_mean by the factor 2 on the same parents
    mean = crossover("svd_mean", [a, a], seed=0)
    assert all(_rel(_delta(doubled, pair), 2 * _delta(mean, pair)) < 1e-5 for pair in pairs)


def test_paper_codes_name_the_same_operators():
    a, b = _adapter(0), _adapter(1)
    assert sorted(c for c in OPERATOR_CODES.values() if c[0] == "M") == [f"M{i}" for i in range(1, 7)]
    assert sorted(c for c in OPERATOR_CODES.values() if c[0] == "X") == sorted(f"X{i}" for i in range(1, 10))
    assert set(OPERATOR_CODES) == set(MUTATION_NAMES) | set(CROSSOVER_NAMES)
    for name, code in OPERATOR_CODES.items():
        if name in MUTATION_NAMES:
            assert _same(mutate(code, a, seed=5), mutate(name, a, seed=5))
        else:
            assert _same(crossover(code, [a, b], seed=5), crossover(name, [a, b], seed=5))


def test_configured_parameters_reach_the_operator():
    a = _adapter(0)
    population = Population.create(2, 2)
    ratings = make_ratings()
    for member in population.alive():
        ratings.add(member.id)
    cfg = EvolutionConfig(evolve_every=1, min_age=0, replace_fraction=0.5, operators={"M1": 1.0})
    cfg.params.gaussian_scale = 0.3
    action = plan_evolution(population, ratings, 1, cfg, seed=0)[0]
    assert action.operator == "gaussian" and action.params == {"scale": 0.3}
    assert action.to_dict()["operator_code"] == "M1"
    child, info = apply_action(action, [a])
    assert _same(child, mutate("gaussian", a, seed=action.seed, scale=0.3))
    assert not _same(child, mutate("gaussian", a, seed=action.seed))  # the default (0.05) would differ
    assert info["operator"] == "gaussian" and info["operator_code"] == "M1"


@pytest.mark.parametrize("menu, kind", [({"copy_parent": 1.0}, "mutation"), ({"linear_0_5": 1.0}, "crossover")])
def test_controls_can_be_selected_by_name(menu, kind):
    population = Population.create(3, 3)
    ratings = make_ratings()
    for member in population.alive():
        ratings.add(member.id)
    adapters = {m.adapter: _adapter(i) for i, m in enumerate(population.alive())}
    cfg = EvolutionConfig(evolve_every=1, min_age=0, replace_fraction=0.34, operators=menu)
    actions = plan_evolution(population, ratings, 1, cfg, seed=0)
    assert actions and {a.operator for a in actions} == set(menu)
    for action in actions:
        child, _ = apply_action(action, adapters)
        parents = [adapters[slot] for slot in action.parent_adapters]
        expected = parents[0] if kind == "mutation" else {k: (parents[0][k] + parents[1][k]) / 2 for k in child}
        assert all(torch.allclose(child[k], expected[k]) for k in child)


def test_operator_menu_rejects_one_operator_under_two_names():
    with pytest.raises(ValueError, match="twice"):
        EvolutionConfig(operators={"M1": 1.0, "gaussian": 1.0}).validate()
    with pytest.raises(ValueError, match="evolution.params.ties_density must be in"):
        cfg = EvolutionConfig()
        cfg.params.ties_density = 0.0
        cfg.validate()


def test_sv_splice_takes_top_components_from_each_parent():
    a, b = _adapter(0), _adapter(1)
    child = crossover("sv_splice", [a, b], seed=0, top=3)
    for pair in lora_pairs(a):
        ua, sa, vha = torch.linalg.svd(_delta(a, pair), full_matrices=False)
        ub, sb, vhb = torch.linalg.svd(_delta(b, pair), full_matrices=False)
        target = (ua[:, :3] * sa[:3]) @ vha[:3] + (ub[:, :1] * sb[:1]) @ vhb[:1]
        assert _rel(_delta(child, pair), target) < 1e-4
    assert all(
        _rel(_delta(crossover("sv_splice", [a, b], seed=0, top=RANK), p), _delta(a, p)) < 1e-4
        for p in lora_pairs(a)
    )


def test_ties_resolves_sign_conflicts():
    a = _adapter(0)
    neg = {k: (-v if "lora_B" in k else v) for k, v in a.items()}  # delta -> -delta
    info = {}
    crossover("ties", [a, neg], weights=[0.6, 0.4], seed=0, info=info)
    child = crossover("ties", [a, neg], weights=[0.6, 0.4], seed=0, density=1.0)
    # every entry's elected sign is parent 0's; the disjoint mean then keeps parent 0's delta exactly
    for pair in lora_pairs(a):
        assert _rel(_delta(child, pair), _delta(a, pair)) < 1e-4
    plain = crossover("svd_mean", [a, neg], weights=[0.6, 0.4], seed=0)
    assert _rel(_delta(plain, lora_pairs(a)[0]), 0.2 * _delta(a, lora_pairs(a)[0])) < 1e-4


def test_bad_input_names_the_problem():
    a, b = _adapter(0), _adapter(1)
    with pytest.raises(ValueError, match="unknown evolution operator 'warp'"):
        mutate("warp", a, seed=0)
    with pytest.raises(ValueError, match="unknown evolution operator 'blend'"):
        crossover("blend", [a, b], seed=0)
    with pytest.raises(ValueError, match="'svd_mean' is a crossover"):
        mutate("X1", a, seed=0)
    with pytest.raises(ValueError, match="'gaussian' is a mutation"):
        crossover("gaussian", [a, b], seed=0)
    with pytest.raises(ValueError, match="takes scale"):
        mutate("gaussian", a, seed=0, sigma=0.1)
    with pytest.raises(ValueError, match=">= 2 parent"):
        crossover("svd_mean", [a], seed=0)
    with pytest.raises(ValueError, match="exactly 2"):
        crossover("slerp", [a, b, a], seed=0)
    with pytest.raises(ValueError, match="weights"):
        crossover("svd_mean", [a, b], weights=[1.0], seed=0)
    with pytest.raises(ValueError, match="weights"):
        crossover("svd_mean", [a, b], weights=[-1.0, 2.0], seed=0)
    with pytest.raises(ValueError, match="fraction"):
        mutate("layer_gaussian", a, seed=0, fraction=0.0)
    with pytest.raises(ValueError, match="scale"):
        mutate("gaussian", a, seed=0, scale=float("nan"))
    with pytest.raises(TypeError, match="seed"):
        mutate("gaussian", a, seed=1.5)
    with pytest.raises(ValueError, match="NaN"):
        key = next(iter(a))
        mutate("gaussian", {**a, key: torch.full_like(a[key], float("nan"))}, seed=0)
    with pytest.raises(ValueError, match="shape"):
        crossover("svd_mean", [a, {**b, next(iter(b)): torch.zeros(RANK + 1, 24)}], seed=0)


def test_apply_action_end_to_end_with_the_plan():
    population = Population.create(4, 4)
    ratings = make_ratings()
    for i, member in enumerate(population.alive()):
        ratings.add(member.id, mu=20.0 + i % 4, sigma=1.0)
    adapters = {m.adapter: _adapter(i) for i, m in enumerate(population.alive())}
    cfg = EvolutionConfig(replace_fraction=0.5, operators={"svd_fitness": 1.0, "sv_lognormal": 1.0})
    actions = plan_evolution(population, ratings, 25, cfg, seed=0)
    assert {a.operator for a in actions} == {"svd_fitness", "sv_lognormal"}
    results = [apply_action(action, adapters) for action in actions]  # read every parent first
    for action, (child, info) in zip(actions, results, strict=True):
        assert list(child) == list(adapters[action.slot])
        assert info["operator"] == action.operator and info["parents"] == list(action.parents)
        if action.operator == "svd_fitness":
            assert info["weights"][0] >= info["weights"][1]  # best parent first, heavier weight
            again, _ = apply_action(action, [adapters[p] for p in action.parent_adapters])
            assert _same(child, again)
        adapters[action.slot] = child
    apply_plan(population, ratings, actions, [info for _, info in results])
    assert all("truncation_energy" in population.get(a.new_id).info for a in actions)
    with pytest.raises(ValueError, match="no state dict"):
        apply_action(actions[0], {"zz": _adapter(0)})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_operators_keep_the_device_and_match_cpu_results():
    a, b = _adapter(0), _adapter(1)
    a_gpu = {k: v.cuda() for k, v in a.items()}
    b_gpu = {k: v.cuda() for k, v in b.items()}
    for name in MUTATION_NAMES:
        child = mutate(name, a_gpu, seed=3)
        assert all(v.is_cuda for v in child.values())
        reference = mutate(name, a, seed=3)  # same seeded noise: drawn on the CPU on every device
        for pair in lora_pairs(a):
            assert _rel(_delta(child, pair).cpu(), _delta(reference, pair)) < 1e-4
    for name in CROSSOVER_NAMES:
        child = crossover(name, [a_gpu, b_gpu], seed=3)
        assert all(v.is_cuda for v in child.values())
        reference = crossover(name, [a, b], seed=3)
        for pair in lora_pairs(a):
            assert _rel(_delta(child, pair).cpu(), _delta(reference, pair)) < 1e-4


def test_every_operator_handles_modules_narrower_than_the_rank():
    gen = torch.Generator().manual_seed(0)

    def narrow():
        return {"layers.0.m.lora_A.weight": torch.randn(RANK, 10, generator=gen),
                "layers.0.m.lora_B.weight": torch.randn(3, RANK, generator=gen),  # out 3 < rank 4
                "layers.1.m.lora_A.weight": torch.randn(RANK, 2, generator=gen),  # in 2 < rank 4
                "layers.1.m.lora_B.weight": torch.randn(6, RANK, generator=gen)}

    a, b = narrow(), narrow()
    children = [mutate(name, a, seed=0) for name in MUTATION_NAMES]
    children += [crossover(name, [a, b], seed=0) for name in CROSSOVER_NAMES]
    for child in children:
        assert all(child[k].shape == a[k].shape and bool(torch.isfinite(child[k]).all()) for k in a)


# -- exact values the operators promise (each test names the broken implementation it catches) ----------------


def test_subspace_rotation_tilts_each_direction_by_exactly_the_angle():
    # catches: a tilt direction not projected out of span(U) (g + U U^T g), and one normalised over the whole
    # matrix instead of per column: either turns the first basis vector by less or more than arctan(angle)
    from openrlhf_populora.evolution.mutations import _tilt

    u = torch.linalg.qr(torch.randn(12, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64))[0]
    for angle in (0.05, 0.2, 1.0):
        out = _tilt(u, angle, torch.Generator().manual_seed(1))
        assert torch.allclose(out.T @ out, torch.eye(3, dtype=torch.float64), atol=1e-12)  # still orthonormal
        # QR keeps the first column's direction: u_1 + angle * g_1 with g_1 a unit vector orthogonal to span(U)
        assert float((u.T @ out[:, 0]).norm()) == pytest.approx(1 / math.sqrt(1 + angle**2), abs=1e-12)
        assert float(out[:, 0] @ u[:, 0]) > 0  # turned from u_1, not flipped


def test_drop_components_reports_exactly_the_fraction_it_dropped():
    # catches: a count overwritten per module instead of summed, kept components counted as dropped, and a
    # counter that does not start at zero
    parent = _adapter(0)
    for p in (0.3, 0.7):
        info = {}
        child = mutate("drop_components", parent, seed=2, info=info, p=p)
        pairs = lora_pairs(parent)
        dropped = 0
        for pair in pairs:
            s = torch.linalg.svdvals(_delta(child, pair))[:RANK]
            dropped += int((s < 1e-6 * float(torch.linalg.svdvals(_delta(parent, pair))[0])).sum())
        assert 0 < dropped < RANK * len(pairs)
        assert info["dropped_fraction"] == dropped / (RANK * len(pairs))


@pytest.mark.parametrize("factor", [-1.0, 0.0, float("inf"), float("nan")])
def test_rescale_refuses_a_factor_that_is_not_finite_and_positive(factor):
    # catches: "finite OR positive" (inf would pass, and -1 would flip the delta's sign)
    with pytest.raises(ValueError, match=r"rescale: factor must be finite and > 0, got"):
        mutate("rescale", _adapter(0), seed=0, factor=factor)


def test_crossover_weights_that_are_all_zero_are_refused():
    # catches: "sum < 0" in place of "sum <= 0" (all-zero weights would divide by zero)
    with pytest.raises(ValueError, match="not all zero"):
        crossover("svd_mean", [_adapter(0), _adapter(1)], weights=[0.0, 0.0], seed=0)


def test_svd_fitness_weights_are_a_softmax_of_fitness_over_the_temperature():
    # catches: fitness multiplied by the temperature instead of divided (the same at temperature 1 only)
    a, b = _adapter(0), _adapter(1)
    info = {}
    child = crossover("svd_fitness", [a, b], seed=0, info=info, fitness=[3.0, 1.0], temperature=4.0)
    w = math.exp(0.5)  # exp((3 - 1) / 4)
    assert info["weights"] == pytest.approx([w / (w + 1), 1 / (w + 1)], abs=1e-15)
    assert all(_rel(_delta(child, p), _delta(crossover("svd_mean", [a, b], weights=info["weights"], seed=0), p))
               < 1e-6 for p in lora_pairs(a))


def test_ties_trim_keeps_exactly_the_densest_entries():
    # catches: an off-by-one in the top-k threshold (k - 1 or k + 1 entries kept)
    from openrlhf_populora.evolution.crossovers import _trim

    core = (torch.randperm(16, generator=torch.Generator().manual_seed(0)).double() + 1).reshape(4, 4)
    core[::2] *= -1  # magnitudes 1..16, both signs
    for density, keep in ((0.25, 4), (0.3, 5), (1 / 16, 1), (0.01, 1), (1.0, 16)):
        out = _trim(core, density)
        assert int((out != 0).sum()) == keep, density
        assert torch.equal(out[out != 0], core[core.abs() > 16 - keep])  # the largest magnitudes, unchanged


def test_sv_splice_with_top_zero_is_the_second_parent():
    # catches: top = 0 refused (it is in the parameter's range [0, inf): every component from parent 2)
    a, b = _adapter(0), _adapter(1)
    child = crossover("sv_splice", [a, b], seed=0, top=0)
    assert all(_rel(_delta(child, p), _delta(b, p)) < 1e-5 for p in lora_pairs(a))


def test_slerp_with_a_zero_parent_is_the_linear_blend():
    # catches: a wrong blend on the zero-norm branch, as with an untrained newborn (its lora_B is zero)
    a = _adapter(0)
    fresh = {k: (torch.zeros_like(v) if "lora_B" in k else v) for k, v in _adapter(1).items()}
    child = crossover("slerp", [a, fresh], seed=0, t=0.3)
    assert all(_rel(_delta(child, p), 0.7 * _delta(a, p)) < 1e-5 for p in lora_pairs(a))


def test_layer_gaussian_lists_its_layers_in_layer_order():
    # catches: the layers sorted as strings ("10" before "2")
    info = {}
    mutate("layer_gaussian", _adapter(0, layers=12), seed=0, info=info, fraction=1.0)
    assert info["mutated_layers"] == [str(i) for i in range(12)]


def test_apply_action_takes_one_state_dict_for_a_one_parent_action():
    # catches: a lone state dict taken for a mapping of members (its LoRA keys looked up as member ids), and an
    # unhelpful error when the count of state dicts is wrong
    population = Population.create(2, 2)
    ratings = make_ratings()
    for member in population.alive():
        ratings.add(member.id)
    cfg = EvolutionConfig(evolve_every=1, min_age=0, replace_fraction=0.5, operators={"M1": 1.0})
    action = plan_evolution(population, ratings, 1, cfg, seed=0)[0]
    a = _adapter(0)
    assert _same(apply_action(action, a)[0], apply_action(action, [a])[0])
    with pytest.raises(ValueError, match="action 'gaussian' names 1 parents, got 2 state dicts"):
        apply_action(action, [a, a])


def test_truncation_energy_per_module_names_the_worst_module():
    # catches: a module whose parents are all zero counted as wholly lost (untrained newborns have lora_B = 0),
    # and the worst module's name or energy not reported
    a = _adapter(0)
    zeroed = lora_pairs(a)[0]
    a[zeroed.b_key] = torch.zeros_like(a[zeroed.b_key])
    info = {}
    crossover("svd_mean", [a, a], seed=0, info=info)  # nothing lost anywhere (but rounding)
    assert info["truncation_energy"] < 1e-12 and info["max_module_truncation_energy"] < 1e-12
    assert info["worst_module"] in {""} | {p.module for p in lora_pairs(a)[1:]}
    b = _adapter(1)
    info = {}
    crossover("task_arithmetic", [a, b], seed=0, info=info)  # the sum of two rank-r deltas: rank 2r, truncated
    lost = {}
    for pair in lora_pairs(a):
        s2 = torch.linalg.svdvals(_delta(a, pair) + _delta(b, pair)).square()
        lost[pair.module] = 1 - float(s2[:RANK].sum() / s2.sum())
    worst = max(lost, key=lost.get)
    assert info["worst_module"] == worst
    assert info["max_module_truncation_energy"] == pytest.approx(lost[worst], abs=1e-5)
    assert 0 < info["truncation_energy"] < info["max_module_truncation_energy"]


def test_no_parents_is_refused_by_name():
    from openrlhf_populora.evolution.lowrank import check_adapters

    with pytest.raises(ValueError, match="no parent adapters given"):
        check_adapters([])


def test_malformed_parents_are_refused_saying_what_is_wrong():
    a = _adapter(0)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    with pytest.raises(ValueError, match=r"svd_fitness: need one finite fitness per parent, got \[1.0\]"):
        crossover("svd_fitness", [a, _adapter(1)], seed=0, fitness=[1.0])
    with pytest.raises(ValueError, match=f"module '{key}' has no lora_A weight"):
        mutate("gaussian", {k: v for k, v in a.items() if k != f"{key}.lora_A.weight"}, seed=0)
    with pytest.raises(ValueError, match=r"lora_A is \(4, 24\) but lora_B is \(32, 3\); expected A \(r x in\) and B"):
        mutate("gaussian", {**a, f"{key}.lora_B.weight": torch.zeros(32, 3)}, seed=0)
