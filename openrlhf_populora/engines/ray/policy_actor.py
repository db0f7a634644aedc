"""The training side of the Ray engine: OpenRLHF's policy actor with N LoRA adapters in ONE DeepSpeed engine.

- :class:`MultiAdapterActorTrainer` (an ``ActorPPOTrainer``) trains one adapter per micro-batch: the adapter is
  the sample's ``info[ADAPTER_INFO_KEY]`` (an index into the run's adapter names). Micro-batches are
  adapter-homogeneous for any ``--train.micro_batch_size`` (an adapter-bucketed replay buffer), and every
  metric is also reported per adapter.
- No Adam drift on adapters without gradient: one optimizer holds all adapters, and a step moves every
  parameter that has Adam moments, gradient or not (and under ZeRO-3 DeepSpeed even re-applies the previous
  gradient of a parameter that got none). At each real optimizer step the trainer finds the adapters that got
  no gradient in that step (on any data-parallel rank), snapshots their local optimizer-side state
  (:class:`~openrlhf_populora.engines.ray.adapters_ds.AdapterSnapshot`: fp32 master, Adam moments,
  low-precision copy; no collectives) and restores it right after the step, so they leave the step
  bit-identical; under ZeRO-3 it then zeroes the kept gradient partitions. The adapters that did train share
  Adam's per-group step count and the global gradient-norm clipping (one norm over the adapters present).
- Data parallelism: ranks may train different adapters in the same step. With more than one rank every
  adapter runs in every forward pass, the inactive ones with LoRA scaling 0 (bit-identical outputs, exactly
  zero gradients), so DeepSpeed's gradient buckets and ZeRO-3 gathers see the same parameters on every rank
  (``adapters_ds.activate(all_in_graph=True)``; the cost is one LoRA product per adapter per layer).
- :class:`PopuLoRAPolicyActor` (the Ray actor, ``num_gpus=1``) builds the adapters named
  ``strategy.args.populora.adapter_names`` before ``strategy.prepare`` (one engine, one optimizer) and
  otherwise runs upstream's ``init_model_from_pretrained`` unchanged. It reads and writes adapters in PEFT's
  saved format (``get_adapter_state``/``set_adapter_state``: collectives, every rank calls in the same order),
  keeps the population state in the DeepSpeed checkpoint's client states, and does not broadcast to vLLM:
  the controller uploads changed adapters through the vLLM actors' ``load_adapter``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor
from openrlhf.utils.vlm_utils import merge_mm_train_inputs

from . import ADAPTER_INFO_KEY, GROUP_INFO_KEY
from . import adapters_ds as ads

PER_ADAPTER_PREFIX = "populora"  # status["populora/<adapter>/<metric>"] = float (flat: upstream logs floats)
CLIENT_STATE_KEY = "populora"  # DeepSpeed client_states[CLIENT_STATE_KEY] = the controller's population state
ADAPTER_NAMES_STATE_KEY = "populora_adapter_names"  # the adapter names a checkpoint was saved with


def split_per_adapter(status: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{"populora/<adapter>/<metric>": v}`` entries of a ``fit`` status -> ``{adapter: {metric: v}}``."""
    out: dict[str, dict[str, float]] = {}
    for key, value in status.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == PER_ADAPTER_PREFIX:
            out.setdefault(parts[1], {})[parts[2]] = value
    return out


def data_parallel() -> bool:
    """More than one training rank: ranks may then train different adapters in the same step."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def device() -> torch.device:
    """The training device: the current CUDA device, or the CPU where there is no CUDA."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def adapter_index_of(info: Mapping[str, Any]) -> list[int]:
    """The adapter indices of a (batched or single-sample) experience's ``info[ADAPTER_INFO_KEY]``."""
    value = info[ADAPTER_INFO_KEY]
    if isinstance(value, (list, tuple)):
        value = torch.stack([torch.as_tensor(v).reshape(()) for v in value]) if value else torch.zeros(0)
    return [int(v) for v in torch.as_tensor(value).reshape(-1).tolist()]


def plan_buckets(adapter_of_items: Sequence[int], micro_batch_size: int, accumulation_steps: int = 1,
                 min_buckets: int = 0):
    """Group item indices into adapter-homogeneous micro-batches of at most ``micro_batch_size``.

    Each adapter's items (in order) are chunked; then, while the number of micro-batches is below
    ``min_buckets`` or not a multiple of ``accumulation_steps``, and some micro-batch holds more than one
    item, the largest is split in two -- so the last gradient-accumulation window is complete whenever the
    item count allows it (a trailing partial window would never reach DeepSpeed's optimizer step), and all
    data-parallel ranks can be given the same count. Returns a list of lists of item indices.
    """
    if micro_batch_size < 1 or accumulation_steps < 1:
        raise ValueError("micro_batch_size and accumulation_steps must be >= 1")
    by_adapter: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(adapter_of_items):
        by_adapter[k].append(i)
    buckets = [idx[j: j + micro_batch_size] for k in sorted(by_adapter) for idx in [by_adapter[k]]
               for j in range(0, len(idx), micro_batch_size)]
    target = math.ceil(max(len(buckets), min_buckets) / accumulation_steps) * accumulation_steps
    while len(buckets) < target:
        largest = max(range(len(buckets)), key=lambda b: len(buckets[b]))
        if len(buckets[largest]) < 2:
            break
        half = len(buckets[largest]) // 2
        buckets[largest: largest + 1] = [buckets[largest][:half], buckets[largest][half:]]
    return buckets


class AdapterBucketedReplayBuffer(NaiveReplayBuffer):
    """Upstream's replay buffer whose dataset items are whole adapter-homogeneous micro-batches.

    ``ActorPPOTrainer.ppo_train`` builds ``DataLoader(buffer, batch_size=buffer.sample_batch_size,
    shuffle=...)``; here ``sample_batch_size`` is 1 and item ``i`` is micro-batch ``i`` of
    :func:`plan_buckets`, so upstream's shuffle shuffles micro-batches and never mixes adapters. Dynamic
    batching is not supported.
    """

    def __init__(self, micro_batch_size: int, accumulation_steps: int = 1, limit: int = 0,
                 cpu_offload: bool = True, packing_samples: bool = False):
        super().__init__(micro_batch_size, limit, cpu_offload, packing_samples, dynamic_batch=False)
        self.micro_batch_size = micro_batch_size
        self.accumulation_steps = max(int(accumulation_steps), 1)
        self.sample_batch_size = 1
        self._buckets: list[list[int]] | None = None

    def append(self, experience: Experience) -> None:
        super().append(experience)
        self._buckets = None

    def clear(self) -> None:
        super().clear()
        self._buckets = None

    def plan(self, min_buckets: int = 0) -> list[list[int]]:
        """(Re)build the micro-batches, at least ``min_buckets`` of them where the items allow."""
        adapters = [adapter_index_of(item.info)[0] for item in self.items]
        self._buckets = plan_buckets(adapters, self.micro_batch_size, self.accumulation_steps, min_buckets)
        return self._buckets

    def buckets(self) -> list[list[int]]:
        return self._buckets if self._buckets is not None else self.plan()

    def __len__(self) -> int:
        return len(self.buckets())

    def __getitem__(self, idx: int) -> list[Experience]:
        return [self.items[i] for i in self.buckets()[idx]]

    def collate_fn(self, batch) -> Experience:
        return make_experience_batch([item for bucket in batch for item in bucket], self.packing_samples)


class _StepHookedStrategy:
    """The trainer's view of the DeepSpeed strategy: everything forwards, except that ``optimizer_step`` runs
    the trainer's hooks around the real optimizer step (at gradient-accumulation boundaries only)."""

    def __init__(self, strategy, trainer: MultiAdapterActorTrainer):
        self.__dict__["_strategy"] = strategy
        self.__dict__["_trainer"] = trainer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._strategy, name, value)

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs) -> None:
        engine = ads.ds_engine(model)
        boundary = engine is not None and engine.is_gradient_accumulation_boundary()
        context = self._trainer._before_optimizer_step() if boundary else None
        self._strategy.optimizer_step(optimizer, model, scheduler, name=name, **kwargs)
        if boundary:
            self._trainer._after_optimizer_step(context)


class MultiAdapterActorTrainer(ActorPPOTrainer):
    """``ActorPPOTrainer`` over N adapters: one adapter per micro-batch, per-adapter metrics, frozen absent
    adapters (see the module docstring). ``freeze_absent=False`` turns the drift mitigation off (measurement).
    """

    def __init__(self, strategy, actor, *args, adapter_names: Sequence[str], freeze_absent: bool = True,
                 **kwargs):
        self.adapter_names = list(adapter_names)
        self.freeze_absent = freeze_absent
        super().__init__(_StepHookedStrategy(strategy, self), actor, *args, **kwargs)
        if self.args.train.dynamic_batch_enable:
            raise ValueError("--train.dynamic_batch_enable is not supported with PopuLoRA adapters")
        self.replay_buffer = AdapterBucketedReplayBuffer(
            self.micro_train_batch_size,
            accumulation_steps=getattr(strategy, "accumulated_gradient", 1),
            limit=self.replay_buffer.limit,
            cpu_offload=self.replay_buffer.cpu_offload,
            packing_samples=self.args.ds.packing_samples,
        )
        self._window: set[int] = set()  # adapters with a micro-batch since the last optimizer step
        self._stats: dict[str, dict[str, float]] = {}

    # -- routing ------------------------------------------------------------------------------------------

    def _adapter_of(self, experience: Experience) -> int:
        indices = set(adapter_index_of(experience.info))
        if len(indices) != 1:
            raise ValueError(f"a micro-batch must hold one adapter's samples, got adapter indices {sorted(indices)}")
        (index,) = indices
        if not 0 <= index < len(self.adapter_names):
            raise ValueError(f"adapter index {index} out of range for adapters {self.adapter_names}")
        return index

    def training_step(self, experience: Experience, kl_ctl: float, step: int, loss_batch_info=None):
        index = self._adapter_of(experience)
        name = self.adapter_names[index]
        experience.info.pop(ADAPTER_INFO_KEY)
        experience.info.pop(GROUP_INFO_KEY, None)
        ads.activate(self.actor, name, all_in_graph=data_parallel())
        self._window.add(index)
        status = super().training_step(experience, kl_ctl, step, loss_batch_info)
        self._record(name, status)
        return status

    # -- the optimizer step: per-adapter gradient norms, absent adapters frozen ---------------------------

    def _present_everywhere(self) -> list[int]:
        """Adapter indices with a micro-batch in this step on ANY data-parallel rank."""
        flags = torch.zeros(len(self.adapter_names), dtype=torch.float32, device=device())
        for index in self._window:
            flags[index] = 1.0
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return [i for i, f in enumerate(flags.tolist()) if f > 0]

    def _before_optimizer_step(self):
        present = self._present_everywhere()
        for index in present:  # collective under ZeRO-3: the same list on every rank
            name = self.adapter_names[index]
            stats = self._stats.setdefault(name, defaultdict(float))
            stats["_grad_norm_sum"] += ads.adapter_grad_norm(self.actor, name)
            stats["optimizer_steps"] += 1
        absent = [n for i, n in enumerate(self.adapter_names) if i not in present]
        return ads.AdapterSnapshot(self.actor, absent) if absent and self.freeze_absent else None

    def _after_optimizer_step(self, snapshot) -> None:
        if snapshot is not None:
            snapshot.restore()
        ads.clear_stale_grads(self.actor, self.adapter_names)
        self._window.clear()

    # -- metrics ------------------------------------------------------------------------------------------

    def _record(self, name: str, status: dict) -> None:
        stats = self._stats.setdefault(name, defaultdict(float))
        metrics, n_tokens, n_samples = status["metrics"], status["num_action_tokens"], status["num_samples"]
        stats["_tokens"] += n_tokens
        stats["_samples"] += n_samples
        stats["_loss_sum"] += float(metrics["policy_loss"].float().mean()) * n_tokens
        if isinstance(metrics.get("entropy_loss"), torch.Tensor):
            stats["_entropy_sum"] += float(metrics["entropy_loss"].float().mean()) * n_tokens
        for key in ("response_length", "reward"):
            value = metrics.get(key)
            if isinstance(value, torch.Tensor):
                stats[f"_{key}_sum"] += float(value.float().sum())

    def _per_adapter_metrics(self) -> dict[str, dict[str, float]]:
        """Sums over this rank's micro-batches, all-reduced over ranks, turned into means per adapter."""
        fields = ("_tokens", "_samples", "_loss_sum", "_entropy_sum", "_response_length_sum", "_reward_sum")
        local = {f"{n}/{f}": float(self._stats.get(n, {}).get(f, 0.0)) for n in self.adapter_names for f in fields}
        total = self.strategy.all_reduce(local, op="sum") if torch.distributed.is_initialized() else local
        out = {}
        for name in self.adapter_names:
            samples, tokens = total[f"{name}/_samples"], total[f"{name}/_tokens"]
            if samples == 0:
                continue
            stats = self._stats.get(name, {})
            steps = stats.get("optimizer_steps", 0.0)
            out[name] = {
                "loss": total[f"{name}/_loss_sum"] / max(tokens, 1.0),  # the policy loss, token-mean
                "response_length": total[f"{name}/_response_length_sum"] / samples,
                "reward": total[f"{name}/_reward_sum"] / samples,
                "grad_norm": stats.get("_grad_norm_sum", 0.0) / steps if steps else 0.0,
                "optimizer_steps": steps,
                "samples": samples,
            }
            if self.args.actor.entropy_coef is not None:
                out[name]["entropy"] = total[f"{name}/_entropy_sum"] / max(tokens, 1.0)
        return out

    def _equalise_micro_batches(self) -> None:
        """Give every data-parallel rank the same number of micro-batches (DeepSpeed steps in lockstep)."""
        count = len(self.replay_buffer.plan())
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            target = torch.tensor([count], dtype=torch.float32, device=device())
            torch.distributed.all_reduce(target, op=torch.distributed.ReduceOp.MAX)
            count = int(target.item())
            if len(self.replay_buffer.plan(min_buckets=count)) != count:
                raise RuntimeError(f"this rank's {len(self.replay_buffer.items)} samples cannot fill the {count} "
                                   f"adapter-homogeneous micro-batches other ranks need; give every rank the same "
                                   f"number of samples per adapter or more samples")

    def ppo_train(self, kl_ctl: float):
        """Upstream's ``ppo_train`` (status means over all micro-batches) plus, for every adapter trained,
        ``status["populora/<adapter>/<metric>"]``: ``loss``, ``grad_norm`` (mean over its optimizer steps),
        ``entropy`` (when ``--actor.entropy_coef`` is set), ``response_length``, ``reward``, ``samples`` and
        ``optimizer_steps``. :func:`split_per_adapter` nests them."""
        self._stats, self._window = {}, set()
        self._equalise_micro_batches()
        # The LR schedule counts self-play steps (the controller's get_max_steps is --populora.total_steps):
        # how many optimizer steps one self-play step takes depends on how many samples each adapter got,
        # so DeepSpeed's per-optimizer-step scheduler call is held back and the schedule advances once here.
        engine = ads.ds_engine(self.actor)
        scheduler = getattr(engine, "lr_scheduler", None)
        if scheduler is not None:
            engine.lr_scheduler = None
        try:
            status = super().ppo_train(kl_ctl)  # reports actor_lr: the rate this step trained with
        finally:
            if scheduler is not None:
                engine.lr_scheduler = scheduler
        if scheduler is not None:
            scheduler.step()
        for name, metrics in self._per_adapter_metrics().items():
            status.update({f"{PER_ADAPTER_PREFIX}/{name}/{key}": value for key, value in metrics.items()})
        return status

    def broadcast_to_vllm(self):
        """Nothing: the controller uploads changed adapters to vLLM (``load_adapter``), never the base."""


class _PrepareWithAdapters:
    """The strategy as ``PolicyModelActor.init_model_from_pretrained`` sees it: ``prepare`` first gives the
    trainable Actor the run's adapters, so upstream's one ``prepare`` call builds one engine over all."""

    def __init__(self, strategy, names: Sequence[str], seed: int):
        self.__dict__.update(_strategy=strategy, _names=list(names), _seed=seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._strategy, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._strategy, name, value)

    def prepare(self, *models):
        for entry in models:
            if isinstance(entry, tuple) and entry[0] is not None:  # (model, optimizer config): the trained one
                ads.attach_adapters(entry[0], self._names, seed=self._seed)
        return self._strategy.prepare(*models)


def populora_settings(args) -> tuple[list[str], int]:
    """(adapter names, adapter-init seed) from ``args.populora``; the seed defaults to ``--train.seed``."""
    populora = getattr(args, "populora", None)
    names = list(getattr(populora, "adapter_names", None) or [])
    if not names:
        raise ValueError("strategy.args.populora.adapter_names must list the adapters to train")
    if args.ds.lora.rank <= 0:
        raise ValueError("PopuLoRA needs LoRA: set --ds.lora.rank > 0")
    seed = getattr(populora, "seed", None)
    return names, int(args.train.seed if seed is None else seed)


@ray.remote(num_gpus=1)
class PopuLoRAPolicyActor(PolicyModelActor.__ray_actor_class__):
    """OpenRLHF's policy actor holding every adapter of the run in one DeepSpeed engine. The plain class is
    ``PopuLoRAPolicyActor.__ray_actor_class__`` (in-process use, tests)."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        """Upstream's set-up with the adapters attached before ``prepare`` and :class:`MultiAdapterActorTrainer`.

        ``vllm_engines`` is kept (the controller's uploads use them) but not given to upstream, which would open
        an NCCL weight-sync group that LoRA cannot use.
        """
        args = strategy.args
        self.adapter_names, seed = populora_settings(args)
        if args.train.enable_ema:
            raise ValueError("--train.enable_ema is not supported with PopuLoRA adapters")
        super().init_model_from_pretrained(_PrepareWithAdapters(strategy, self.adapter_names, seed), pretrain,
                                           max_steps=max_steps, vllm_engines=None)
        self.strategy = strategy
        self.vllm_engines = vllm_engines
        saved = self.checkpoint_states.get(ADAPTER_NAMES_STATE_KEY) if self.checkpoint_states else None
        if saved is not None and list(saved) != self.adapter_names:
            raise ValueError(f"checkpoint holds adapters {list(saved)}, this run names {self.adapter_names}")
        self.trainer = MultiAdapterActorTrainer(
            strategy,
            self.actor,
            ema_model=None,
            actor_optim=self.actor_optim,
            actor_scheduler=self.actor_scheduler,
            micro_train_batch_size=args.train.micro_batch_size,
            tokenizer=self.tokenizer,
            eps_clip=args.actor.eps_clip,
            ema_beta=args.train.ema_beta,
            vllm_engines=None,
            adapter_names=self.adapter_names,
        )

    def lora_config(self) -> dict:
        """The adapters' shared LoRA config (for vLLM's ``load_adapter`` and PEFT's ``adapter_config.json``)."""
        config = ads.peft_model(self.actor).peft_config[self.adapter_names[0]]
        targets = config.target_modules
        return {
            "r": int(config.r),
            "lora_alpha": config.lora_alpha,
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
            "lora_dropout": float(config.lora_dropout),
        }

    def get_adapter_names(self) -> list[str]:
        return list(self.adapter_names)

    def get_adapter_state(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name`` in PEFT's saved format (fp32, CPU). Every rank calls (ZeRO-3 gathers)."""
        return ads.adapter_state(self.actor, name)

    def set_adapter_state(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite adapter ``name`` (fp32 master, low-precision copy) and zero its Adam moments. Every rank
        calls, in the same order, with the same tensors."""
        ads.write_adapter(self.actor, name, tensors)

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None, adapter_name=None) -> torch.Tensor:
        """No-grad action log-probs through adapter ``adapter_name`` (a name or an index; ``None``: the
        active one). Upstream's ``execute_batch`` passes it per micro-batch."""
        if adapter_name is not None:
            if not isinstance(adapter_name, str):
                adapter_name = self.adapter_names[int(adapter_name)]
            ads.activate(self.actor, adapter_name, all_in_graph=data_parallel())
        dev = device()
        mm_inputs = {}
        if mm_train_inputs_list and getattr(self.actor, "is_vlm", False):
            mm_inputs = merge_mm_train_inputs(mm_train_inputs_list, dev)
        self.actor.eval()
        with torch.no_grad():
            log_probs = self.actor(sequences.to(dev), action_mask.to(dev), attention_mask.to(dev),
                                   ring_attn_group=self.strategy.ring_attn_group, **mm_inputs)
        self.actor.train()
        return log_probs.to("cpu")

    def fit(self, kl_ctl: float = 0):
        """Train on the replay buffer; upstream's status plus the per-adapter entries (see ``ppo_train``)."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.actor.train()
        status = self.trainer.ppo_train(kl_ctl)
        self.trainer.replay_buffer.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        return status

    def broadcast_to_vllm(self):
        """Nothing: adapters reach vLLM through the controller's uploads (never the frozen base)."""

    def save_adapters(self, output_dir: str, names: Sequence[str] | None = None) -> None:
        """Write adapters in PEFT's format, one folder each: ``<output_dir>/<name>/adapter_config.json`` and
        ``adapter_model.safetensors`` (loadable by ``PeftModel.from_pretrained`` and vLLM ``--lora-modules``),
        plus the tokenizer in ``output_dir``. Every rank calls (ZeRO-3 gathers); rank 0 writes.

        Replaces upstream's PEFT save, which under ZeRO-3 reads only an adapter named "default"."""
        import os

        from openrlhf_populora.engines.adapter_files import write_peft_adapter

        peft = ads.peft_model(self.actor)
        for name in names or self.adapter_names:
            tensors = self.get_adapter_state(name)
            if self.strategy.is_rank_0():
                write_peft_adapter(os.path.join(output_dir, name), tensors, peft.peft_config[name].to_dict())
        if self.strategy.is_rank_0():
            self.tokenizer.save_pretrained(output_dir)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def save_model(self):
        """The final save upstream's ``train()`` calls after ``fit``: nothing left to do. The controller's run has
        already written every living member's adapter to ``<output_dir>/adapters/<member id>/`` and a final
        checkpoint; a copy under slot names here would mislabel members that evolution put in a slot."""

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """Upstream's DeepSpeed checkpoint (all adapters, the optimizer), with the adapter names and the
        given ``client_states`` (the controller puts its population state under ``CLIENT_STATE_KEY``).
        With ``--ckpt.save_hf`` the adapters also go to ``{ckpt.path}/{tag}_hf/<name>/`` in PEFT format."""
        import os

        states = dict(client_states or {})
        states[ADAPTER_NAMES_STATE_KEY] = list(self.adapter_names)
        save_hf, self.save_hf_ckpt = self.save_hf_ckpt, False
        try:
            super().save_checkpoint(tag, states, metric_value=metric_value, metric_key=metric_key)
        finally:
            self.save_hf_ckpt = save_hf
        if save_hf:
            self.save_adapters(os.path.join(self.strategy.args.ckpt.path, f"{tag}_hf"))

    def save_state(self, path: str, client_states: Mapping[str, Any] | None = None) -> None:
        """A DeepSpeed checkpoint (every adapter, the optimizer, the scheduler) in folder ``path``, with
        ``client_states`` and the adapter names. Every rank calls."""
        states = dict(client_states or {})
        states[ADAPTER_NAMES_STATE_KEY] = list(self.adapter_names)
        self.strategy.save_ckpt(self.actor.model, path, tag="populora", max_num=1 << 30, max_mem=float("inf"),
                                client_state=states)

    def load_state(self, path: str) -> dict:
        """Restore what ``save_state`` wrote; returns its client states. Every rank calls."""
        _, states = self.strategy.load_ckpt(self.actor.model, path, tag="populora")
        states = dict(states or {})
        saved = states.get(ADAPTER_NAMES_STATE_KEY)
        if saved is not None and list(saved) != self.adapter_names:
            raise ValueError(f"{path} holds adapters {list(saved)}, this run names {self.adapter_names}")
        self.checkpoint_states = states
        return states

    def load_checkpoint_states(self) -> dict:
        """The client states of the checkpoint loaded at start-up ({} when none was loaded)."""
        return dict(self.checkpoint_states or {})
