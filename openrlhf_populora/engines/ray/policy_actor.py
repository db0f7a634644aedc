"""The training side of the Ray engine: OpenRLHF's policy actor with N LoRA adapters in ONE DeepSpeed engine.

**One algorithm with the local engine.** Per self-play step, and per epoch of ``--train.max_epochs``, every
adapter with samples takes exactly one optimizer update on its own samples, with its own loss normalisation
(the token mean over its response tokens on all ranks), its own gradient clip and its own Adam step count --
what ``engines/local`` does. :class:`MultiAdapterActorTrainer` gets there with one DeepSpeed engine and one
optimizer over all adapters:

- **one window per adapter.** ``ppo_train`` runs each adapter's micro-batches as one gradient-accumulation
  window whose boundary it sets itself (``set_gradient_accumulation_boundary``), through upstream's own
  ``training_step`` (its policy loss, entropy and KL terms) with the loss normaliser of that adapter alone. The
  window ends in one optimizer step, in which only that adapter has gradient, so DeepSpeed's global
  gradient-norm clip is that adapter's own clip;
- **the others stay put.** Adam moves a parameter that has moments even without gradient (and ZeRO-3 keeps
  stale gradient partitions), so the other adapters' optimizer-side state is snapshotted before the window and
  restored after its step (:class:`~openrlhf_populora.engines.ray.adapters_ds.AdapterSnapshot`: fp32 master,
  Adam moments, low-precision copy; no collectives), leaving them bit-identical;
- **Adam's step count per adapter.** The optimizer counts steps per parameter group, shared by all adapters;
  the trainer keeps each adapter's own count (:attr:`MultiAdapterActorTrainer.adam_steps`, saved in
  checkpoints) and sets the optimizer's to it before the adapter's step, so bias correction is the adapter's
  own. Evolution writes a child with zero moments and count 0: a fresh Adam, as on the local engine;
- **the LR schedule counts updates**, one per epoch of the self-play step (DeepSpeed's per-optimizer-step
  scheduler call is held back), so ``--populora.total_steps x --train.max_epochs`` is its length.

Data parallelism: ranks may hold different adapters' samples. Every rank runs every adapter's window with the
same number of micro-batches (padded with a micro-batch whose loss mask is empty: zero loss, zero gradient), and
since every rank runs the same adapter's window at the same time, DeepSpeed's gradient reductions (ZeRO-1/2)
and parameter gathers (ZeRO-3, every LoRA tensor partitioned) see the same parameters on every rank with only
that adapter in the graph: a training pass costs one adapter's LoRA products whatever the rank count (checked on
two gloo ranks against one rank, under ZeRO-2 and ZeRO-3). Experience making's forward passes (``forward``)
score different adapters on different ranks at once; they run every adapter only under ZeRO-3, whose gathers
need the same parameters on every rank: ZeRO-1/2 have no collective in a forward pass, so there they run the
one adapter.

:class:`PopuLoRAPolicyActor` (the Ray actor, ``num_gpus=1``) builds the adapters named
``strategy.args.populora.adapter_names`` before ``strategy.prepare`` (one engine, one optimizer) and otherwise
runs upstream's ``init_model_from_pretrained`` unchanged. It reads and writes adapters in PEFT's saved format
(``get_adapter_state``/``set_adapter_state``: collectives, every rank calls in the same order), scores sequences
per adapter (``forward``, also the sync probe's trainer side), keeps the population state in the DeepSpeed
checkpoint's client states, and does not broadcast to vLLM: the controller uploads changed adapters through the
vLLM actors' ``load_adapter``.

**Checkpoints hold the adapters, not the base** (:func:`adapter_only_checkpoints`, installed on the engine at
``prepare``): the module states keep only the trainable (adapter) parameters, next to the optimizer states; the
frozen base is not written, and on a resume it is the one the model was built from, ``--actor.model_name_or_path``.
Checkpoints written before this (the base inside) still load.
"""

from __future__ import annotations

import functools
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor
from openrlhf.utils.vlm_utils import merge_mm_train_inputs

from . import ADAPTER_INFO_KEY, GROUP_INFO_KEY
from . import adapters_ds as ads
from .digest import adapter_digest
from .experience import is_padding

PER_ADAPTER_PREFIX = "populora"  # status["populora/<adapter>/<metric>"] = float (flat: upstream logs floats)
CLIENT_STATE_KEY = "populora"  # DeepSpeed client_states[CLIENT_STATE_KEY] = the controller's population state
ADAPTER_NAMES_STATE_KEY = "populora_adapter_names"  # the adapter names a checkpoint was saved with
ADAM_STEPS_STATE_KEY = "populora_adam_steps"  # each adapter's own Adam step count
BASE_MODEL_STATE_KEY = "populora_base_model"  # --actor.model_name_or_path of the run that saved (not in the ckpt)


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


def _all_reduce(values: list[float], op) -> list[float]:
    """Element-wise all-reduce of a few numbers over the data-parallel ranks (identity on one rank)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device())
    if data_parallel():
        torch.distributed.all_reduce(tensor, op=op)
    return tensor.tolist()


def empty_micro_batch(index: int, pad_token_id: int) -> Experience:
    """A micro-batch of adapter ``index`` whose loss mask is empty: its loss and gradient are exactly 0. Ranks
    with fewer micro-batches of an adapter than others run these, so every rank takes part in every window."""
    return Experience(
        sequences=torch.full((1, 2), pad_token_id, dtype=torch.long),
        attention_mask=torch.ones((1, 2), dtype=torch.long),
        action_mask=torch.zeros((1, 1), dtype=torch.long),
        action_log_probs=torch.zeros((1, 1)),
        advantages=torch.zeros((1, 1)),
        returns=torch.zeros((1, 1)),
        response_length=torch.zeros(1),
        total_length=torch.full((1,), 2.0),
        info={ADAPTER_INFO_KEY: torch.tensor([index])},
    )


class MultiAdapterActorTrainer(ActorPPOTrainer):
    """``ActorPPOTrainer`` over N adapters, each updated as the local engine updates it (module docstring)."""

    def __init__(self, strategy, actor, *args, adapter_names: Sequence[str], **kwargs):
        super().__init__(strategy, actor, *args, **kwargs)
        if self.args.train.dynamic_batch_enable:
            raise ValueError("--train.dynamic_batch_enable is not supported with PopuLoRA adapters")
        self.adapter_names = list(adapter_names)
        self.adam_steps: dict[str, int] = {name: 0 for name in self.adapter_names}
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
        """Upstream's ``training_step`` (loss, backward, ``engine.step``) through the micro-batch's adapter. The
        routing keys are hidden from it (it would log them as metrics) and kept for the next epoch."""
        name = self.adapter_names[self._adapter_of(experience)]
        # one adapter in the graph: every rank runs the same adapter's window (module docstring)
        ads.activate(self.actor, name)
        info = experience.info
        experience.info = {k: v for k, v in info.items() if k not in (ADAPTER_INFO_KEY, GROUP_INFO_KEY)}
        try:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        finally:
            experience.info = info

    # -- the update -----------------------------------------------------------------------------------------

    def _micro_batches(self) -> dict[int, list[Experience]]:
        """This rank's replay-buffer samples, grouped by adapter into micro-batches (buffer order kept)."""
        by_adapter: dict[int, list[Experience]] = defaultdict(list)
        for item in self.replay_buffer.items:
            if is_padding(item):  # a padding pass of experience making (experience.deal_experiences)
                continue
            by_adapter[adapter_index_of(item.info)[0]].append(item)
        size = self.micro_train_batch_size
        return {k: [make_experience_batch(items[i:i + size], self.args.ds.packing_samples)
                    for i in range(0, len(items), size)] for k, items in by_adapter.items()}

    def ppo_train(self, kl_ctl: float):
        """``--train.max_epochs`` updates of every adapter with samples (on any rank), one window each (module
        docstring). Returns upstream-style batch means plus ``status["populora/<adapter>/<metric>"]``: ``loss``,
        ``entropy`` (with ``--actor.entropy_coef``), ``clip_ratio``, ``grad_norm``, ``lr`` (means over the
        epochs), ``updates``, ``num_sequences``, ``num_tokens``, ``response_length`` and ``reward``."""
        self._stats = {}
        batches = self._micro_batches()
        counts = _all_reduce([len(batches.get(k, [])) for k in range(len(self.adapter_names))],
                             torch.distributed.ReduceOp.MAX)
        present = [k for k, count in enumerate(counts) if count > 0]
        if data_parallel():  # how evenly the ranks share each adapter's window (the rest is padding passes)
            real = _all_reduce([len(batches.get(k, [])) for k in range(len(self.adapter_names))],
                               torch.distributed.ReduceOp.SUM)
            if torch.distributed.get_rank() == 0:
                ranks = torch.distributed.get_world_size()
                shares = ", ".join(f"{self.adapter_names[k]} {int(counts[k])} micro-steps x {ranks} ranks "
                                   f"({int(real[k])} real)" for k in present)
                print(f"[populora] training windows: {shares}", file=sys.stderr, flush=True)
        engine = ads.ds_engine(self.actor)
        scheduler, engine.lr_scheduler = engine.lr_scheduler, None  # the schedule advances once per epoch
        try:
            for _ in range(self.max_epochs):
                for index in present:
                    self._update(index, batches.get(index, []), int(counts[index]), kl_ctl)
                if scheduler is not None:
                    scheduler.step()
        finally:
            engine.lr_scheduler = scheduler
            engine.set_gradient_accumulation_boundary(None)
        return self._status()

    def _update(self, index: int, batches: list[Experience], count: int, kl_ctl: float) -> None:
        """One optimizer update of adapter ``index`` from its ``batches`` (``count`` micro-batches on every rank)."""
        name = self.adapter_names[index]
        engine = ads.ds_engine(self.actor)
        tokens, sequences = _all_reduce([sum(float(b.action_mask.sum()) for b in batches),
                                         sum(float(b.action_mask.shape[0]) for b in batches)],
                                        torch.distributed.ReduceOp.SUM)
        gas = engine.gradient_accumulation_steps()  # DeepSpeed divides each backward by it: compensated here
        norm = {"dp_size": torch.distributed.get_world_size() if data_parallel() else 1,
                "batch_num_tokens": torch.tensor(tokens / gas), "global_batch_size": torch.tensor(sequences / gas)}
        others = [n for n in self.adapter_names if n != name]
        snapshot = ads.AdapterSnapshot(self.actor, others)
        ads.set_adam_step(engine, self.adam_steps[name])
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else 0
        stats = self._stats.setdefault(name, defaultdict(float))
        for i in range(count):
            real = i < len(batches)
            batch = batches[i] if real else empty_micro_batch(index, pad)
            batch.to_device(device())
            boundary = i == count - 1
            engine.set_gradient_accumulation_boundary(boundary)
            status = self.training_step(batch, kl_ctl, i, norm)
            if real:
                self._record(stats, status, scale=norm["dp_size"] * gas)
            if boundary:
                stats["_grad_norm"] += status["metrics"].get("actor_grad_norm", 0.0)
                stats["_lr"] += float(status["metrics"]["actor_lr"])
                stats["updates"] += 1
        self.adam_steps[name] += 1
        snapshot.restore()
        ads.clear_stale_grads(self.actor, self.adapter_names)

    # -- metrics ------------------------------------------------------------------------------------------

    @staticmethod
    def _record(stats: dict[str, float], status: dict, scale: float) -> None:
        """Add one micro-batch. The policy and entropy losses come normalised by the window's token count times
        ``scale`` (data-parallel size x DeepSpeed's accumulation steps), so their sum over a window and the ranks,
        divided by ``scale``, is the window's token mean; the clip ratio is a micro-batch mean."""
        metrics, n_tokens, n_samples = status["metrics"], status["num_action_tokens"], status["num_samples"]
        stats["_tokens"] += n_tokens
        stats["_samples"] += n_samples
        stats["_loss_sum"] += float(metrics["policy_loss"].float().sum()) / scale
        if isinstance(metrics.get("entropy_loss"), torch.Tensor):
            stats["_entropy_sum"] += float(metrics["entropy_loss"].float().sum()) / scale
        if isinstance(metrics.get("ppo_clip_ratio"), torch.Tensor):
            stats["_clip_sum"] += float(metrics["ppo_clip_ratio"].float().mean()) * n_tokens
        for key in ("response_length", "reward"):
            value = metrics.get(key)
            if isinstance(value, torch.Tensor):
                stats[f"_{key}_sum"] += float(value.float().sum())

    def _status(self) -> dict[str, float]:
        """Per-adapter means (sums over this rank's micro-batches, all-reduced over ranks) and batch means."""
        fields = ("_tokens", "_samples", "_loss_sum", "_entropy_sum", "_clip_sum", "_response_length_sum",
                  "_reward_sum")
        names = self.adapter_names
        local = [float(self._stats.get(n, {}).get(f, 0.0)) for n in names for f in fields]
        total = dict(zip([f"{n}/{f}" for n in names for f in fields],
                         _all_reduce(local, torch.distributed.ReduceOp.SUM), strict=True))
        status: dict[str, float] = {}
        for name in names:
            samples, tokens = total[f"{name}/_samples"], total[f"{name}/_tokens"]
            updates = self._stats.get(name, {}).get("updates", 0.0)
            if not updates:
                continue
            stats = self._stats[name]
            per = {
                "loss": total[f"{name}/_loss_sum"] / updates,  # the policy loss, token mean, mean over epochs
                "clip_ratio": total[f"{name}/_clip_sum"] / max(tokens, 1.0),
                "grad_norm": stats["_grad_norm"] / updates,
                "lr": stats["_lr"] / updates,
                "updates": updates / 1.0,
                "num_sequences": samples / updates,
                "num_tokens": tokens / updates,
                "response_length": total[f"{name}/_response_length_sum"] / max(samples, 1.0),
                "reward": total[f"{name}/_reward_sum"] / max(samples, 1.0),
            }
            if self.args.actor.entropy_coef is not None:
                per["entropy"] = total[f"{name}/_entropy_sum"] / updates
            status.update({f"{PER_ADAPTER_PREFIX}/{name}/{key}": value for key, value in per.items()})
        trained = split_per_adapter(status)
        if trained:  # upstream's batch-level keys, as its ppo_train reports them
            weight = {n: s["num_tokens"] for n, s in trained.items()}
            total_tokens = max(sum(weight.values()), 1.0)
            status["policy_loss"] = sum(s["loss"] * weight[n] for n, s in trained.items()) / total_tokens
            status["actor_lr"] = next(iter(trained.values()))["lr"]
            status["actor_grad_norm"] = max(s["grad_norm"] for s in trained.values())
        return status


def wait_for_engines(engines: Sequence[Any] | None) -> None:
    """Block until every vLLM engine actor has finished starting (its ``__init__`` builds the engine and measures
    its memory). Upstream's ``train()`` creates the engines without waiting for them (it waits only under
    ``--vllm.enable_sleep``) and starts loading the policy at once. Colocated on the same GPUs
    (``--train.colocate_all``), DeepSpeed's allocations during vLLM's start-up would be counted as vLLM's own
    (vLLM 0.29 measures its use as the drop in device-wide free memory): a smaller KV cache, or a failed start."""
    if engines:
        ray.get([engine.__ray_ready__.remote() for engine in engines])


class _PrepareWithAdapters:
    """The strategy as ``PolicyModelActor.init_model_from_pretrained`` sees it: ``prepare`` first gives the
    trainable Actor the run's adapters, so upstream's one ``prepare`` call builds one engine over all, then makes
    that engine's checkpoints adapters-only (:func:`adapter_only_checkpoints`) before upstream's start-up load."""

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
        strategy = self._strategy
        strategy.get_ds_train_config = functools.partial(no_persistent_params, strategy.get_ds_train_config)
        try:
            prepared = strategy.prepare(*models)
        finally:
            del strategy.get_ds_train_config  # the instance attribute: the class's method again
        for entry in models:
            if isinstance(entry, tuple) and entry[0] is not None:  # before upstream's start-up load_ckpt
                adapter_only_checkpoints(ads.ds_engine(entry[0]))
        return prepared


def frozen_parameter_names(module: torch.nn.Module, prefix: str = "") -> set[str]:
    """Every name of every frozen parameter of ``module``, a tied one under each of its names (the tiny model's
    and small Qwen2/SmolLM2 models' ``lm_head.weight`` is ``embed_tokens.weight``)."""
    return {prefix + n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def load_adapter_module_states(src: Mapping[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """DeepSpeed's ``custom_load_fn`` for a checkpoint's module states: ``dst.load_state_dict(src)``, strict
    except that frozen parameters may be absent (an adapters-only checkpoint). Checked before anything is
    loaded: a checkpoint lacking any other entry of ``dst``'s state dict -- an adapter's tensor -- or holding an
    entry ``dst`` has not, is refused with the keys named. (The trainable tensors' values also come from the
    optimizer's fp32 partitions when optimizer states are loaded; the key check is what says the checkpoint is
    this model's adapters.) Frozen entries, where an older checkpoint has them, are loaded as before."""
    expected = set(dst.state_dict(keep_vars=True))
    missing = sorted(expected - set(src) - frozen_parameter_names(dst))
    unexpected = sorted(set(src) - expected)
    if missing or unexpected:
        raise RuntimeError(f"checkpoint module states do not match the model: missing {missing} (only frozen "
                           f"parameters may be absent), unexpected {unexpected}")
    dst.load_state_dict(src, strict=False)


def adapter_only_checkpoints(engine) -> None:
    """Make ``engine``'s DeepSpeed checkpoints hold only the trainable (adapter) parameters in the module
    states; the optimizer states are written as before.

    DeepSpeed's default (``save_checkpoint(exclude_frozen_parameters=False)``, what upstream's
    ``DeepspeedStrategy.save_ckpt`` calls) writes the whole frozen base into rank 0's module states (15.2 GB for a
    7B model in bf16) and, as ``frozen_param_fragments``, once more: under ZeRO-2 the whole base again in the same
    file (a CPU copy every rank takes; on CPU it shares the tensors' storage and is not written twice), under ZeRO-3
    each rank's partition in its own file (its module states are empty placeholders). A resume reads it back on
    every rank. Three narrow overrides on this engine instance, so that every caller -- upstream's
    ``save_ckpt`` with its rotation by ``--ckpt.max_num``/``max_mem`` and its start-up ``load_ckpt``, and
    :meth:`PopuLoRAPolicyActor.save_state`/``load_state`` -- goes through DeepSpeed's own API unchanged (the
    strategy's rotation code is not copied):

    - ``save_checkpoint`` defaults ``exclude_frozen_parameters`` to True (an explicit False still writes the
      base: how the tests make an old-style checkpoint);
    - ``module_state_dict(exclude_frozen_parameters=True)`` also drops a frozen parameter's tied names:
      DeepSpeed 0.19 drops the names ``named_parameters()`` lists, one per tied tensor, so a tied
      ``lm_head.weight`` (vocab x hidden) would stay in the checkpoint;
    - ``load_checkpoint`` loads the module states with :func:`load_adapter_module_states` (a strict load would
      refuse the missing base; a plain non-strict one would skip a missing adapter silently). A caller passing
      its own ``custom_load_fn`` or ``load_module_strict=False`` gets DeepSpeed's behaviour.

    The frozen base is not in the checkpoint: after a load it is the one the model was built from
    (``--actor.model_name_or_path``). Old checkpoints (the base inside) load as before: their frozen entries and,
    under ZeRO-2/3, their frozen fragments overwrite the built base with the saved one."""
    if engine is None or getattr(engine, "_populora_adapter_only", False):
        return
    save, load, module_state = engine.save_checkpoint, engine.load_checkpoint, engine.module_state_dict

    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=True):
        return save(save_dir, tag=tag, client_state={} if client_state is None else client_state,
                    save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters)

    def module_state_dict(destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        state = module_state(destination=destination, prefix=prefix, keep_vars=keep_vars,
                             exclude_frozen_parameters=exclude_frozen_parameters)
        if exclude_frozen_parameters and state is not None:
            for name in frozen_parameter_names(engine.module, prefix):
                state.pop(name, None)
        return state

    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        if custom_load_fn is None and load_module_strict:
            custom_load_fn = load_adapter_module_states
        return load(load_dir, tag, load_module_strict=load_module_strict,
                    load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only, custom_load_fn=custom_load_fn)

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
    engine.module_state_dict = module_state_dict
    engine._populora_adapter_only = True


def no_persistent_params(get_ds_train_config, *args, **kwargs) -> dict:
    """Upstream's DeepSpeed config, with ZeRO-3's ``stage3_param_persistence_threshold`` at 0.

    Upstream passes ``"auto"``, which DeepSpeed drops, so its default (1e5 elements) applies: smaller
    parameters -- most LoRA tensors of a 7B model at rank 16 -- are "persistent", re-gathered whole into fresh
    tensors at the end of every optimizer ``step()`` and never re-gathered by forward passes. With more than one
    rank, those full copies are taken before :class:`~adapters_ds.AdapterSnapshot` restores the adapters that
    were not in the window (it restores the partitions), so the next forward passes would use every other
    adapter's Adam-drifted weights. With the threshold at 0 no parameter is persistent: every forward gathers
    the restored partitions (small norm weights included, a few more small all-gathers per layer)."""
    config = get_ds_train_config(*args, **kwargs)
    zero = config.get("zero_optimization", {})
    if int(zero.get("stage", 0)) == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return config


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
        With ``--ckpt.load_enable`` upstream loads ``{ckpt.path}/_actor``: an adapters-only checkpoint leaves the
        frozen base built from ``pretrain``; an older one with the base inside overwrites it with the saved one.

        ``vllm_engines`` is kept (the controller's uploads use them) but not given to upstream, which would open
        an NCCL weight-sync group that LoRA cannot use. The model is loaded only once every engine has started
        (:func:`wait_for_engines`).
        """
        args = strategy.args
        self.adapter_names, seed = populora_settings(args)
        if args.train.enable_ema:
            raise ValueError("--train.enable_ema is not supported with PopuLoRA adapters")
        wait_for_engines(vllm_engines)
        super().init_model_from_pretrained(_PrepareWithAdapters(strategy, self.adapter_names, seed), pretrain,
                                           max_steps=max_steps, vllm_engines=None)
        self.strategy = strategy
        self.vllm_engines = vllm_engines
        self._check_loaded(self.checkpoint_states or {}, "the checkpoint")
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
        steps = self.checkpoint_states.get(ADAM_STEPS_STATE_KEY) if self.checkpoint_states else None
        if steps is not None:
            self.trainer.adam_steps.update({name: int(steps[name]) for name in self.adapter_names})

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

    def vocab_size(self) -> int:
        """The width of the model's logits (its output embedding's rows): what a scoring forward's memory scales
        with (``memory.logit_bytes``)."""
        return int(ads.peft_model(self.actor).get_output_embeddings().out_features)

    def get_adapter_state(self, name: str, all_ranks: bool = False) -> dict[str, torch.Tensor] | None:
        """Adapter ``name`` in PEFT's saved format (fp32, CPU). Every rank calls (ZeRO-3 gathers); only rank 0
        returns it (the others return None, unless ``all_ranks``): one copy travels to the caller, not one per
        rank."""
        state = ads.adapter_state(self.actor, name)
        if all_ranks or not data_parallel() or torch.distributed.get_rank() == 0:
            return state
        return None

    def adapter_digest(self, name: str, dtype: str) -> str | None:
        """The sync proof's trainer side of the content check: the sha256 of adapter ``name`` as this trainer
        holds it now, cast to ``dtype`` (the vLLM engine's; :func:`digest.adapter_digest`). Every rank calls
        (ZeRO-3 gathers); rank 0 answers."""
        state = self.get_adapter_state(name)
        return None if state is None else adapter_digest(state, dtype)

    def set_adapter_state(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite adapter ``name`` (fp32 master, low-precision copy) and reset its optimizer state fully: zero
        Adam moments and step count 0, a fresh Adam as on the local engine. Every rank calls, in the same order,
        with the same tensors."""
        ads.write_adapter(self.actor, name, tensors)
        self.trainer.adam_steps[name] = 0

    def forward(self, sequences, action_mask=None, attention_mask=None, packed_seq_lens=None,
                mm_train_inputs_list=None, adapter_name=None) -> torch.Tensor:
        """No-grad action log-probs through adapter ``adapter_name`` (a name or an index; ``None``: the
        active one). Upstream's ``execute_batch`` passes it per micro-batch."""
        if adapter_name is not None:
            if not isinstance(adapter_name, str):
                adapter_name = self.adapter_names[int(adapter_name)]
            # ranks may score different adapters in the same call: ZeRO-3's gathers need the same set everywhere
            ads.activate(self.actor, adapter_name, all_in_graph=data_parallel() and self._zero3())
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

    def _zero3(self) -> bool:
        return int(self.strategy.args.ds.zero_stage) == 3

    def probe_log_probs(self, sequences, action_mask, attention_mask, adapter_name) -> torch.Tensor:
        """The sync probe's trainer side: :meth:`forward` at temperature 1 (vLLM reports raw log-probs)."""
        temperature, self.actor.temperature = self.actor.temperature, 1.0
        try:
            return self.forward(sequences, action_mask, attention_mask, adapter_name=adapter_name)
        finally:
            self.actor.temperature = temperature

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

    def _own_states(self, client_states: Mapping[str, Any] | None) -> dict:
        """``client_states`` plus what a checkpoint of this actor records: the adapter names, each adapter's
        Adam step count and the base model's path (the base itself is not in the checkpoint)."""
        states = dict(client_states or {})
        states[ADAPTER_NAMES_STATE_KEY] = list(self.adapter_names)
        states[ADAM_STEPS_STATE_KEY] = dict(self.trainer.adam_steps)
        states[BASE_MODEL_STATE_KEY] = str(self.strategy.args.actor.model_name_or_path)
        return states

    def _check_loaded(self, states: Mapping[str, Any], where: str) -> None:
        """A loaded checkpoint's adapter names must be this run's; a different recorded base path is reported
        (the checkpoint holds no base: this run's ``--actor.model_name_or_path`` is the one used)."""
        saved = states.get(ADAPTER_NAMES_STATE_KEY)
        if saved is not None and list(saved) != self.adapter_names:
            raise ValueError(f"{where} holds adapters {list(saved)}, this run names {self.adapter_names}")
        base, ours = states.get(BASE_MODEL_STATE_KEY), str(self.strategy.args.actor.model_name_or_path)
        if base is not None and base != ours and self.strategy.is_rank_0():
            print(f"[populora] WARNING: {where} was saved on base model {base}; this run's is {ours}. Checkpoints "
                  "hold only the adapters: they now run on this run's base.", file=sys.stderr, flush=True)

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """Upstream's DeepSpeed checkpoint (its ``save_ckpt``, rotation by ``--ckpt.max_num``/``max_mem`` included)
        of every adapter and the optimizer -- not the frozen base (:func:`adapter_only_checkpoints`) -- with the
        given ``client_states`` (the controller puts its population state under ``CLIENT_STATE_KEY``) and
        :meth:`_own_states`. With ``--ckpt.save_hf`` the adapters also go to ``{ckpt.path}/{tag}_hf/<name>/`` in
        PEFT format."""
        import os

        states = self._own_states(client_states)
        save_hf, self.save_hf_ckpt = self.save_hf_ckpt, False
        try:
            super().save_checkpoint(tag, states, metric_value=metric_value, metric_key=metric_key)
        finally:
            self.save_hf_ckpt = save_hf
        if save_hf:
            self.save_adapters(os.path.join(self.strategy.args.ckpt.path, f"{tag}_hf"))

    def save_state(self, path: str, client_states: Mapping[str, Any] | None = None) -> None:
        """A DeepSpeed checkpoint (every adapter, the optimizer, the scheduler; not the frozen base:
        :func:`adapter_only_checkpoints`) in folder ``path``, with ``client_states`` and :meth:`_own_states`. Every
        rank calls."""
        states = self._own_states(client_states)
        self.strategy.save_ckpt(self.actor.model, path, tag="populora", max_num=1 << 30, max_mem=float("inf"),
                                client_state=states)

    def load_state(self, path: str) -> dict:
        """Restore what ``save_state`` wrote (or an older checkpoint with the base inside); returns its client
        states. A checkpoint lacking any adapter tensor is refused (:func:`load_adapter_module_states`); an
        adapters-only one leaves the frozen base the one the model was built from. Every rank calls."""
        _, states = self.strategy.load_ckpt(self.actor.model, path, tag="populora")
        states = dict(states or {})
        self._check_loaded(states, path)
        steps = states.get(ADAM_STEPS_STATE_KEY)
        if steps is not None:
            self.trainer.adam_steps.update({name: int(steps[name]) for name in self.adapter_names})
        self.checkpoint_states = states
        return states

    def load_checkpoint_states(self) -> dict:
        """The client states of the checkpoint loaded at start-up ({} when none was loaded)."""
        return dict(self.checkpoint_states or {})
