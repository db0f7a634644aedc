"""The Ray engine's scoring forwards within a memory budget (engines/ray/memory.py, RayEngine.token_log_probs).

A scoring forward holds rows x tokens x vocab logits at 6 bytes each (bf16 plus upstream's fp32 copy): 8 rows of
3,000 tokens of Qwen2.5's 152,064-entry vocabulary are 21.9 GB, which ran out of memory beside vLLM's half of an
80 GB GPU. The memory numbers below are computed by hand in the comments; the log-prob tests score a tiny model
with upstream's own ``Actor.forward`` in fp32 on CPU, through a stand-in for the policy actor group that records
the rows and padded width of every forward it receives. Ray itself is not under test (``ray.get`` is identity).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from openrlhf_populora.engines.base import Trajectory
from openrlhf_populora.engines.ray import memory

VOCAB = 152_064  # Qwen2.5
QWEN_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4}  # head_dim 3584 / 28 = 128, k/v 4 x 128 = 512 features
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ------------------------------------------------------------------------------------ the arithmetic


@pytest.mark.parametrize(("rows", "tokens", "expected"), [
    (8, 2048, 14_948_499_456),  # 8 x 2,048 x 152,064 x 6: the review's 14.9 GB
    (8, 3000, 21_897_216_000),  # 21.9 GB
    (8, 3500, 25_546_752_000),  # 25.5 GB
    (2, 3500, 6_386_688_000),  # 6.4 GB
])
def test_logit_bytes_are_rows_tokens_vocab_times_six(rows, tokens, expected):
    """Catches counting only one of the two copies (4 or 2 bytes a value)."""
    assert memory.logit_bytes(rows, tokens, VOCAB) == expected


def test_the_budget_in_tokens_and_rows():
    # 8e9 bytes / (152,064 x 6 = 912,384 bytes a token) = 8,768.2 -> 8,768 tokens a forward
    assert memory.scoring_tokens(8e9, VOCAB) == 8768
    # rows of a width: 8,768 // 3,000 = 2, // 4,096 = 2, // 8,192 = 1; a row of 10,000 tokens still runs, alone
    assert [memory.rows_per_forward(w, 8768) for w in (3000, 4096, 8192, 10_000)] == [2, 2, 1, 1]
    assert memory.rows_per_forward(100, 8768, limit=8) == 8  # --rollout.micro_batch_size caps short rows
    # the peak at --data.max_len 4,096: 2 rows, 2 x 4,096 x 152,064 x 6 = 7,474,249,728 bytes
    assert memory.scoring_peak(8, 4096, VOCAB, 8e9) == 7_474_249_728
    assert memory.scoring_peak(8, 10_000, VOCAB, 8e9) == memory.logit_bytes(1, 10_000, VOCAB)  # one row, over
    with pytest.raises(ValueError, match="scoring_memory_gb"):
        memory.scoring_tokens(0, VOCAB)


def test_row_chunks_by_hand():
    """Greedy, in order: at most max_rows rows, and rows x the chunk's longest row at most max_tokens."""
    lengths = [4, 4, 4, 9, 2, 2]
    # 3 x 4 = 12 fits 12 tokens; adding the 9 makes 4 x 9 = 36; the 9 alone, then 2 x 9 = 18 > 12; 2 x 2 = 4
    assert memory.row_chunks(lengths, 4, 12) == [range(0, 3), range(3, 4), range(4, 6)]
    assert memory.row_chunks(lengths, 4, None) == [range(0, 4), range(4, 6)]  # fixed slices without a budget
    assert memory.row_chunks(lengths, 2, 1000) == [range(0, 2), range(2, 4), range(4, 6)]
    assert memory.row_chunks([50, 1], 4, 10) == [range(0, 1), range(1, 2)]  # a row over the budget runs alone
    assert memory.row_chunks([], 3, 5) == []


def test_one_qwen_7b_adapter_is_40_4_million_parameters():
    # per layer, rank 16 x (in + out): q 3584+3584, k 3584+512, v 3584+512, o 3584+3584, gate and up 3584+18944,
    # down 18944+3584 = 90,112 features x 16 = 1,441,792; x 28 layers = 40,370,176 (80.7 MB in bf16)
    assert memory.lora_parameter_count(QWEN_7B, 16, SEVEN) == 40_370_176
    assert memory.lora_parameter_count(QWEN_7B, 16, "all-linear") == 40_370_176
    assert memory.lora_parameter_count(QWEN_7B, 8, ["q_proj", "v_proj"]) == 8 * (7168 + 4096) * 28
    with pytest.raises(ValueError, match="--ds.lora.target_modules"):
        memory.lora_parameter_count(QWEN_7B, 16, ["lm_head"])


def test_the_8t8s_budget_per_gpu_by_hand():
    """8t8s on Qwen2.5-7B (7,615,616,512 parameters), 16 adapters of 40,370,176, ZeRO-2 on 8 ranks in bf16, vLLM
    colocated at 0.5 of a 79.6 GB H100. Catches ZeRO partitioning the wrong states, vLLM's share left out, and the
    scoring peak left out or not bounded by the chunks."""
    trainable = 16 * 40_370_176  # 645,922,816
    plan = memory.gpu_memory_plan(gpu_bytes=79_600_000_000, base_params=7_615_616_512, adapter_params=40_370_176,
                                  adapters=16, ranks=8, zero_stage=2, vllm_gpu_memory_utilization=0.5,
                                  scoring_bytes=memory.logit_bytes(8, 3000, VOCAB))  # today: 8 rows in one forward
    assert plan.base == 15_231_233_024  # x 2 bytes, replicated under ZeRO-2
    assert plan.adapters == trainable * 2 == 1_291_845_632  # bf16 weights, replicated
    assert plan.gradients == trainable * 2 // 8 == 161_480_704  # bf16, partitioned under ZeRO-2
    assert plan.optimizer == trainable * 12 // 8 == 968_884_224  # fp32 master + 2 moments, partitioned
    assert plan.overhead == 1_500_000_000 and plan.vllm == 39_800_000_000
    # 15,231,233,024 + 1,291,845,632 + 161,480,704 + 968,884,224 + 1.5e9 + 21,897,216,000 + 39.8e9
    assert plan.total == 80_850_659_584 and plan.free == -1_250_659_584 and not plan.fits
    chunked = memory.gpu_memory_plan(
        gpu_bytes=79_600_000_000, base_params=7_615_616_512, adapter_params=40_370_176, adapters=16, ranks=8,
        zero_stage=2, vllm_gpu_memory_utilization=0.5, scoring_bytes=memory.scoring_peak(8, 3000, VOCAB, 8e9))
    assert chunked.scoring == 2 * 3000 * VOCAB * 6 == 5_474_304_000  # 2 rows a forward under 8 GB
    assert chunked.total == 64_427_747_584 and chunked.fits
    assert [name for name, _ in chunked.parts()][-2:] == ["total", "GPU"]


def test_zero_stages_offload_and_fp32_by_hand():
    kw = {"gpu_bytes": 80 * memory.GB, "base_params": 1000, "adapter_params": 100, "adapters": 2, "ranks": 4}
    zero0 = memory.gpu_memory_plan(zero_stage=0, **kw)
    assert (zero0.base, zero0.adapters, zero0.gradients, zero0.optimizer) == (2000, 400, 400, 2400)
    zero1 = memory.gpu_memory_plan(zero_stage=1, **kw)
    assert (zero1.gradients, zero1.optimizer) == (400, 600)
    zero3 = memory.gpu_memory_plan(zero_stage=3, **kw)
    assert (zero3.base, zero3.adapters, zero3.gradients, zero3.optimizer) == (500, 100, 100, 600)
    assert memory.gpu_memory_plan(zero_stage=2, adam_offload=True, **kw).optimizer == 0
    fp32 = memory.gpu_memory_plan(zero_stage=0, param_bytes=4, **kw)  # no separate master: 8 bytes of Adam
    assert (fp32.base, fp32.adapters, fp32.gradients, fp32.optimizer) == (4000, 800, 800, 1600)
    with pytest.raises(ValueError, match="--ds.zero_stage"):
        memory.gpu_memory_plan(zero_stage=4, **kw)
    with pytest.raises(ValueError, match="--vllm.gpu_memory_utilization"):
        memory.gpu_memory_plan(zero_stage=2, vllm_gpu_memory_utilization=1.5, **kw)


# --------------------------------------------------------------------- RayEngine.token_log_probs, chunked


class _Handle:
    """A Ray actor handle stand-in: ``handle.method.remote()`` returns the value at once."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        method = getattr(self._target, name)
        return SimpleNamespace(remote=lambda *args, **kwargs: method(*args, **kwargs))


class ScoringGroup:
    """The policy actor group's calls that ``token_log_probs`` makes, answered by upstream's ``Actor.forward`` on
    the tiny model in fp32 (every adapter name scores the same model); records each forward's (adapter, rows,
    padded width)."""

    def __init__(self, actor):
        self.actor, self.calls, self.duplicate_actors = actor, [], 1
        self._actor_handlers = [_Handle(self)]

    def lora_config(self):
        return {}

    def vocab_size(self):
        return int(self.actor.model.config.vocab_size)

    def async_run_method(self, method_name, **kwargs):
        return [getattr(self, method_name)(**kwargs)]

    def probe_log_probs(self, sequences, action_mask, attention_mask, adapter_name):
        self.calls.append((adapter_name, *sequences.shape))
        with torch.no_grad():
            return self.actor(sequences, action_mask, attention_mask)


@pytest.fixture(scope="module")
def upstream_actor(tiny_model_dir):
    """Upstream's ``Actor`` on the tiny model in fp32 (the CPU patches let upstream take "fp32")."""
    from openrlhf.models import Actor
    from openrlhf_populora.patches import openrlhf_0_11_2 as pinned
    from openrlhf_populora.patches.openrlhf_0_11_2 import cpu

    pinned.apply(cpu.cpu_patches())
    try:
        actor = Actor(tiny_model_dir, attn_implementation="sdpa", param_dtype="fp32")
    finally:
        pinned.revert()
    actor.eval()
    return actor


@pytest.fixture()
def make_engine(upstream_actor, monkeypatch):
    from openrlhf_populora.engines.ray import trainer as ray_trainer
    from openrlhf_populora.models.tiny import build_tiny_tokenizer

    monkeypatch.setattr(ray_trainer, "_get", lambda refs, timeout=None: refs)
    tokenizer = build_tiny_tokenizer()

    def make(budget_tokens: float | None):
        """A RayEngine whose scoring budget is ``budget_tokens`` tokens a forward (None: 8 GB, no chunking)."""
        vocab = int(upstream_actor.model.config.vocab_size)
        gb = 8.0 if budget_tokens is None else (budget_tokens + 0.5) * vocab * memory.LOGIT_BYTES / memory.GB
        args = SimpleNamespace(populora=SimpleNamespace(adapter_names=["t0", "s0"], sync_tolerance=None,
                                                        scoring_memory_gb=gb), ds=SimpleNamespace(param_dtype="fp32"))
        group = ScoringGroup(upstream_actor)
        host = SimpleNamespace(args=args, tokenizer=tokenizer, vllm_engines=[object()], actor_model_group=group)
        engine = ray_trainer.RayEngine(host)
        return engine, group

    return make


def trajectories() -> list[Trajectory]:
    """Two adapters, interleaved, of different lengths (prompt, response); t0's longest is 23 tokens, s0's 26."""
    shapes = [("t0", 5, 7), ("s0", 12, 3), ("t0", 3, 20), ("s0", 9, 9), ("t0", 4, 1), ("s0", 15, 11),
              ("t0", 2, 6), ("s0", 6, 2), ("t0", 10, 4)]
    g = torch.Generator().manual_seed(1)
    out = []
    for adapter, prompt, response in shapes:
        ids = torch.randint(0, 250, (prompt + response,), generator=g).tolist()
        out.append(Trajectory(adapter, ids[:prompt], ids[prompt:], 0.0))
    return out


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_row_chunked_scoring_equals_one_call_bit_for_bit(make_engine, rows):
    """The chunks keep the call's padded width, so each row's log-probs are bit-identical to one call's (fp32,
    CPU, SDPA; measured: chunks re-padded to their own longest row differ by up to 3e-6). Catches a chunking that
    drops, repeats or reorders rows, or re-pads chunks."""
    one, one_group = make_engine(None)
    expected = one.token_log_probs(trajectories())
    assert [(a, r) for a, r, _w in one_group.calls] == [("t0", 5), ("s0", 4)]  # one forward per adapter
    chunked, group = make_engine(rows * 26)  # `rows` rows a forward of either adapter's width (26 and 23)
    got = chunked.token_log_probs(trajectories())
    assert got == expected
    assert [len(v) for v in got] == [len(t.response_ids) for t in trajectories()]
    assert len(group.calls) > 2


def test_each_scoring_forward_stays_within_the_budget(make_engine):
    """Every forward's rows x padded width stays within the budget's tokens (here 52: 2 rows of s0's 26 tokens,
    2 of t0's 23), every row is scored once; without a budget one forward per adapter held 5 x 23 and 4 x 26
    tokens. Catches scoring an adapter's rows in one call whatever the budget."""
    engine, group = make_engine(52)
    engine.token_log_probs(trajectories())
    assert engine.scoring_tokens == 52
    assert all(rows * width <= 52 for _a, rows, width in group.calls), group.calls
    assert [(a, r) for a, r, _w in group.calls] == [("t0", 2), ("t0", 2), ("t0", 1), ("s0", 2), ("s0", 2)]
    peak = max(memory.logit_bytes(rows, width, group.vocab_size()) for _a, rows, width in group.calls)
    assert peak <= float(engine.args.populora.scoring_memory_gb) * memory.GB


def test_a_row_longer_than_the_budget_is_scored_alone(make_engine):
    engine, group = make_engine(10)  # fewer tokens than any row: each row is one forward
    engine.token_log_probs(trajectories())
    assert [rows for _a, rows, _w in group.calls] == [1] * 9
