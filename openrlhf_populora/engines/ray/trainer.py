"""The controller: OpenRLHF's PPO trainer running the PopuLoRA self-play loop on Ray.

``PopuLoRATrainer`` subclasses upstream's ``PPOTrainer`` (its inner class, re-decorated: Ray forbids
subclassing an actor class). Upstream's ``train()`` builds it exactly as it builds ``PPOTrainer``, with the
policy actor group and the vLLM engines. What changes:

- no prompt dataset: the prompts are the loop's proposer and solver prompts, written each step;
- ``fit`` hands a :class:`RayEngine` to the run function the composition layer named in
  ``args.populora.runner`` (``"module:function"``; ``build.ray:run_selfplay`` runs the same self-play loop as the local
  engine). The trainer knows no loop, no config tree and no AZR;
- ``RayEngine.train_step`` hands the loop's trajectories to upstream's own ``train_step`` (experience making
  with advantages grouped per (member, role, task type), ``append`` to the actor shards, ``ppo_train``), then
  uploads the adapters that changed itself, each version under a fresh LoRA id; upstream's
  ``broadcast_to_vllm`` hook does nothing (the caller pushes; nothing is pulled through callbacks), and the
  frozen base never moves.

**Sync proof.** After every upload, :meth:`RayEngine.check_sync` proves that each vLLM engine serves what the
trainer holds: the sha256 of the adapter file each engine loaded must equal the policy actor's hash of its
current weights in the engine's dtype (a stale or corrupted upload stops the run, in any dtype), and the
log-probs vLLM reports on a few fixed probe prompts, decoded greedily and sampled, must match the policy actor's
on the same tokens within ``--populora.sync_tolerance`` on the mean (per-dtype defaults, :data:`SYNC_TOLERANCE`).
The largest difference is reported per adapter (``sync_logprob_diff`` in the step's diagnostics).

**Scoring memory.** Every forward that scores log-probs (experience making, :meth:`RayEngine.token_log_probs`)
holds at most ``--populora.scoring_memory_gb`` of logits (rows x padded tokens x vocab x 6 bytes, ``memory.py``):
calls are split into chunks of rows.

**Data parallelism.** ``train_step`` deals each adapter's micro-batches across the policy actor's ranks and pads
every rank to the same count (:func:`experience.deal_experiences`): upstream hands each rank a contiguous chunk.

**A lost node.** When a node that holds the run's actors dies (preempted, failed, stopped), the call that meets
it fails as :class:`LostNode`, naming the node by its address; the runner then stops at its last whole step and
says how to resume. The trainer actor itself is placed on the head node (the driver's), so losing any other node
leaves the controller alive to say so.

``RayEngine`` implements ``engines.base.Engine`` over the actor group and the vLLM actors; it knows nothing of
AZR. It runs inside the trainer actor's process.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

import ray
import torch
from openrlhf.trainer.ppo_trainer import BasePPOTrainer, PPOTrainer
from openrlhf.utils.utils import get_tokenizer

from openrlhf_populora.engines.adapter_files import write_peft_adapter
from openrlhf_populora.engines.base import (
    BASE_ADAPTER,
    Completion,
    GenerationRequest,
    SamplingParams,
    Trajectory,
    render_chat,
)
from openrlhf_populora.engines.ray import memory
from openrlhf_populora.engines.ray.experience import (
    PopuLoRAExperienceMaker,
    build_experiences,
    deal_experiences,
)

RAY_TIMEOUT_S = 3600.0  # one ray.get never waits longer than this: an unschedulable actor must not hang a run
PROBE_TEXTS = ("def f(x):\n    return", "The answer is", "for i in range(")  # the sync probe's prompts
PROBE_TOKENS = 8  # tokens per probe prompt, greedy and sampled
PROBE_SEED = 20261204  # the sampled probe's seed (each prompt's own stream derives from it)
# The sync probe's tolerance on the mean |log-prob difference| over its tokens, per training dtype. Measured on
# the tiny model (tests/cluster/test_ray_vllm_rollout.py), a fresh upload: fp32 mean 1.4e-6 (max 8e-6); vLLM in bf16 against
# the fp32 trainer, mean 0.036 (max 0.18). Published for Qwen2.5-0.5B: about 0.03 nats RMS between DeepSpeed and
# vLLM in bf16 (ServiceNow/Fast-LLM#525), single tokens up to 0.3 (vllm#18352): hence a mean, not a maximum, with
# room above it. Staleness and corruption are caught exactly by the content hash, whatever the dtype (in bf16 a
# corrupted upload moved the mean by 0.04 only).
SYNC_TOLERANCE = {"fp32": 1e-3, "bf16": 0.1}


class AdapterSyncError(RuntimeError):
    """vLLM serves an adapter whose log-probs differ from the trainer's beyond the tolerance."""


HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node alone


class LostNode(RuntimeError):
    """A Ray node that held the run's actors died during a call (preempted, failed or stopped)."""


# After a Ray error, how long to wait for the cluster to declare a node dead: Ray's GCS marks a raylet dead after
# its health checks fail (by default every 3 s, 5 in a row, each with a 10 s timeout), and a surviving rank can
# fail first (its collective's peer is gone).
NODE_DEATH_WAIT_S = 90.0


def _get(refs, timeout: float = RAY_TIMEOUT_S):
    return ray.get(refs, timeout=timeout)


def alive_nodes() -> dict[str, str]:
    """``{node id: address}`` of the cluster's live nodes ({} outside a Ray cluster: nothing to lose)."""
    if not ray.is_initialized():
        return {}
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def dead_nodes(known: Mapping[str, str], wait_s: float, poll_s: float = 2.0) -> list[str]:
    """Which of ``known`` (``{node id: address}``) the cluster reports dead, as ``"address (node id[:8], why)"``,
    polling up to ``wait_s`` for one to be declared dead; [] if none is."""
    deadline = time.monotonic() + wait_s
    while True:
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        dead = []
        for node, address in known.items():
            if nodes.get(node, {}).get("Alive", False):
                continue
            why = nodes.get(node, {}).get("DeathReasonMessage")  # Ray's words, when it has them
            dead.append(f"{address} (node {node[:8]}{', ' + why if why else ''})")
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(poll_s)


def _names_lost_nodes(method):
    """A Ray error in ``method`` becomes :class:`LostNode` when a node the run started with has died."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ray.exceptions.RayError as err:
            # decorated methods call each other (train_step -> upload -> check_sync): the innermost asks the
            # cluster once; the callers pass its answer on rather than wait again
            if getattr(err, "_populora_nodes_checked", False):
                raise
            dead = dead_nodes(self._nodes, NODE_DEATH_WAIT_S)
            if not dead:
                err._populora_nodes_checked = True
                raise
            raise LostNode(f"lost Ray node {', '.join(dead)} in {method.__name__}: the actors it held are gone "
                           f"({type(err).__name__})") from err

    return call


class RayEngine:
    """The engine protocol over OpenRLHF's actor group (DeepSpeed, all adapters) and vLLM actors (multi-LoRA)."""

    def __init__(self, trainer: PopuLoRATrainerBase) -> None:
        self.trainer = trainer
        self.args = trainer.args
        self.tokenizer = trainer.tokenizer
        self.actors = trainer.actor_model_group
        self.vllm_engines = list(trainer.vllm_engines or [])
        self._nodes = alive_nodes()  # the nodes the run starts with: one that dies is named (_names_lost_nodes)
        if not self.vllm_engines:
            raise ValueError("the Ray engine generates with vLLM only: set --vllm.num_engines >= 1")
        self._names = list(self.args.populora.adapter_names)
        actor = self.actors._actor_handlers[0]
        self._lora_config, vocab = _get([actor.lora_config.remote(), actor.vocab_size.remote()])
        # the most tokens (rows x padded width) one scoring forward may hold: its logits, rows x tokens x vocab x 6
        # bytes, stay within --populora.scoring_memory_gb (memory.py)
        self.scoring_tokens = memory.scoring_tokens(float(self.args.populora.scoring_memory_gb) * memory.GB, vocab)
        self._uploaded: set[str] = set()
        self.global_step = 0
        tolerance = self.args.populora.sync_tolerance
        if tolerance is None:  # fp32 on both sides agrees to rounding; bf16 kernels differ in the last bits
            tolerance = SYNC_TOLERANCE["fp32" if self.args.ds.param_dtype == "fp32" else "bf16"]
        self.sync_tolerance = float(tolerance)
        self.sync: dict[str, float] = {}  # adapter -> max |log-prob difference| at its last upload
        self.sync_mean: dict[str, float] = {}  # adapter -> mean |log-prob difference| (worst engine)
        self.sync_content_failures = 0
        self.sync_seconds = 0.0  # wall time spent in sync probes
        self.skipped_prompts = 0  # prompts too long for vLLM, answered empty (see generate)
        self._probe = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROBE_TEXTS]
        # upstream's actor group hands each rank one contiguous chunk of every batched call
        self.data_parallel_size = len(self.actors._actor_handlers) // max(1, int(self.actors.duplicate_actors))

    # -------------------------------------------------------------------------------- adapters

    def adapter_names(self) -> list[str]:
        return list(self._names)

    def add_adapter(self, name: str, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Adapters are created with the DeepSpeed engine (one optimizer over all of them), so the set is fixed
        at launch by ``--populora.*``; evolution rewrites slots in place."""
        if name not in self._names:
            raise ValueError(f"the Ray engine holds a fixed set of adapters {self._names}; {name!r} is not one")
        if weights is not None:
            self.set_adapter(name, weights)

    @_names_lost_nodes
    def get_adapter(self, name: str) -> dict[str, torch.Tensor]:
        self._check(name)
        # a collective under ZeRO-3: every rank gathers, only rank 0 returns its copy
        return _get(self.actors.async_run_method(method_name="get_adapter_state", name=name))[0]

    @_names_lost_nodes
    def set_adapter(self, name: str, weights: Mapping[str, torch.Tensor]) -> None:
        self._check(name)
        tensors = ray.put({k: v.detach().to("cpu", torch.float32) for k, v in weights.items()})  # stored once
        _get(self.actors.async_run_method(method_name="set_adapter_state", name=name, tensors=tensors))
        self.upload([name])

    def save_adapter(self, name: str, path: str) -> None:
        write_peft_adapter(path, self.get_adapter(name), self._lora_config)

    def _check(self, name: str) -> None:
        if name not in self._names:
            raise KeyError(f"unknown adapter {name!r}; the engine holds {self._names}")

    @_names_lost_nodes
    def upload(self, names: Sequence[str]) -> None:
        """Send the current weights of ``names`` to every vLLM engine (each engine gives them a fresh LoRA id),
        then prove the sync (:meth:`check_sync`)."""
        refs = []
        for name in names:
            tensors = ray.put(self.get_adapter(name))
            refs += [engine.load_adapter.remote(name, tensors, self._lora_config) for engine in self.vllm_engines]
        _get(refs)
        self._uploaded.update(names)
        self.check_sync(names)

    @_names_lost_nodes
    def check_sync(self, names: Sequence[str]) -> dict[str, float]:
        """Prove that every vLLM engine serves, for each adapter of ``names``, the weights the trainer holds now.

        1. **Content.** Each engine reports the sha256 of the file it loaded for the adapter and whether vLLM
           still holds that LoRA id; the policy actor hashes its own current weights in the engine's dtype (an
           independent path: not the tensors the upload sent). Any difference -- an upload one update stale,
           one that never arrived, a changed byte -- stops the run with :class:`AdapterSyncError`, in any dtype.
        2. **Behaviour.** Each engine completes the probe prompts greedily and sampled (temperature 1, fixed
           seeds) and reports its log-prob of every token; the policy actor scores the same tokens. The mean
           absolute difference per engine must stay within ``--populora.sync_tolerance`` (the per-dtype
           default: :data:`SYNC_TOLERANCE`); the largest is recorded as ``sync_logprob_diff``, the mean as
           ``sync_logprob_mean``. This catches an adapter vLLM applies differently from the trainer.

        Every engine's requests go out at once; the trainer scores all of them, one actor call per adapter.
        """
        tic = time.perf_counter()
        names = list(dict.fromkeys(names))
        try:
            self.check_content(names)
            out, means = self.probe_gaps(names)
        finally:
            self.sync_seconds += time.perf_counter() - tic
        self.sync.update(out)
        self.sync_mean.update(means)
        for name in names:
            if not means[name] <= self.sync_tolerance:  # NaN fails too
                raise AdapterSyncError(
                    f"adapter {name!r}: vLLM's log-probs differ from the trainer's by {means[name]:.3g} on "
                    f"average (up to {out[name]:.3g}; tolerance {self.sync_tolerance:g}, --populora.sync_tolerance):"
                    f" vLLM does not apply the adapter as the trainer does")
        return out

    def check_content(self, names: Sequence[str]) -> None:
        """The content half of :meth:`check_sync`: raises :class:`AdapterSyncError` unless every engine holds,
        for each adapter, a file whose tensors hash as the trainer's current weights in the engine's dtype."""
        pairs = [(name, engine) for name in names for engine in self.vllm_engines]
        loaded = _get([engine.loaded_adapter.remote(name) for name, engine in pairs])
        held: dict[tuple[str, str], str] = {}
        for (name, _engine), info in zip(pairs, loaded, strict=True):
            key = (name, info["dtype"])
            if key not in held:  # a collective under ZeRO-3: every rank gathers, rank 0 answers
                held[key] = _get(self.actors.async_run_method(method_name="adapter_digest", name=name,
                                                              dtype=info["dtype"]))[0]
            if not info["served"]:
                raise AdapterSyncError(f"adapter {name!r}: vLLM no longer holds LoRA id {info['lora_int_id']}, "
                                       "the version the rollout actor routes to")
            if info["sha256"] != held[key]:
                self.sync_content_failures += 1
                raise AdapterSyncError(
                    f"adapter {name!r}: the weights vLLM loaded (sha256 {info['sha256'][:12]}) are not the ones "
                    f"the trainer holds (sha256 {held[key][:12]}, both in {info['dtype']}): a stale or corrupted "
                    f"upload")

    @_names_lost_nodes
    def probe_gaps(self, names: Sequence[str]) -> tuple[dict[str, float], dict[str, float]]:
        """The behaviour half of :meth:`check_sync`: per adapter, the largest |log-prob difference| between
        vLLM and the trainer over the probe's greedy and sampled tokens on every engine, and the worst engine's
        mean (NaN if any is NaN)."""
        pairs = [(name, engine) for name in names for engine in self.vllm_engines]
        calls = [(name, engine, seed) for name, engine in pairs for seed in (None, PROBE_SEED)]
        answers = _get([engine.probe.remote(self._probe, name, PROBE_TOKENS, seed=seed)
                        for name, engine, seed in calls])
        trajectories, reported, owners = [], [], []
        for (name, engine, _seed), samples in zip(calls, answers, strict=True):
            for prompt, sample in zip(self._probe, samples, strict=True):
                trajectories.append(Trajectory(name, prompt, sample["response_ids"], 0.0))
                reported.append(sample["logprobs"])
                owners.append((name, id(engine)))
        ours = self.token_log_probs(trajectories)
        gaps: dict[tuple[str, int], list[float]] = {}
        for owner, mine, theirs in zip(owners, ours, reported, strict=True):
            gaps.setdefault(owner, []).extend(abs(a - b) for a, b in zip(mine, theirs, strict=True))
        out: dict[str, float] = {}
        worst_mean: dict[str, float] = {}
        for name in names:
            values = [g for (owner, _), found in gaps.items() if owner == name for g in found]
            means = [fmean(found) if found else 0.0 for (owner, _), found in gaps.items() if owner == name]
            nan = any(math.isnan(g) for g in values)
            out[name] = float("nan") if nan else max(values, default=0.0)
            worst_mean[name] = float("nan") if nan else max(means, default=0.0)
        return out, worst_mean

    @_names_lost_nodes
    def token_log_probs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Each response token's log-prob at temperature 1 under its trajectory's adapter, as the policy actor
        (the trainer's weights) computes it (diagnostics, the learning probe, the sync probe, tests).

        Each adapter's rows are padded to their longest and scored in chunks of rows, in order, whose logits stay
        within ``--populora.scoring_memory_gb`` (:func:`memory.rows_per_forward` rows of that width; at least
        one): one actor call per chunk. Every chunk keeps the whole call's padded width, so a row's log-probs
        do not depend on the chunking (bit-identical to one call in fp32 on CPU, tests/unit/engines/test_ray_scoring.py)."""
        out: list[list[float]] = [[] for _ in trajectories]
        pad = self.tokenizer.pad_token_id
        for name in dict.fromkeys(t.adapter for t in trajectories):
            index = [i for i, t in enumerate(trajectories) if t.adapter == name]
            rows = [list(trajectories[i].prompt_ids) + list(trajectories[i].response_ids) for i in index]
            width = max(len(r) for r in rows)
            sequences = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
            attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
            action = torch.zeros((len(rows), width - 1), dtype=torch.bool)  # position t predicts token t + 1
            for k, i in enumerate(index):
                start = len(trajectories[i].prompt_ids) - 1
                action[k, start: start + len(trajectories[i].response_ids)] = True
            step = memory.rows_per_forward(width, self.scoring_tokens)
            refs = [self.actors.async_run_method(  # queued in order; the actors run them one at a time
                method_name="probe_log_probs", sequences=sequences[lo:lo + step], action_mask=action[lo:lo + step],
                attention_mask=attention[lo:lo + step], adapter_name=name) for lo in range(0, len(rows), step)]
            log_probs = torch.cat([_get(ref)[0] for ref in refs])
            for k, i in enumerate(index):
                out[i] = log_probs[k][action[k]].tolist()
        return out

    # ------------------------------------------------------------------------------ generation

    def render_prompt(self, user_text: str, chat_template: bool = True) -> str:
        return render_chat(self.tokenizer, user_text, chat_template)

    @_names_lost_nodes
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        missing = sorted({r.adapter for r in requests} - self._uploaded - {BASE_ADAPTER})
        if missing:  # first use: upstream syncs vLLM only on resume, so the adapters go up here
            self.upload(missing)
        prompts = [self.tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in requests]
        results: list[list[Completion] | None] = [None] * len(requests)
        # vLLM refuses a prompt as long as its max_model_len (--data.max_len), and one refusal fails the whole
        # batch: such a prompt is not sent; its answers are a lone EOS (an empty answer, which the loop scores
        # as a format error) and the run goes on
        limit = getattr(getattr(self.args, "data", None), "max_len", None)
        eos = self.tokenizer.eos_token_id
        too_long = [i for i, p in enumerate(prompts) if limit is not None and len(p) >= int(limit)]
        for index in too_long:
            results[index] = [Completion(adapter=requests[index].adapter, prompt_ids=prompts[index],
                                         response_ids=[eos], text="", finished=True)] * requests[index].n
        if too_long:
            self.skipped_prompts += len(too_long)
            print(f"[populora] {len(too_long)} prompt(s) of {len(prompts)} at or over --data.max_len {limit} tokens "
                  f"(the longest {max(len(prompts[i]) for i in too_long)}): not generated, answered with an empty "
                  f"response", file=sys.stderr, flush=True)
        by_n: dict[int, list[int]] = {}
        for index, request in enumerate(requests):
            if results[index] is None:
                by_n.setdefault(request.n, []).append(index)
        # sample j of request i draws with derive_seed(seed, i, j), i being the request's index in this call
        # whichever engine serves it, so no two engines repeat a stream (the local engine's rule too)
        for n, indices in by_n.items():
            sampling = {"temperature": params.temperature, "top_p": params.top_p,
                        "max_tokens": params.max_new_tokens, "n": n, "seed": params.seed}
            chunks = [indices[i::len(self.vllm_engines)] for i in range(len(self.vllm_engines))]
            refs = [engine.generate_batch.remote([prompts[i] for i in chunk],
                                                 [None if requests[i].adapter == BASE_ADAPTER else requests[i].adapter
                                                  for i in chunk], sampling, request_indices=chunk)
                    for engine, chunk in zip(self.vllm_engines, chunks, strict=True) if chunk]
            for chunk, outputs in zip([c for c in chunks if c], _get(refs), strict=True):
                for index, samples in zip(chunk, outputs, strict=True):
                    results[index] = [
                        Completion(adapter=requests[index].adapter, prompt_ids=prompts[index],
                                   response_ids=list(s["response_ids"]),
                                   text=self.tokenizer.decode(s["response_ids"], skip_special_tokens=True),
                                   finished=bool(s["finished"]))
                        for s in samples
                    ]
        return results  # type: ignore[return-value]

    # -------------------------------------------------------------------------------- training

    @_names_lost_nodes
    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
        """Upstream's ``train_step`` on the trajectories (experiences, ``append``, ``ppo_train``), then the
        upload of every adapter it changed, with its sync proof (``sync_logprob_diff`` in its diagnostics)."""
        if not trajectories:
            return {}
        # micro-batches of at most --rollout.micro_batch_size samples, each scored by one forward within the
        # scoring memory budget
        experiences = build_experiences(trajectories, self._names, self.tokenizer.pad_token_id,
                                        self.args.rollout.micro_batch_size, ranks=self.data_parallel_size,
                                        max_tokens=self.scoring_tokens)
        # each adapter's micro-batches dealt across the data-parallel ranks, every rank padded to the same count
        experiences = deal_experiences(experiences, self.data_parallel_size, self.tokenizer.pad_token_id)
        changed = sorted({t.adapter for t in trajectories})
        status, self.global_step = self.trainer.train_step(experiences, self.global_step)
        probing = self.sync_seconds
        self.upload(changed)
        stats = per_adapter_stats(status, changed)
        for name in changed:
            stats[name]["sync_logprob_diff"] = self.sync[name]
            stats[name]["sync_logprob_mean"] = self.sync_mean[name]
            stats[name]["sync_seconds"] = (self.sync_seconds - probing) / len(changed)  # its share of the probes
        return stats

    # ------------------------------------------------------------------------------------ state

    @_names_lost_nodes
    def save_state(self, path: str) -> None:
        """A DeepSpeed checkpoint of the actor (every adapter, the optimizer, the scheduler) under ``path``."""
        Path(path).mkdir(parents=True, exist_ok=True)
        _get(self.actors.async_run_method(method_name="save_state", path=path,
                                          client_states={"global_step": self.global_step}))

    @_names_lost_nodes
    def load_state(self, path: str) -> None:
        states = _get(self.actors.async_run_method(method_name="load_state", path=path))[0]
        self.global_step = int((states or {}).get("global_step", 0))
        self._uploaded.clear()  # vLLM still serves the pre-resume weights: upload again on first use

    def close(self) -> None:
        """Ray actors belong to upstream's ``train()``, which tears them down."""


def per_adapter_stats(status: Mapping[str, Any], adapters: Sequence[str]) -> dict[str, dict[str, float]]:
    """``{"populora/<adapter>/<metric>": v}`` entries of the actor's status -> ``{adapter: {metric: v}}``;
    upstream's batch-level scalars (``policy_loss``, ``actor_lr`` ...) are shared by every trained adapter."""
    per: dict[str, dict[str, float]] = {name: {} for name in adapters}
    for key, value in status.items():
        if not isinstance(value, (int, float)):
            continue
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "populora" and parts[1] in per:
            per[parts[1]][parts[2]] = float(value)
    shared = {"policy_loss": "loss", "actor_lr": "lr", "entropy": "entropy"}
    for key, name in shared.items():
        if isinstance(status.get(key), (int, float)):
            for stats in per.values():
                stats.setdefault(name, float(status[key]))
    return per


class PopuLoRATrainerBase(PPOTrainer.__ray_actor_class__):
    """The controller's logic, without the Ray decorator (tests drive it in-process)."""

    def __init__(self, pretrain: str, strategy, actor_model_group, critic_model_group, reward_model_group,
                 reference_model_group, vllm_engines, **generate_kwargs) -> None:
        args = strategy.args
        if critic_model_group is not None or reward_model_group is not None:
            raise ValueError("PopuLoRA trains with REINFORCE++ on sandbox rewards: no critic and no reward model "
                             "(use --algo.advantage.estimator reinforce and leave --reward.model_name_or_path unset)")
        tokenizer = get_tokenizer(pretrain, None, "left", strategy, use_fast=not args.data.disable_fast_tokenizer)
        self.generate_kwargs = generate_kwargs
        self.prompts_dataloader = self.eval_dataloader = None  # the loop writes its prompts each step
        # the LR schedule's length: the actor steps it once per epoch of every self-play step
        self.max_steps = int(args.populora.total_steps) * int(args.train.max_epochs)
        # Upstream's PPOTrainer.__init__ would load a prompt dataset; the base class sets up everything else,
        # except its W&B/TensorBoard loggers: the loop's Tracker writes every metric to the same sinks, and two
        # loggers would open two W&B runs. The logger settings are hidden from it for the call.
        wandb_key, tensorboard_dir = args.logger.wandb.key, args.logger.tensorboard_dir
        args.logger.wandb.key = args.logger.tensorboard_dir = None
        try:
            BasePPOTrainer.__init__(self, strategy, actor_model_group, critic_model_group, reward_model_group,
                                    reference_model_group, vllm_engines, tokenizer)
        finally:
            args.logger.wandb.key, args.logger.tensorboard_dir = wandb_key, tensorboard_dir
        self.experience_maker = PopuLoRAExperienceMaker(
            actor_model_group, critic_model_group, reward_model_group, reference_model_group, self.kl_ctl,
            strategy, tokenizer, adapter_names=list(args.populora.adapter_names),
        )

    def get_max_steps(self) -> int:
        return self.max_steps

    def broadcast_to_vllm(self) -> None:
        """Nothing: :meth:`RayEngine.train_step` uploads what it changed (upstream's ``train_step`` calls this)."""

    def fit(self, global_step: int = 0) -> int:
        """Run the function ``args.populora.runner`` (``"module:function"``, set by the launcher) on this
        trainer's :class:`RayEngine`; it owns the run (directory, loop, checkpoints)."""
        module, _, function = str(self.args.populora.runner).partition(":")
        runner = getattr(importlib.import_module(module), function)
        return runner(self.args, RayEngine(self))


# on the head node, where the driver runs: losing any other node leaves the controller alive to name it
@ray.remote(resources={HEAD_RESOURCE: 0.001})
class PopuLoRATrainer(PopuLoRATrainerBase):
    """The Ray actor upstream's ``train()`` creates in place of ``PPOTrainer`` (swapped in by ``launch``)."""
