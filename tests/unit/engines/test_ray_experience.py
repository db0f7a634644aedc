"""Trajectories -> OpenRLHF experiences, and advantages grouped per (member, role, task type).

Every expected number below is computed by hand in the comments. Ray itself is not under test: like
upstream's own tests, ``ray.put``/``ray.get`` are identity functions, while upstream's real
``RayActorGroup.async_run_method_batch`` and ``BaseModelActor.execute_batch`` do the slicing and the
``forward(**item)`` calls against in-process fake actors that compute real log-probs.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip("openrlhf")

from openrlhf.trainer.ppo_utils import experience_maker as upstream_maker  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import (  # noqa: E402
    make_experience_batch,
    split_experience_batch,
)
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController  # noqa: E402
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator  # noqa: E402
from openrlhf.trainer.ray import launcher  # noqa: E402

from openrlhf_populora.engines.base import Trajectory  # noqa: E402
from openrlhf_populora.engines.ray import ADAPTER_INFO_KEY, GROUP_INFO_KEY  # noqa: E402
from openrlhf_populora.engines.ray.experience import (  # noqa: E402
    PopuLoRAExperienceMaker,
    build_experiences,
    deal_experiences,
    experience_group_names,
    group_names,
    is_padding,
)
from openrlhf_populora.selfplay.advantages import whiten_by_group  # noqa: E402

PAD = 99
VOCAB = 100
ADAPTERS = ["t0", "s0"]


def ns(**kwargs) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kwargs)


def make_args(estimator="reinforce", gamma=1.0, no_std_norm=False, use_loss=False, micro=2):
    """The leaves of upstream's hierarchized ``args`` that the experience maker reads (upstream defaults)."""
    return ns(
        algo=ns(advantage=ns(estimator=estimator, gamma=gamma, no_std_norm=no_std_norm),
                kl=ns(use_loss=use_loss, estimator="k1")),
        reward=ns(clip_range=(-10, 10), overlong_buffer_len=None, stop_properly_penalty_coef=None),
        rollout=ns(micro_batch_size=micro, n_samples_per_prompt=1),
        train=ns(colocate_all=False, colocate_actor_ref=False, colocate_critic_reward=False,
                 dynamic_batch_enable=False),
        ds=ns(ring_attn_size=1, tensor_parallel_size=1),
    )


def traj(adapter, group, prompt_len, response_len, advantage, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (prompt_len + response_len,), generator=g).tolist()
    return Trajectory(adapter, ids[:prompt_len], ids[prompt_len:], advantage, group=group)


# ------------------------------------------------------------------------- fake actor groups (real math)


def bigram_table(name: str) -> torch.Tensor:
    """Each 'model' is a bigram table: log p(x_{t+1} | x_t) = log_softmax(W[x_t])[x_{t+1}]."""
    seed = sum(ord(c) * 31**i for i, c in enumerate(name)) % (2**31)
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))


def bigram_log_probs(table: torch.Tensor, sequences: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Shaped like OpenRLHF's ``Actor.forward``: next-token log-probs, ``[:, -A:] * action_mask``."""
    logp = torch.log_softmax(table[sequences[:, :-1]], dim=-1)
    logp = logp.gather(-1, sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logp[:, -action_mask.shape[1]:] * action_mask.float()


class PolicyActor:
    """Stands in for the policy actor: ``forward`` activates the named adapter (a different bigram table)."""

    def __init__(self, rank: int):
        self.strategy = ns(is_rank_0=lambda: rank == 0)
        self.calls: list[tuple[str, list[int]]] = []
        self.shapes: list[tuple[int, int]] = []  # (rows, padded width) of every forward
        self.execute_batch = ns(remote=lambda *a: launcher.BaseModelActor.execute_batch(self, *a))

    def forward(self, sequences, action_mask, attention_mask, adapter_name, mm_train_inputs_list=None):
        self.calls.append((adapter_name, sequences[:, 0].tolist()))
        self.shapes.append(tuple(sequences.shape))
        return bigram_log_probs(bigram_table(adapter_name), sequences, action_mask)


class ReferenceActor(PolicyActor):
    """The frozen base: ``forward`` takes no adapter (a TypeError if the maker sent one here)."""

    def forward(self, sequences, action_mask, attention_mask, mm_train_inputs_list=None):
        self.calls.append(("base", sequences[:, 0].tolist()))
        return bigram_log_probs(bigram_table("base"), sequences, action_mask)


class Group:
    """Upstream's ``RayActorGroup`` dispatch (its real ``async_run_method_batch``) over in-process actors."""

    def __init__(self, actor_type, num_actors: int):
        self._actor_handlers = [actor_type(rank) for rank in range(num_actors)]
        self.duplicate_actors = 1

    async_run_method_batch = launcher.RayActorGroup.async_run_method_batch


@pytest.fixture()
def identity_ray(monkeypatch):
    fake = ns(put=lambda value: value, get=lambda refs, **_: refs)
    monkeypatch.setattr(upstream_maker, "ray", fake)
    monkeypatch.setattr(launcher, "ray", fake)
    return fake


def make_maker(args, actors=None, ref=None, kl_coef=0.0, **kwargs) -> PopuLoRAExperienceMaker:
    strategy = ns(args=args)
    return PopuLoRAExperienceMaker(actors, None, None, ref, FixedKLController(kl_coef), strategy,
                                   ns(pad_token_id=PAD), adapter_names=ADAPTERS, **kwargs)


def finish(maker, experiences, kl=None):
    """What ``make_experience`` leaves for ``compute_advantages_and_returns``: a kl tensor (zeros: no ref)."""
    for e in experiences:
        e.kl = torch.zeros(e.action_mask.shape) if kl is None else kl
    return maker.compute_advantages_and_returns(experiences)


def per_token(experiences) -> dict[int, list[float]]:
    """Trajectory index -> its advantages on action tokens."""
    out = {}
    for e in experiences:
        for row, index in enumerate(e.index):
            out[index] = e.advantages[row][e.action_mask[row].bool()].tolist()
    return out


# ------------------------------------------------------------------------------------ build_experiences


def test_one_sample_matches_upstreams_process_response():
    t = traj("s0", "s0/solve/code_o", prompt_len=4, response_len=3, advantage=-0.25, seed=1)
    ours = build_experiences([t], ADAPTERS, PAD, micro_batch_size=1)[0]
    response = {"observation_tokens": t.prompt_ids + t.response_ids, "action_ranges": [(4, 7)],
                "reward": -0.25, "scores": -0.25, "rollout_log_probs": None, "prompt": "", "label": "",
                "truncated": False, "extra_logs": {}}
    theirs = SamplesGenerator._process_response_into_experience(None, response, max_len=1024)
    for name in ("sequences", "attention_mask", "action_mask", "rewards", "scores", "response_length",
                 "truncated", "total_length"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for key, value in theirs.info.items():
        assert ours.info[key].dtype == value.dtype and torch.equal(ours.info[key], value), key
    assert ours.action_mask.tolist() == [[0, 0, 0, 1, 1, 1]]  # 7 tokens -> 6 predictions, the last 3 are actions
    assert ours.images == theirs.images and ours.mm_train_inputs == theirs.mm_train_inputs


def test_micro_batches_are_homogeneous_and_keep_input_order_interleaved():
    order = ["s0", "t0", "s0", "t0", "t0", "s0", "s0"]
    trajectories = [traj(a, f"{a}/g", 2, 1 + i % 3, 0.1 * i, seed=i) for i, a in enumerate(order)]
    experiences = build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=2)
    # t0 (adapter 0) holds inputs 1, 3, 4; s0 (adapter 1) holds 0, 2, 5, 6; buckets in adapter_names order
    assert [e.index for e in experiences] == [[1, 3], [4], [0, 2], [5, 6]]
    assert [e.info[ADAPTER_INFO_KEY].tolist() for e in experiences] == [[0, 0], [0], [1, 1], [1, 1]]
    assert [e.info[ADAPTER_INFO_KEY].dtype for e in experiences] == [torch.int64] * 4
    for e in experiences:
        for row, index in enumerate(e.index):
            assert e.rewards[row].item() == pytest.approx(0.1 * index)
            assert e.info["reward"][row].item() == pytest.approx(0.1 * index)


def test_contiguous_input_gives_the_same_buckets():
    trajectories = [traj("t0", "t0/p", 2, 2, 0.0, seed=i) for i in range(3)]
    trajectories += [traj("s0", "s0/s", 2, 2, 0.0, seed=10 + i) for i in range(3)]
    experiences = build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=2)
    assert [e.index for e in experiences] == [[0, 1], [2], [3, 4], [5]]
    assert [e.info[ADAPTER_INFO_KEY].tolist() for e in experiences] == [[0, 0], [0], [1, 1], [1]]


def test_padding_is_right_with_pad_token_and_masks_follow():
    short = traj("t0", "t0/propose/code_o", prompt_len=2, response_len=1, advantage=1.0, seed=3)
    long = traj("t0", "t0/propose/code_o", prompt_len=3, response_len=3, advantage=-1.0, seed=4)
    (e,) = build_experiences([short, long], ADAPTERS, PAD, micro_batch_size=4)
    assert e.sequences.shape == (2, 6) and e.action_mask.shape == (2, 5)
    assert e.sequences[0].tolist() == short.prompt_ids + short.response_ids + [PAD] * 3
    assert e.sequences[1].tolist() == long.prompt_ids + long.response_ids
    assert e.attention_mask.tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    # short: 3 tokens -> predictions 0..1, action = prediction 1; long: 6 tokens, actions = predictions 2..4
    assert e.action_mask.tolist() == [[0, 1, 0, 0, 0], [0, 0, 1, 1, 1]]
    assert e.response_length.tolist() == [1, 3] and e.total_length.tolist() == [3.0, 6.0]
    assert e.truncated.tolist() == [False, False] and e.labels == ["t0/propose/code_o"] * 2


def test_group_indices_map_back_to_names():
    trajectories = [traj("s0", "s0/solve/code_i", 2, 1, 0.0), traj("t0", "t0/propose/code_i", 2, 1, 0.0),
                    traj("s0", "s0/solve/code_o", 2, 1, 0.0), traj("s0", "s0/solve/code_i", 2, 1, 0.0),
                    traj("t0", "", 2, 1, 0.0)]
    names = group_names(trajectories)
    assert names == ["s0/solve/code_i", "t0/propose/code_i", "s0/solve/code_o", "t0"]  # "" = the adapter's own
    experiences = build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=8)
    assert experience_group_names(experiences) == dict(enumerate(names))
    by_index = {i: int(g) for e in experiences for i, g in zip(e.index, e.info[GROUP_INFO_KEY], strict=True)}
    assert by_index == {0: 0, 1: 1, 2: 2, 3: 0, 4: 3}


@pytest.mark.parametrize(("trajectories", "names", "micro", "message"), [
    ([traj("x9", "x9/g", 2, 1, 0.0)], ADAPTERS, 1, "unknown adapter 'x9'"),
    ([Trajectory("t0", [1, 2], [], 0.0)], ADAPTERS, 1, "empty response"),
    ([Trajectory("t0", [], [1, 2], 0.0)], ADAPTERS, 1, "empty prompt"),
    ([Trajectory("t0", [1], [2], float("nan"))], ADAPTERS, 1, "non-finite advantage"),
    ([], ADAPTERS, 1, "no trajectories"),
    ([traj("t0", "g", 2, 1, 0.0)], ["t0", "t0"], 1, "distinct"),
    ([traj("t0", "g", 2, 1, 0.0)], ADAPTERS, 0, "micro_batch_size"),
])
def test_bad_input_is_rejected(trajectories, names, micro, message):
    with pytest.raises(ValueError, match=message):
        build_experiences(trajectories, names, PAD, micro)


def test_built_experiences_survive_upstreams_replay_buffer_split_and_rebatch():
    trajectories = [traj("t0", "t0/g", 2, 1 + i, 0.5 - i, seed=i) for i in range(3)]
    maker = make_maker(make_args())
    experiences = finish(maker, build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=3))
    items = split_experience_batch(experiences[0])
    rebatched = make_experience_batch(items)
    assert [int(k) for k in rebatched.info[ADAPTER_INFO_KEY]] == [0, 0, 0]  # a list of 0-d tensors there
    assert torch.equal(rebatched.advantages, experiences[0].advantages)


# -------------------------------------------------------------------------------- advantages (by hand)


def scenario():
    """Two adapters, two roles, four groups of sizes 2, 3, 1, 2, interleaved, different response lengths."""
    return [
        traj("t0", "t0/propose/code_o", 2, 3, 1.0, seed=0),    # 0  G1 a=+1, 3 action tokens
        traj("s0", "s0/solve/code_o", 3, 1, 2.0, seed=1),      # 1  G2 a=+2, 1 token
        traj("s0", "s0/solve/code_i", 2, 2, 0.7, seed=2),      # 2  G3 (size 1) a=0.7, 2 tokens
        traj("t0", "t0/propose/code_o", 4, 1, -1.0, seed=3),   # 3  G1 a=-1, 1 token
        traj("s0", "s0/solve/code_o", 2, 1, 0.0, seed=4),      # 4  G2 a=0, 1 token
        traj("t0", "t0/propose/code_i", 2, 2, 0.3, seed=5),    # 5  G4 (constant) a=0.3, 2 tokens
        traj("s0", "s0/solve/code_o", 2, 2, -2.0, seed=6),     # 6  G2 a=-2, 2 tokens
        traj("t0", "t0/propose/code_i", 3, 4, 0.3, seed=7),    # 7  G4 a=0.3, 4 tokens
    ]


def test_kl_off_auto_keeps_each_trajectorys_value_on_every_action_token():
    trajectories = scenario()
    experiences = build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=2)
    maker = make_maker(make_args())
    assert not maker.rewhitens()
    adv = per_token(finish(maker, experiences))
    for i, t in enumerate(trajectories):
        assert adv[i] == [pytest.approx(t.advantage)] * len(t.response_ids)
    for e in experiences:  # reward on the last action token, gamma 1: the return is the reward
        assert torch.equal(e.returns, e.advantages)
        assert (e.advantages[~e.action_mask.bool()] == 0).all()
        assert e.info["return"].tolist() == pytest.approx(e.rewards.tolist())


def test_rewhiten_always_whitens_tokens_within_each_group_by_hand():
    maker = make_maker(make_args(), rewhiten="always")
    adv = per_token(finish(maker, build_experiences(scenario(), ADAPTERS, PAD, micro_batch_size=2)))
    # G1 tokens [1, 1, 1, -1]: mean 0.5, var (3*0.25 + 2.25)/4 = 0.75, std 0.866025
    #   -> +0.5/0.866025 = 0.577350 ; -1.5/0.866025 = -1.732051
    assert adv[0] == pytest.approx([0.577350] * 3, abs=1e-5)
    assert adv[3] == pytest.approx([-1.732051], abs=1e-5)
    # G2 tokens [2, 0, -2, -2]: mean -0.5, var (6.25 + 0.25 + 2.25 + 2.25)/4 = 2.75, std 1.658312
    #   -> 2.5/1.658312 = 1.507557 ; 0.5/1.658312 = 0.301511 ; -1.5/1.658312 = -0.904534
    assert adv[1] == pytest.approx([1.507557], abs=1e-5)
    assert adv[4] == pytest.approx([0.301511], abs=1e-5)
    assert adv[6] == pytest.approx([-0.904534] * 2, abs=1e-5)
    # G3 (one sequence, equal tokens) and G4 (equal rewards): 0
    assert adv[2] == [0.0, 0.0] and adv[5] == [0.0, 0.0] and adv[7] == [0.0] * 4


def test_no_std_norm_only_subtracts_the_group_token_mean():
    maker = make_maker(make_args(no_std_norm=True), rewhiten="always")
    adv = per_token(finish(maker, build_experiences(scenario(), ADAPTERS, PAD, micro_batch_size=2)))
    # G1 mean 0.5 -> 0.5, -1.5 ; G2 mean -0.5 -> 2.5, 0.5, -1.5
    assert adv[0] == pytest.approx([0.5] * 3) and adv[3] == pytest.approx([-1.5])
    assert adv[1] == pytest.approx([2.5]) and adv[4] == pytest.approx([0.5]) and adv[6] == pytest.approx([-1.5] * 2)
    assert adv[2] == [0.0, 0.0] and adv[7] == [0.0] * 4


def test_reinforce_baseline_subtracts_the_group_mean_of_sequence_rewards():
    trajectories = [traj("s0", "s0/solve/code_o", 2, 1, 1.0, seed=1),
                    traj("t0", "t0/propose/code_o", 2, 2, 0.4, seed=2),
                    traj("s0", "s0/solve/code_o", 2, 3, 0.0, seed=3),
                    traj("s0", "s0/solve/code_o", 2, 2, 0.0, seed=4)]
    maker = make_maker(make_args(estimator="reinforce_baseline"))
    experiences = finish(maker, build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=2))
    adv = per_token(experiences)
    # s0 group [1, 0, 0]: mean 1/3 (each sequence once, whatever its length) -> 2/3, -1/3, -1/3; t0 alone -> 0
    assert adv[0] == pytest.approx([2 / 3])
    assert adv[2] == pytest.approx([-1 / 3] * 3) and adv[3] == pytest.approx([-1 / 3] * 2)
    assert adv[1] == [0.0, 0.0]
    # upstream's group_reward_std (unbiased): sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3) = 0.577350; one -> 0
    stds = {i: float(s) for e in experiences for i, s in zip(e.index, e.info["group_reward_std"], strict=True)}
    assert stds == pytest.approx({0: 0.577350, 2: 0.577350, 3: 0.577350, 1: 0.0}, abs=1e-6)


def kl_pair():
    a = traj("s0", "g", prompt_len=2, response_len=3, advantage=1.0, seed=8)   # 5 tokens, actions 1..3
    b = traj("s0", "g", prompt_len=2, response_len=2, advantage=-1.0, seed=9)  # 4 tokens, actions 1..2
    (e,) = build_experiences([a, b], ADAPTERS, PAD, micro_batch_size=2)
    # kl per prediction; 5.0 sits on a prompt position (masked: must not count)
    kl = torch.tensor([[5.0, 0.1, 0.2, 0.3], [0.0, 0.2, 0.0, 0.0]])
    return e, kl


def test_kl_shaping_enters_returns_like_upstreams_compute_reward():
    e, kl = kl_pair()
    maker = make_maker(make_args(), ref=object(), kl_coef=0.5, rewhiten="never")
    (out,) = finish(maker, [e], kl=kl)
    # a: shaped = -0.5*kl + r on the last action = [-0.05, -0.10, 1 - 0.15] -> returns [0.70, 0.75, 0.85]
    # b: shaped = [-0.10, -1 - 0] -> returns [-1.10, -1.00]
    assert out.returns.tolist()[0] == pytest.approx([0.0, 0.70, 0.75, 0.85])
    assert out.returns.tolist()[1] == pytest.approx([0.0, -1.10, -1.00, 0.0])
    assert out.info["return"].tolist() == pytest.approx([0.70, -1.10])  # the shaped rewards' sum, upstream's info
    assert out.kl is None


def test_kl_on_auto_rewhitens_within_the_group_by_hand():
    e, kl = kl_pair()
    maker = make_maker(make_args(), ref=object(), kl_coef=0.5)
    assert maker.rewhitens()
    (out,) = finish(maker, [e], kl=kl)
    # tokens [0.70, 0.75, 0.85, -1.10, -1.00]: mean 0.04; deviations 0.66 0.71 0.81 -1.14 -1.04;
    # var = (0.4356 + 0.5041 + 0.6561 + 1.2996 + 1.0816)/5 = 0.7954, std 0.891852
    expected = [[0.0, 0.740033, 0.796096, 0.908223], [0.0, -1.278239, -1.166113, 0.0]]
    assert out.advantages.tolist()[0] == pytest.approx(expected[0], abs=1e-5)
    assert out.advantages.tolist()[1] == pytest.approx(expected[1], abs=1e-5)


def test_kl_is_ignored_without_a_reference_group_or_under_kl_loss():
    for ref, use_loss in ((None, False), (object(), True)):
        e, kl = kl_pair()
        maker = make_maker(make_args(use_loss=use_loss), ref=ref, kl_coef=0.5)
        assert not maker.kl_in_rewards() and not maker.rewhitens()
        (out,) = finish(maker, [e], kl=kl)
        assert out.returns.tolist()[0] == pytest.approx([0.0, 1.0, 1.0, 1.0])
        assert out.returns.tolist()[1] == pytest.approx([0.0, -1.0, -1.0, 0.0])


def test_kl_off_per_sequence_advantage_equals_whiten_by_group():
    raw = [1.0, 0.0, 1.0, 1.0, 0.25, 0.5, 0.0, 0.0, 0.9]
    groups = [("t0", "propose", "code_o"), ("s0", "solve", "code_o"), ("s0", "solve", "code_o"),
              ("t0", "propose", "code_o"), ("t0", "propose", "code_i"), ("s0", "solve", "code_i"),
              ("s0", "solve", "code_o"), ("t0", "propose", "code_o"), ("s0", "solve", "code_f")]
    expected = whiten_by_group(raw, groups)
    trajectories = [traj(g[0], "/".join(g), 2 + i % 2, 1 + i % 4, a, seed=i)
                    for i, (g, a) in enumerate(zip(groups, expected, strict=True))]
    maker = make_maker(make_args())
    adv = per_token(finish(maker, build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=3)))
    for i, t in enumerate(trajectories):
        assert adv[i] == pytest.approx([expected[i]] * len(t.response_ids), abs=1e-6)
    assert expected[4] == 0.0 and expected[8] == 0.0  # singletons carry no signal through either path


# ---------------------------------------------------------------------------------- the maker, end to end


def test_make_experience_batch_routes_each_micro_batch_to_its_adapter(identity_ray):
    order = ["s0", "t0", "s0", "t0", "t0", "s0", "s0"]
    trajectories = [traj(a, f"{a}/r", 2 + i % 2, 1 + i % 3, float(i % 2) - 0.5, seed=20 + i)
                    for i, a in enumerate(order)]
    experiences = build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=2)
    actors, ref = Group(PolicyActor, 2), Group(ReferenceActor, 2)
    maker = make_maker(make_args(), actors=actors, ref=ref, kl_coef=0.0)
    out = maker.make_experience_batch(experiences)
    # upstream slices the 4 micro-batches 2 + 2 over the two actors; each forward names its own adapter
    seen = [name for actor in actors._actor_handlers for name, _ in actor.calls]
    assert seen == ["t0", "t0", "s0", "s0"]
    assert [name for actor in ref._actor_handlers for name, _ in actor.calls] == ["base"] * 4
    for e in out:
        for row, index in enumerate(e.index):
            t = trajectories[index]
            alone = build_experiences([t], ADAPTERS, PAD, micro_batch_size=1)[0]
            want = bigram_log_probs(bigram_table(t.adapter), alone.sequences, alone.action_mask)[0]
            got = e.action_log_probs[row][: want.shape[0]]
            assert torch.allclose(got, want)  # right padding leaves the sample's log-probs untouched
            assert (e.action_log_probs[row][want.shape[0]:] == 0).all()
            base = bigram_log_probs(bigram_table("base"), alone.sequences, alone.action_mask)[0]
            kl_mean = (want - base)[alone.action_mask[0].bool()].mean()  # upstream k1, masked mean
            assert e.info["kl"][row].item() == pytest.approx(kl_mean.item(), abs=1e-5)
    # KL coefficient 0: advantages are still exactly the trajectories' values
    adv = per_token(out)
    for i, t in enumerate(trajectories):
        assert adv[i] == [pytest.approx(t.advantage)] * len(t.response_ids)


def test_make_experience_batch_with_kl_uses_the_reference_log_probs(identity_ray):
    trajectories = [traj("t0", "t0/p", 2, 3, 1.0, seed=30), traj("t0", "t0/p", 2, 2, -1.0, seed=31)]
    experiences = build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=2)
    coef = 0.05
    maker = make_maker(make_args(), actors=Group(PolicyActor, 1), ref=Group(ReferenceActor, 1),
                       kl_coef=coef, rewhiten="never")
    (out,) = maker.make_experience_batch(experiences)
    for row, t in enumerate(trajectories):
        alone = build_experiences([t], ADAPTERS, PAD, micro_batch_size=1)[0]
        mask = alone.action_mask[0].bool()
        kl = (bigram_log_probs(bigram_table("t0"), alone.sequences, alone.action_mask)[0]
              - bigram_log_probs(bigram_table("base"), alone.sequences, alone.action_mask)[0])[mask]
        # returns_t = r - coef * sum_{s >= t} kl_s (gamma 1)
        want = [t.advantage - coef * float(kl[j:].sum()) for j in range(len(kl))]
        assert out.returns[row][mask.nonzero().flatten()].tolist() == pytest.approx(want, abs=1e-5)


def test_mixed_micro_batches_and_missing_names_are_rejected(identity_ray):
    a, b = traj("t0", "g", 2, 1, 0.0), traj("s0", "g", 2, 1, 0.0)
    mixed = build_experiences([a], ADAPTERS, PAD, 1)[0]
    mixed.info[ADAPTER_INFO_KEY] = torch.tensor([0, 1])
    maker = make_maker(make_args(), actors=Group(PolicyActor, 1))
    with pytest.raises(ValueError, match="mixes adapters"):
        maker.make_experience_batch([mixed])
    maker.adapter_names = None
    with pytest.raises(ValueError, match="adapter_names is unset"):
        maker.make_experience_batch(build_experiences([b], ADAPTERS, PAD, 1))


@pytest.mark.parametrize("estimator", ["gae", "rloo", "group_norm", "dr_grpo", "flash_reinforce"])
def test_only_reinforce_estimators_are_accepted(estimator):
    with pytest.raises(ValueError, match="reinforce or reinforce_baseline"):
        make_maker(make_args(estimator=estimator))


def test_length_penalties_and_bad_modes_are_rejected():
    args = make_args()
    args.reward.overlong_buffer_len = 16
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        make_maker(args)
    with pytest.raises(ValueError, match="rewhiten"):
        make_maker(make_args(), rewhiten="sometimes")
    args = make_args()
    args.train.dynamic_batch_enable = True
    with pytest.raises(ValueError, match="dynamic_batch_enable"):
        make_maker(args)


def test_reinforce_baseline_keeps_gamma_one_like_upstream():
    t = traj("t0", "t0/g", 2, 3, 1.0, seed=5)
    u = traj("t0", "t0/g", 2, 1, -1.0, seed=6)
    maker = make_maker(make_args(estimator="reinforce_baseline", gamma=0.5))
    assert not maker.rewhitens()
    (e,) = finish(maker, build_experiences([t, u], ADAPTERS, PAD, micro_batch_size=2))
    # group mean 0, no discounting: every action token keeps its sequence's value
    assert e.returns[0][e.action_mask[0].bool()].tolist() == pytest.approx([1.0, 1.0, 1.0])
    assert e.returns[1][e.action_mask[1].bool()].tolist() == pytest.approx([-1.0])


def test_gamma_below_one_discounts_and_auto_rewhitens():
    t = traj("t0", "t0/g", 2, 3, 1.0, seed=5)
    u = traj("t0", "t0/g", 2, 1, -1.0, seed=6)
    maker = make_maker(make_args(gamma=0.5), rewhiten="auto")
    assert maker.rewhitens()
    experiences = finish(maker, build_experiences([t, u], ADAPTERS, PAD, micro_batch_size=2))
    e = experiences[0]
    # returns: t = [0.25, 0.5, 1.0], u = [-1.0] (reward on the last token, discounted backwards)
    assert e.returns[0][e.action_mask[0].bool()].tolist() == pytest.approx([0.25, 0.5, 1.0])
    # tokens [0.25, 0.5, 1, -1]: mean 0.1875; var = (0.00390625 + 0.09765625 + 0.66015625 + 1.41015625)/4
    #   = 0.54296875, std 0.736864 -> [0.084819, 0.424094, 1.102646, -1.611559]
    adv = e.advantages[e.action_mask.bool()].tolist()
    assert adv == pytest.approx([0.084819, 0.424094, 1.102646, -1.611559], abs=1e-5)
    assert math.isclose(sum(adv), 0.0, abs_tol=1e-6)


@pytest.mark.parametrize(("counts", "ranks"), [((1, 0), 2), ((1, 2), 2), ((5, 2), 4), ((3, 3), 1)])
def test_micro_batches_are_dealt_evenly_over_the_ranks_with_equal_forward_counts(identity_ray, counts, ranks):
    """Upstream gives rank r the contiguous chunk r of the list (ceil(total / ranks) each), raises "Insufficient
    batch size" when there are fewer micro-batches than ranks and leaves the last ranks short otherwise: an
    adapter's micro-batches sat on one rank, and under ZeRO-3 ranks with fewer forward passes wait forever in
    the others' all-gathers. Dealt, every rank runs the same number of forwards (padding passes where needed),
    holds its share of each adapter, and the real samples keep their advantages; padding gets none."""
    trajectories = [traj(name, f"{name}/r", 3, 2, float(i % 2) - 0.5, seed=40 + i)
                    for name, count in zip(ADAPTERS, counts, strict=True) for i in range(2 * count)]
    built = build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=2, ranks=ranks)
    dealt = deal_experiences(built, ranks, PAD)
    if ranks == 1:
        assert dealt == built
    actors = Group(PolicyActor, ranks)
    out = make_maker(make_args(), actors=actors).make_experience_batch(dealt)
    calls = [[name for name, _ in actor.calls] for actor in actors._actor_handlers]
    assert len({len(c) for c in calls}) == 1 and len(calls[0]) >= 1  # the same number of forwards on every rank
    real = [[e for e in out[r * len(calls[0]):(r + 1) * len(calls[0])] if not is_padding(e)] for r in range(ranks)]
    for name, count in zip(ADAPTERS, counts, strict=True):
        mine = [sum(1 for e in rank if ADAPTERS[int(e.info[ADAPTER_INFO_KEY][0])] == name) for rank in real]
        assert sum(mine) == sum(1 for e in built if ADAPTERS[int(e.info[ADAPTER_INFO_KEY][0])] == name)
        assert max(mine) - min(mine) <= 1, (name, mine)  # spread, not stacked
        if 2 * count >= ranks:  # enough samples: a share on every rank (micro-batches made small enough)
            assert min(mine) >= 1, (name, mine)
    padding = [e for e in out if is_padding(e)]
    assert len(out) == len(built) + len(padding) and len(out) % ranks == 0
    for e in padding:
        assert not e.action_mask.any() and not e.advantages.any() and e.info["kl"].item() == 0
    adv = per_token([e for e in out if not is_padding(e)])
    for i, t in enumerate(trajectories):
        assert adv[i] == [pytest.approx(t.advantage)] * len(t.response_ids)


def test_experience_forwards_stay_within_the_scoring_budget(identity_ray):
    """Experience making runs one forward per micro-batch; with ``max_tokens`` (the scoring memory budget in
    tokens, ``memory.scoring_tokens``) each holds at most that many tokens (rows x padded width) and at most
    ``micro_batch_size`` rows, a longer sample alone; every sample's log-probs and advantages are the ones it gets
    without the bound. Catches micro-batches of --rollout.micro_batch_size rows whatever their length."""
    responses = [2, 9, 3, 3, 12, 2, 2]  # prompts of 3: widths 5, 12, 6, 6, 15, 5, 5
    trajectories = [traj("t0", "t0/r", 3, n, float(i % 3) - 1.0, seed=60 + i) for i, n in enumerate(responses)]
    free = make_maker(make_args(), actors=Group(PolicyActor, 1)).make_experience_batch(
        build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=4))
    actors = Group(PolicyActor, 1)
    bounded = build_experiences(trajectories, ADAPTERS, PAD, micro_batch_size=4, max_tokens=14)
    out = make_maker(make_args(), actors=actors).make_experience_batch(bounded)
    # 5 then 12: 2 x 12 = 24 > 14, so 5 alone; 12 then 6: 24 > 14; 6 + 6: 12; then 15 (over 14) alone; 5 + 5: 10
    assert actors._actor_handlers[0].shapes == [(1, 5), (1, 12), (2, 6), (1, 15), (2, 5)]
    assert [e.index for e in out] == [[0], [1], [2, 3], [4], [5, 6]]
    logp_free, logp = ({i: e.action_log_probs[r][e.action_mask[r].bool()].tolist()
                        for e in got for r, i in enumerate(e.index)} for got in (free, out))
    assert logp == logp_free and per_token(out) == per_token(free)
