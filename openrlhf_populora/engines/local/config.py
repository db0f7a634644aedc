"""Knobs of the embedded engine. The CLI maps OpenRLHF's flag names onto these (``cli/train.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # fp16: GPU only, in practice
LR_SCHEDULERS = ("constant", "cosine_with_min_lr")


def native_bf16(device: str) -> bool:
    """Whether ``device`` multiplies bf16 matrices natively (CPU: AVX512-BF16 or AMX; CUDA: Ampere or newer)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto`` -> ``bf16`` where the device has native bf16 matrix units, else ``fp32``; others unchanged."""
    if dtype != "auto":
        return dtype
    return "bf16" if native_bf16(device) else "fp32"


TRAINING_FIELDS = ("lr", "lr_scheduler", "lr_warmup_steps", "lr_total_steps", "min_lr_ratio", "weight_decay",
                   "adam_betas", "adam_eps", "max_norm", "eps_clip_low", "eps_clip_high", "entropy_coef", "max_epochs")


@dataclass
class LocalEngineConfig:
    """Knobs of the embedded engine.

    Every knob the run's ``Config`` also holds has no default here: the composition layer
    (``build.local_engine_config``) maps ``Config``'s one set of values onto these fields, so the two trees
    cannot disagree. The training fields are None on an engine that only generates
    (:meth:`for_inference`, used by evaluation); ``train_step`` then refuses. Only knobs of this engine's own
    implementation, which ``Config`` does not have, keep defaults.
    """

    # the model and its adapters (Config: actor.model_name_or_path, ds.*, populora.device/num_threads, train.seed)
    model_name_or_path: str | None  # a local HF directory, a hub id or a name models.embedded.resolve_model knows
    lora_rank: int  # --ds.lora.rank
    lora_alpha: int  # --ds.lora.alpha
    lora_target_modules: str | list[str]  # --ds.lora.target_modules
    lora_dropout: float  # --ds.lora.dropout
    # the frozen base's dtype (LoRA tensors and optimizer states always stay fp32); auto: bf16 where the
    # device has native bf16 matrix units (this project's 2-core CPU: 380 vs 137 GFLOP/s), else fp32
    dtype: str  # --ds.param_dtype
    device: str  # --populora.device: cpu | cuda | cuda:N
    attn_implementation: str  # --ds.attn_implementation (sdpa: one-token decode steps use grouped-query matmuls)
    num_threads: int | None  # torch CPU threads; None or 0 leaves torch's default (2 shared cores thrash with more)
    seed: int  # --train.seed: adapter init (with the adapter's name) and unseeded generation
    micro_batch_size: int  # --actor.micro_batch_size: responses per forward/backward in training and scoring
    logprob_temperature: float  # log-probs of softmax(logits / T) (--rollout.temperature, as OpenRLHF scores)
    # training (Config: actor.*, train.max_epochs); None on an engine that only generates
    lr: float | None  # --actor.adam.lr: the peak learning rate
    lr_scheduler: str | None  # --actor.lr_scheduler: constant | cosine_with_min_lr (over updates)
    lr_warmup_steps: int | None  # linear warm-up updates (--actor.lr_warmup_ratio x total updates)
    lr_total_steps: int | None  # updates the cosine spans (--populora.total_steps x --train.max_epochs)
    min_lr_ratio: float | None  # --actor.min_lr_ratio: the cosine's floor, as a fraction of lr
    weight_decay: float | None  # --actor.adam.weight_decay
    adam_betas: tuple[float, float] | None  # --actor.adam.betas
    adam_eps: float | None  # --actor.adam.eps
    max_norm: float | None  # --actor.max_norm (per adapter); <= 0 disables clipping
    eps_clip_low: float | None  # --actor.eps_clip_low_high (or --actor.eps_clip)
    eps_clip_high: float | None
    entropy_coef: float | None  # --actor.entropy_coef
    max_epochs: int | None  # --train.max_epochs: updates per train_step on the same trajectories (PPO epochs)
    # this engine's own implementation
    generation_batch_size: int = 32  # rows decoded together
    share_prefill: bool = True  # one prefill per distinct (adapter, prompt), shared by its n samples
    share_prompts: bool = True  # training: one forward of a prompt shared by the responses that follow it
    policy_loss: str = "auto"  # auto | openrlhf | native
    old_logprobs: str = "auto"  # auto: reuse the update pass (exact when lora_dropout == 0) | recompute

    @classmethod
    def for_inference(cls, model_name_or_path: str | None, lora_rank: int, lora_alpha: int,
                      lora_target_modules: str | list[str], dtype: str, device: str,
                      num_threads: int | None, **engine_knobs) -> LocalEngineConfig:
        """An engine that generates and scores but never trains (evaluation): no training fields, no LoRA
        dropout, SDPA attention, seed 0 (generation is seeded per call), temperature-1 log-probs."""
        return cls(model_name_or_path=model_name_or_path, lora_rank=lora_rank, lora_alpha=lora_alpha,
                   lora_target_modules=lora_target_modules, lora_dropout=0.0, dtype=dtype, device=device,
                   attn_implementation="sdpa", num_threads=num_threads, seed=0, micro_batch_size=8,
                   logprob_temperature=1.0, **dict.fromkeys(TRAINING_FIELDS), **engine_knobs)

    @property
    def trains(self) -> bool:
        return self.lr is not None

    def validate(self) -> None:
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1, got {self.lora_rank}")
        if self.dtype not in (*DTYPES, "auto"):
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if self.old_logprobs not in ("auto", "recompute"):
            raise ValueError(f"old_logprobs must be auto|recompute, got {self.old_logprobs!r}")
        if self.policy_loss not in ("auto", "openrlhf", "native"):
            raise ValueError(f"policy_loss must be auto|openrlhf|native, got {self.policy_loss!r}")
        for name in ("micro_batch_size", "generation_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 or None: torch's default), got {self.num_threads}")
        if not 0 <= self.lora_dropout < 1 or self.logprob_temperature <= 0:
            raise ValueError("lora_dropout must be in [0, 1) and logprob_temperature > 0")
        unset = [name for name in TRAINING_FIELDS if getattr(self, name) is None]
        if not unset:
            self._validate_training()
        elif len(unset) != len(TRAINING_FIELDS):
            raise ValueError(f"training fields {unset} are unset while others are set: give all or none")

    def _validate_training(self) -> None:
        if self.lr < 0 or self.weight_decay < 0:
            raise ValueError("lr and weight_decay must be >= 0")
        if self.max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1, got {self.max_epochs}")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"lr_scheduler must be one of {LR_SCHEDULERS}, got {self.lr_scheduler!r}")
        if self.lr_warmup_steps < 0 or self.lr_total_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr_warmup_steps and lr_total_steps must be >= 0 and min_lr_ratio in [0, 1]")
        if self.eps_clip_low < 0 or self.eps_clip_high < 0:
            raise ValueError("eps_clip_low/high must be >= 0")
