"""N named LoRA adapters in one single-process DeepSpeed engine (gloo, ZeRO-2 and ZeRO-3, torch Adam):
routing, exact reads and writes of the fp32 masters, the evolution write (moments reset, low-precision copy
refreshed), and Adam drift on adapters that got no gradient -- measured, then removed by the snapshot."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.engines.ray import adapters_ds as A

# the tiny model's tests: fp32, every linear layer, seed 0 (Config's defaults: auto dtype, q/k/v/o, 42)
TEST_ENGINE = {"dtype": "fp32", "lora_target_modules": "all-linear", "seed": 0}


def engine_config(**overrides):
    """The local engine's config from Config's defaults (the one source), the tiny-model test defaults, then
    ``overrides``."""
    return local_engine_config(Config(), **{**TEST_ENGINE, **overrides})

NAMES = ["t0", "t1", "s0", "s1"]
LR, BETAS = 1e-2, (0.9, 0.95)
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def gloo():
    import deepspeed

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed("gloo")


def ds_config(stage: int, clip: float = 0.0) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1, "train_batch_size": 1, "gradient_clipping": clip,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
    }


def make_actor(model_dir, stage: int, names=NAMES, seed: int = 0, engine: bool = True):
    """OpenRLHF's Actor (one "default" adapter), re-adaptered to ``names``, wrapped in a DeepSpeed engine."""
    import deepspeed
    from openrlhf.models import Actor
    from openrlhf.utils.deepspeed.deepspeed_utils import get_optimizer_grouped_parameters

    cfg = ds_config(stage)
    actor = Actor(model_dir, attn_implementation="eager", param_dtype="bf16", lora_rank=4, lora_alpha=8,
                  target_modules="all-linear", ds_config=cfg)
    A.attach_adapters(actor, names, seed=seed)
    if engine:
        params = get_optimizer_grouped_parameters(actor.model, 0.0)
        actor.model, *_ = deepspeed.initialize(model=actor.model, model_parameters=params, config=cfg)
    return actor


SEQ = torch.tensor([[5, 17, 99, 3, 42, 7, 120, 64, 11, 200, 31, 8]])
MASK = torch.ones(1, 6, dtype=torch.bool)


def log_probs(actor, name):
    A.activate(actor, name)
    with torch.no_grad():
        return actor(SEQ, MASK, attention_mask=torch.ones_like(SEQ)).float()


def backward(actor, name):
    A.activate(actor, name)
    actor.model.backward(-actor(SEQ, MASK, attention_mask=torch.ones_like(SEQ)).float().mean())


def train_step(actor, name):
    backward(actor, name)
    actor.model.step()


def states(actor):
    return {n: A.adapter_state(actor, n) for n in NAMES}


def max_change(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def moments(actor, name):
    from deepspeed.utils import safe_get_full_optimizer_state

    return {k: {m: safe_get_full_optimizer_state(p, m).clone() for m in A.MOMENT_KEYS}
            for k, p in A.lora_parameters(actor, name).items()}


def test_attach_gives_exactly_the_names_reproducibly_per_seed_and_name(tiny_model_dir):
    a = make_actor(tiny_model_dir, 2, names=["t0", "t1", "s0"], seed=5, engine=False)
    b = make_actor(tiny_model_dir, 2, names=["s0", "t1"], seed=5, engine=False)
    c = make_actor(tiny_model_dir, 2, names=["t1"], seed=6, engine=False)
    assert A.adapter_names(a) == ["t0", "t1", "s0"] and A.adapter_names(b) == ["s0", "t1"]
    ta, tb, tc = A.adapter_state(a, "t1"), A.adapter_state(b, "t1"), A.adapter_state(c, "t1")
    assert list(ta) == list(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)  # order of creation is irrelevant
    assert any(not torch.equal(ta[k], tc[k]) for k in ta if "lora_A" in k)  # the seed matters
    assert not all(torch.equal(ta[k], A.adapter_state(a, "t0")[k]) for k in ta if "lora_A" in k)  # the name too
    assert all(k.startswith("base_model.model.") and (".lora_A.weight" in k or ".lora_B.weight" in k) for k in ta)
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in ta.values())
    assert all(p.requires_grad for n in ["t0", "t1", "s0"] for p in A.lora_parameters(a, n).values())
    with pytest.raises(ValueError):
        A.attach_adapters(a, ["x", "x"])


def test_keys_match_the_embedded_engine(tiny_model_dir):
    from openrlhf_populora.engines.local import LocalEngine

    local = LocalEngine(engine_config(model_name_or_path=tiny_model_dir, lora_rank=4, lora_alpha=8,
                                          lora_target_modules=["all-linear"], seed=3))
    local.add_adapter("t0")
    actor = make_actor(tiny_model_dir, 2, names=["t0"], seed=3, engine=False)
    ours, theirs = A.adapter_state(actor, "t0"), local.get_adapter("t0")
    assert list(ours) == list(theirs) and all(ours[k].shape == theirs[k].shape for k in ours)
    # the same init rule: equal up to the bf16 rounding of this Actor's LoRA weights
    assert all(torch.allclose(ours[k], theirs[k], rtol=1e-2, atol=1e-6) for k in ours)


@pytest.mark.parametrize("stage", [2, 3])
def test_backward_on_one_adapter_gives_gradient_only_to_it(tiny_model_dir, stage):
    actor = make_actor(tiny_model_dir, stage)
    backward(actor, "t1")
    norms = {n: A.adapter_grad_norm(actor, n) for n in NAMES}
    assert norms["t1"] > 0 and all(norms[n] == 0.0 for n in NAMES if n != "t1"), norms
    actor.model.step()
    assert A.active_adapter(actor) == "t1"
    assert all(p.requires_grad for n in NAMES for p in A.lora_parameters(actor, n).values())


@pytest.mark.parametrize("stage", [2, 3])
def test_round_trip_and_low_precision_copy(tiny_model_dir, stage):
    actor = make_actor(tiny_model_dir, stage)
    train_step(actor, "t0")  # moments exist now
    gen = torch.Generator().manual_seed(0)
    new = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in A.adapter_state(actor, "s0").items()}
    A.write_adapter(actor, "s0", new)
    back = A.adapter_state(actor, "s0")
    assert all(torch.equal(back[k], new[k]) for k in new)  # exact: the fp32 master holds the written values
    # the forward pass (bf16 copy) sees the write at once: s1 := t0's tensors gives t0's log-probs
    A.write_adapter(actor, "s1", A.adapter_state(actor, "t0"))
    assert torch.equal(log_probs(actor, "s1"), log_probs(actor, "t0"))
    assert not torch.equal(log_probs(actor, "s0"), log_probs(actor, "t0"))


@pytest.mark.parametrize("stage", [2, 3])
def test_write_and_a_reset_step_count_give_a_fresh_adams_first_step(tiny_model_dir, stage):
    """Evolution's reset: the written values, zero moments, and (set_adam_step(0)) the bias correction of a first
    step. Without the step-count reset the child's first update would be ~0.73x a fresh Adam's here (t = 3)."""
    from deepspeed.utils import safe_get_full_grad

    actor = make_actor(tiny_model_dir, stage)
    for _ in range(2):
        train_step(actor, "t1")  # t1 has non-zero moments
    assert any(v["exp_avg"].abs().sum() > 0 for v in moments(actor, "t1").values())
    gen = torch.Generator().manual_seed(1)
    new = {k: v + torch.randn(v.shape, generator=gen) * 0.05 for k, v in A.adapter_state(actor, "t1").items()}
    A.write_adapter(actor, "t1", new)
    assert all(m.abs().sum() == 0 for v in moments(actor, "t1").values() for m in v.values())
    assert A.adam_steps(actor.model) == {2}
    A.set_adam_step(actor.model, 0)
    backward(actor, "t1")
    params = A.lora_parameters(actor, "t1")
    grads = {k: safe_get_full_grad(p).float().reshape(new[k].shape).clone() for k, p in params.items()}
    actor.model.step()
    after, mom = A.adapter_state(actor, "t1"), moments(actor, "t1")
    assert A.adam_steps(actor.model) == {1}
    t = 1  # a fresh Adam: the first step's bias correction
    scale = LR * ((1 - BETAS[0]) / (1 - BETAS[0] ** t)) / ((1 - BETAS[1]) / (1 - BETAS[1] ** t)) ** 0.5
    for k in new:
        g = grads[k]
        assert torch.allclose(mom[k]["exp_avg"].reshape(g.shape), (1 - BETAS[0]) * g, rtol=1e-5, atol=1e-10)
        assert torch.allclose(mom[k]["exp_avg_sq"].reshape(g.shape), (1 - BETAS[1]) * g * g, rtol=1e-5, atol=1e-14)
        big = g.abs() > 1e-4  # where eps is negligible, one Adam step from zero moments is +-scale
        assert big.any()
        assert torch.allclose((after[k] - new[k])[big], -scale * g.sign()[big], rtol=1e-3, atol=1e-7)


def test_write_rejects_wrong_keys_and_shapes(tiny_model_dir):
    actor = make_actor(tiny_model_dir, 2)
    good = A.adapter_state(actor, "t0")
    with pytest.raises(ValueError, match="missing"):
        A.write_adapter(actor, "t0", dict(list(good.items())[1:]))
    with pytest.raises(ValueError, match="unexpected"):
        A.write_adapter(actor, "t0", {**good, "base_model.model.extra.lora_A.weight": torch.zeros(1)})
    key = next(iter(good))
    with pytest.raises(ValueError, match="shape"):
        A.write_adapter(actor, "t0", {**good, key: torch.zeros(3, 3)})
    with pytest.raises(KeyError, match="unknown adapter"):
        A.write_adapter(actor, "nope", good)


@pytest.mark.parametrize("stage", [2, 3])
def test_adam_drift_on_absent_adapters_measured_and_removed_by_snapshot(tiny_model_dir, stage, capsys):
    actor = make_actor(tiny_model_dir, stage)
    train_step(actor, "t0")  # t0 now has Adam state
    before = states(actor)
    train_step(actor, "t1")  # no gradient for t0
    drift = max_change(states(actor)["t0"], before["t0"])
    assert drift > 1e-4, "expected Adam drift on an adapter without gradient (the problem being mitigated)"
    with capsys.disabled():
        print(f"\n[measured] ZeRO-{stage}: one step without gradient moved adapter t0 by up to {drift:.4g} "
              f"(lr {LR})")
    # mitigation: snapshot the absent adapters before the step, restore after it
    before, mom_before = states(actor), moments(actor, "t0")
    backward(actor, "t1")
    snap = A.AdapterSnapshot(actor, ["t0", "s0", "s1"])
    actor.model.step()
    snap.restore()
    after, mom_after = states(actor), moments(actor, "t0")
    for n in ["t0", "s0", "s1"]:
        assert all(torch.equal(after[n][k], before[n][k]) for k in after[n]), n
    assert all(torch.equal(mom_after[k][m], mom_before[k][m]) for k in mom_after for m in A.MOMENT_KEYS)
    assert max_change(after["t1"], before["t1"]) > 0  # the present adapter trained
    # the bf16 copy is restored too: t0's forward equals a fresh write of its fp32 tensors into s1
    A.write_adapter(actor, "s1", after["t0"])
    assert torch.equal(log_probs(actor, "t0"), log_probs(actor, "s1"))


def test_zero3_keeps_stale_gradients_and_clearing_them_works(tiny_model_dir):
    actor = make_actor(tiny_model_dir, 3)
    train_step(actor, "t0")
    backward(actor, "t1")
    assert A.adapter_grad_norm(actor, "t0") > 0  # DeepSpeed's ZeRO-3 still holds t0's gradient of the last step
    actor.model.step()
    A.clear_stale_grads(actor, NAMES)
    backward(actor, "t1")
    assert A.adapter_grad_norm(actor, "t0") == 0.0 and A.adapter_grad_norm(actor, "t1") > 0
    snap = A.AdapterSnapshot(actor, ["t0", "s0", "s1"])
    before = states(actor)
    actor.model.step()
    snap.restore()
    after = states(actor)
    assert all(torch.equal(after["t0"][k], before["t0"][k]) for k in before["t0"])
    A.clear_stale_grads(actor, NAMES)  # also a no-op-safe call on ZeRO-2 models
    A.clear_stale_grads(make_actor(tiny_model_dir, 2), NAMES)


def test_zero3_clearing_stale_gradients_makes_no_tensor_and_no_copy(tiny_model_dir, monkeypatch):
    """clear_stale_grads runs after every window on every LoRA tensor of every adapter (100,000 tensors a step
    at N = 16 on a 7B model). It must zero the gradient partitions where they are: no tensor made, none copied.
    Catches the full-size host zeros tensor per LoRA tensor that DeepSpeed's setter then copies to the device
    (the calls are counted, so the CPU shows what a GPU would pay for); the partitions still end up zero."""
    from collections import Counter

    actor = make_actor(tiny_model_dir, 3)
    train_step(actor, "t0")
    backward(actor, "t1")
    actor.model.step()
    assert A.adapter_grad_norm(actor, "t0") > 0 and A.adapter_grad_norm(actor, "t1") > 0  # stale, both
    calls: Counter = Counter()

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    with monkeypatch.context() as patch:
        for name in ("zeros", "zeros_like", "empty", "empty_like", "full", "ones", "tensor"):
            patch.setattr(torch, name, counted(f"torch.{name}", getattr(torch, name)))
        for name in ("copy_", "to", "clone", "cpu", "cuda"):
            patch.setattr(torch.Tensor, name, counted(f"Tensor.{name}", getattr(torch.Tensor, name)))
        A.clear_stale_grads(actor, NAMES)
    tensors = sum(len(A.lora_parameters(actor, n)) for n in NAMES)
    assert calls == Counter(), f"{dict(calls)} for {tensors} LoRA tensors"
    assert all(A.adapter_grad_norm(actor, n) == 0.0 for n in NAMES)


def test_keeping_the_name_default_reinitialises_it_by_the_same_rule(tiny_model_dir):
    a = make_actor(tiny_model_dir, 2, names=["default", "x"], seed=5, engine=False)
    b = make_actor(tiny_model_dir, 2, names=["x", "default"], seed=5, engine=False)
    c = make_actor(tiny_model_dir, 2, names=["x"], seed=5, engine=False)
    assert A.adapter_names(a) == ["default", "x"] and A.adapter_names(c) == ["x"]
    assert all(torch.equal(u, v) for u, v in zip(A.adapter_state(a, "default").values(),
                                                 A.adapter_state(b, "default").values(), strict=True))
    assert all(torch.equal(u, v) for u, v in zip(A.adapter_state(a, "x").values(),
                                                 A.adapter_state(c, "x").values(), strict=True))


@pytest.mark.parametrize("stage", [2, 3])
def test_all_in_graph_routing_is_bit_identical_and_gives_others_zero_gradients(tiny_model_dir, stage):
    actor = make_actor(tiny_model_dir, stage)
    gen = torch.Generator().manual_seed(2)
    for name in NAMES:
        state = A.adapter_state(actor, name)
        A.write_adapter(actor, name, {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in state.items()})
    alone = {n: log_probs(actor, n) for n in NAMES}
    for name in NAMES:
        A.activate(actor, name, all_in_graph=True)
        assert A.active_adapter(actor) == name
        with torch.no_grad():
            routed = actor(SEQ, MASK, attention_mask=torch.ones_like(SEQ)).float()
        assert torch.equal(routed, alone[name]), name
    A.activate(actor, "s0", all_in_graph=True)
    actor.model.backward(-actor(SEQ, MASK, attention_mask=torch.ones_like(SEQ)).float().mean())
    norms = {n: A.adapter_grad_norm(actor, n) for n in NAMES}
    assert norms["s0"] > 0 and all(norms[n] == 0.0 for n in NAMES if n != "s0"), norms
    actor.model.step()
    assert torch.equal(log_probs(actor, "t0"), alone["t0"])  # back to plain routing: scalings restored


@pytest.mark.parametrize("stage", [2, 3])
def test_base_routing_scores_the_frozen_base_and_restores_the_adapters(tiny_model_dir, stage):
    """BASE_ADAPTER (the learning probe's base log-probs on the Ray engine) gives exactly what a fresh (B = 0)
    adapter gives, with every adapter moved; the next activation routes through its adapter again. Catches
    the base scored through the last active adapter and scalings left at zero afterwards."""
    from openrlhf_populora.engines.base import BASE_ADAPTER

    actor = make_actor(tiny_model_dir, stage, names=[*NAMES, "fresh"])
    fresh = log_probs(actor, "fresh")
    gen = torch.Generator().manual_seed(3)
    for name in NAMES:
        state = A.adapter_state(actor, name)
        A.write_adapter(actor, name, {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in state.items()})
    before = log_probs(actor, "t0")
    assert torch.equal(log_probs(actor, BASE_ADAPTER), fresh)
    assert not torch.equal(before, fresh)
    assert torch.equal(log_probs(actor, "t0"), before)
