"""The embedded engine: transformers + peft, one frozen base model and N named LoRA adapters, one process.

Runs on CPU or one CUDA GPU. Everything the self-play loop needs (see ``engines/base.py``):

- **Generation.** Every request is expanded into ``n`` rows; rows are sorted by prompt length, cut into
  batches of ``generation_batch_size``, left-padded, and decoded with a KV cache. Rows of *different*
  adapters share one forward pass: by default every LoRA layer applies all adapters at once with two
  batched matmuls (``StackedLoRA``); ``mixed_lora="peft"`` uses peft's ``adapter_names`` batches
  instead (same tokens, slower: it loops over adapters in every layer). Rows that hit EOS leave the
  batch. Each row samples with its own ``torch.Generator`` seeded from (seed, request index, sample
  index), so a completion does not depend on how rows were batched. ``temperature == 0`` is greedy;
  otherwise softmax(logits / T) restricted to the top-p nucleus.
- **Training (REINFORCE++).** Per adapter, one optimizer step on its trajectories. With the policy
  log-probs ``logp`` (at ``logprob_temperature``), the old log-probs ``old`` of the policy before the
  update, and the advantage ``A`` shared by every token of a response::

      ratio = exp(clamp(logp - old, -20, 20))
      loss_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
      loss = sum_t loss_t / T  -  entropy_coef * sum_t H_t / T           (token-mean over the adapter's T tokens)

  OpenRLHF's ``PolicyLoss`` computes the first term when it imports (``policy_loss="auto"``), else the
  same maths written here. ``old`` is recomputed in a no_grad pass before the update when LoRA dropout
  is on (or ``old_logprobs="recompute"``); without dropout it is bit-for-bit the update pass's own
  log-probs (one update per step), so that pass is reused, saving a third of the compute. Gradients are
  accumulated over micro-batches, clipped to ``max_norm`` per adapter, and applied by that adapter's
  own AdamW: an adapter absent from a step stays bit-identical, weights and optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from openrlhf_populora.engines.base import (
    BASE_ADAPTER,
    Completion,
    GenerationRequest,
    SamplingParams,
    Trajectory,
    render_chat,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # fp16: GPU only, in practice
STATE_FILE = "engine_state.pt"


@dataclass
class LocalEngineConfig:
    """Knobs of the embedded engine (the CLI maps OpenRLHF's flag names onto these)."""

    model_name_or_path: str | None = None  # a local HF directory; None/"embedded" = SmolLM2-135M-Instruct
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
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (the base; LoRA tensors and optimizer states stay fp32)
    device: str = "cpu"  # cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"  # --ds.attn_implementation; sdpa: 5x faster than eager at 2k tokens on CPU
    num_threads: int | None = 1  # torch CPU threads; None or 0 leaves torch's default (cpu-stack.md: threads)
    micro_batch_size: int = 4  # sequences per forward/backward in training (gradient accumulation)
    generation_batch_size: int = 32  # rows per generation forward
    mixed_lora: str = "stacked"  # stacked: all adapters in 2 bmm per layer | peft: peft's adapter_names loop
    policy_loss: str = "auto"  # auto | openrlhf | native
    old_logprobs: str = "auto"  # auto: reuse the update pass (exact when lora_dropout == 0) | recompute
    seed: int = 0  # adapter init (with the adapter's name) and unseeded generation

    def validate(self) -> None:
        if self.lora_rank < 1:
            raise ValueError(f"lora_rank must be >= 1, got {self.lora_rank}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if self.old_logprobs not in ("auto", "recompute"):
            raise ValueError(f"old_logprobs must be auto|recompute, got {self.old_logprobs!r}")
        if self.mixed_lora not in ("stacked", "peft"):
            raise ValueError(f"mixed_lora must be stacked|peft, got {self.mixed_lora!r}")
        if self.policy_loss not in ("auto", "openrlhf", "native"):
            raise ValueError(f"policy_loss must be auto|openrlhf|native, got {self.policy_loss!r}")
        for name in ("micro_batch_size", "generation_batch_size"):
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


LR_SCHEDULERS = ("constant", "cosine_with_min_lr")


def lr_factor(kind: str, update: int, warmup: int, total: int, min_ratio: float) -> float:
    """The learning-rate multiplier of update number ``update`` (0-based), as OpenRLHF's schedulers define it:
    linear warm-up from 0 over ``warmup`` updates, then constant, or a cosine from 1 down to ``min_ratio`` at
    update ``total``."""
    if update < warmup:
        return update / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (update - warmup) / (total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (not Python's salted ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


# ----------------------------------------------------------------------------------------- policy loss


def native_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: float,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped-ratio policy loss summed over masked tokens and divided by ``num_tokens`` (the token
    count of the whole adapter batch, so micro-batch losses add up to the token mean), and the
    number of tokens whose ratio was clipped."""
    ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = -torch.min(surr1, surr2)
    clipped = (surr2 < surr1).float()
    return (loss * mask).sum() / num_tokens, (clipped * mask).sum()


_OPENRLHF_POLICY_LOSS: list = []  # memo of the import attempt: [class] or [exception]


def _import_openrlhf_policy_loss():
    """OpenRLHF's ``PolicyLoss`` class, or the exception its import raised (tried once per process:
    the import chain pulls deepspeed, and it needs ``flash_attn`` or a stub of it)."""
    if not _OPENRLHF_POLICY_LOSS:
        try:
            from openrlhf.models.loss import PolicyLoss

            _OPENRLHF_POLICY_LOSS.append(PolicyLoss)
        except Exception as err:  # ImportError, or anything the heavy import chain raises
            _OPENRLHF_POLICY_LOSS.append(err)
    return _OPENRLHF_POLICY_LOSS[0]


def make_policy_loss(choice: str, eps_low: float, eps_high: float) -> tuple[Callable, str]:
    """``(fn, source)``: fn(log_probs, old, adv, mask, num_tokens) -> (loss, clipped_count), where
    source is "openrlhf" (its ``PolicyLoss``, token-level) or "native" (``native_policy_loss``)."""
    if choice in ("auto", "openrlhf"):
        found = _import_openrlhf_policy_loss()
        if isinstance(found, Exception) and choice == "openrlhf":
            raise ImportError(f"policy_loss='openrlhf' but openrlhf.models.loss does not import: {found}") from found
        if not isinstance(found, Exception):
            module = found(clip_eps_low=eps_low, clip_eps_high=eps_high, token_level_loss=True)

            def openrlhf_loss(log_probs, old_log_probs, advantages, mask, num_tokens):
                loss, clip_ratio, *_ = module(
                    log_probs, old_log_probs, advantages, action_mask=mask, batch_num_tokens=num_tokens
                )
                return loss, clip_ratio * mask.sum()

            return openrlhf_loss, "openrlhf"

    def loss_fn(log_probs, old_log_probs, advantages, mask, num_tokens):
        return native_policy_loss(log_probs, old_log_probs, advantages, mask, num_tokens, eps_low, eps_high)

    return loss_fn, "native"


# ----------------------------------------------------------------------------------------- sampling


def sample_next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """One token per row of ``logits`` (B, V): argmax when ``temperature == 0``, else a draw from
    softmax(logits / T) restricted to the smallest set of tokens whose probability reaches ``top_p``."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    draws = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    return torch.cat(draws)


# ----------------------------------------------------------------------------------------- mixed LoRA


class StackedLoRA:
    """Mixed-adapter LoRA for generation with a fixed number of ops per layer, whatever the adapter count.

    peft's ``adapter_names`` path loops over the adapters present in the batch in every LoRA layer
    (index, two matmuls and an index_put each), which dominates small models. Here every layer's
    adapters are stacked, ``A: (N+1, r, in)``, ``B: (N+1, out, r)``, ``s: (N+1,)`` (the last entry is
    zero for ``__base__`` rows), and with ``k`` the adapter index of each row::

        y = base(x) + s[k] * (x @ A[k]^T) @ B[k]^T            (two batched matmuls)

    Used inside ``peft.disable_adapter()`` (LoRA layers compute ``base(x)`` only) with forward hooks
    that add the second term. Inference only: no dropout, no gradients.
    """

    def __init__(self, peft_model, names: Sequence[str]):
        self.peft = peft_model
        self.index = {name: i for i, name in enumerate(names)}
        self.index[BASE_ADAPTER] = len(names)
        self.rows: torch.Tensor | None = None  # adapter index of each batch row, set before each forward
        self.layers = []
        for module in peft_model.modules():
            if hasattr(module, "lora_A") and hasattr(module, "base_layer") and len(module.lora_A):
                A = [module.lora_A[n].weight for n in names]
                B = [module.lora_B[n].weight for n in names]
                scale = [float(module.scaling[n]) for n in names] + [0.0]
                self.layers.append((module, torch.stack([*A, torch.zeros_like(A[0])]),
                                    torch.stack([*B, torch.zeros_like(B[0])]),
                                    torch.tensor(scale, dtype=A[0].dtype, device=A[0].device)))
        self._hooks = []
        self._context = None

    @staticmethod
    def supports(peft_model, names: Sequence[str]) -> bool:
        """Plain LoRA Linear layers holding every adapter (no DoRA/variants, no fan_in_fan_out)."""
        from peft.tuners.lora import Linear as LoraLinear

        for module in peft_model.modules():
            if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
                if type(module) is not LoraLinear or module.fan_in_fan_out or module.lora_variant:
                    return False
                if not all(n in module.lora_A for n in names):
                    return False
        return True

    def set_rows(self, adapter_names: Sequence[str]) -> None:
        device = self.layers[0][1].device if self.layers else "cpu"
        self.rows = torch.tensor([self.index[a] for a in adapter_names], device=device)

    def _hook(self, A, B, scale):
        def add_lora(module, args, output):
            k = self.rows
            x = args[0].to(A.dtype)
            flat = x.reshape(x.shape[0], -1, x.shape[-1])  # (rows, tokens, in)
            low = torch.bmm(flat, A[k].transpose(1, 2))  # (rows, tokens, r)
            delta = torch.bmm(low, B[k].transpose(1, 2)) * scale[k][:, None, None]
            return output + delta.reshape(output.shape).to(output.dtype)

        return add_lora

    def __enter__(self):
        self._context = self.peft.disable_adapter()
        self._context.__enter__()
        self._hooks = [module.register_forward_hook(self._hook(A, B, s)) for module, A, B, s in self.layers]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._context.__exit__(*exc)
        return False


# ----------------------------------------------------------------------------------------- engine


class LocalEngine:
    """transformers + peft multi-adapter engine (implements ``engines.base.Engine``)."""

    def __init__(self, config: LocalEngineConfig, model=None, tokenizer=None):
        """Load ``config.model_name_or_path`` (resolved by ``models.embedded.resolve_model``), or use a
        ready ``model``/``tokenizer`` pair (tests pass the tiny model built in memory)."""
        config.validate()
        self.config = config
        if config.num_threads and config.device == "cpu":
            torch.set_num_threads(config.num_threads)  # process-wide: 2 shared cores thrash with more
        if (model is None) != (tokenizer is None):
            raise ValueError("pass both model and tokenizer, or neither")
        if model is None:
            model, tokenizer = self._load(config)
            self.model_path = model.name_or_path
        else:
            self.model_path = getattr(model, "name_or_path", "") or ""
        for p in model.parameters():
            p.requires_grad_(False)
        self.base = model.to(device=config.device, dtype=DTYPES[config.dtype]).eval()
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer needs both an eos_token and a pad_token")
        self.stop_ids = self._stop_ids()
        self.peft = None  # the PeftModel wrapping self.base, created with the first adapter
        self._adapters: dict[str, dict[str, torch.nn.Parameter]] = {}  # name -> {peft key: parameter}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._generate_calls = 0  # seeds unseeded generate() calls reproducibly; part of save_state
        self.updates = 0  # train_step calls so far: the learning-rate schedule's clock; part of save_state
        self._loss_fn, self.policy_loss_source = make_policy_loss(
            config.policy_loss, config.eps_clip_low, config.eps_clip_high
        )

    @staticmethod
    def _load(config: LocalEngineConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from openrlhf_populora.models.embedded import resolve_model

        path = resolve_model(config.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[config.dtype], attn_implementation=config.attn_implementation,
            local_files_only=True,
        )
        return model, tokenizer

    def _stop_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.base, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
        return ids

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device)

    # ------------------------------------------------------------------------------------- adapters

    def adapter_names(self) -> list[str]:
        return list(self._adapters)

    def _lora_config(self):
        from peft import LoraConfig

        c = self.config
        targets = c.lora_target_modules
        if not isinstance(targets, str) and list(targets) == ["all-linear"]:
            targets = "all-linear"  # OpenRLHF's nargs="*" flag gives a one-element list; peft wants the str
        return LoraConfig(
            task_type="CAUSAL_LM", r=c.lora_rank, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
            target_modules=targets if isinstance(targets, str) else list(targets), bias="none",
        )

    def add_adapter(self, name: str, weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Create adapter ``name``. A fresh adapter's init (A random, B zero) depends only on
        (config.seed, name), not on creation order."""
        if not isinstance(name, str) or not name or "." in name or name == BASE_ADAPTER:
            raise ValueError(f"invalid adapter name {name!r}: a non-empty string without '.', not {BASE_ADAPTER!r}")
        if name in self._adapters:
            raise ValueError(f"adapter {name!r} already exists")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.config.seed, "adapter-init", name))
            if self.peft is None:
                from peft import get_peft_model

                self.peft = get_peft_model(self.base, self._lora_config(), adapter_name=name)
            else:
                self.peft.add_adapter(name, self._lora_config())
        self.peft.to(self.device)
        self.peft.eval()
        self._adapters[name] = self._collect_parameters(name)
        self._optimizers[name] = self._new_optimizer(name)
        if weights is not None:
            self.set_adapter(name, weights)

    def _collect_parameters(self, name: str) -> dict[str, torch.nn.Parameter]:
        """Map PEFT's saved-state keys (``...q_proj.lora_A.weight``) to this adapter's live parameters."""
        params = {}
        for pname, param in self.peft.named_parameters():
            parts = pname.split(".")
            hits = [i for i in range(1, len(parts)) if parts[i] == name and parts[i - 1].startswith("lora_")]
            if hits:
                del parts[hits[-1]]
                params[".".join(parts)] = param
        if not params:
            raise RuntimeError(f"no LoRA parameters found for adapter {name!r} (target_modules matched nothing?)")
        return dict(sorted(params.items()))

    def _new_optimizer(self, name: str) -> torch.optim.Optimizer:
        c = self.config
        return torch.optim.AdamW(
            list(self._adapters[name].values()), lr=c.lr, betas=tuple(c.adam_betas), eps=c.adam_eps,
            weight_decay=c.weight_decay,
        )

    def _check_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise KeyError(f"unknown adapter {name!r}; the engine holds {self.adapter_names()}")

    def get_adapter(self, name: str) -> dict[str, torch.Tensor]:
        self._check_adapter(name)
        return {k: p.detach().to("cpu", copy=True) for k, p in self._adapters[name].items()}

    def set_adapter(self, name: str, weights: Mapping[str, torch.Tensor]) -> None:
        self._check_adapter(name)
        params = self._adapters[name]
        if set(weights) != set(params):
            missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
            raise ValueError(f"adapter {name!r}: keys do not match (missing {missing[:3]}, unexpected {extra[:3]})")
        for key, param in params.items():
            if tuple(weights[key].shape) != tuple(param.shape):
                raise ValueError(f"adapter {name!r}: {key} has shape {tuple(weights[key].shape)}, "
                                 f"expected {tuple(param.shape)}")
        with torch.no_grad():
            for key, param in params.items():
                param.copy_(weights[key].to(device=param.device, dtype=param.dtype))
        self._optimizers[name] = self._new_optimizer(name)  # fresh AdamW state

    def remove_adapter(self, name: str) -> None:
        """Delete an adapter and its optimizer (not in the protocol; handy when evolution retires members)."""
        self._check_adapter(name)
        if len(self._adapters) == 1:
            # peft cannot hold zero adapters: drop the wrapper and unwrap the base model.
            self.base = self.peft.unload()
            self.peft = None
        else:
            with warnings.catch_warnings():  # "adapter was active, now deleted": we set it per call anyway
                warnings.simplefilter("ignore", UserWarning)
                self.peft.delete_adapter(name)
        del self._adapters[name], self._optimizers[name]

    def save_adapter(self, name: str, path: str) -> None:
        from openrlhf_populora.engines.adapter_files import write_peft_adapter

        self._check_adapter(name)
        config = {**self.peft.peft_config[name].to_dict(), "inference_mode": True,
                  "base_model_name_or_path": self.model_path or None}
        write_peft_adapter(path, self.get_adapter(name), config)

    # ------------------------------------------------------------------------------------- prompts

    def render_prompt(self, user_text: str, chat_template: bool = True) -> str:
        return render_chat(self.tokenizer, user_text, chat_template)

    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids, without adding special tokens (rendered prompts carry their own)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------------------------- generation

    def _mixer(self):
        """(context, forward_for(names) -> (model, kwargs)) for one generate call."""
        from contextlib import nullcontext

        names = self.adapter_names()
        if self.peft is None:
            return nullcontext(), lambda rows: (self.base, {})
        if self.config.mixed_lora == "stacked" and StackedLoRA.supports(self.peft, names):
            stacked = StackedLoRA(self.peft, names)

            def forward_stacked(rows):
                stacked.set_rows(rows)
                return self.peft, {}

            return stacked, forward_stacked
        return nullcontext(), lambda rows: (self.peft, {"adapter_names": list(rows)})

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[list[Completion]]:
        self._check_sampling(params)
        for r in requests:
            if r.adapter != BASE_ADAPTER:
                self._check_adapter(r.adapter)
            if not isinstance(r.prompt, str) or r.n < 1:
                raise ValueError(f"bad request {r!r}: prompt must be a str and n >= 1")
        call_seed = params.seed if params.seed is not None else derive_seed(self.config.seed, "generate",
                                                                            self._generate_calls)
        self._generate_calls += 1
        encoded = [self.encode(r.prompt) for r in requests]
        max_pos = getattr(self.base.config, "max_position_embeddings", None)
        for ids in encoded:
            if not ids:
                raise ValueError("empty prompt")
            if max_pos is not None and len(ids) + params.max_new_tokens > max_pos:
                raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens {params.max_new_tokens} "
                                 f"exceeds the model's {max_pos} positions")
        rows = [(i, j) for i, r in enumerate(requests) for j in range(r.n)]
        rows.sort(key=lambda ij: -len(encoded[ij[0]]))  # similar lengths share a batch: less padding
        size = self.config.generation_batch_size
        chunks = [rows[start : start + size] for start in range(0, len(rows), size)]
        if self.peft is not None:
            self.peft.eval()
        context, forward_for = self._mixer()
        with context:
            outputs = [
                self._generate_batch(
                    [encoded[i] for i, _ in chunk], [requests[i].adapter for i, _ in chunk],
                    [derive_seed(call_seed, i, j) for i, j in chunk], params, forward_for,
                )
                for chunk in chunks
            ]
        results: dict[tuple[int, int], Completion] = {}
        for chunk, outs in zip(chunks, outputs, strict=True):
            for (i, j), (response, finished) in zip(chunk, outs, strict=True):
                results[(i, j)] = Completion(
                    adapter=requests[i].adapter, prompt_ids=list(encoded[i]), response_ids=response,
                    text=self.tokenizer.decode(response, skip_special_tokens=True), finished=finished,
                )
        return [[results[(i, j)] for j in range(r.n)] for i, r in enumerate(requests)]

    @staticmethod
    def _check_sampling(params: SamplingParams) -> None:
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.max_new_tokens < 1:
            raise ValueError(f"bad sampling params {params}: need temperature >= 0, 0 < top_p <= 1, "
                             "max_new_tokens >= 1")

    def _generate_batch(self, prompts, adapters, seeds, params, forward_for) -> list[tuple[list[int], bool]]:
        """Decode one left-padded batch with a KV cache; finished rows are dropped from the batch."""
        dev = self.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [torch.Generator(device=dev).manual_seed(s) for s in seeds]
        alive = list(range(len(prompts)))  # original row index of each batch row
        names = list(adapters)
        responses: list[list[int]] = [[] for _ in prompts]
        finished = [False] * len(prompts)
        model, kwargs = forward_for(names)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1, **kwargs)
        cache = out.past_key_values
        for step in range(params.max_new_tokens):
            tokens = sample_next_tokens(out.logits[:, -1, :], params.temperature, params.top_p,
                                        [generators[r] for r in alive])
            for row, tok in zip(alive, tokens.tolist(), strict=True):
                responses[row].append(tok)
                finished[row] = tok in self.stop_ids
            keep = [k for k, row in enumerate(alive) if not finished[row]]
            if not keep or step == params.max_new_tokens - 1:
                break
            if len(keep) < len(alive):
                index = torch.tensor(keep, device=dev)
                cache.batch_select_indices(index)
                mask, positions, tokens = mask[index], positions[index], tokens[index]
                alive, names = [alive[k] for k in keep], [names[k] for k in keep]
            mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
            positions = positions[:, -1:] + 1
            model, kwargs = forward_for(names)
            out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True, **kwargs)
        return [(responses[r], finished[r]) for r in range(len(prompts))]

    # ------------------------------------------------------------------------------------- training

    def _batch_tensors(self, trajectories: Sequence[Trajectory]):
        """[left pad | prompt | response | right pad]: every response starts at the same column."""
        width_p = max(len(t.prompt_ids) for t in trajectories)
        width_r = max(len(t.response_ids) for t in trajectories)
        n = len(trajectories)
        ids = torch.full((n, width_p + width_r), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, t in enumerate(trajectories):
            ids[row, width_p - len(t.prompt_ids) : width_p] = torch.tensor(t.prompt_ids)
            ids[row, width_p : width_p + len(t.response_ids)] = torch.tensor(t.response_ids)
            mask[row, width_p - len(t.prompt_ids) : width_p + len(t.response_ids)] = 1
        advantages = torch.tensor([float(t.advantage) for t in trajectories], dtype=torch.float32)
        dev = self.device
        return ids.to(dev), mask.to(dev), width_r, advantages.to(dev)

    def _response_logprobs(self, ids, mask, width_r, entropy: str | None = None):
        """Log-probs (B, R) of the response tokens under the active adapter, the per-token entropy (B, R)
        of softmax(logits / T) (None, "detached" or "grad": differentiable), and the response mask."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.peft(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                        logits_to_keep=width_r + 1)
        logits = out.logits[:, :-1, :].float() / self.config.logprob_temperature
        log_all = torch.log_softmax(logits, dim=-1)
        logp = log_all.gather(-1, ids[:, -width_r:, None]).squeeze(-1)
        token_entropy = None
        if entropy is not None:
            with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                token_entropy = -(log_all.exp() * log_all).sum(-1)
        return logp, token_entropy, mask[:, -width_r:].float()

    @torch.no_grad()
    def response_log_probs(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """Sum of the response tokens' log-probs (at ``logprob_temperature``) under each trajectory's
        adapter, in order (not in the protocol; for diagnostics and tests)."""
        self._check_trajectories(trajectories)
        totals = [0.0] * len(trajectories)
        for name in self._adapters:
            rows = [i for i, t in enumerate(trajectories) if t.adapter == name]
            if not rows:
                continue
            self.peft.set_adapter(name)
            self.peft.eval()
            for start in range(0, len(rows), self.config.micro_batch_size):
                chunk = rows[start : start + self.config.micro_batch_size]
                ids, mask, width_r, _ = self._batch_tensors([trajectories[i] for i in chunk])
                logp, _, resp_mask = self._response_logprobs(ids, mask, width_r)
                for i, value in zip(chunk, (logp * resp_mask).sum(-1).tolist(), strict=True):
                    totals[i] = value
        return totals

    def _check_trajectories(self, trajectories: Sequence[Trajectory]) -> None:
        vocab = self.base.get_input_embeddings().num_embeddings
        for t in trajectories:
            self._check_adapter(t.adapter)
            if not t.prompt_ids or not t.response_ids:
                raise ValueError(f"trajectory for {t.adapter!r} has an empty prompt or response")
            if not all(0 <= x < vocab for x in [*t.prompt_ids, *t.response_ids]):
                raise ValueError(f"trajectory for {t.adapter!r} has token ids outside [0, {vocab})")
            if not torch.isfinite(torch.tensor(float(t.advantage))):
                raise ValueError(f"trajectory for {t.adapter!r} has a non-finite advantage {t.advantage}")

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
        """One update of every adapter in ``trajectories``, at the learning rate of update number
        ``self.updates`` (the schedule counts train_step calls, so a child born by evolution follows the
        run's schedule, not a fresh one)."""
        self._check_trajectories(trajectories)
        groups: dict[str, list[Trajectory]] = {name: [] for name in self._adapters}
        for t in trajectories:
            groups[t.adapter].append(t)
        c = self.config
        lr = c.lr * lr_factor(c.lr_scheduler, self.updates, c.lr_warmup_steps, c.lr_total_steps, c.min_lr_ratio)
        for optimizer in self._optimizers.values():
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
        stats = {name: self._train_adapter(name, group) for name, group in groups.items() if group}
        self.updates += 1
        return stats

    def _train_adapter(self, name: str, trajectories: list[Trajectory]) -> dict[str, float]:
        c = self.config
        self.peft.set_adapter(name)  # peft: only this adapter's tensors require grad
        ordered = sorted(trajectories, key=lambda t: len(t.prompt_ids) + len(t.response_ids))
        micro = [self._batch_tensors(ordered[i : i + c.micro_batch_size])
                 for i in range(0, len(ordered), c.micro_batch_size)]
        num_tokens = float(sum(len(t.response_ids) for t in trajectories))
        old: list[torch.Tensor | None] = [None] * len(micro)
        if c.old_logprobs == "recompute" or c.lora_dropout > 0:
            self.peft.eval()
            with torch.no_grad():
                old = [self._response_logprobs(ids, mask, w)[0] for ids, mask, w, _ in micro]
        self.peft.train()  # LoRA dropout (if any) is active for the update, as in OpenRLHF
        optimizer = self._optimizers[name]
        optimizer.zero_grad(set_to_none=True)
        total_loss = total_entropy = total_clipped = 0.0
        entropy_grad = c.entropy_coef != 0
        for (ids, mask, width_r, adv), old_logp in zip(micro, old, strict=True):
            logp, entropy, resp_mask = self._response_logprobs(
                ids, mask, width_r, "grad" if entropy_grad else "detached"
            )
            if old_logp is None:  # one update per step, no dropout: the pre-update policy is this pass
                old_logp = logp.detach()
            policy_loss, clipped = self._loss_fn(logp, old_logp, adv[:, None].expand_as(logp), resp_mask,
                                                 num_tokens)
            entropy_mean = (entropy * resp_mask).sum() / num_tokens
            loss = policy_loss - c.entropy_coef * entropy_mean if entropy_grad else policy_loss
            loss.backward()
            total_loss += float(loss.detach())
            total_entropy += float(entropy_mean.detach())
            total_clipped += float(clipped)
        params = list(self._adapters[name].values())
        if c.max_norm > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, c.max_norm))
        else:
            grads = [p.grad.norm() for p in params if p.grad is not None]
            grad_norm = float(torch.stack(grads).norm()) if grads else 0.0
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.peft.eval()
        return {
            "loss": total_loss,
            "grad_norm": grad_norm,
            "entropy": total_entropy,
            "clip_ratio": total_clipped / num_tokens,
            "lr": float(optimizer.param_groups[0]["lr"]),
            "num_tokens": num_tokens,
            "num_sequences": float(len(trajectories)),
            "response_length": num_tokens / len(trajectories),
        }

    # ------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """Adapters (in order), their optimizer states and the generation counter: an exact resume point."""
        return {
            "format": 1,
            "adapters": self.adapter_names(),
            "weights": {name: self.get_adapter(name) for name in self._adapters},
            "optimizers": {name: opt.state_dict() for name, opt in self._optimizers.items()},
            "generate_calls": self._generate_calls,
            "updates": self.updates,
            "lora": {"rank": self.config.lora_rank, "alpha": self.config.lora_alpha},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore ``state_dict()``: adapters missing here are created, adapters not in the state are
        removed, so the engine ends up holding exactly the saved adapters in the saved order."""
        if state.get("format") != 1:
            raise ValueError(f"unknown engine state format {state.get('format')!r}")
        lora = {"rank": self.config.lora_rank, "alpha": self.config.lora_alpha}
        if state["lora"] != lora:
            raise ValueError(f"state was saved with LoRA {state['lora']}, this engine has {lora}")
        for name in [n for n in self._adapters if n not in state["adapters"]]:
            self.remove_adapter(name)
        for name in state["adapters"]:
            if name not in self._adapters:
                self.add_adapter(name)
            self.set_adapter(name, state["weights"][name])
            self._optimizers[name].load_state_dict(state["optimizers"][name])
        order = list(state["adapters"])
        self._adapters = {n: self._adapters[n] for n in order}
        self._optimizers = {n: self._optimizers[n] for n in order}
        self._generate_calls = int(state["generate_calls"])
        self.updates = int(state.get("updates", 0))

    def save_state(self, path: str) -> None:
        """Write ``<path>/engine_state.pt`` atomically (a crash mid-write leaves the old file intact)."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".engine_state.", suffix=".tmp")
        os.close(fd)
        try:
            torch.save(self.state_dict(), tmp)
            os.replace(tmp, out / STATE_FILE)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        (out / "engine_config.json").write_text(json.dumps(asdict(self.config), indent=1, default=str))

    def load_state(self, path: str) -> None:
        file = Path(path) / STATE_FILE
        if not file.is_file():
            raise FileNotFoundError(f"no engine state at {file}")
        self.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))

    def close(self) -> None:
        self._optimizers.clear()
        self._adapters.clear()
        self.peft = None
        self.base = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
