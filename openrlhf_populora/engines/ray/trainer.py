"""The controller: OpenRLHF's PPO trainer running the PopuLoRA self-play loop on Ray.

``PopuLoRATrainer`` subclasses upstream's ``PPOTrainer`` (its inner class, re-decorated: Ray forbids
subclassing an actor class). Upstream's ``train()`` builds it exactly as it builds ``PPOTrainer``, with the
policy actor group and the vLLM engines. What changes:

- no prompt dataset: the prompts are the loop's proposer and solver prompts, written each step;
- ``fit`` hands a :class:`RayEngine` to the run function the composition layer named in
  ``args.populora.runner`` (``"module:function"``; the CLI's runs the same self-play loop as the embedded
  engine). The trainer knows no loop, no config tree and no AZR;
- ``RayEngine.train_step`` hands the loop's trajectories to upstream's own ``train_step`` (experience making
  with advantages grouped per (member, role, task type), ``append`` to the actor shards, ``ppo_train``), then
  uploads the adapters that changed itself, each version under a fresh LoRA id; upstream's
  ``broadcast_to_vllm`` hook does nothing (the caller pushes; nothing is pulled through callbacks), and the
  frozen base never moves.

**Sync proof.** After every upload, :meth:`RayEngine.check_sync` compares what vLLM now serves with what the
trainer holds: a few fixed probe prompts are decoded greedily by vLLM with the adapter, and the log-probs
vLLM reports for those tokens are compared with the policy actor's own log-probs of the same sequences (both
at temperature 1). The largest absolute difference is reported per adapter (``sync_logprob_diff`` in the
step's diagnostics); above ``--populora.sync_tolerance`` the run stops with an error naming the adapter.

``RayEngine`` implements ``engines.base.Engine`` over the actor group and the vLLM actors; it knows nothing of
AZR. It runs inside the trainer actor's process.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
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
from openrlhf_populora.engines.ray.experience import PopuLoRAExperienceMaker, build_experiences

RAY_TIMEOUT_S = 3600.0  # one ray.get never waits longer than this: an unschedulable actor must not hang a run
PROBE_TEXTS = ("def f(x):\n    return", "The answer is", "for i in range(")  # the sync probe's prompts
PROBE_TOKENS = 8  # greedy tokens per probe prompt


class AdapterSyncError(RuntimeError):
    """vLLM serves an adapter whose log-probs differ from the trainer's beyond the tolerance."""


def _get(refs, timeout: float = RAY_TIMEOUT_S):
    return ray.get(refs, timeout=timeout)


class RayEngine:
    """The engine protocol over OpenRLHF's actor group (DeepSpeed, all adapters) and vLLM actors (multi-LoRA)."""

    def __init__(self, trainer: PopuLoRATrainerBase) -> None:
        self.trainer = trainer
        self.args = trainer.args
        self.tokenizer = trainer.tokenizer
        self.actors = trainer.actor_model_group
        self.vllm_engines = list(trainer.vllm_engines or [])
        if not self.vllm_engines:
            raise ValueError("the Ray engine generates with vLLM only: set --vllm.num_engines >= 1")
        self._names = list(self.args.populora.adapter_names)
        self._lora_config = _get(self.actors._actor_handlers[0].lora_config.remote())
        self._uploaded: set[str] = set()
        self.global_step = 0
        tolerance = self.args.populora.sync_tolerance
        if tolerance is None:  # fp32 on both sides agrees to rounding; bf16 kernels differ in the last bits
            tolerance = 1e-3 if self.args.ds.param_dtype == "fp32" else 0.25
        self.sync_tolerance = float(tolerance)
        self.sync: dict[str, float] = {}  # adapter -> max |log-prob difference| at its last upload
        self.sync_seconds = 0.0  # wall time spent in sync probes
        self._probe = [self.tokenizer(text, add_special_tokens=False)["input_ids"] for text in PROBE_TEXTS]

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

    def get_adapter(self, name: str) -> dict[str, torch.Tensor]:
        self._check(name)
        # a collective under ZeRO-3: every rank gathers, rank 0's copy is returned
        return _get(self.actors.async_run_method(method_name="get_adapter_state", name=name))[0]

    def set_adapter(self, name: str, weights: Mapping[str, torch.Tensor]) -> None:
        self._check(name)
        tensors = {k: v.detach().to("cpu", torch.float32) for k, v in weights.items()}
        _get(self.actors.async_run_method(method_name="set_adapter_state", name=name, tensors=tensors))
        self.upload([name])

    def save_adapter(self, name: str, path: str) -> None:
        write_peft_adapter(path, self.get_adapter(name), self._lora_config)

    def _check(self, name: str) -> None:
        if name not in self._names:
            raise KeyError(f"unknown adapter {name!r}; the engine holds {self._names}")

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

    def check_sync(self, names: Sequence[str]) -> dict[str, float]:
        """For each adapter of ``names`` and each vLLM engine: greedy-decode the probe prompts with vLLM, score
        the same sequences with the policy actor, and record the largest absolute log-prob difference. Raises
        :class:`AdapterSyncError` naming the adapter above the tolerance."""
        tic = time.perf_counter()
        out = {}
        for name in names:
            worst = 0.0
            for engine in self.vllm_engines:
                samples = _get(engine.probe.remote(self._probe, name, PROBE_TOKENS))
                worst = max(worst, self._probe_difference(name, samples))
            out[name] = worst
            if not worst <= self.sync_tolerance:  # NaN fails too
                raise AdapterSyncError(
                    f"adapter {name!r}: vLLM's log-probs differ from the trainer's by up to {worst:.3g} (tolerance "
                    f"{self.sync_tolerance:g}, --populora.sync_tolerance): vLLM is not serving the weights the "
                    f"trainer holds")
        self.sync.update(out)
        self.sync_seconds += time.perf_counter() - tic
        return out

    def _probe_difference(self, name: str, samples: Sequence[Mapping[str, Any]]) -> float:
        ours = self.token_log_probs([Trajectory(name, prompt, s["response_ids"], 0.0)
                                     for prompt, s in zip(self._probe, samples, strict=True)])
        return max(abs(a - b) for mine, s in zip(ours, samples, strict=True)
                   for a, b in zip(mine, s["logprobs"], strict=True))

    def token_log_probs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Each response token's log-prob at temperature 1 under its trajectory's adapter, as the policy actor
        (the trainer's weights) computes it; one actor call per adapter (diagnostics, the sync probe, tests)."""
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
            log_probs = _get(self.actors.async_run_method(
                method_name="probe_log_probs", sequences=sequences, action_mask=action, attention_mask=attention,
                adapter_name=name))[0]
            for k, i in enumerate(index):
                out[i] = log_probs[k][action[k]].tolist()
        return out

    # ------------------------------------------------------------------------------ generation

    def render_prompt(self, user_text: str, chat_template: bool = True) -> str:
        return render_chat(self.tokenizer, user_text, chat_template)

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        missing = sorted({r.adapter for r in requests} - self._uploaded - {BASE_ADAPTER})
        if missing:  # first use: upstream syncs vLLM only on resume, so the adapters go up here
            self.upload(missing)
        prompts = [self.tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in requests]
        results: list[list[Completion] | None] = [None] * len(requests)
        by_n: dict[int, list[int]] = {}
        for index, request in enumerate(requests):
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

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
        """Upstream's ``train_step`` on the trajectories (experiences, ``append``, ``ppo_train``), then the
        upload of every adapter it changed, with its sync proof (``sync_logprob_diff`` in its diagnostics)."""
        if not trajectories:
            return {}
        experiences = build_experiences(trajectories, self._names, self.tokenizer.pad_token_id,
                                        self.args.rollout.micro_batch_size)
        changed = sorted({t.adapter for t in trajectories})
        status, self.global_step = self.trainer.train_step(experiences, self.global_step)
        probing = self.sync_seconds
        self.upload(changed)
        stats = per_adapter_stats(status, changed)
        for name in changed:
            stats[name]["sync_logprob_diff"] = self.sync[name]
            stats[name]["sync_seconds"] = (self.sync_seconds - probing) / len(changed)  # its share of the probes
        return stats

    # ------------------------------------------------------------------------------------ state

    def save_state(self, path: str) -> None:
        """A DeepSpeed checkpoint of the actor (every adapter, the optimizer, the scheduler) under ``path``."""
        Path(path).mkdir(parents=True, exist_ok=True)
        _get(self.actors.async_run_method(method_name="save_state", path=path,
                                          client_states={"global_step": self.global_step}))

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


@ray.remote
class PopuLoRATrainer(PopuLoRATrainerBase):
    """The Ray actor upstream's ``train()`` creates in place of ``PPOTrainer`` (swapped in by ``launch``)."""
