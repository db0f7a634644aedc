"""Self-play trajectories -> OpenRLHF experiences, with advantages grouped per (member, role, task type).

Upstream's ``RemoteExperienceMaker`` assumes one policy and equal prompt groups: it reshapes every reward of
the rollout to ``(-1, n_samples_per_prompt)`` and whitens advantages over the whole batch. A PopuLoRA step
holds N adapters and groups of different sizes (a teacher's proposals, a student's m answers per task), so:

- :func:`build_experiences` turns the loop's ``Trajectory`` list into the micro-batch ``Experience`` objects
  upstream's ``split_rollout_samples`` would produce (one sample = what ``_process_response_into_experience``
  builds; micro-batch = ``Experience.concat_experiences``, right padding), bucketed so that every micro-batch
  holds ONE adapter, and small enough that the forward scoring it stays within the scoring memory budget
  (``memory.row_chunks``). Each sample carries ``info[ADAPTER_INFO_KEY]`` (its adapter's index in
  ``adapter_names``) and ``info[GROUP_INFO_KEY]`` (its group's index in :func:`group_names` of the
  trajectories); its ``labels`` entry is the group name.
- :class:`PopuLoRAExperienceMaker` keeps upstream's ``make_experience`` (old log-probs, reference KL) and
  adds ``adapter_name=[...]`` to the actor group's batched ``forward``; its ``compute_advantages_and_returns``
  reuses upstream's ``compute_reward`` and ``get_cumulative_returns`` but never reshapes globally and whitens
  per group instead of batch-wide.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

from openrlhf_populora.engines.base import Trajectory
from openrlhf_populora.engines.ray import ADAPTER_INFO_KEY, GROUP_INFO_KEY
from openrlhf_populora.engines.ray.memory import row_chunks

log = logging.getLogger(__name__)

ESTIMATORS = ("reinforce", "reinforce_baseline")
REWHITEN_MODES = ("auto", "always", "never")


# ------------------------------------------------------------------------------------------ trajectories


def group_key(trajectory: Trajectory) -> str:
    """The trajectory's advantage group: ``trajectory.group``, or its adapter's name when that is empty."""
    return trajectory.group or trajectory.adapter


def group_names(trajectories: Sequence[Trajectory]) -> list[str]:
    """Distinct group keys in order of first appearance: ``info[GROUP_INFO_KEY] == i`` means ``names[i]``."""
    return list(dict.fromkeys(group_key(t) for t in trajectories))


def experience_group_names(experiences: Sequence[Experience]) -> dict[int, str]:
    """Group index -> group name, read back from built experiences (their ``labels`` hold the names)."""
    names: dict[int, str] = {}
    for experience in experiences:
        for index, label in zip(experience.info[GROUP_INFO_KEY].tolist(), experience.labels, strict=True):
            if names.setdefault(int(index), label) != label:
                raise ValueError(f"group index {index} names both {names[int(index)]!r} and {label!r}")
    return names


def _sample(trajectory: Trajectory, index: int, adapter: int, group: int) -> Experience:
    """One sample, shaped as upstream's ``_process_response_into_experience`` shapes it (batch of one).

    ``sequences`` = prompt + response; ``action_mask`` has one entry per next-token prediction (length
    ``len(sequences) - 1``), set for the predictions of response tokens; ``rewards`` = ``scores`` =
    ``info["reward"]`` = the trajectory's (already whitened) advantage.
    """
    prompt, response = list(trajectory.prompt_ids), list(trajectory.response_ids)
    if not prompt:
        raise ValueError(f"trajectory {index} ({trajectory.adapter!r}) has an empty prompt")
    if not response:
        raise ValueError(f"trajectory {index} ({trajectory.adapter!r}) has an empty response")
    advantage = float(trajectory.advantage)
    if not math.isfinite(advantage):
        raise ValueError(f"trajectory {index} ({trajectory.adapter!r}) has a non-finite advantage {advantage}")
    tokens = prompt + response
    sequences = torch.tensor(tokens, dtype=torch.long)
    attention_mask = torch.ones(len(tokens), dtype=torch.long)
    action_mask = torch.zeros(len(tokens), dtype=torch.long)
    action_mask[len(prompt):] = 1
    action_mask = action_mask[1:]  # position t predicts token t + 1, as upstream slices it
    reward = torch.tensor([advantage])
    return Experience(
        sequences=sequences.unsqueeze(0),
        attention_mask=attention_mask.unsqueeze(0),
        action_mask=action_mask.unsqueeze(0),
        index=[index],
        prompts=[""],
        labels=[group_key(trajectory)],
        images=[None],
        mm_train_inputs=[None],
        rewards=reward,
        scores=reward.clone(),
        response_length=torch.tensor([len(response)]),
        truncated=torch.tensor([False]),
        total_length=torch.tensor([float(len(tokens))]),
        info={
            "response_clip_ratio": torch.tensor([False]),
            "reward": reward.clone(),
            "score": reward.clone(),
            ADAPTER_INFO_KEY: torch.tensor([adapter]),
            GROUP_INFO_KEY: torch.tensor([group]),
        },
    )


def build_experiences(
    trajectories: Sequence[Trajectory], adapter_names: Sequence[str], pad_token_id: int, micro_batch_size: int,
    ranks: int = 1, max_tokens: int | None = None,
) -> list[Experience]:
    """One ``Experience`` per micro-batch of at most ``micro_batch_size`` samples, each of ONE adapter.

    ``ranks``: the data-parallel ranks the micro-batches will be dealt over (:func:`deal_experiences`); an
    adapter's micro-batches are then made small enough that there is one per rank where its samples allow
    (at most ``ceil(n / ranks)`` samples each), so every rank holds a share of every adapter.

    ``max_tokens``: the most tokens (samples x the micro-batch's padded width) one micro-batch may hold, so that
    the forward pass scoring it stays within the scoring memory budget (``memory.scoring_tokens``); a micro-batch
    is closed early when the next sample would pass it (:func:`memory.row_chunks`), and one sample is always a
    micro-batch. ``None``: no bound.

    Samples are bucketed by adapter (buckets in ``adapter_names`` order, input order kept within a bucket),
    then concatenated with upstream's ``Experience.concat_experiences`` (right padding: ``sequences`` with
    ``pad_token_id``, every other tensor with 0). ``Experience.index`` lists each sample's position in
    ``trajectories``; ``info[ADAPTER_INFO_KEY]`` and ``info[GROUP_INFO_KEY]`` are int64 indices into
    ``adapter_names`` and ``group_names(trajectories)``.
    """
    names = list(adapter_names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"adapter_names must be non-empty and distinct, got {names}")
    if int(micro_batch_size) < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not trajectories:
        raise ValueError("no trajectories to build experiences from")
    adapter_index = {name: i for i, name in enumerate(names)}
    group_index = {name: i for i, name in enumerate(group_names(trajectories))}
    buckets: list[list[Experience]] = [[] for _ in names]
    for i, trajectory in enumerate(trajectories):
        if trajectory.adapter not in adapter_index:
            raise ValueError(f"trajectory {i} names unknown adapter {trajectory.adapter!r}; known: {names}")
        k = adapter_index[trajectory.adapter]
        buckets[k].append(_sample(trajectory, i, k, group_index[group_key(trajectory)]))
    out = []
    for bucket in buckets:
        size = max(1, min(int(micro_batch_size), -(-len(bucket) // max(1, int(ranks)))))
        lengths = [int(sample.sequences.shape[1]) for sample in bucket]
        out += [Experience.concat_experiences(bucket[chunk.start:chunk.stop], pad_token_id)
                for chunk in row_chunks(lengths, size, max_tokens)]
    return out


PAD_GROUP = -1  # info[GROUP_INFO_KEY] of a padding micro-batch: no action token, no advantage group


def padding_experience(adapter: int, pad_token_id: int) -> Experience:
    """A one-sample micro-batch of ``adapter`` index with no action token: a forward pass that changes nothing.
    :func:`deal_experiences` gives one to each rank that would otherwise run fewer forward passes than the
    others; the maker gives it no advantage and the policy actor leaves it out of training."""
    zero = torch.zeros(1)
    return Experience(
        sequences=torch.full((1, 2), pad_token_id, dtype=torch.long),
        attention_mask=torch.ones((1, 2), dtype=torch.long),
        action_mask=torch.zeros((1, 1), dtype=torch.long),
        index=[-1],
        prompts=[""],
        labels=[""],
        images=[None],
        mm_train_inputs=[None],
        rewards=zero,
        scores=zero.clone(),
        response_length=torch.tensor([0]),
        truncated=torch.tensor([False]),
        total_length=torch.tensor([2.0]),
        info={
            "response_clip_ratio": torch.tensor([False]),
            "reward": zero.clone(),
            "score": zero.clone(),
            ADAPTER_INFO_KEY: torch.tensor([adapter]),
            GROUP_INFO_KEY: torch.tensor([PAD_GROUP]),
        },
    )


def is_padding(experience: Experience) -> bool:
    """Whether a micro-batch (or one sample) is :func:`padding_experience`."""
    group = experience.info.get(GROUP_INFO_KEY)
    if group is None:
        return False
    if isinstance(group, (list, tuple)):
        group = torch.stack([torch.as_tensor(g).reshape(()) for g in group]) if group else torch.zeros(0)
    return bool((torch.as_tensor(group).reshape(-1) == PAD_GROUP).all())


def deal_experiences(experiences: Sequence[Experience], ranks: int, pad_token_id: int) -> list[Experience]:
    """The micro-batches ordered for ``ranks`` data-parallel ranks, so each rank gets a near-equal share of
    every adapter's micro-batches and exactly as many micro-batches as every other rank.

    Upstream hands rank r the contiguous chunk ``[r*c, (r+1)*c)`` with ``c = ceil(total / ranks)``
    (``RayActorGroup.async_run_method_batch``), raises "Insufficient batch size" when ``total < ranks`` and
    leaves the last ranks short when ``ranks`` does not divide ``total``. :func:`build_experiences` emits the
    micro-batches adapter by adapter, so contiguous chunks would put each adapter on one or two ranks (the
    others pad its training window with empty passes), and under ZeRO-3 ranks running different numbers of
    forward passes wait forever in each other's all-gathers. Here micro-batch i goes to rank ``i % ranks``
    (each adapter's micro-batches dealt across the ranks in turn), every rank is padded with
    :func:`padding_experience` to the same count (at least one), and the ranks' lists are concatenated: each
    chunk is then exactly one rank's list. With one rank the list is returned unchanged.
    """
    experiences = list(experiences)
    if ranks <= 1 or not experiences:
        return experiences
    buckets: list[list[Experience]] = [[] for _ in range(ranks)]
    for i, experience in enumerate(experiences):
        buckets[i % ranks].append(experience)
    width = max(len(bucket) for bucket in buckets)
    for bucket in buckets:
        adapter = micro_batch_adapter(bucket[-1] if bucket else experiences[-1])
        bucket += [padding_experience(adapter, pad_token_id) for _ in range(width - len(bucket))]
    return [experience for bucket in buckets for experience in bucket]


def micro_batch_adapter(experience: Experience) -> int:
    """The one adapter index of a micro-batch; raises when it is missing or mixed."""
    if ADAPTER_INFO_KEY not in experience.info:
        raise ValueError(f"experience has no info[{ADAPTER_INFO_KEY!r}]: build it with build_experiences")
    indices = set(experience.info[ADAPTER_INFO_KEY].reshape(-1).tolist())
    if len(indices) != 1:
        raise ValueError(f"micro-batch mixes adapters {sorted(indices)}: one adapter per micro-batch")
    return int(indices.pop())


# ----------------------------------------------------------------------------------------- the maker


class PopuLoRAExperienceMaker(RemoteExperienceMaker):
    """Upstream's experience maker for N adapters and explicit advantage groups.

    Constructed like ``RemoteExperienceMaker`` (actor, critic, reward, initial model groups, KL controller,
    strategy, tokenizer), plus two keywords:

    - ``adapter_names``: index -> adapter name, the list given to :func:`build_experiences` (settable later
      as ``maker.adapter_names``); used to name each micro-batch's adapter in the actor's ``forward``.
    - ``rewhiten``: token-level whitening within each group after returns are computed (see
      :meth:`compute_advantages_and_returns`): ``"auto"`` (default), ``"always"`` or ``"never"``.

    Only the estimators ``reinforce`` and ``reinforce_baseline`` are accepted; there is never a reward
    model (rewards are the loop's advantages, precomputed, so upstream skips the RM) and never a critic.
    """

    def __init__(self, *args, adapter_names: Sequence[str] | None = None, rewhiten: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        if self.advantage_estimator not in ESTIMATORS:
            raise ValueError(f"PopuLoRA supports --algo.advantage.estimator {' or '.join(ESTIMATORS)}, "
                             f"not {self.advantage_estimator!r}")
        if rewhiten not in REWHITEN_MODES:
            raise ValueError(f"rewhiten must be one of {REWHITEN_MODES}, got {rewhiten!r}")
        reward = getattr(self.args, "reward", None)
        for flag in ("overlong_buffer_len", "stop_properly_penalty_coef"):
            if getattr(reward, flag, None) is not None:
                raise ValueError(f"--reward.{flag} is not supported: PopuLoRA's rewards are whitened per group "
                                 "by the self-play loop before they reach OpenRLHF")
        if getattr(getattr(self.args, "train", None), "dynamic_batch_enable", False):
            raise ValueError("--train.dynamic_batch_enable is not supported: its length-balanced re-batching mixes "
                             "adapters, and every micro-batch must hold one adapter")
        self.adapter_names = list(adapter_names) if adapter_names is not None else None
        self.rewhiten = rewhiten
        self._forward_adapters: list[str] | None = None

    # ---------------------------------------------------------------------------------- experience

    @torch.no_grad()
    def make_experience_batch(self, rollout_samples: list[Experience]) -> list[Experience]:
        """``rollout_samples`` are :func:`build_experiences`' micro-batches (already split, one adapter each):
        upstream's ``make_experience`` then ``compute_advantages_and_returns``, without re-splitting."""
        if not rollout_samples:
            raise ValueError("no experiences")
        for experience in rollout_samples:
            micro_batch_adapter(experience)
            if experience.rewards is None:
                raise ValueError("experience without rewards: PopuLoRA never runs a reward model")
        experiences = self.make_experience(rollout_samples)
        return self.compute_advantages_and_returns(experiences)

    @torch.no_grad()
    def make_experience(self, samples_list: list[Experience]) -> list[Experience]:
        """Upstream's ``make_experience``, with each micro-batch's adapter name sent to the actor's forward."""
        if self.adapter_names is None:
            raise ValueError("PopuLoRAExperienceMaker.adapter_names is unset: pass the list build_experiences got")
        adapters = [micro_batch_adapter(s) for s in samples_list]
        if max(adapters) >= len(self.adapter_names):
            raise ValueError(f"adapter index {max(adapters)} outside adapter_names {self.adapter_names}")
        self._forward_adapters = [self.adapter_names[k] for k in adapters]
        try:
            return super().make_experience(samples_list)
        finally:
            self._forward_adapters = None

    def _dispatch_forward(self, group, sync_condition, **kwargs):
        """Upstream's dispatch; the actor group's batched ``forward`` also gets ``adapter_name=[...]``,
        which ``async_run_method_batch`` slices like the tensors, so each ``forward`` call gets its own."""
        if group is self.actor_model_group and self._forward_adapters is not None:
            kwargs["adapter_name"] = list(self._forward_adapters)
        return super()._dispatch_forward(group, sync_condition, **kwargs)

    # ---------------------------------------------------------------------------------- advantages

    def kl_in_rewards(self) -> bool:
        """Whether ``compute_reward`` shapes rewards with KL: a reference group, ``kl.use_loss`` off and a
        positive coefficient (upstream's conditions; otherwise ``experience.kl`` is zero or unused)."""
        return (self.initial_model_group is not None and not self.args.algo.kl.use_loss
                and float(self.kl_ctl.value) > 0.0)

    def _gamma(self) -> float:
        gamma = float(self.args.algo.advantage.gamma)
        if self.advantage_estimator == "reinforce_baseline" and gamma != 1.0:
            log.warning("gamma is 1.0 for reinforce_baseline (got %s), as upstream sets it", gamma)
            return 1.0
        return gamma

    def rewhitens(self) -> bool:
        """Whether advantages are whitened again (token level, per group) after returns are computed.

        ``"auto"``: exactly when the per-token returns can differ from the trajectory's value, i.e. KL shaping
        is in the rewards or gamma != 1. Otherwise every action token's return IS the loop's advantage,
        already whitened per group (sequence level), and a second whitening would only re-weight by length.
        """
        if self.rewhiten == "auto":
            return self.kl_in_rewards() or self._gamma() != 1.0
        return self.rewhiten == "always"

    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences: list[Experience]) -> list[Experience]:
        """Returns and advantages per token, grouped by ``info[GROUP_INFO_KEY]`` instead of upstream's
        ``reshape(-1, n_samples_per_prompt)`` and batch-wide whitening.

        Per sample i of group g, with r_i = ``rewards[i]`` (the loop's advantage):

        1. ``reinforce_baseline`` only: r_i -= mean of r over the sequences of g (each sequence counts once).
        2. upstream's ``compute_reward``: clip r_i to ``--reward.clip_range`` and put it on the last action
           token, minus ``kl_coef * kl`` on every token (kl is 0 unless :meth:`kl_in_rewards`).
        3. upstream's ``get_cumulative_returns`` (gamma; 1 for ``reinforce_baseline``): advantages = returns.
        4. if :meth:`rewhitens`: whiten per group over its action tokens, A <- (A - mean_g) / std_g with
           mean_g, var_g = masked token mean and variance over the group's tokens (upstream's formula:
           var clamped at 1e-8; only the mean is subtracted under ``--algo.advantage.no_std_norm``).
           A group whose action-token values are all equal gets 0.

        With KL off and gamma 1, every action token's advantage equals the trajectory's advantage exactly
        (``rewhiten="auto"``). Rewhitening it anyway (``"always"``) is not a no-op: the token-level mean and
        std weight each sequence by its length, so a group [+1, -1] with 3 and 1 action tokens becomes
        [+0.577, -1.732]; longer responses pull the baseline towards themselves.

        Padded (non-action) positions hold 0 in advantages and returns. ``info`` gains ``return`` (the
        shaped reward summed over action tokens; upstream sums every position, the same number whenever kl
        is 0 off the action tokens, as upstream's masked log-probs make it) and ``group_reward_std`` (std of r in the group,
        unbiased as upstream's, 0 for a group of one).
        """
        args = self.args
        if self.advantage_estimator not in ESTIMATORS:
            raise ValueError(f"unsupported advantage estimator {self.advantage_estimator!r}")
        everything, experiences = experiences, [e for e in experiences if not is_padding(e)]
        for experience in everything:
            if is_padding(experience):  # no action token: nothing to learn, no group statistics
                experience.returns = torch.zeros(experience.action_mask.shape)
                experience.advantages = torch.zeros(experience.action_mask.shape)
                experience.info["return"] = torch.zeros(1)
                experience.info["group_reward_std"] = torch.zeros(1)
                for key in ("kl", "logprobs_diff"):  # upstream's masked means over no token: 0/0
                    if key in experience.info:
                        experience.info[key] = torch.zeros(1)
                experience.kl = None
        if not experiences:
            return everything
        for experience in experiences:
            experience.rewards = experience.rewards.to(torch.promote_types(experience.rewards.dtype, torch.float32))
            if GROUP_INFO_KEY not in experience.info:
                raise ValueError(f"experience has no info[{GROUP_INFO_KEY!r}]: build it with build_experiences")

        sizes = [len(e.rewards) for e in experiences]
        rewards = torch.cat([e.rewards for e in experiences])
        groups = torch.cat([e.info[GROUP_INFO_KEY].reshape(-1).long() for e in experiences])
        if len(groups) != len(rewards):
            raise ValueError(f"{len(rewards)} rewards but {len(groups)} group ids")
        _, slot = torch.unique(groups, return_inverse=True)
        n_groups = int(slot.max()) + 1
        counts = torch.bincount(slot, minlength=n_groups).to(rewards.dtype)
        means = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, slot, rewards) / counts
        squares = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, slot, (rewards - means[slot]) ** 2)
        stds = torch.where(counts > 1, (squares / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(squares))
        if self.advantage_estimator == "reinforce_baseline":
            rewards = rewards - means[slot]

        gamma = self._gamma()
        kl_coef = float(self.kl_ctl.value) if self.kl_in_rewards() else 0.0
        for experience, reward, group_std in zip(experiences, rewards.split(sizes), stds[slot].split(sizes),
                                                 strict=True):
            mask = experience.action_mask
            kl = experience.kl if experience.kl is not None else torch.zeros(mask.shape, dtype=torch.float32)
            shaped = compute_reward(reward, kl_coef, kl, action_mask=mask, reward_clip_range=args.reward.clip_range)
            experience.returns = self.get_cumulative_returns(shaped, mask, gamma) * mask
            experience.advantages = experience.returns.clone()
            experience.info["return"] = (shaped * mask).sum(dim=-1)
            experience.info["group_reward_std"] = group_std
            experience.kl = None

        if self.rewhitens():
            self._whiten_per_group(experiences, slot.split(sizes), n_groups)
        return everything

    def _whiten_per_group(self, experiences: list[Experience], slots: Sequence[torch.Tensor], n_groups: int) -> None:
        """Masked token-level whitening within each group (upstream's batch-wide formula, per group)."""
        no_std_norm = bool(self.args.algo.advantage.no_std_norm)
        for g in range(n_groups):
            rows = [(e, s == g) for e, s in zip(experiences, slots, strict=True) if bool((s == g).any())]
            values = torch.cat([e.advantages[r].float()[e.action_mask[r].bool()] for e, r in rows])
            if bool((values == values[0]).all()):
                mean, rstd = values[0], 0.0  # constant group: every centered value is 0
            else:
                mean = values.mean()
                rstd = 1.0 if no_std_norm else float((values - mean).pow(2).mean().clamp(min=1e-8).rsqrt())
            for e, r in rows:
                mask = e.action_mask[r].to(e.advantages.dtype)
                e.advantages[r] = (e.advantages[r] - mean) * rstd * mask
