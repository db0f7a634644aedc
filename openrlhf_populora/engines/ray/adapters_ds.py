"""N named LoRA adapters on one frozen base inside one DeepSpeed engine (pure helpers, no Ray).

OpenRLHF's ``Actor`` wraps the base in a ``PeftModel`` with one adapter, ``"default"``. :func:`attach_adapters`
replaces it by the run's named adapters (same rank and target modules), each initialised from
``(seed, name)`` alone, and leaves every LoRA parameter trainable so ``strategy.prepare`` puts all of them in
the one optimizer. Training then routes each micro-batch to one adapter with :func:`activate`.

Adapter tensors travel in PEFT's saved-state format: keys ``base_model.model.<module>.lora_A.weight`` (the
adapter name removed), fp32, on CPU -- exactly what ``LocalEngine.get_adapter`` returns and what
``PeftModel.from_pretrained`` and vLLM's LoRA loader read.

Under DeepSpeed the fp32 master copy (held by the ZeRO optimizer) is the truth: :func:`adapter_state` reads it
and :func:`write_adapter` writes it, zeroes the adapter's Adam moments and refreshes the low-precision
``p.data`` too (a bare ``p.data`` edit is overwritten from the master at the next step; a master write alone is
not seen by forward passes until the next step). Under ZeRO-3 every one of these is a collective: all ranks
call them, with the same adapters in the same order.

:class:`AdapterSnapshot` saves and restores adapters bit-exactly (master, moments, low-precision copy); the
multi-adapter trainer uses it around each optimizer step so that adapters without gradient in that step do not
drift (Adam's moments would otherwise keep moving them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from openrlhf_populora.engines.base import BASE_ADAPTER
from openrlhf_populora.engines.seeding import adapter_init_seed

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")  # Adam's optimizer state per parameter


def peft_model(model: Any):
    """The ``PeftModel`` inside an OpenRLHF ``Actor``, a ``DeepSpeedEngine`` or a ``PeftModel`` itself."""
    from peft import PeftModel

    inner = model
    for _ in range(4):
        if isinstance(inner, PeftModel):
            return inner
        if hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):  # DeepSpeedEngine
            inner = inner.module
        elif hasattr(inner, "model") and isinstance(inner.model, torch.nn.Module):  # openrlhf Actor
            inner = inner.model
        else:
            break
    raise TypeError(f"no PeftModel found inside {type(model).__name__}")


def ds_engine(model: Any):
    """The ``DeepSpeedEngine`` inside an ``Actor`` (or the engine itself); None if not wrapped yet."""
    import deepspeed

    for candidate in (model, getattr(model, "model", None)):
        if isinstance(candidate, deepspeed.DeepSpeedEngine):
            return candidate
    return None


def adapter_names(model: Any) -> list[str]:
    return list(peft_model(model).peft_config)


def attach_adapters(model: Any, names: Sequence[str], lora_config=None, seed: int = 0) -> list[str]:
    """Give the peft-wrapped ``model`` exactly the adapters ``names`` (in that order), all trainable.

    ``lora_config`` defaults to the existing ``"default"`` adapter's config (the one OpenRLHF built from the
    ``--ds.lora.*`` flags). Each adapter is initialised under ``torch.manual_seed(adapter_init_seed(seed,
    name))`` -- the same rule as the embedded engine -- so its weights depend only on (seed, name). Call before ``strategy.prepare``: the optimizer takes the parameters that require grad then.
    """
    names = list(names)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"adapter names must be non-empty and distinct, got {names}")
    for name in names:
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"invalid adapter name {name!r}: a non-empty string without '.'")
    peft = peft_model(model)
    existing = list(peft.peft_config)
    if lora_config is None:
        lora_config = peft.peft_config[existing[0]]
    for name in names:
        if name in existing:
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(adapter_init_seed(seed, name))
            peft.add_adapter(name, lora_config)
    peft.set_adapter(names[0])
    for old in existing:
        if old in names:  # e.g. "default" requested by name: re-initialise it by the same rule
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(adapter_init_seed(seed, old))
                for module in peft.modules():
                    if hasattr(module, "reset_lora_parameters") and old in getattr(module, "lora_A", {}):
                        module.reset_lora_parameters(old, True)
        else:
            peft.delete_adapter(old)
    enable_all_lora_grads(peft)
    missing = [n for n in names if not lora_parameters(peft, n)]
    if missing:
        raise RuntimeError(f"no LoRA parameters for adapters {missing} (target_modules matched nothing?)")
    return names


def enable_all_lora_grads(model: Any) -> int:
    """Set ``requires_grad`` on every LoRA parameter of every adapter; returns how many there are."""
    count = 0
    for pname, param in peft_model(model).named_parameters():
        if ".lora_" in pname:
            param.requires_grad_(True)
            count += 1
    return count


def activate(model: Any, name: str, all_in_graph: bool = False) -> None:
    """Route forward passes through adapter ``name``; every LoRA parameter stays trainable.

    peft's ``set_adapter`` leaves only the active adapter trainable; the others are re-enabled so ZeRO keeps
    treating every LoRA parameter as an optimizer parameter (they simply receive no gradient).

    ``all_in_graph=True`` runs every adapter in the forward pass with the other adapters' LoRA scaling set to
    0: the output is bit-identical (``y + 0 == y``) and the others get exactly-zero gradients, but every
    LoRA parameter is in the autograd graph. It is for ranks that run DIFFERENT adapters at the same time
    under ZeRO-3 (experience making's scoring): its parameter gathers follow the parameters a rank touches,
    and different sets on different ranks fail ("disagreement on list contents", measured on 2 gloo ranks;
    under ZeRO-2 the same mismatch in the gradient buckets gave wrong updates). Training does not need it: its
    windows run the same adapter on every rank at once. It costs one LoRA product per adapter per layer.

    ``name == BASE_ADAPTER``: the frozen base, as every adapter in the graph with every scaling 0 (no-grad
    scoring only, e.g. the learning probe's base log-probs; the same parameters on every rank under ZeRO-3).
    """
    peft = peft_model(model)
    if name == BASE_ADAPTER:
        peft.base_model.set_adapter(list(peft.peft_config))
        _route_scaling(peft, BASE_ADAPTER)  # no adapter has that name: every scaling is zeroed
        peft._populora_routed = name
        enable_all_lora_grads(peft)
        return
    if name not in peft.peft_config:
        raise KeyError(f"unknown adapter {name!r}; the model holds {list(peft.peft_config)}")
    if all_in_graph:
        peft.base_model.set_adapter(list(peft.peft_config))
        _route_scaling(peft, name)
    else:
        _route_scaling(peft, None)
        peft.set_adapter(name)
    peft._populora_routed = name
    enable_all_lora_grads(peft)


def _route_scaling(peft, name: str | None) -> None:
    """Zero every adapter's LoRA scaling except ``name``'s (``None``: restore them all)."""
    from peft.tuners.lora import LoraLayer

    for module in peft.modules():
        if not isinstance(module, LoraLayer):
            continue
        original = module.__dict__.setdefault("_populora_scaling", dict(module.scaling))
        for adapter in module.scaling:
            keep = name is None or adapter == name
            module.scaling[adapter] = original.get(adapter, module.scaling[adapter]) if keep else 0.0


def active_adapter(model: Any) -> str:
    peft = peft_model(model)
    return getattr(peft, "_populora_routed", None) or peft.active_adapter


def lora_parameters(model: Any, name: str) -> dict[str, torch.nn.Parameter]:
    """Adapter ``name``'s parameters keyed as PEFT saves them (``...q_proj.lora_A.weight``), sorted."""
    params = {}
    for pname, param in peft_model(model).named_parameters():
        parts = pname.split(".")
        hits = [i for i in range(1, len(parts)) if parts[i] == name and parts[i - 1].startswith("lora_")]
        if hits:
            del parts[hits[-1]]
            params[".".join(parts)] = param
    return dict(sorted(params.items()))


def _zero3(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def _gathered(params: Iterable[torch.nn.Parameter], modifier_rank: int | None = None):
    import deepspeed

    params = [p for p in params if _zero3(p)]
    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank, enabled=bool(params))


def _fp32_master(param: torch.nn.Parameter) -> torch.Tensor | None:
    from deepspeed.utils import safe_get_full_fp32_param

    if not (_zero3(param) or hasattr(param, "_hp_mapping")):
        return None
    return safe_get_full_fp32_param(param)


def adapter_state(model: Any, name: str) -> dict[str, torch.Tensor]:
    """Adapter ``name`` as fp32 CPU tensors in PEFT's saved-state keys. Reads DeepSpeed's fp32 master when
    the model is in a ZeRO optimizer (collective under ZeRO-3: every rank calls), else the parameters."""
    params = lora_parameters(model, name)
    if not params:
        raise KeyError(f"unknown adapter {name!r}; the model holds {adapter_names(model)}")
    out = {}
    for key, param in params.items():
        master = _fp32_master(param) if param.requires_grad else None
        if master is None:
            with _gathered([param]):
                master = param.data
        out[key] = master.detach().to("cpu", torch.float32, copy=True).reshape(_full_shape(param))
    return out


def _full_shape(param: torch.nn.Parameter) -> tuple[int, ...]:
    return tuple(param.ds_shape) if _zero3(param) else tuple(param.shape)


def _has_moments(engine) -> bool:
    """Whether the optimizer has created Adam state yet (torch Adam creates it lazily at the first step)."""
    inner = getattr(getattr(engine, "optimizer", None), "optimizer", None)
    state = getattr(inner, "state", None)
    return bool(state) and all(key in next(iter(state.values())) for key in MOMENT_KEYS)


def validate_adapter_tensors(model: Any, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless ``tensors`` has exactly adapter ``name``'s keys and full shapes."""
    params = lora_parameters(model, name)
    if not params:
        raise KeyError(f"unknown adapter {name!r}; the model holds {adapter_names(model)}")
    missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or extra:
        raise ValueError(f"adapter {name!r}: keys do not match (missing {missing[:3]}{'...' * (len(missing) > 3)}, "
                         f"unexpected {extra[:3]}{'...' * (len(extra) > 3)})")
    for key, param in params.items():
        if tuple(tensors[key].shape) != _full_shape(param):
            raise ValueError(f"adapter {name!r}: {key} has shape {tuple(tensors[key].shape)}, "
                             f"expected {_full_shape(param)}")


def _write_param(engine, param, value: torch.Tensor) -> None:
    """Write one parameter's fp32 master, zero its Adam moments, and write its low-precision copy."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    value = value.detach().to(torch.float32)
    in_optimizer = engine is not None and (_zero3(param) or hasattr(param, "_hp_mapping"))
    if in_optimizer:
        device = param.device if not _zero3(param) else _fp32_device(engine)
        safe_set_full_fp32_param(param, value.to(device))
        if _has_moments(engine):
            _link_moments(engine, param)
            for key in MOMENT_KEYS:
                safe_set_full_optimizer_state(param, torch.zeros_like(value, device=device), key)
    with torch.no_grad(), _gathered([param], modifier_rank=0):
        param.data.copy_(value.to(param.device, param.dtype).reshape(param.data.shape))


def _link_moments(engine, param) -> None:
    """ZeRO-1/2 link each parameter to its Adam moments only at the first optimizer step after the optimizer
    was built or a checkpoint was loaded (``load_checkpoint`` re-links the fp32 fragments but leaves the moment
    views empty until then). Writing moments before that step, as evolution right after a resume does, needs
    the link now; DeepSpeed's own lazy initializer makes it (a private method of the pinned deepspeed 0.19.6)."""
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None or mapping.optim_fragment is not None:
        return
    optimizer = engine.optimizer
    optimizer._hp_optimizer_states_linked = False
    optimizer._lazy_init_hp_params_optimizer_state()


def _fp32_device(engine) -> torch.device:
    return getattr(engine, "device", torch.device("cpu"))


def write_adapter(model: Any, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Overwrite adapter ``name`` with ``tensors`` (PEFT keys, full shapes) and reset its Adam moments.

    For evolution: the next optimizer step starts from these weights with zero ``exp_avg``/``exp_avg_sq``.
    Writes the fp32 master (``safe_set_full_fp32_param``), the moments (``safe_set_full_optimizer_state``) and
    the low-precision ``p.data`` (gathered under ZeRO-3). Collective under ZeRO-3: every rank calls, with the
    same tensors. Adam's step count lives per parameter group, shared by the adapters; the multi-adapter trainer
    keeps each adapter's own count and sets it before the adapter's step (:func:`set_adam_step`), and the policy
    actor resets the written adapter's count to 0.
    """
    validate_adapter_tensors(model, name, tensors)
    engine = ds_engine(model)
    enable_all_lora_grads(model)  # ZeRO-3's setters skip parameters that do not require grad
    for key, param in lora_parameters(model, name).items():
        _write_param(engine, param, tensors[key])


class AdapterSnapshot:
    """A bit-exact copy of some adapters' optimizer-side state, restorable after an optimizer step.

    Saves, for every parameter of the adapters, this rank's piece of the fp32 master, of Adam's moments and
    of the low-precision copy the forward pass uses (ZeRO-2: the full ``p.data``; ZeRO-3: the partition
    ``p.ds_tensor``). Local only: no collectives, and 1/world_size of the fp32 state in memory. ``restore``
    after ``engine.step()`` writes every piece back, so the adapters leave the step bit-identical. Moments
    that did not exist yet when the snapshot was taken are restored as zeros (their implicit value).
    """

    def __init__(self, model: Any, names: Iterable[str]):
        self.model = model
        self.engine = ds_engine(model)
        self.names = list(names)
        with_moments = self.engine is not None and _has_moments(self.engine)
        enable_all_lora_grads(model)  # ZeRO-3's local accessors skip parameters that do not require grad
        self.saved: list[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]] = []
        for name in self.names:
            for param in lora_parameters(model, name).values():
                if with_moments:
                    _link_moments(self.engine, param)  # after a checkpoint load ZeRO-1/2 link them lazily
                pieces = {key: view.detach().clone() for key, view in _local_pieces(param, with_moments).items()}
                self.saved.append((param, pieces))

    def restore(self) -> None:
        with_moments = self.engine is not None and _has_moments(self.engine)
        with torch.no_grad():
            for param, pieces in self.saved:
                for key, view in _local_pieces(param, with_moments).items():
                    view.copy_(pieces[key] if key in pieces else torch.zeros_like(view))


def _local_pieces(param: torch.nn.Parameter, with_moments: bool) -> dict[str, torch.Tensor]:
    """Writable views of this rank's pieces of ``param``: ``lp`` (low-precision copy), ``master`` and the
    moments (when the optimizer holds them). Private DeepSpeed attributes, read-only use of their layout:
    ZeRO-3's ``get_local_fp32_param`` (a view of the fp32 partition) and ZeRO-1/2's ``_hp_mapping`` fragment."""
    if _zero3(param):
        pieces = {"lp": param.ds_tensor.data}
        optimizer = getattr(param, "_z3_optimizer", None)
        if optimizer is not None:
            if getattr(optimizer, "offload_optimizer", False):  # get_local_fp32_param would return a copy
                raise NotImplementedError("adapter snapshots under ZeRO-3 need the optimizer state on the "
                                          "accelerator (no --ds.adam_offload)")
            pieces["master"] = optimizer.get_local_fp32_param(param)
            if with_moments:
                pieces.update({k: optimizer.get_local_fp32_param(param, k) for k in MOMENT_KEYS})
        return pieces
    pieces = {"lp": param.data}
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is not None:
        pieces["master"] = mapping.get_hp_fragment()
        if with_moments:
            pieces.update({k: mapping.get_hp_fragment(k) for k in MOMENT_KEYS})
    return pieces


def _inner_optimizer(engine):
    """The torch-level optimizer under DeepSpeed's ZeRO wrapper (or the engine's optimizer itself)."""
    optimizer = engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def set_adam_step(engine, step: int) -> None:
    """Set the optimizer's step count, wherever it keeps it (``param_groups[i]["step"]`` for DeepSpeed's fused
    Adam, ``state[p]["step"]`` for torch's and DeepSpeed's CPU Adam), to ``step`` for every parameter group.
    The next ``engine.step()`` then updates with the bias correction of step ``step + 1``. Before the optimizer's
    first step there is no state yet; it starts at 0 by itself."""
    optimizer = _inner_optimizer(engine)
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = step
    for state in optimizer.state.values():  # every state, not only the groups' current params (ZeRO-3 swaps
        if "step" in state:                 # one sub-group's fp32 partition into its param group at a time)
            if torch.is_tensor(state["step"]):
                state["step"].fill_(step)
            else:
                state["step"] = step


def adam_steps(engine) -> set[int]:
    """The distinct step counts the optimizer holds (tests and diagnostics)."""
    optimizer = _inner_optimizer(engine)
    seen = {int(group["step"]) for group in optimizer.param_groups if "step" in group}
    seen |= {int(state["step"]) for state in optimizer.state.values() if "step" in state}
    return seen


def adapter_grad_norm(model: Any, name: str) -> float:
    """L2 norm of adapter ``name``'s accumulated gradient; valid between backward and the optimizer step at
    an accumulation boundary (collective under ZeRO-3). Zero when the adapter received no gradient."""
    from deepspeed.utils import safe_get_full_grad

    total = 0.0
    for param in lora_parameters(model, name).values():
        grad = safe_get_full_grad(param)
        if grad is not None:
            total += float(grad.detach().float().pow(2).sum())
    return total**0.5


def clear_stale_grads(model: Any, names: Iterable[str]) -> None:
    """Zero the ZeRO-3 gradient partitions of adapters ``names``. Call right after each optimizer step.

    ZeRO-3 keeps every parameter's reduced-gradient partition between steps and only overwrites it when the
    parameter receives a gradient, so an adapter without gradient in the next step would see its previous
    gradient again -- in the global norm, in clipping and in the optimizer update (measured: a full
    learning-rate step on an adapter that was not in the batch). ZeRO-1/2 clear their gradients at every
    step, so this is a no-op there. Not a collective: each rank zeroes its own partitions.

    It runs after every window on every LoRA tensor of every adapter (at N = 16 on a 7B model, about 6,000
    tensors a window, 100,000 a step), so it zeroes each partition where ZeRO-3 keeps it, in place, in one fused
    call: no new tensor and no copy. DeepSpeed's own setter (``set_fp32_grad_for_param``) would need a full-size
    tensor per parameter (on the host, then copied to the device); the partitions end up the same zeros.
    """
    partitions = [_grad_partition(param) for name in names for param in lora_parameters(model, name).values()
                  if _zero3(param) and param.requires_grad]
    if partitions:
        torch._foreach_zero_(partitions)


def _grad_partition(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's gradient partition of a ZeRO-3 parameter: the view into the optimizer's flat gradient buffer
    (on the device) that DeepSpeed's ``set_fp32_grad_for_param`` writes (a private accessor of the pinned
    deepspeed 0.19.6, read-only use of its layout)."""
    optimizer = param._z3_optimizer
    if getattr(optimizer, "offload_optimizer", False):  # the partition would be a host or NVMe buffer
        raise NotImplementedError("clearing stale gradients under ZeRO-3 needs the optimizer state on the "
                                  "accelerator (no --ds.adam_offload)")
    partition, _group = optimizer._get_fp32_grad_state_partition(param=param, release_swap_buffers=False)
    return partition
