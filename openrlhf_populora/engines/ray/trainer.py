"""The controller: OpenRLHF's PPO trainer running the PopuLoRA self-play loop on Ray.

``PopuLoRATrainer`` subclasses upstream's ``PPOTrainer`` (its inner class, re-decorated: Ray forbids
subclassing an actor class). Upstream's ``train()`` builds it exactly as it builds ``PPOTrainer``, with the
policy actor group and the vLLM engines. What changes:

- no prompt dataset: the prompts are the loop's proposer and solver prompts, written each step;
- ``fit`` runs ``selfplay.runner.run`` (the same outer loop as the embedded engine) on a :class:`RayEngine`;
- ``RayEngine.train_step`` hands the loop's trajectories to upstream's own ``train_step`` (experience making
  with advantages grouped per (member, role, task type), ``append`` to the actor shards, ``ppo_train``, weight
  sync), so every upstream behaviour around the update stays upstream's;
- ``broadcast_to_vllm`` uploads only the adapters that changed, each version under a fresh LoRA id; the frozen
  base never moves.

``RayEngine`` implements ``engines.base.Engine`` over the actor group and the vLLM actors; it knows nothing of
AZR. It runs inside the trainer actor's process.
"""

from __future__ import annotations

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
from openrlhf_populora.engines.ray.settings import config_from_args

RAY_TIMEOUT_S = 3600.0  # one ray.get never waits longer than this: an unschedulable actor must not hang a run


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
        """Send the current weights of ``names`` to every vLLM engine (each engine gives them a fresh LoRA id)."""
        refs = []
        for name in names:
            tensors = ray.put(self.get_adapter(name))
            refs += [engine.load_adapter.remote(name, tensors, self._lora_config) for engine in self.vllm_engines]
        _get(refs)
        self._uploaded.update(names)

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
        for n, indices in by_n.items():
            sampling = {"temperature": params.temperature, "top_p": params.top_p,
                        "max_tokens": params.max_new_tokens, "n": n, "seed": params.seed}
            chunks = [indices[i::len(self.vllm_engines)] for i in range(len(self.vllm_engines))]
            refs = [engine.generate_batch.remote([prompts[i] for i in chunk],
                                                 [None if requests[i].adapter == BASE_ADAPTER else requests[i].adapter
                                                  for i in chunk], sampling)
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
        if not trajectories:
            return {}
        experiences = build_experiences(trajectories, self._names, self.tokenizer.pad_token_id,
                                        self.args.rollout.micro_batch_size)
        changed = sorted({t.adapter for t in trajectories})
        self.trainer.changed_adapters = changed
        status, self.global_step = self.trainer.train_step(experiences, self.global_step)
        return per_adapter_stats(status, changed)

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
        self.max_steps = int(args.populora.total_steps)  # LR schedule length: the actor steps it once per step
        self.changed_adapters: list[str] = []
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
        """After an update: only the adapters trained in this step move to vLLM, each under a fresh LoRA id."""
        engine: RayEngine | None = getattr(self, "engine", None)
        if engine is not None and self.changed_adapters:
            engine.upload(self.changed_adapters)

    def fit(self, global_step: int = 0) -> int:
        from openrlhf_populora.selfplay.runner import claim_run_dir, run

        config = config_from_args(self.args)
        lock = claim_run_dir(config)  # noqa: F841 - held (the run directory locked) until fit returns

        def build_engine(_config) -> RayEngine:
            self.engine = RayEngine(self)
            return self.engine

        return run(config, build_engine, progress=True)


@ray.remote
class PopuLoRATrainer(PopuLoRATrainerBase):
    """The Ray actor upstream's ``train()`` creates in place of ``PPOTrainer`` (swapped in by ``launch``)."""
