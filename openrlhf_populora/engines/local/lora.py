"""A different LoRA adapter on every row of one batch, with a fixed number of ops per layer.

peft keeps every adapter's ``lora_A``/``lora_B`` inside each target ``Linear``; its own mixed-batch path
(``adapter_names``) loops over the adapters present in every layer. Here, inside peft's
``disable_adapter()`` (so each LoRA layer computes ``base(x)`` only), a forward hook on every LoRA layer
adds each row's own low-rank term with two batched matmuls. With the adapters of this batch stacked,
``A: (N+1, r, in)``, ``B: (N+1, out, r)``, ``s: (N+1,)`` (the last entry zero, for ``__base__`` rows), and
``k`` the adapter index of each row::

    y = base(x) + s[k] * (dropout(x) @ A[k]^T) @ B[k]^T

exactly peft's ``base(x) + lora_B(lora_A(dropout(x))) * scaling`` per row, in the LoRA tensors' dtype
(fp32) and rounded once to the output's dtype, as peft does.

- ``trainable=False`` (generation): the stacks are detached copies made once.
- ``trainable=True`` (training): the stacks are rebuilt from the live parameters at every forward, so each
  row's gradient reaches its own adapter only; ``dropout`` is LoRA dropout, applied in training mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from openrlhf_populora.engines.base import BASE_ADAPTER


def lora_layers(peft_model) -> list:
    """Every peft LoRA layer of the model (the modules holding ``lora_A``/``lora_B``)."""
    return [m for m in peft_model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


def check_supported(peft_model) -> None:
    """The hooks implement plain LoRA on ``nn.Linear`` layers: refuse anything else, naming the layer."""
    from peft.tuners.lora import Linear as LoraLinear

    for module in lora_layers(peft_model):
        if type(module) is not LoraLinear or module.fan_in_fan_out or module.lora_variant:
            raise ValueError(f"the local engine applies plain LoRA to nn.Linear layers only; {type(module).__name__} "
                             "(a Conv1D, an embedding, DoRA or another variant) is not supported")


class MixedLoRA:
    """Context manager: within it, every forward of the peft model applies row ``i``'s adapter to row ``i``
    (set with :meth:`set_rows` before each forward)."""

    def __init__(self, peft_model, names: Sequence[str], trainable: bool = False, dropout: float = 0.0):
        self.peft = peft_model
        self.names = list(names)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.index[BASE_ADAPTER] = len(self.names)
        self.trainable = trainable
        self.dropout = dropout
        self.rows: torch.Tensor | None = None
        self.layers = [m for m in lora_layers(peft_model) if all(n in m.lora_A for n in self.names)]
        self._frozen = None if trainable else [self._stacks(m) for m in self.layers]
        self._hooks: list = []
        self._context = None

    def _stacks(self, module):
        """(A, B, scale) of one layer, the adapters in order and a zero entry for ``__base__`` rows."""
        A = [module.lora_A[n].weight for n in self.names]
        B = [module.lora_B[n].weight for n in self.names]
        scale = torch.tensor([float(module.scaling[n]) for n in self.names] + [0.0], dtype=A[0].dtype,
                             device=A[0].device)
        stack_A = torch.stack([*A, torch.zeros_like(A[0])])
        stack_B = torch.stack([*B, torch.zeros_like(B[0])])
        if not self.trainable:
            stack_A, stack_B = stack_A.detach(), stack_B.detach()
        return stack_A, stack_B, scale

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.layers for n in self.names for p in (m.lora_A[n].weight, m.lora_B[n].weight)]

    def set_rows(self, adapters: Sequence[str]) -> None:
        """The adapter of each batch row, for the next forwards."""
        device = self.layers[0].lora_A[self.names[0]].weight.device if self.layers else "cpu"
        self.rows = torch.tensor([self.index[a] for a in adapters], device=device)

    def _hook(self, position: int):
        def add_lora(module, args, output):
            A, B, scale = self._frozen[position] if self._frozen is not None else self._stacks(module)
            k = self.rows
            x = args[0].to(A.dtype)
            flat = x.reshape(x.shape[0], -1, x.shape[-1])  # (rows, tokens, in)
            if self.trainable and self.dropout > 0 and module.training:
                flat = torch.nn.functional.dropout(flat, self.dropout, training=True)
            low = torch.bmm(flat, A[k].transpose(1, 2))  # (rows, tokens, r)
            delta = torch.bmm(low, B[k].transpose(1, 2)) * scale[k][:, None, None]
            return (output + delta.reshape(output.shape)).to(output.dtype)

        return add_lora

    def __enter__(self):
        self._context = self.peft.disable_adapter()
        self._context.__enter__()
        if self.trainable:  # peft's disable_adapter() turns requires_grad off on every LoRA tensor
            for param in self.parameters():
                param.requires_grad_(True)
        self._hooks = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.layers)]
        return self

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._context.__exit__(*exc)
        return False


def check_target_modules(model: torch.nn.Module, targets) -> None:
    """ValueError naming what ``model`` has, for a LoRA target that matches none of its modules (peft would raise
    only when the first adapter is made, and less clearly). ``all-linear`` matches every model."""
    if isinstance(targets, str) or list(targets) == ["all-linear"]:
        return
    names = [name for name, _ in model.named_modules()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"LoRA target modules {missing} match no module of this model; its linear layers are "
                         f"{', '.join(linear)} (or use all-linear)")
