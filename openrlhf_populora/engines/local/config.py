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


@dataclass
class LocalEngineConfig:
    """Knobs of the embedded engine (the CLI maps OpenRLHF's flag names onto these)."""

    model_name_or_path: str | None = None  # a local HF directory or a name models.embedded.resolve_model knows
    lora_rank: int = 8  # --ds.lora.rank
    lora_alpha: int = 16  # --ds.lora.alpha
    lora_target_modules: str | list[str] = "all-linear"  # --ds.lora.target_modules
    lora_dropout: float = 0.0  # --ds.lora.dropout
    lr: float = 1e-5  # --actor.adam.lr: the peak learning rate
    lr_scheduler: str = "constant"  # --actor.lr_scheduler: constant | cosine_with_min_lr (over train_step calls)
    lr_warmup_steps: int = 0  # linear warm-up updates (--actor.lr_warmup_ratio x total steps)
    lr_total_steps: int = 0  # updates the cosine spans (the run's total steps)
    min_lr_ratio: float = 0.1  # --actor.min_lr_ratio: the cosine's floor, as a fraction of lr
    weight_decay: float = 0.0  # --actor.adam.weight_decay
    adam_betas: tuple[float, float] = (0.9, 0.95)  # --actor.adam.betas
    adam_eps: float = 1e-8  # --actor.adam.eps
    max_norm: float = 1.0  # --actor.max_norm (per adapter); <= 0 disables clipping
    eps_clip_low: float = 0.2  # --actor.eps_clip_low_high
    eps_clip_high: float = 0.2
    entropy_coef: float = 0.0  # --actor.entropy_coef
    logprob_temperature: float = 1.0  # log-probs of softmax(logits / T) in training (OpenRLHF: rollout temperature)
    # the frozen base's dtype (LoRA tensors and optimizer states always stay fp32); auto: bf16 where the
    # device has native bf16 matrix units (this project's 2-core CPU: 380 vs 137 GFLOP/s), else fp32
    dtype: str = "fp32"
    device: str = "cpu"  # cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"  # --ds.attn_implementation (sdpa: one-token decode steps use grouped-query matmuls)
    num_threads: int | None = 1  # torch CPU threads; None or 0 leaves torch's default (2 shared cores thrash with more)
    micro_batch_size: int = 4  # responses per forward/backward in training (gradient accumulation)
    max_epochs: int = 1  # --train.max_epochs: updates per train_step on the same trajectories (PPO epochs)
    generation_batch_size: int = 32  # rows decoded together
    share_prefill: bool = True  # one prefill per distinct (adapter, prompt), shared by its n samples
    share_prompts: bool = True  # training: one forward of a prompt shared by the responses that follow it
    policy_loss: str = "auto"  # auto | openrlhf | native
    old_logprobs: str = "auto"  # auto: reuse the update pass (exact when lora_dropout == 0) | recompute
    seed: int = 0  # adapter init (with the adapter's name) and unseeded generation

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
        for name in ("micro_batch_size", "generation_batch_size", "max_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0 or None: torch's default), got {self.num_threads}")
        if self.lr < 0 or self.weight_decay < 0 or not 0 <= self.lora_dropout < 1:
            raise ValueError("lr and weight_decay must be >= 0 and lora_dropout in [0, 1)")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"lr_scheduler must be one of {LR_SCHEDULERS}, got {self.lr_scheduler!r}")
        if self.lr_warmup_steps < 0 or self.lr_total_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr_warmup_steps and lr_total_steps must be >= 0 and min_lr_ratio in [0, 1]")
        if self.eps_clip_low < 0 or self.eps_clip_high < 0 or self.logprob_temperature <= 0:
            raise ValueError("eps_clip_low/high must be >= 0 and logprob_temperature > 0")
