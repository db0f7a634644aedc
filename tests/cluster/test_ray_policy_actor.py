"""The PopuLoRA policy actor, in-process (its plain class), with the CPU patches and OpenRLHF's real
``DeepspeedStrategy`` on gloo: N adapters in one engine, per-adapter forward, a fit that trains exactly the
adapters in the batch and leaves the others bit-identical, reads/writes, checkpoints. Plus the pure pieces
(the trainer's routing checks) without DeepSpeed."""

from __future__ import annotations

import argparse
import math
import os
import re
import runpy
import socket
from types import SimpleNamespace

import pytest
import torch
from openrlhf_populora.patches import openrlhf_0_11_2 as pinned
from openrlhf_populora.patches.openrlhf_0_11_2 import cpu

from openrlhf_populora.build import local_engine_config
from openrlhf_populora.config import Config
from openrlhf_populora.engines.ray import ADAPTER_INFO_KEY, GROUP_INFO_KEY
from openrlhf_populora.engines.ray import adapters_ds as ads
from openrlhf_populora.engines.ray import policy_actor as pa

# the tiny model's tests: fp32, every linear layer, seed 0 (Config's defaults: auto dtype, q/k/v/o, 42)
TEST_ENGINE = {"dtype": "fp32", "lora_target_modules": "all-linear", "seed": 0}


def engine_config(**overrides):
    """The local engine's config from Config's defaults (the one source), the tiny-model test defaults, then
    ``overrides``."""
    return local_engine_config(Config(), **{**TEST_ENGINE, **overrides})


NAMES = ["t0", "t1", "s0", "s1"]


# -- pure pieces ------------------------------------------------------------------------------------------


def test_adapter_index_of_reads_batched_and_single_sample_info():
    assert pa.adapter_index_of({ADAPTER_INFO_KEY: torch.tensor([2, 2, 1])}) == [2, 2, 1]
    assert pa.adapter_index_of({ADAPTER_INFO_KEY: [torch.tensor(3), torch.tensor(3)]}) == [3, 3]
    assert pa.adapter_index_of({ADAPTER_INFO_KEY: torch.tensor(0)}) == [0]


# -- in-process actor on DeepSpeed (gloo) ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def upstream_args(argv: list[str]):
    """OpenRLHF 0.11.2's own parser and the defaults its validation derives (captured, not copied)."""
    from openrlhf.utils.config import hierarchize

    class Captured(Exception):
        pass

    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise Captured(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
        raise AssertionError("train_ppo_ray did not parse arguments")
    except Captured as captured:
        parser = captured.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    args = hierarchize(original(parser, argv))
    args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)
    if len(args.algo.advantage.is_correction_threshold) == 1:
        args.algo.advantage.is_correction_threshold.insert(0, 0.0)
    return args


@pytest.fixture(scope="module")
def cpu_patched():
    if torch.cuda.is_available():
        pytest.skip("in-process CPU test")
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(key, value)
    pinned.apply(cpu.cpu_patches())
    yield
    pinned.revert()


def make_policy(model_dir, tmp_path, zero_stage=2, micro=1, batch=4, load=False, epochs=1, dtype="bf16",
                max_norm=0.0, scheduler=("--actor.lr_scheduler", "constant"), vllm_engines=None):
    from openrlhf.utils import get_strategy

    args = upstream_args([
        "--actor.model_name_or_path", model_dir, "--ds.lora.rank", "4", "--ds.lora.alpha", "8",
        "--ds.attn_implementation", "eager", "--ds.zero_stage", str(zero_stage),
        "--train.batch_size", str(batch), "--train.micro_batch_size", str(micro),
        "--actor.adam.lr", "1e-2", *scheduler, "--actor.max_norm", str(max_norm),
        "--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0", "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "out"), "--vllm.num_engines", "0", "--train.max_epochs", str(epochs),
        *(["--ckpt.load_enable"] if load else []),
    ])
    args.ds.param_dtype = dtype  # "fp32": the CPU launch's default (upstream's parser offers bf16 and fp16)
    args.populora = SimpleNamespace(adapter_names=list(NAMES), seed=7)
    strategy = get_strategy(args)
    actor = pa.PopuLoRAPolicyActor.__ray_actor_class__.__new__(pa.PopuLoRAPolicyActor.__ray_actor_class__)
    actor.init_model_from_pretrained(strategy, model_dir, max_steps=10, vllm_engines=vllm_engines)
    return actor


SEQ = torch.tensor([[5, 17, 99, 3, 42, 7, 120, 64, 11, 200, 31, 8],
                    [9, 12, 250, 77, 3, 14, 15, 92, 26, 5, 35, 89]])
ATTN = torch.ones_like(SEQ)
ACTION = torch.ones(2, 6, dtype=torch.bool)


def experience(actor, index: int, advantage: float):
    """Two samples for adapter ``index``; old log-probs from the actor itself (ratio 1)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    old = actor.forward(SEQ, ACTION, ATTN, adapter_name=NAMES[index])
    return Experience(
        sequences=SEQ.clone(), attention_mask=ATTN.clone(), action_mask=ACTION.clone(), action_log_probs=old,
        advantages=torch.full((2, 6), advantage), returns=torch.full((2, 6), advantage),
        response_length=torch.full((2,), 6.0), total_length=torch.full((2,), 12.0),
        info={ADAPTER_INFO_KEY: torch.tensor([index, index]), GROUP_INFO_KEY: torch.tensor([index, index]),
              "reward": torch.tensor([advantage, advantage])},
    )


def all_states(actor):
    return {n: actor.get_adapter_state(n, all_ranks=True) for n in NAMES}


def moments(actor, name):
    from deepspeed.utils import safe_get_full_optimizer_state

    return {k: [safe_get_full_optimizer_state(p, m).clone() for m in ads.MOMENT_KEYS]
            for k, p in ads.lora_parameters(actor.actor, name).items()}


def same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def distinct_adapters(actor):
    gen = torch.Generator().manual_seed(0)
    for name in NAMES:
        state = actor.get_adapter_state(name, all_ranks=True)  # every rank perturbs its own copy alike
        actor.set_adapter_state(name, {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in state.items()})


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage,micro", [(2, 1), (3, 2)])
def test_fit_trains_exactly_the_adapters_in_the_batch(cpu_patched, tiny_model_dir, tmp_path, zero_stage, micro):
    actor = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=micro, batch=4)
    assert ads.adapter_names(actor.actor) == NAMES
    assert actor.lora_config() == {"r": 4, "lora_alpha": 8, "target_modules": actor.lora_config()["target_modules"],
                                   "lora_dropout": 0.0}
    assert actor.vocab_size() == 259  # the logits' width (256 bytes + 3 special tokens), under ZeRO-3 too
    distinct_adapters(actor)
    lp = {n: actor.forward(SEQ, ACTION, ATTN, adapter_name=n) for n in NAMES}
    assert all(not torch.equal(lp[a], lp[b]) for a in NAMES for b in NAMES if a < b)
    assert torch.equal(actor.forward(SEQ, ACTION, ATTN, adapter_name=2), lp["s0"])  # an index works too

    # every adapter gets Adam moments (one update each)
    for k in range(4):
        actor.append(experience(actor, k, 1.0 if k % 2 else -1.0))
    status = actor.fit(0.0)
    assert set(pa.split_per_adapter(status)) == set(NAMES) and "policy_loss" in status

    before, mom_before = all_states(actor), {n: moments(actor, n) for n in NAMES}
    actor.append(experience(actor, 0, 1.0))
    actor.append(experience(actor, 3, -1.0))
    status = actor.fit(0.0)
    after, mom_after = all_states(actor), {n: moments(actor, n) for n in NAMES}
    per = pa.split_per_adapter(status)
    assert all(isinstance(v, float) for v in status.values() if not isinstance(v, dict))  # upstream logs floats
    assert set(per) == {"t0", "s1"}
    assert per["t0"]["num_sequences"] == 2 and per["t0"]["updates"] == 1 and per["t0"]["grad_norm"] > 0
    assert per["t0"]["num_tokens"] == 12 and per["t0"]["clip_ratio"] == 0.0
    assert per["t0"]["response_length"] == 6.0 and per["t0"]["reward"] == 1.0 and per["s1"]["reward"] == -1.0
    # each adapter's step saw only its own gradient: the step's reported norm is the larger of the two
    assert status["actor_grad_norm"] == max(per["t0"]["grad_norm"], per["s1"]["grad_norm"])
    assert per["t0"]["grad_norm"] != per["s1"]["grad_norm"]
    for name in ["t0", "s1"]:
        assert not same(after[name], before[name]), name
    for name in ["t1", "s0"]:
        assert same(after[name], before[name]), name  # bit-identical fp32 masters
        old, new = mom_before[name], mom_after[name]
        assert all(torch.equal(x, y) for k in new for x, y in zip(new[k], old[k], strict=True))  # and moments
        assert torch.equal(actor.forward(SEQ, ACTION, ATTN, adapter_name=name), lp_after_write(actor, name))


def lp_after_write(actor, name):
    """The log-probs of a fresh copy of ``name``'s fp32 tensors (written into a spare adapter slot and back)."""
    state = actor.get_adapter_state(name)
    spare = "t1" if name != "t1" else "s0"
    saved = actor.get_adapter_state(spare)
    actor.set_adapter_state(spare, state)
    out = actor.forward(SEQ, ACTION, ATTN, adapter_name=spare)
    actor.set_adapter_state(spare, saved)
    return out


@pytest.mark.slow
def test_routing_rejects_mixed_micro_batches_and_checkpoint_keeps_client_states(cpu_patched, tiny_model_dir,
                                                                               tmp_path):
    actor = make_policy(tiny_model_dir, tmp_path, micro=2)
    mixed = experience(actor, 0, 1.0)
    mixed.info[ADAPTER_INFO_KEY] = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="one adapter"):
        actor.trainer.training_step(mixed, 0.0, 0)
    distinct_adapters(actor)
    states = all_states(actor)
    actor.save_checkpoint("global_step1", {pa.CLIENT_STATE_KEY: {"members": ["t0"], "step": 1}})
    assert (tmp_path / "ckpt" / "_actor" / "global_step1").is_dir()
    actor.trainer.strategy.print("reload")
    again = make_policy(tiny_model_dir, tmp_path, micro=2, load=True)
    loaded = again.load_checkpoint_states()
    assert loaded[pa.CLIENT_STATE_KEY] == {"members": ["t0"], "step": 1}
    assert loaded[pa.ADAPTER_NAMES_STATE_KEY] == NAMES
    assert all(same(again.get_adapter_state(n), states[n]) for n in NAMES)
    # the controller's save_state / load_state: a DeepSpeed checkpoint in a folder of its own
    again.save_state(str(tmp_path / "state"), {"global_step": 3})
    again.set_adapter_state("t0", {k: v + 1 for k, v in states["t0"].items()})
    assert again.load_state(str(tmp_path / "state"))["global_step"] == 3
    assert same(again.get_adapter_state("t0"), states["t0"])


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_saved_adapters_load_in_peft(cpu_patched, tiny_model_dir, tmp_path, zero_stage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    actor = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage)
    distinct_adapters(actor)
    out = tmp_path / "out"
    actor.save_adapters(str(out))
    assert (out / "tokenizer_config.json").exists()
    for name in ["t1", "s0"]:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
        loaded = PeftModel.from_pretrained(base, str(out / name))
        ours = actor.get_adapter_state(name)
        theirs = ads.adapter_state(loaded, "default")
        assert list(theirs) == list(ours) and same(theirs, ours), name
    before = sorted(out.rglob("*"))
    actor.save_model()  # upstream's final save: the run has exported every member already; nothing new
    assert sorted(out.rglob("*")) == before


@pytest.mark.slow
def test_the_ray_actor_trains_in_a_ray_worker(tiny_model_dir, tmp_path):
    """The decorated actor in a real local Ray worker (one logical GPU declared on a CPU-only node), set up
    by the CPU worker hook: init, per-adapter forward, write, fit, read back -- all through Ray."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only Ray check")
    import ray
    from openrlhf.utils import get_strategy

    args = upstream_args([
        "--actor.model_name_or_path", tiny_model_dir, "--ds.lora.rank", "4", "--ds.lora.alpha", "8",
        "--ds.attn_implementation", "eager", "--train.batch_size", "4", "--actor.adam.lr", "1e-2",
        "--actor.lr_scheduler", "constant", "--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0",
        "--ckpt.path", str(tmp_path / "ckpt"), "--vllm.num_engines", "0",
    ])
    args.populora = SimpleNamespace(adapter_names=list(NAMES), seed=7)
    hook = "openrlhf_populora.patches.openrlhf_0_11_2.cpu.setup_cpu_worker"
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": hook,
                          "env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        actor = pa.PopuLoRAPolicyActor.options(num_cpus=1).remote(1, 0, None, None)
        ray.get(actor.init_model_from_pretrained.remote(get_strategy(args), tiny_model_dir, 10), timeout=300)
        assert ray.get(actor.get_adapter_names.remote(), timeout=60) == NAMES
        state = ray.get(actor.get_adapter_state.remote("t1"), timeout=60)
        new = {k: v + 0.1 for k, v in state.items()}
        ray.get(actor.set_adapter_state.remote("t1", new), timeout=60)
        assert same(ray.get(actor.get_adapter_state.remote("t1"), timeout=60), new)
        lp = ray.get([actor.forward.remote(SEQ, ACTION, ATTN, adapter_name=n) for n in ("t0", "t1")], timeout=60)
        assert not torch.equal(lp[0], lp[1])
        from openrlhf.trainer.ppo_utils.experience import Experience

        exp = Experience(sequences=SEQ, attention_mask=ATTN, action_mask=ACTION, action_log_probs=lp[1],
                         advantages=torch.ones(2, 6), returns=torch.ones(2, 6), response_length=torch.full((2,), 6.0),
                         total_length=torch.full((2,), 12.0), info={ADAPTER_INFO_KEY: torch.tensor([1, 1])})
        untouched = ray.get(actor.get_adapter_state.remote("s0"), timeout=60)
        ray.get(actor.append.remote(exp), timeout=60)
        ray.get(actor.append.remote(exp), timeout=60)
        status = ray.get(actor.fit.remote(0.0), timeout=120)
        assert set(pa.split_per_adapter(status)) == {"t1"}
        assert not same(ray.get(actor.get_adapter_state.remote("t1"), timeout=60), new)
        assert same(ray.get(actor.get_adapter_state.remote("s0"), timeout=60), untouched)
    finally:
        ray.shutdown()


TWO_RANK_SCRIPT = r"""
import importlib.util, os
from pathlib import Path
import torch
from openrlhf_populora.patches.openrlhf_0_11_2 import cpu
cpu.setup_cpu_worker()
spec = importlib.util.spec_from_file_location("policy_actor_tests", os.environ["TEST_FILE"])
t = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)
# DeepSpeed's own persistence threshold (upstream's config): the tiny model's LoRA tensors are all below it, as
# 11 of the 14 per layer are on a 7B model at rank 16

rank, world, out = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), Path(os.environ["OUT"])
actor = t.make_policy(os.environ["MODEL"], out, zero_stage=int(os.environ["STAGE"]), micro=2, batch=4)
t.distinct_adapters(actor)
from peft.tuners.lora import LoraLayer
layer = next(m for m in actor.actor.modules() if isinstance(m, LoraLayer))
widths, fitting = set(), [False]  # how many adapters each training pass runs through a LoRA layer
layer.register_forward_pre_hook(lambda m, _: widths.add(len(m.active_adapters)) if fitting[0] else None)
def exp(index, rows):
    e = t.experience(actor, index, 1.0 if index % 2 else -1.0)
    for f in ("sequences", "attention_mask", "action_mask", "action_log_probs", "advantages", "returns",
              "response_length", "total_length"):
        setattr(e, f, getattr(e, f)[rows])
    e.info = {k: v[rows] for k, v in e.info.items()}
    return e
both = slice(0, 2)
plans = [{0: [(0, both)], 1: [(1, both)]},  # rank 0 trains t0 while rank 1 trains t1
         {0: [(0, both)], 1: [(3, both)]},
         {0: [(0, both)], 1: [(3, slice(0, 1)), (2, slice(1, 2))]}]  # rank 0 has no s0/s1: padded
saved = {}
for step, plan in enumerate(plans if world == 2 else plans[:2]):
    for r in [0, 1]:  # every rank runs the same forwards (ZeRO-3 gathers are collectives), keeps its own
        for index, rows in plan[r]:
            built = exp(index, rows)
            if world == 1 or r == rank:
                actor.append(built)
    fitting[0] = True
    saved[f"fit{step}"] = t.pa.split_per_adapter(actor.fit(0.0))
    fitting[0] = False
    saved[f"state{step}"] = t.all_states(actor)
saved["graph_widths"] = widths
torch.save(saved, out / f"world{world}_rank{rank}.pt")
"""


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_data_parallel_ranks_training_different_adapters_match_one_rank(tiny_model_dir, tmp_path, zero_stage):
    """Two gloo ranks training DIFFERENT adapters in the same step (ZeRO-2; ZeRO-3 with DeepSpeed's default
    persistence threshold, which every LoRA tensor here is under) give exactly the single-rank result on the same
    samples (an adapter outside the window must not forward with Adam-drifted persistent copies); a rank without samples of an adapter
    takes part in its window with empty micro-batches (ranks stay in lockstep); adapters absent on every rank
    stay bit-identical. Training passes run one adapter through the LoRA layers, under ZeRO-3 too: the windows
    give every rank the same adapter at the same time, so reductions and gathers agree without the others."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("CPU-only multi-process check")
    script = tmp_path / "ranks.py"
    script.write_text(TWO_RANK_SCRIPT)
    procs = []
    for world, rank, port in [(2, 0, _free_port()), (2, 1, None), (1, 0, _free_port())]:
        port = port or procs[-1][1]
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", TEST_FILE=__file__, OUT=str(tmp_path),
                   MODEL=tiny_model_dir, STAGE=str(zero_stage))
        procs.append((subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True), port))
    try:
        logs = [p.communicate(timeout=1500)[0] for p, _ in procs]
    finally:
        for p, _ in procs:
            p.kill()
    assert all(p.returncode == 0 for p, _ in procs), "\n".join(log[-3000:] for log in logs)
    r0, r1, ref = (torch.load(tmp_path / f) for f in ("world2_rank0.pt", "world2_rank1.pt", "world1_rank0.pt"))
    for step in range(3):
        for name in NAMES:
            assert same(r0[f"state{step}"][name], r1[f"state{step}"][name]), (step, name)  # ranks agree
    for step in range(2):
        for name in NAMES:
            assert torch.allclose(torch.cat([v.flatten() for v in r0[f"state{step}"][name].values()]),
                                  torch.cat([v.flatten() for v in ref[f"state{step}"][name].values()]),
                                  rtol=0, atol=1e-6), (step, name)
    assert set(r0["fit0"]) == {"t0", "t1"} and set(r0["fit2"]) == {"t0", "s0", "s1"}
    assert all(r0["fit2"][n]["updates"] == 1 for n in ("t0", "s0", "s1"))  # one update each, padded or not
    assert same(r0["state2"]["t1"], r0["state1"]["t1"])  # absent on both ranks: untouched
    assert r0["graph_widths"] == r1["graph_widths"] == {1}
    for name in ["t0", "s0", "s1"]:
        assert not same(r0["state2"][name], r0["state1"][name]), name


@pytest.mark.slow
def test_evolution_right_after_a_resume_writes_weights_and_zeroes_moments(cpu_patched, tiny_model_dir, tmp_path):
    """After ``load_state`` (a fresh process resuming), ZeRO-2 has not linked the loaded Adam moments to the
    parameters yet; overwriting an adapter then (evolution at the first resumed step) must still work and
    leave that adapter with zero moments while the others keep theirs."""
    actor = make_policy(tiny_model_dir, tmp_path, micro=2)
    distinct_adapters(actor)
    actor.append(experience(actor, 0, 1.0))
    actor.append(experience(actor, 1, -1.0))
    actor.fit(0.0)
    actor.save_state(str(tmp_path / "state"), {"global_step": 1})
    trained_moments = moments(actor, "t1")
    again = make_policy(tiny_model_dir, tmp_path, micro=2)
    assert again.load_state(str(tmp_path / "state"))["global_step"] == 1
    child = {k: v * 0.5 for k, v in again.get_adapter_state("t0").items()}
    again.set_adapter_state("t0", child)
    assert same(again.get_adapter_state("t0"), child)
    assert all(not m.any() for ms in moments(again, "t0").values() for m in ms)
    kept = moments(again, "t1")
    assert all(torch.equal(a, b) for k in kept for a, b in zip(kept[k], trained_moments[k], strict=True))
    assert any(m.any() for ms in kept.values() for m in ms)


@pytest.mark.slow
def test_the_lr_schedule_advances_once_per_self_play_step_whatever_the_optimizer_steps(cpu_patched, tiny_model_dir,
                                                                                     tmp_path):
    """Upstream steps the LR scheduler at every optimizer step; a self-play step takes as many optimizer steps as
    its adapters' samples fill, so the schedule (length: --populora.total_steps) advances once per ``fit``."""
    actor = make_policy(tiny_model_dir, tmp_path, micro=1, batch=2, scheduler=(
        "--actor.lr_scheduler", "cosine_with_min_lr", "--actor.lr_warmup_ratio", "0", "--actor.min_lr_ratio", "0.1"))
    engine = ads.ds_engine(actor.actor)
    lrs, steps = [], []
    for samples_of in ([0], [0, 1, 2]):  # 2 samples, then 6: accumulating 2 micro-batches of 1 -> 1, then 3 steps
        before = engine.global_steps
        for index in samples_of:
            actor.append(experience(actor, index, 1.0))
        lrs.append(actor.fit(0.0)["actor_lr"])
        steps.append(engine.global_steps - before)
    assert steps == [1, 3]
    # cosine over max_steps=10 self-play steps: step 0 trains at the peak, step 1 at cos(pi/10)
    expected = [1e-2, 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + math.cos(math.pi / 10))]
    assert lrs == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_each_adapter_updates_as_if_trained_alone(cpu_patched, tiny_model_dir, tmp_path):
    """One optimizer shared by the adapters must not couple them: t0 and s0 trained in one fit end exactly where
    each ends trained alone (same step's samples) -- own loss normalisation, own clip, own Adam step count. The
    second fit checks the counts: an adapter's second update uses bias correction 2 whatever the others did."""
    together = make_policy(tiny_model_dir, tmp_path / "together")
    distinct_adapters(together)
    start = all_states(together)
    alone = {}
    for name in ("t0", "s0"):
        alone[name] = make_policy(tiny_model_dir, tmp_path / name)
        for n in NAMES:
            alone[name].set_adapter_state(n, start[n])
    plan = [(0, 1.0), (2, -1.0)]  # (adapter index, advantage)
    for _ in range(2):
        for k, advantage in plan:
            together.append(experience(together, k, advantage))
        together.fit(0.0)
        for k, advantage in plan:
            alone[NAMES[k]].append(experience(alone[NAMES[k]], k, advantage))
            alone[NAMES[k]].fit(0.0)
    assert together.trainer.adam_steps == {"t0": 2, "t1": 0, "s0": 2, "s1": 0}
    for name in ("t0", "s0"):
        assert same(together.get_adapter_state(name), alone[name].get_adapter_state(name)), name
        assert not same(together.get_adapter_state(name), start[name])


@pytest.mark.slow
def test_epochs_are_updates_of_every_adapter_with_the_schedule_counting_them(cpu_patched, tiny_model_dir, tmp_path):
    actor = make_policy(tiny_model_dir, tmp_path, epochs=2, scheduler=(
        "--actor.lr_scheduler", "cosine_with_min_lr", "--actor.lr_warmup_ratio", "0", "--actor.min_lr_ratio", "0.1"))
    distinct_adapters(actor)
    actor.append(experience(actor, 1, 1.0))
    per = pa.split_per_adapter(actor.fit(0.0))
    assert per["t1"]["updates"] == 2 and actor.trainer.adam_steps["t1"] == 2
    assert ads.ds_engine(actor.actor).lr_scheduler.last_epoch == 2  # one scheduler step per update
    # the second epoch's ratio has moved off 1 (the old log-probs stay the sampling policy's): lr 1e-2 clips
    assert per["t1"]["clip_ratio"] > 0


@pytest.mark.slow
def test_an_evolved_child_gets_a_fresh_adam(cpu_patched, tiny_model_dir, tmp_path):
    """set_adapter_state (evolution) resets the adapter's moments AND its step count: the child's next update
    equals a brand-new engine's first update from the same weights."""
    actor = make_policy(tiny_model_dir, tmp_path / "old")
    distinct_adapters(actor)
    for _ in range(3):
        actor.append(experience(actor, 0, 1.0))
        actor.fit(0.0)
    assert actor.trainer.adam_steps["t0"] == 3
    child = {k: v * 0.5 for k, v in actor.get_adapter_state("t0").items()}
    actor.set_adapter_state("t0", child)
    assert actor.trainer.adam_steps["t0"] == 0
    fresh = make_policy(tiny_model_dir, tmp_path / "fresh")
    fresh.set_adapter_state("t0", child)
    for engine in (actor, fresh):
        engine.append(experience(engine, 0, -1.0))
        engine.fit(0.0)
    assert same(actor.get_adapter_state("t0"), fresh.get_adapter_state("t0"))


def test_the_model_loads_only_after_the_vllm_engines_started(cpu_patched, tiny_model_dir, tmp_path, monkeypatch):
    """The set-up waits for the engines (``wait_for_engines``, tested on real Ray actors in tests/cluster/test_ray_launch.py)
    before DeepSpeed builds the model, and keeps them for the uploads. Catches: the wait dropped, or moved after
    ``prepare`` (colocated, vLLM would count DeepSpeed's memory as its own)."""
    events = []
    monkeypatch.setattr(pa, "wait_for_engines", lambda engines: events.append(("wait", list(engines))))
    prepare = pa._PrepareWithAdapters.prepare
    monkeypatch.setattr(pa._PrepareWithAdapters, "prepare",
                        lambda self, *models: (events.append(("prepare", None)), prepare(self, *models))[1])
    actor = make_policy(tiny_model_dir, tmp_path, vllm_engines=["engine0", "engine1"])
    assert events == [("wait", ["engine0", "engine1"]), ("prepare", None)]
    assert actor.vllm_engines == ["engine0", "engine1"]


def module_states(folder):
    """The module states (``mp_rank_00_model_states.pt``, under ZeRO-3 ``zero_pp_rank_0_...``) of a checkpoint
    folder on one rank: its path and contents."""
    (path,) = folder.glob("*model_states.pt")
    return path, torch.load(path, map_location="cpu", weights_only=False)


def trainable_names(actor) -> set[str]:
    return {n for n, p in ads.ds_engine(actor.actor).module.named_parameters() if p.requires_grad}


def all_moments(actor):
    """Every adapter's Adam moments; after a load, ZeRO-2 links them to the parameters (as its next step would)
    so that they can be read."""
    engine = ads.ds_engine(actor.actor)
    for name in NAMES:
        for param in ads.lora_parameters(actor.actor, name).values():
            ads._link_moments(engine, param)
    return {n: moments(actor, n) for n in NAMES}


def same_moments(a, b) -> bool:
    return all(torch.equal(x, y) for n in a for k in a[n] for x, y in zip(a[n][k], b[n][k], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_checkpoints_hold_the_adapters_and_the_optimizer_but_not_the_frozen_base(cpu_patched, tiny_model_dir,
                                                                                 tmp_path, zero_stage):
    """Both save paths (upstream's ``save_checkpoint`` with its rotation, the controller's ``save_state``): the
    module states hold exactly the adapters' parameters -- no frozen base, not even the tied ``lm_head.weight``
    -- and no frozen fragments; the optimizer states are still there."""
    actor = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2)
    adapters = trainable_names(actor)
    assert len(adapters) == len(NAMES) * len(ads.lora_parameters(actor.actor, "t0"))
    assert all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert "base_model.model.lm_head.weight" not in adapters  # the tiny model ties it to the embedding
    actor.save_checkpoint("global_step1")
    actor.save_state(str(tmp_path / "state"))
    for folder in (tmp_path / "ckpt" / "_actor" / "global_step1", tmp_path / "state" / "populora"):
        _, ckpt = module_states(folder)
        assert set(ckpt["module"]) == adapters, folder
        assert ckpt.get("frozen_param_fragments") is None and ckpt.get("frozen_param_shapes") is None
        assert list(folder.glob("*optim_states.pt")), folder
        assert ckpt[pa.BASE_MODEL_STATE_KEY] == tiny_model_dir  # the base it needs, by path
    # upstream's rotation still applies to save_checkpoint (--ckpt.max_num 3 by default)
    for step in range(2, 5):
        actor.save_checkpoint(f"global_step{step}")
    kept = sorted(p.name for p in (tmp_path / "ckpt" / "_actor").iterdir() if p.is_dir())
    assert kept == ["global_step2", "global_step3", "global_step4"]


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_adam_step_counts_survive_a_checkpoint(cpu_patched, tiny_model_dir, tmp_path, zero_stage, capsys):
    """Save -> a fresh policy -> load, through ``save_state``/``load_state`` and through upstream's
    ``save_checkpoint`` and start-up load: bit-identical adapters, Adam moments and step counts from a checkpoint
    that holds no frozen base. A run on another base path is told so."""
    actor = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2)
    distinct_adapters(actor)
    actor.append(experience(actor, 0, 1.0))
    actor.fit(0.0)
    actor.append(experience(actor, 2, -1.0))
    actor.append(experience(actor, 0, -1.0))
    actor.fit(0.0)
    states, trained = all_states(actor), all_moments(actor)
    assert any(m.any() for n in ("t0", "s0") for ms in trained[n].values() for m in ms)
    actor.save_state(str(tmp_path / "state"), {"global_step": 1})
    actor.save_checkpoint("global_step1")
    again = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2)
    assert again.trainer.adam_steps["t0"] == 0
    again.load_state(str(tmp_path / "state"))
    assert again.trainer.adam_steps == {"t0": 2, "t1": 0, "s0": 1, "s1": 0}
    assert all(same(again.get_adapter_state(n, all_ranks=True), states[n]) for n in NAMES)
    assert same_moments(all_moments(again), trained)
    resumed = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2, load=True)
    assert resumed.trainer.adam_steps == {"t0": 2, "t1": 0, "s0": 1, "s1": 0}
    assert all(same(resumed.get_adapter_state(n, all_ranks=True), states[n]) for n in NAMES)
    assert same_moments(all_moments(resumed), trained)
    # and training goes on from there: the other adapters' moments, loaded but not yet linked to their
    # parameters by ZeRO-2 (all_moments links them: a policy of its own), are snapshotted and restored around
    # the step
    goes_on = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2)
    assert "saved on base model" not in capsys.readouterr().err
    goes_on.strategy.args.actor.model_name_or_path = "elsewhere/same-weights"
    goes_on.load_state(str(tmp_path / "state"))
    assert f"saved on base model {tiny_model_dir}; this run's is elsewhere/same-weights" in capsys.readouterr().err
    goes_on.append(experience(goes_on, 1, 1.0))
    goes_on.fit(0.0)
    assert goes_on.trainer.adam_steps == {"t0": 2, "t1": 1, "s0": 1, "s1": 0}
    assert same(goes_on.get_adapter_state("t0"), states["t0"])
    assert same_moments({n: m for n, m in all_moments(goes_on).items() if n != "t1"},
                        {n: m for n, m in trained.items() if n != "t1"})


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_checkpoint_missing_an_adapter_tensor_is_refused_naming_it(cpu_patched, tiny_model_dir, tmp_path,
                                                                    zero_stage):
    """The base may be absent from a checkpoint's module states, an adapter's tensor may not: the load is not
    simply non-strict."""
    actor = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2)
    actor.save_state(str(tmp_path / "state"))
    path, ckpt = module_states(tmp_path / "state" / "populora")
    dropped = sorted(ckpt["module"])[5]
    assert ".lora_" in dropped
    del ckpt["module"][dropped]
    torch.save(ckpt, path)
    again = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2)
    with pytest.raises(RuntimeError, match=re.escape(dropped)):
        again.load_state(str(tmp_path / "state"))


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_an_old_checkpoint_with_the_frozen_base_inside_still_loads(cpu_patched, tiny_model_dir, tmp_path,
                                                                   zero_stage):
    """A checkpoint written the old way (DeepSpeed's default, the base in the module states and as frozen
    fragments) loads at start-up and through ``load_state``; it is the larger one."""
    actor = make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2)
    distinct_adapters(actor)
    actor.append(experience(actor, 1, 1.0))
    actor.fit(0.0)
    states, trained = all_states(actor), all_moments(actor)
    engine = ads.ds_engine(actor.actor)
    old = actor._own_states({"global_step": 1})
    engine.save_checkpoint(str(tmp_path / "ckpt" / "_actor"), tag="global_step1", client_state=old,
                           exclude_frozen_parameters=False)
    engine.save_checkpoint(str(tmp_path / "state"), tag="populora", client_state=old,
                           exclude_frozen_parameters=False)
    old_path, old_ckpt = module_states(tmp_path / "state" / "populora")
    assert set(old_ckpt["module"]) > trainable_names(actor)  # the base inside: an old-style checkpoint
    assert old_ckpt["frozen_param_fragments"]
    actor.save_state(str(tmp_path / "new"))
    new_path, _ = module_states(tmp_path / "new" / "populora")
    print(f"module states, ZeRO-{zero_stage}: {old_path.stat().st_size} bytes with the base, "
          f"{new_path.stat().st_size} without")
    assert new_path.stat().st_size < old_path.stat().st_size
    for again in (make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2, load=True),
                  make_policy(tiny_model_dir, tmp_path, zero_stage=zero_stage, micro=2)):
        if not again.checkpoint_states:
            assert again.load_state(str(tmp_path / "state"))["global_step"] == 1
        assert again.load_checkpoint_states()["global_step"] == 1
        assert again.trainer.adam_steps == {"t0": 0, "t1": 1, "s0": 0, "s1": 0}
        assert all(same(again.get_adapter_state(n, all_ranks=True), states[n]) for n in NAMES)
        assert same_moments(all_moments(again), trained)


# -- two engines, one algorithm ----------------------------------------------------------------------------

def _parity_trajectories(tokenizer):
    """Scored trajectories of two adapters, prompts and responses of different lengths, non-zero advantages."""
    from openrlhf_populora.engines.base import Trajectory

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rows = [("t0", "def f(x):", " return x + 1", 1.0), ("t0", "def f(x):", " return x*x*x", -0.5),
            ("t0", "print(", "'hello world')", 0.75), ("s0", "answer:", " 42", -1.0),
            ("s0", "answer:", " the list [1, 2]", 0.5), ("s0", "# a longer prompt here", " ok", 1.25)]
    return [Trajectory(a, ids(p), ids(r), adv, group=a) for a, p, r, adv in rows]


def _ds_train_step(actor, trajectories, micro):
    """What the Ray engine's experience maker feeds the actor, with KL off and gamma 1: the sampling policy's
    log-probs as old log-probs, and the trajectory's advantage on every response token."""
    from openrlhf_populora.engines.ray.experience import build_experiences

    for experience in build_experiences(trajectories, NAMES, actor.tokenizer.pad_token_id, micro):
        name = NAMES[int(experience.info[ADAPTER_INFO_KEY][0])]
        mask = experience.action_mask
        experience.action_log_probs = actor.forward(experience.sequences, mask, experience.attention_mask,
                                                    adapter_name=name)
        experience.advantages = experience.rewards[:, None] * mask
        experience.returns = experience.advantages.clone()
        actor.append(experience)
    return pa.split_per_adapter(actor.fit(0.0))


@pytest.mark.slow
@pytest.mark.parametrize("max_norm, batch", [(0.0, 2), (0.05, 8)])
def test_the_local_engine_and_the_deepspeed_actor_make_the_same_update(cpu_patched, tiny_model_dir, tmp_path,
                                                                      max_norm, batch, capsys):
    """The same tiny model, adapters and trajectories (two adapters in one step, then again) through the local
    engine and through the DeepSpeed policy actor (fp32, ZeRO-2 on gloo, in-process): the adapters agree to
    float rounding, with and without a gradient clip that acts. ``--train.batch_size`` must not matter: with 2
    (one micro-batch per DeepSpeed window) upstream's loop would take several steps per adapter, with 8 it would
    put both adapters in one window under one clip and one loss normaliser."""
    from openrlhf_populora.engines.local import LocalEngine

    actor = make_policy(tiny_model_dir, tmp_path, micro=2, batch=batch, dtype="fp32", max_norm=max_norm)
    args = actor.strategy.args
    distinct_adapters(actor)
    local = LocalEngine(engine_config(
        model_name_or_path=tiny_model_dir, lora_rank=4, lora_alpha=8, lora_target_modules="all-linear",
        lr=1e-2, adam_betas=tuple(args.actor.adam.betas), adam_eps=args.actor.adam.eps, weight_decay=0.0,
        max_norm=max_norm, micro_batch_size=2, dtype="fp32", attn_implementation="eager", num_threads=1))
    for name in NAMES:
        local.add_adapter(name, actor.get_adapter_state(name))
    trajectories = _parity_trajectories(actor.tokenizer)
    start = {name: local.get_adapter(name) for name in NAMES}
    worst = moved = 0.0
    for step in range(2):
        shift = trajectories[step:] + trajectories[:step]  # step 2: other advantages on the same responses
        batch = [t.__class__(t.adapter, t.prompt_ids, t.response_ids, u.advantage, t.group)
                 for t, u in zip(trajectories, shift, strict=True)]
        ours = local.train_step(batch)
        theirs = _ds_train_step(actor, batch, micro=2)
        assert set(ours) == set(theirs) == {"t0", "s0"}
        for name in ("t0", "s0"):
            assert ours[name]["grad_norm"] == pytest.approx(theirs[name]["grad_norm"], rel=1e-4)
            assert ours[name]["loss"] == pytest.approx(theirs[name]["loss"], rel=1e-4, abs=1e-6)
            if max_norm:
                assert theirs[name]["grad_norm"] > max_norm  # the clip acted
    for name in NAMES:
        a, b = local.get_adapter(name), actor.get_adapter_state(name)
        worst = max(worst, max(float((a[k] - b[k]).abs().max()) for k in a))
        moved = max(moved, max(float((a[k] - start[name][k]).abs().max()) for k in a))
    with capsys.disabled():
        print(f"\n[measured] local vs DeepSpeed adapters after 2 steps (lr 1e-2, max_norm {max_norm}): "
              f"max |diff| {worst:.3g} = {worst / 1e-2:.2g} of one step's size (lr); largest change {moved:.3g}")
    # Adam divides by sqrt(v) + eps, so an entry whose gradient is near eps (1e-7 here) turns float rounding of
    # the gradient into ~1e-3 of a step; an algorithmic difference (bias correction, clip) moves most entries by
    # 10-30% of a step. A wrong loss normaliser scales gradients, which Adam hides: the grad norms catch that.
    assert moved > 1e-2 and worst < 1e-2 * 1e-2
