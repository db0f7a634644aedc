"""The embedded engine on the tiny random model: generation, training, adapter I/O, state."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.engines.base import BASE_ADAPTER, Engine, GenerationRequest, SamplingParams, Trajectory
from openrlhf_populora.engines.local import LocalEngine, native_policy_loss
from openrlhf_populora.models.tiny import build_tiny_model

# the tiny model's tests: fp32, every linear layer, seed 0 (Config's defaults: auto dtype, q/k/v/o, 42)
TEST_ENGINE = {"dtype": "fp32", "lora_target_modules": "all-linear", "seed": 0}


def engine_config(**overrides):
    """The local engine's config from Config's defaults (the one source), the tiny-model test defaults, then
    ``overrides``."""
    return local_engine_config(Config(), **{**TEST_ENGINE, **overrides})

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def make_engine(adapters=("t0", "t1", "s0"), randomize=True, **overrides) -> LocalEngine:
    """Tiny-model engine; ``randomize`` gives every adapter random non-zero B so adapters differ."""
    model, tokenizer = build_tiny_model(seed=0)
    settings = {"lr": 1e-2, "policy_loss": "native", "micro_batch_size": 4, **overrides}
    config = engine_config(**settings)
    engine = LocalEngine(config, model, tokenizer)
    gen = torch.Generator().manual_seed(123)
    for name in adapters:
        engine.add_adapter(name)
        if randomize:
            weights = engine.get_adapter(name)
            engine.set_adapter(name, {k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in weights.items()})
    return engine


def prompts(engine: LocalEngine, k: int = 4) -> list[str]:
    return [engine.render_prompt(f"task {i}: " + "x" * (3 * i)) for i in range(k)]


def trajectories(engine: LocalEngine, adapters, advantages=(1.0, -0.5, 0.25)) -> list[Trajectory]:
    """Deterministic scored trajectories (sampled once with a fixed seed)."""
    reqs = [GenerationRequest(a, p, n=2) for a in adapters for p in prompts(engine, 3)]
    outs = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=10, seed=7))
    flat = [c for group in outs for c in group]
    return [Trajectory(c.adapter, c.prompt_ids, c.response_ids, advantages[i % len(advantages)])
            for i, c in enumerate(flat)]


def snapshot(engine: LocalEngine, name: str):
    opt = engine._optimizers[name].state_dict()
    state = {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()}
             for k, v in opt["state"].items()}
    return engine.get_adapter(name), state


def same_snapshot(a, b) -> bool:
    (wa, sa), (wb, sb) = a, b
    weights = set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    states = set(sa) == set(sb) and all(
        torch.equal(sa[i][k], sb[i][k]) if torch.is_tensor(sa[i][k]) else sa[i][k] == sb[i][k]
        for i in sa for k in sa[i]
    )
    return weights and states


def test_engine_satisfies_protocol():
    engine = make_engine(adapters=("t0",))
    assert isinstance(engine, Engine)
    assert engine.adapter_names() == ["t0"]


def test_adapter_isolation():
    engine = make_engine()
    engine.train_step(trajectories(engine, ["t0", "t1", "s0"]))  # every adapter now has Adam state
    before = {name: snapshot(engine, name) for name in engine.adapter_names()}
    stats = engine.train_step(trajectories(engine, ["t0"]))
    assert set(stats) == {"t0"}
    assert same_snapshot(snapshot(engine, "t1"), before["t1"])
    assert same_snapshot(snapshot(engine, "s0"), before["s0"])
    assert not same_snapshot(snapshot(engine, "t0"), before["t0"])


def test_mixed_batch_generation_equals_per_adapter_generation():
    engine = make_engine()
    names = ["t0", "t1", "s0", BASE_ADAPTER]
    reqs = [GenerationRequest(names[i % 4], p, n=2) for i, p in enumerate(prompts(engine, 8))]
    mixed = engine.generate(reqs, GREEDY)
    for req, group in zip(reqs, mixed, strict=True):
        alone = engine.generate([req], GREEDY)[0]
        assert [c.response_ids for c in alone] == [c.response_ids for c in group]
        assert all(c.adapter == req.adapter for c in group)
    # the adapters really differ, so the equality above is not trivial
    p = prompts(engine, 1)[0]
    outs = engine.generate([GenerationRequest(a, p) for a in names], GREEDY)
    assert len({tuple(o[0].response_ids) for o in outs}) == 4


def test_mixed_lora_forward_equals_peft_own_forward_per_adapter():
    """Each row of a mixed batch gets exactly the logits peft computes with that adapter active (or disabled)."""
    from openrlhf_populora.engines.local.lora import MixedLoRA

    engine = make_engine()
    names = ["t0", BASE_ADAPTER, "s0", "t1"]
    ids = torch.tensor([engine.encode(p)[:9] for p in prompts(engine, 4)])
    with torch.no_grad(), MixedLoRA(engine.peft, engine.adapter_names()) as mixer:
        mixer.set_rows(names)
        mixed = engine.peft(input_ids=ids).logits
    for row, name in enumerate(names):
        with torch.no_grad():
            if name == BASE_ADAPTER:
                with engine.peft.disable_adapter():
                    own = engine.peft(input_ids=ids[row : row + 1]).logits
            else:
                engine.peft.set_adapter(name)
                own = engine.peft(input_ids=ids[row : row + 1]).logits
        torch.testing.assert_close(mixed[row : row + 1], own, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mixed[0], mixed[1], atol=1e-3)  # the adapters change the logits


def test_seeded_sampling_is_reproducible_and_independent_of_batching():
    engine = make_engine(generation_batch_size=3)
    reqs = [GenerationRequest(a, p, n=3) for a, p in zip(["t0", "t1", "s0", "t0"], prompts(engine), strict=True)]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=11)
    first = engine.generate(reqs, params)
    again = engine.generate(reqs, params)
    assert [[c.response_ids for c in g] for g in first] == [[c.response_ids for c in g] for g in again]
    one_by_one = [engine.generate([r], params)[0] for r in reqs]
    # request i keeps its seed stream only when it keeps its index, so compare the first request alone
    assert [c.response_ids for c in one_by_one[0]] == [c.response_ids for c in first[0]]
    other = engine.generate(reqs, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, seed=12))
    assert [[c.response_ids for c in g] for g in other] != [[c.response_ids for c in g] for g in first]
    # the n samples of one request differ from each other
    assert len({tuple(c.response_ids) for c in first[0]}) > 1


def test_unseeded_generation_is_reproducible_from_the_engine_seed():
    a, b = make_engine(), make_engine()
    reqs = [GenerationRequest("t0", p, n=2) for p in prompts(a, 2)]
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    out_a = [a.generate(reqs, params) for _ in range(2)]
    out_b = [b.generate(reqs, params) for _ in range(2)]
    ids = [[[c.response_ids for c in g] for g in call] for call in out_a]
    assert ids == [[[c.response_ids for c in g] for g in call] for call in out_b]
    assert ids[0] != ids[1]  # successive calls draw fresh seeds


def test_generation_stops_at_eos_and_reports_it():
    engine = make_engine(adapters=("t0",))
    req = GenerationRequest("t0", prompts(engine, 1)[0])
    long = engine.generate([req], GREEDY)[0][0]
    assert not long.finished and len(long.response_ids) == GREEDY.max_new_tokens
    stop = long.response_ids[4]
    engine.stop_ids = {stop}  # pretend that token is EOS: the real stop logic must cut there
    cut = engine.generate([req], GREEDY)[0][0]
    first = long.response_ids.index(stop)
    assert cut.finished and cut.response_ids == long.response_ids[: first + 1]
    assert cut.text == engine.tokenizer.decode(cut.response_ids, skip_special_tokens=True)


def test_set_adapter_resets_optimizer_state():
    engine = make_engine()
    batch = trajectories(engine, ["t0"])
    engine.train_step(batch)
    assert engine._optimizers["t0"].state  # Adam moments exist
    weights = engine.get_adapter("t0")
    engine.set_adapter("t0", weights)
    assert not engine._optimizers["t0"].state
    # the next step equals a step from a fresh adapter holding the same weights
    fresh = make_engine(adapters=("t0",), randomize=False)
    fresh.set_adapter("t0", weights)
    assert engine.train_step(batch) == fresh.train_step(batch)
    assert same_snapshot(snapshot(engine, "t0"), snapshot(fresh, "t0"))


def test_fresh_adapter_init_depends_on_name_not_order():
    a = make_engine(adapters=("x", "y"), randomize=False)
    b = make_engine(adapters=("y", "x"), randomize=False)
    for name in ("x", "y"):
        wa, wb = a.get_adapter(name), b.get_adapter(name)
        assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(*(next(iter(a.get_adapter(n).values())) for n in ("x", "y")))


def test_save_adapter_loads_with_peft_and_gives_the_same_logits(tmp_path):
    from peft import PeftModel

    engine = make_engine()
    engine.save_adapter("t1", str(tmp_path / "t1"))
    assert (tmp_path / "t1" / "adapter_config.json").is_file()
    assert (tmp_path / "t1" / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(build_tiny_model(seed=0)[0], str(tmp_path / "t1")).eval()
    ids = torch.tensor([engine.encode(prompts(engine, 1)[0])])
    with torch.no_grad():
        expected = engine.peft(input_ids=ids, adapter_names=["t1"]).logits
        got = loaded(input_ids=ids).logits
        base = engine.peft(input_ids=ids, adapter_names=[BASE_ADAPTER]).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(got, base, atol=1e-3)


def test_save_and_load_state_resume_exactly(tmp_path):
    a = make_engine()
    batch1, batch2 = trajectories(a, ["t0", "t1"]), trajectories(a, ["t0", "s0"], advantages=(-1.0, 0.5))
    a.train_step(batch1)
    a.generate([GenerationRequest("t0", "hi")], SamplingParams(max_new_tokens=2))
    a.save_state(str(tmp_path / "ckpt"))
    stats_a = a.train_step(batch2)
    gen_a = a.generate([GenerationRequest("s0", "hi", n=2)], SamplingParams(max_new_tokens=6))

    b = make_engine(adapters=("t0", "zz"))  # "zz" is not in the state: removed; t1, s0 are created
    b.load_state(str(tmp_path / "ckpt"))
    assert b.adapter_names() == ["t0", "t1", "s0"]
    stats_b = b.train_step(batch2)
    gen_b = b.generate([GenerationRequest("s0", "hi", n=2)], SamplingParams(max_new_tokens=6))
    assert stats_a == stats_b
    for name in a.adapter_names():
        assert same_snapshot(snapshot(a, name), snapshot(b, name))
    assert [c.response_ids for c in gen_a[0]] == [c.response_ids for c in gen_b[0]]


def test_positive_advantage_increases_log_prob_and_negative_decreases_it():
    engine = make_engine(adapters=("t0", "t1"))
    prompt_ids = engine.encode(prompts(engine, 1)[0])
    response = engine.encode("def f(x):\n    return x")
    up, down = Trajectory("t0", prompt_ids, response, 1.0), Trajectory("t1", prompt_ids, response, -1.0)
    before = engine.response_log_probs([up, down])
    stats = engine.train_step([up, down])
    after = engine.response_log_probs([up, down])
    assert after[0] > before[0] and after[1] < before[1]
    assert stats["t0"]["num_tokens"] == len(response) and stats["t0"]["clip_ratio"] == 0.0
    assert stats["t0"]["grad_norm"] > 0 and stats["t0"]["entropy"] > 0


def test_micro_batching_does_not_change_the_update():
    batches = []
    for micro in (1, 8):
        engine = make_engine(micro_batch_size=micro)
        stats = engine.train_step(trajectories(engine, ["t0"]))
        batches.append((stats["t0"], engine.get_adapter("t0")))
    (s1, w1), (s8, w8) = batches
    assert s1["loss"] == pytest.approx(s8["loss"], abs=1e-5)
    assert s1["grad_norm"] == pytest.approx(s8["grad_norm"], rel=1e-4)
    for k in w1:  # Adam's first step is ~lr * sign(grad): allow rounding on near-zero gradients
        torch.testing.assert_close(w1[k], w8[k], rtol=1e-3, atol=1e-4)


def test_reusing_the_update_pass_as_old_log_probs_is_exact_without_dropout():
    results = []
    for mode in ("auto", "recompute"):
        engine = make_engine(old_logprobs=mode)
        batch = trajectories(engine, ["t0", "s0"])
        results.append((engine.train_step(batch), engine.train_step(batch), snapshot(engine, "t0")))
    assert results[0][:2] == results[1][:2]
    assert same_snapshot(results[0][2], results[1][2])


def test_lora_dropout_trains_with_recomputed_old_log_probs():
    engine = make_engine(adapters=("t0",), lora_dropout=0.3)
    before = engine.get_adapter("t0")
    stats = engine.train_step(trajectories(engine, ["t0"]))["t0"]
    assert 0.0 <= stats["clip_ratio"] <= 1.0 and stats["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in engine.get_adapter("t0").items())


def test_epochs_reuse_the_sampling_policy_as_old_so_the_clip_acts():
    """--train.max_epochs 2: two updates per adapter per step against the log-probs of the policy that sampled
    the trajectories. An engine that recomputed ``old`` before each epoch would equal two one-epoch steps bit for
    bit, with a clip that never acts."""
    epochs = make_engine(adapters=("t0", "s0"), max_epochs=2, lr=5e-2)
    batch = trajectories(epochs, ["t0", "s0"])
    stepwise = make_engine(adapters=("t0", "s0"), max_epochs=1, lr=5e-2)
    stats = epochs.train_step(batch)
    first = stepwise.train_step(batch)
    stepwise.train_step(batch)
    assert epochs.updates == stepwise.updates == 2
    assert stats["t0"]["updates"] == 2.0 and first["t0"]["updates"] == 1.0
    for name in ("t0", "s0"):
        adam_steps = {int(v["step"]) for v in snapshot(epochs, name)[1].values()}
        assert adam_steps == {2}
        assert first[name]["clip_ratio"] == 0.0  # one update: the ratio is exactly 1
        assert stats[name]["clip_ratio"] > 0.0  # the second epoch's ratio moved past 1 +- 0.2
        assert not same_snapshot(snapshot(epochs, name), snapshot(stepwise, name))


def test_one_epoch_is_the_single_update():
    """max_epochs 1 must stay exactly the one-update step (same weights, Adam state and stats)."""
    a, b = make_engine(max_epochs=1), make_engine()
    batch = trajectories(a, ["t0", "t1"])
    assert a.train_step(batch) == b.train_step(batch)
    assert all(same_snapshot(snapshot(a, n), snapshot(b, n)) for n in ("t0", "t1"))


def test_native_policy_loss_clips_like_ppo():
    logp = torch.tensor([[0.0, 0.5, -0.5]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, clipped = native_policy_loss(logp, old, torch.ones(1, 3), mask, 2.0, 0.2, 0.2)
    # token 0: ratio 1 -> -1; token 1: ratio e^0.5 clipped to 1.2 -> -1.2; token 2 masked
    assert loss.item() == pytest.approx(-(1.0 + 1.2) / 2)
    assert clipped.item() == 1.0


def _import_openrlhf_policy_loss(monkeypatch):
    """OpenRLHF's PolicyLoss; stubs ``flash_attn`` (a CUDA-only import-time dependency) when missing."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        from importlib.machinery import ModuleSpec

        stub = types.ModuleType("flash_attn")
        stub.__spec__ = ModuleSpec("flash_attn", None)  # transformers calls find_spec("flash_attn")
        padding = types.ModuleType("flash_attn.bert_padding")
        for fn in ("index_first_axis", "pad_input", "unpad_input"):
            setattr(padding, fn, lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("flash_attn stub")))
        from einops import rearrange

        padding.rearrange = rearrange
        utils, dist = types.ModuleType("flash_attn.utils"), types.ModuleType("flash_attn.utils.distributed")
        dist.all_gather = padding.pad_input
        for name, module in [("flash_attn", stub), ("flash_attn.bert_padding", padding),
                             ("flash_attn.utils", utils), ("flash_attn.utils.distributed", dist)]:
            monkeypatch.setitem(sys.modules, name, module)
    from openrlhf.models.loss import PolicyLoss

    return PolicyLoss


@pytest.mark.slow
def test_openrlhf_policy_loss_gives_the_same_loss_and_step(monkeypatch):
    import openrlhf_populora.engines.local.training as local

    policy_loss_cls = _import_openrlhf_policy_loss(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    logp, old = torch.randn(3, 5, generator=gen) * 0.3, torch.randn(3, 5, generator=gen) * 0.3
    adv = torch.randn(3, 1, generator=gen).expand(3, 5)
    mask = (torch.rand(3, 5, generator=gen) > 0.3).float()
    ours, clipped = native_policy_loss(logp, old, adv, mask, 11.0, 0.2, 0.28)
    theirs, clip_ratio, *_ = policy_loss_cls(0.2, 0.28)(logp, old, adv, action_mask=mask, batch_num_tokens=11.0)
    torch.testing.assert_close(ours, theirs)
    assert clipped.item() == pytest.approx((clip_ratio * mask.sum()).item())

    monkeypatch.setattr(local, "_OPENRLHF_POLICY_LOSS", [policy_loss_cls])
    engines = [make_engine(policy_loss=choice) for choice in ("native", "openrlhf")]
    assert engines[1].policy_loss_source == "openrlhf"
    batch = trajectories(engines[0], ["t0", "s0"])
    native_stats, openrlhf_stats = (e.train_step(batch) for e in engines)
    for name in native_stats:
        for key, value in native_stats[name].items():
            assert openrlhf_stats[name][key] == pytest.approx(value, rel=1e-6, abs=1e-7)


def test_remove_adapter_and_bad_inputs():
    engine = make_engine()
    engine.remove_adapter("t1")
    assert engine.adapter_names() == ["t0", "s0"]
    with pytest.raises(KeyError, match="unknown adapter 't1'"):
        engine.generate([GenerationRequest("t1", "hi")], GREEDY)
    with pytest.raises(ValueError, match="already exists"):
        engine.add_adapter("t0")
    for bad in ("", "a.b", BASE_ADAPTER):
        with pytest.raises(ValueError, match="invalid adapter name"):
            engine.add_adapter(bad)
    with pytest.raises(ValueError, match="sampling params"):
        engine.generate([GenerationRequest("t0", "hi")], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="keys do not match"):
        engine.set_adapter("t0", {"nope": torch.zeros(1)})
    weights = engine.get_adapter("t0")
    key = next(iter(weights))
    with pytest.raises(ValueError, match="has shape"):
        engine.set_adapter("t0", {**weights, key: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="empty prompt or response"):
        engine.train_step([Trajectory("t0", [1, 2], [], 1.0)])
    with pytest.raises(ValueError, match="non-finite advantage"):
        engine.train_step([Trajectory("t0", [1, 2], [3], float("nan"))])
    with pytest.raises(ValueError, match="dtype"):
        engine_config(dtype="fp8").validate()
    # removing every adapter leaves a working base model
    engine.remove_adapter("t0")
    engine.remove_adapter("s0")
    out = engine.generate([GenerationRequest(BASE_ADAPTER, "hi")], GREEDY)
    assert len(out[0][0].response_ids) == GREEDY.max_new_tokens
    engine.add_adapter("new")
    assert engine.adapter_names() == ["new"]


def test_target_modules_as_openrlhf_gives_them():
    listed = make_engine(adapters=("t0",), randomize=False, lora_target_modules=["all-linear"])
    named = make_engine(adapters=("t0",), randomize=False, lora_target_modules=["q_proj", "v_proj"])
    assert len(listed.get_adapter("t0")) == 2 * 2 * 7  # 2 layers x 7 projections x (A, B)
    assert set(named.get_adapter("t0")) == {k for k in listed.get_adapter("t0") if "q_proj" in k or "v_proj" in k}


def test_bf16_base_trains_fp32_adapters():
    engine = make_engine(adapters=("t0",), dtype="bf16")
    assert next(engine.base.parameters()).dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in engine._adapters["t0"].values())
    before = engine.get_adapter("t0")
    stats = engine.train_step(trajectories(engine, ["t0"]))
    assert torch.isfinite(torch.tensor(stats["t0"]["loss"]))
    after = engine.get_adapter("t0")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_lr_factor_follows_openrlhf_schedules():
    from openrlhf_populora.engines.local import lr_factor

    assert [lr_factor("constant", u, 0, 10, 0.1) for u in (0, 5, 20)] == [1.0, 1.0, 1.0]
    assert [lr_factor("constant", u, 2, 10, 0.1) for u in (0, 1, 2)] == [0.0, 0.5, 1.0]  # linear warm-up
    # cosine from 1 at the end of warm-up (update 2) to min_ratio at update 10; halfway (6) is the midpoint
    cosine = [lr_factor("cosine_with_min_lr", u, 2, 10, 0.1) for u in (2, 6, 10, 50)]
    assert cosine == pytest.approx([1.0, 0.55, 0.1, 0.1])


def test_train_steps_follow_the_schedule_and_resume_on_it(tmp_path):
    engine = make_engine(adapters=("t0", "s0"), lr_scheduler="cosine_with_min_lr", lr_warmup_steps=1,
                         lr_total_steps=3, min_lr_ratio=0.0)
    batch = trajectories(engine, ["t0"])
    first = engine.train_step(batch)["t0"]["lr"]  # update 0: warm-up starts at 0
    second = engine.train_step(batch)["t0"]["lr"]  # update 1: end of warm-up, the peak
    assert (first, second) == (0.0, pytest.approx(1e-2))
    engine.save_state(str(tmp_path / "state"))
    third = engine.train_step(batch)["t0"]["lr"]  # update 2: cosine halfway to 0
    assert third == pytest.approx(0.5e-2)
    resumed = make_engine(adapters=("t0", "s0"), lr_scheduler="cosine_with_min_lr", lr_warmup_steps=1,
                          lr_total_steps=3, min_lr_ratio=0.0)
    resumed.load_state(str(tmp_path / "state"))
    assert resumed.updates == 2
    assert resumed.train_step(batch)["t0"]["lr"] == pytest.approx(third)
    with pytest.raises(ValueError, match="lr_scheduler"):
        engine_config(lr_scheduler="exponential").validate()


# ----------------------------------------------------------------------------------------- prefill sharing


def _count_prefills(monkeypatch) -> list:
    """Record every prompt the engine prefills (wrapping, not replacing, the real prefill)."""
    import openrlhf_populora.engines.local.generation as generation

    seen, real = [], generation.prefill

    def counting(forward, prompt, adapter, device):
        seen.append((adapter, tuple(prompt)))
        return real(forward, prompt, adapter, device)

    monkeypatch.setattr(generation, "prefill", counting)
    return seen


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_new_tokens=14),
                                    SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=14, seed=3)],
                         ids=["greedy", "seeded"])
def test_shared_prefill_gives_the_tokens_of_prefilling_every_row_alone(params, monkeypatch):
    shared, alone = make_engine(), make_engine(share_prefill=False)
    names = ["t0", "t1", BASE_ADAPTER, "s0", "t0"]
    reqs = [GenerationRequest(names[i], p, n=3) for i, p in enumerate(prompts(shared, 5))]
    reqs.append(GenerationRequest("t1", reqs[0].prompt, n=2))  # same prompt, another adapter: not shared
    seen = _count_prefills(monkeypatch)
    out_shared = shared.generate(reqs, params)
    assert len(seen) == len(reqs)  # one prefill per distinct (adapter, prompt)
    seen.clear()
    out_alone = alone.generate(reqs, params)
    assert len(seen) == sum(r.n for r in reqs)
    assert [[c.response_ids for c in g] for g in out_shared] == [[c.response_ids for c in g] for g in out_alone]
    if params.temperature > 0:  # the samples sharing a prefill still draw their own tokens
        assert all(len({tuple(c.response_ids) for c in g}) > 1 for g in out_shared)


def test_generation_matches_plain_transformers_decoding_row_by_row():
    """Greedy tokens of a mixed, padded batch equal peft + transformers' own generate() on each row alone."""
    engine = make_engine()
    names = ["t0", BASE_ADAPTER, "s0", "t1", "t0"]
    reqs = [GenerationRequest(names[i], p) for i, p in enumerate(prompts(engine, 5))]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    out = engine.generate(reqs, params)
    eos = engine.tokenizer.eos_token_id
    for req, group in zip(reqs, out, strict=True):
        ids = torch.tensor([engine.encode(req.prompt)])
        with torch.no_grad():
            if req.adapter == BASE_ADAPTER:
                with engine.peft.disable_adapter():
                    ref = engine.peft.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
            else:
                engine.peft.set_adapter(req.adapter)
                ref = engine.peft.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
        expected = ref[0, ids.shape[1]:].tolist()
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert group[0].response_ids == expected
    assert len({tuple(g[0].response_ids) for g in out}) > 1


def test_decode_attention_equals_sdpa_with_padding_and_grouped_heads():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from openrlhf_populora.engines.local.attention import decode_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 1, 16, generator=gen)
    k, v = torch.randn(3, 2, 10, 16, generator=gen), torch.randn(3, 2, 10, 16, generator=gen)
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False  # left padding of different widths
    mask[2, ..., :1] = False
    module = types.SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    for m in (mask, None):
        ours, _ = decode_attention(module, q, k, v, m, scaling=0.25)
        theirs, _ = sdpa_attention_forward(module, q, k, v, m, scaling=0.25)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_engine_decodes_with_grouped_query_matmuls_and_the_same_tokens():
    model, tokenizer = build_tiny_model(seed=0)
    model.set_attn_implementation("sdpa")  # the tiny model is built eager
    fast = LocalEngine(engine_config(policy_loss="native"), model, tokenizer)
    assert fast.decode_attention and fast.base.config._attn_implementation == "populora_sdpa"
    eager = make_engine(adapters=())
    assert not eager.decode_attention
    reqs = [GenerationRequest(BASE_ADAPTER, p, n=2) for p in prompts(eager, 4)]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    assert [[c.response_ids for c in g] for g in fast.generate(reqs, params)] == \
        [[c.response_ids for c in g] for g in eager.generate(reqs, params)]


def test_top_p_draws_only_from_the_nucleus_in_its_proportions(monkeypatch):
    import openrlhf_populora.engines.local.sampling as sampling

    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(2000, generator=gen) * 3  # the nucleus lies inside the top 1024
    flat = torch.randn(2000, generator=gen) * 0.01  # it does not: the full sort is used
    for logits in (peaked, flat):
        probs = torch.softmax(logits, -1)
        sorted_probs, order = probs.sort(descending=True)
        nucleus = order[(sorted_probs.cumsum(-1) - sorted_probs) < 0.5]
        draws = torch.cat([sampling.sample_next_tokens(logits[None], 1.0, 0.5, [torch.Generator().manual_seed(s)])
                           for s in range(3000)])
        assert set(draws.tolist()) <= set(nucleus.tolist())
        if len(nucleus) <= 8:  # few tokens: their frequencies must follow the renormalised probabilities
            expected = probs[nucleus] / probs[nucleus].sum()
            observed = torch.stack([(draws == t).float().mean() for t in nucleus])
            torch.testing.assert_close(observed, expected, atol=0.03, rtol=0)
    monkeypatch.setattr(sampling, "TOP_K", 3)  # a tiny top-k: the peaked rows now take the fallback too
    again = torch.cat([sampling.sample_next_tokens(peaked[None], 1.0, 0.5, [torch.Generator().manual_seed(s)])
                       for s in range(300)])
    assert set(again.tolist()) <= set(nucleus_of(peaked, 0.5))


def nucleus_of(logits, top_p):
    probs = torch.softmax(logits, -1)
    sorted_probs, order = probs.sort(descending=True)
    return order[(sorted_probs.cumsum(-1) - sorted_probs) < top_p].tolist()


# ----------------------------------------------------------------------------------------- batched training


def test_training_all_adapters_together_gives_each_adapter_its_own_gradient():
    """Mixed-adapter micro-batches with shared prompts give every adapter the gradient it gets trained alone,
    one sequence at a time, with no prompt shared; adapters absent from the batch get none."""
    together = make_engine(adapters=("t0", "t1", "s0", "s1"), micro_batch_size=4)
    alone = make_engine(adapters=("t0", "t1", "s0", "s1"), micro_batch_size=1, share_prompts=False)
    batch = trajectories(together, ["t0", "t1", "s0"], advantages=(1.0, -0.5, 0.25, 0.75))
    assert len({(t.adapter, tuple(t.prompt_ids)) for t in batch}) < len(batch)  # prompts are shared
    grads = together.gradients(batch)
    assert list(grads) == ["t0", "t1", "s0"]
    for name in ("t0", "t1", "s0"):
        own = alone.gradients([t for t in batch if t.adapter == name])[name]
        for key, value in own.items():
            torch.testing.assert_close(grads[name][key], value, rtol=1e-4, atol=1e-6)
        assert any(v.abs().max() > 1e-3 for v in own.values())
    assert all(p.grad is None for p in together._adapters["s1"].values())
    before = snapshot(together, "s1")
    stats = together.train_step(batch)
    assert set(stats) == {"t0", "t1", "s0"} and same_snapshot(before, snapshot(together, "s1"))


def test_each_adapter_clips_its_own_gradient():
    """--actor.max_norm clips every adapter's gradient by its own norm: what reaches adapter a's optimizer is
    g_a * max_norm / |g_a| (every |g_a| here is far above max_norm), and its grad_norm is |g_a| before the clip.
    Catches: one clip_grad_norm_ over all adapters together (each would get max_norm * g_a / |g_all|, smaller
    than max_norm), which the pre-clip gradients() of the test above cannot see."""
    max_norm = 1e-3
    engine = make_engine(adapters=("t0", "s0"), max_norm=max_norm)
    batch = trajectories(engine, ["t0", "s0"], advantages=(1.0, -0.5, 0.25, 0.75))
    grads = engine.gradients(batch)  # before any clip
    norms = {name: float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads[name].values())))
             for name in grads}
    assert all(norm > 10 * max_norm for norm in norms.values())
    stepped = {}
    for name in ("t0", "s0"):
        optimizer = engine._optimizers[name]

        def step(closure=None, name=name, inner=optimizer.step):  # what AdamW is handed
            stepped[name] = {k: p.grad.detach().clone() for k, p in engine._adapters[name].items()}
            return inner(closure)

        optimizer.step = step
    stats = engine.train_step(batch)
    for name in ("t0", "s0"):
        assert stats[name]["grad_norm"] == pytest.approx(norms[name], rel=1e-4)
        for key, g in grads[name].items():
            torch.testing.assert_close(stepped[name][key].double(), g.double() * (max_norm / norms[name]),
                                       rtol=1e-4, atol=1e-12)


def test_shared_prompt_training_gives_the_unshared_update():
    results = []
    for share in (True, False):
        engine = make_engine(adapters=("t0", "s0"), share_prompts=share)
        batch = trajectories(engine, ["t0", "s0"])
        results.append((engine.train_step(batch), engine.response_log_probs(batch)))
    (stats_a, logp_a), (stats_b, logp_b) = results
    for name in stats_a:
        for key in ("loss", "grad_norm", "entropy"):
            assert stats_a[name][key] == pytest.approx(stats_b[name][key], rel=1e-5)
    assert logp_a == pytest.approx(logp_b, rel=1e-5)
