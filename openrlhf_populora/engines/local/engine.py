"""The embedded engine: transformers + peft, one frozen base model and N named LoRA adapters, one process.

Runs on CPU or one CUDA GPU, and implements ``engines/base.py``. How each job is done lives in its module:

- ``lora.py``: every row of a batch with its own adapter (two batched matmuls per LoRA layer), for
  generation and, with gradients, for training;
- ``generation.py``: one prefill per distinct (adapter, prompt), shared by its samples; decoding with a KV
  cache; per-row seeded sampling (``sampling.py``), so a completion does not depend on its batch;
- ``training.py``: REINFORCE++ for every adapter of a step in the same micro-batches, each adapter's update
  exactly its own (own loss normalisation, own gradient clipping, own AdamW);
- ``attention.py``: one-token decode steps without repeating the KV cache for grouped-query heads.

The frozen base may run in bf16 (``dtype``; ``auto`` picks it where the device has bf16 matrix units); LoRA
tensors, their gradients and AdamW states are always fp32.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict

import torch

from openrlhf_populora.engines.base import (
    BASE_ADAPTER,
    Completion,
    GenerationRequest,
    SamplingParams,
    Trajectory,
    render_chat,
)
from openrlhf_populora.engines.local.attention import use_decode_attention
from openrlhf_populora.engines.local.config import DTYPES, LocalEngineConfig, resolve_dtype
from openrlhf_populora.engines.local.generation import generate_rows
from openrlhf_populora.engines.local.lora import MixedLoRA, check_supported, check_target_modules
from openrlhf_populora.engines.local.state import read_state, write_state
from openrlhf_populora.engines.local.training import (
    accumulate_gradients,
    apply_update,
    lr_factor,
    make_policy_loss,
    micro_batches,
    score,
)
from openrlhf_populora.engines.seeding import adapter_init_seed, derive_seed
from openrlhf_populora.engines.torch_threads import set_torch_threads


class LocalEngine:
    """transformers + peft multi-adapter engine (implements ``engines.base.Engine``)."""

    def __init__(self, config: LocalEngineConfig, model=None, tokenizer=None):
        """Load ``config.model_name_or_path`` (resolved by ``models.embedded.resolve_model``), or use a
        ready ``model``/``tokenizer`` pair (tests pass the tiny model built in memory)."""
        config.validate()
        self.config = config
        if config.num_threads and config.device == "cpu":
            set_torch_threads(config.num_threads)  # process-wide: 2 shared cores thrash with more
        if (model is None) != (tokenizer is None):
            raise ValueError("pass both model and tokenizer, or neither")
        self.dtype = resolve_dtype(config.dtype, config.device)
        if model is None:
            model, tokenizer = self._load(config, self.dtype)
            self.model_path = model.name_or_path
        else:
            self.model_path = getattr(model, "name_or_path", "") or ""
        for p in model.parameters():
            p.requires_grad_(False)
        self.base = model.to(device=config.device, dtype=DTYPES[self.dtype]).eval()
        self.decode_attention = use_decode_attention(self.base)
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer needs both an eos_token and a pad_token")
        self.stop_ids = self._stop_ids()
        check_target_modules(self.base, config.lora_target_modules)
        self.peft = None  # the PeftModel wrapping self.base, created with the first adapter
        self._adapters: dict[str, dict[str, torch.nn.Parameter]] = {}  # name -> {peft key: parameter}
        self._optimizers: dict[str, torch.optim.Optimizer | None] = {}  # None: an engine that only generates
        self._generate_calls = 0  # seeds unseeded generate() calls reproducibly; part of save_state
        self.updates = 0  # train_step calls so far: the learning-rate schedule's clock; part of save_state
        self._loss_fn, self.policy_loss_source = make_policy_loss(
            config.policy_loss, config.eps_clip_low, config.eps_clip_high
        ) if config.trains else (None, None)

    @staticmethod
    def _load(config: LocalEngineConfig, dtype: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from openrlhf_populora.models.embedded import resolve_model

        path = resolve_model(config.model_name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], attn_implementation=config.attn_implementation,
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
            torch.manual_seed(adapter_init_seed(self.config.seed, name))
            if self.peft is None:
                from peft import get_peft_model

                self.peft = get_peft_model(self.base, self._lora_config(), adapter_name=name)
            else:
                self.peft.add_adapter(name, self._lora_config())
        self.peft.to(self.device)
        self.peft.eval()
        check_supported(self.peft)
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

    def _new_optimizer(self, name: str) -> torch.optim.Optimizer | None:
        c = self.config
        if not c.trains:
            return None
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

    # ------------------------------------------------------------------------------------- forward

    def _forward(self, mixer: MixedLoRA | None):
        """forward(ids, mask, positions, cache, adapters, logits_to_keep=1) with each row's adapter applied."""
        model = self.base if self.peft is None else self.peft

        def forward(ids, mask, positions, cache, adapters, keep=1):
            if mixer is not None:
                mixer.set_rows(adapters)
            if 0 < keep < ids.shape[1]:
                # an index tensor, not an int: transformers slices the hidden states with it, and a sliced
                # (non-contiguous) input makes torch's linear copy the whole (vocab x hidden) output matrix
                # once per row (about 1 s per prefill of Qwen2.5-0.5B on 2 CPU cores); an indexed one is contiguous
                keep = torch.arange(ids.shape[1] - keep, ids.shape[1], device=ids.device)
            return model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=keep)

        return forward

    def _mixer(self, names: Sequence[str], trainable: bool = False):
        """The mixed-adapter context for ``names`` (a no-op context when the engine holds no adapter)."""
        from contextlib import nullcontext

        if self.peft is None or not names:
            return nullcontext(), None
        mixer = MixedLoRA(self.peft, names, trainable=trainable, dropout=self.config.lora_dropout)
        return mixer, mixer

    # ------------------------------------------------------------------------------------- generation

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
        if self.peft is not None:
            self.peft.eval()
        context, mixer = self._mixer(self.adapter_names())
        with context:
            outputs = generate_rows(
                self._forward(mixer), [encoded[i] for i, _ in rows], [requests[i].adapter for i, _ in rows],
                [derive_seed(call_seed, i, j) for i, j in rows], params, stop_ids=self.stop_ids,
                batch_size=self.config.generation_batch_size, share_prefill=self.config.share_prefill,
                device=self.device,
            )
        results = {}
        for (i, j), (response, finished) in zip(rows, outputs, strict=True):
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

    # ------------------------------------------------------------------------------------- training

    def _scores(self, trajectories: Sequence[Trajectory], forward, batches, entropy=None):
        c = self.config
        return [score(forward, trajectories, groups, pad_id=self.tokenizer.pad_token_id,
                      temperature=c.logprob_temperature, entropy=entropy, device=self.device) for groups in batches]

    @torch.no_grad()
    def token_log_probs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Each response token's log-prob (at ``logprob_temperature``) under its trajectory's adapter, in order;
        ``BASE_ADAPTER`` scores under the frozen base (not in the protocol; for diagnostics and tests)."""
        self._check_trajectories(trajectories, allow_base=True)
        self.peft.eval()
        batches = micro_batches(trajectories, self.config.micro_batch_size, self.config.share_prompts)
        out: list[list[float]] = [[] for _ in trajectories]
        context, mixer = self._mixer(self.adapter_names())
        with context:
            for s in self._scores(trajectories, self._forward(mixer), batches):
                for r, i in enumerate(s.rows):
                    out[i] = s.logp[r][s.mask[r].bool()].tolist()
        return out

    def response_log_probs(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """Sum of the response tokens' log-probs under each trajectory's adapter, in order."""
        return [sum(values) for values in self.token_log_probs(trajectories)]

    def _check_trains(self) -> None:
        if not self.config.trains:
            raise RuntimeError("this engine was configured for inference (LocalEngineConfig.for_inference): it "
                               "has no optimizer settings and cannot train")

    def _check_trajectories(self, trajectories: Sequence[Trajectory], allow_base: bool = False) -> None:
        vocab = self.base.get_input_embeddings().num_embeddings
        for t in trajectories:
            if not (allow_base and t.adapter == BASE_ADAPTER):
                self._check_adapter(t.adapter)
            if not t.prompt_ids or not t.response_ids:
                raise ValueError(f"trajectory for {t.adapter!r} has an empty prompt or response")
            if not all(0 <= x < vocab for x in [*t.prompt_ids, *t.response_ids]):
                raise ValueError(f"trajectory for {t.adapter!r} has token ids outside [0, {vocab})")
            if not torch.isfinite(torch.tensor(float(t.advantage))):
                raise ValueError(f"trajectory for {t.adapter!r} has a non-finite advantage {t.advantage}")

    def train_step(self, trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
        """``max_epochs`` updates of every adapter in ``trajectories`` (one by default), each at the learning
        rate of update number ``self.updates`` (the schedule counts updates, so a child born by evolution
        follows the run's schedule, not a fresh one). Returns each adapter's diagnostics, averaged over the
        epochs, with ``updates`` = the epochs taken."""
        self._check_trains()
        self._check_trajectories(trajectories)
        c = self.config
        old: list | None = None
        epochs: list[dict[str, dict[str, float]]] = []
        for _ in range(c.max_epochs):
            lr = c.lr * lr_factor(c.lr_scheduler, self.updates, c.lr_warmup_steps, c.lr_total_steps,
                                  c.min_lr_ratio)
            self.updates += 1
            stats, old = self._accumulate(trajectories, old)
            epochs.append({name: self._apply_update(name, lr, s, trajectories) for name, s in stats.items()})
        out = {}
        for name in epochs[0] if epochs else []:
            out[name] = {key: sum(e[name][key] for e in epochs) / len(epochs) for key in epochs[0][name]}
            out[name]["updates"] = float(len(epochs))
        return out

    def gradients(self, trajectories: Sequence[Trajectory]) -> dict[str, dict[str, torch.Tensor]]:
        """Each adapter's gradient of its loss on ``trajectories``, keyed like :meth:`get_adapter`, without
        clipping or updating anything (not in the protocol; for diagnostics and tests)."""
        self._check_trains()
        self._check_trajectories(trajectories)
        stats, _ = self._accumulate(trajectories)
        grads = {}
        for name in stats:
            grads[name] = {k: p.grad.detach().clone() for k, p in self._adapters[name].items()}
            self._optimizers[name].zero_grad(set_to_none=True)
        return grads

    def _accumulate(self, trajectories: Sequence[Trajectory], old: list | None = None
                    ) -> tuple[dict[str, dict[str, float]], list]:
        """Fill the ``.grad`` of every adapter in ``trajectories`` (in adapter order) with its loss's gradient,
        against the old log-probs ``old`` (per micro-batch; None: the sampling policy, computed here). Returns
        the per-adapter stats and the old log-probs used, for the next epoch."""
        if not trajectories:
            return {}, []
        c = self.config
        names = [n for n in self._adapters if any(t.adapter == n for t in trajectories)]
        batches = micro_batches(trajectories, c.micro_batch_size, c.share_prompts)
        for name in names:
            self._optimizers[name].zero_grad(set_to_none=True)
        context, mixer = self._mixer(names, trainable=True)
        with context:
            forward = self._forward(mixer)
            if old is None:
                old = [None] * len(batches)
            if old[0] is None and (c.old_logprobs == "recompute" or c.lora_dropout > 0):
                self.peft.eval()
                with torch.no_grad():
                    old = [s.logp for s in self._scores(trajectories, forward, batches)]
            self.peft.train()  # LoRA dropout (if any) is active for the update, as in OpenRLHF
            stats, used_old = accumulate_gradients(
                forward, trajectories, batches, loss_fn=self._loss_fn, old=old, entropy_coef=c.entropy_coef,
                pad_id=self.tokenizer.pad_token_id, temperature=c.logprob_temperature, device=self.device)
        self.peft.eval()
        return {name: stats[name] for name in names}, used_old

    def _apply_update(self, name: str, lr: float, stats: dict[str, float], trajectories) -> dict[str, float]:
        """Clip adapter ``name``'s accumulated gradient to ``max_norm`` and take its AdamW step."""
        sequences = float(sum(t.adapter == name for t in trajectories))
        return apply_update(list(self._adapters[name].values()), self._optimizers[name], lr, self.config.max_norm,
                            stats, sequences)

    # ------------------------------------------------------------------------------------- state

    def state_dict(self) -> dict:
        """Adapters (in order), their optimizer states and the generation counter: an exact resume point."""
        return {
            "format": 1,
            "adapters": self.adapter_names(),
            "weights": {name: self.get_adapter(name) for name in self._adapters},
            "optimizers": {name: opt.state_dict() if opt else None for name, opt in self._optimizers.items()},
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
            if self._optimizers[name] is not None:
                self._optimizers[name].load_state_dict(state["optimizers"][name])
        order = list(state["adapters"])
        self._adapters = {n: self._adapters[n] for n in order}
        self._optimizers = {n: self._optimizers[n] for n in order}
        self._generate_calls = int(state["generate_calls"])
        self.updates = int(state.get("updates", 0))

    def save_state(self, path: str) -> None:
        write_state(path, self.state_dict(), asdict(self.config))

    def load_state(self, path: str) -> None:
        self.load_state_dict(read_state(path))

    def close(self) -> None:
        self._optimizers.clear()
        self._adapters.clear()
        self.peft = None
        self.base = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
