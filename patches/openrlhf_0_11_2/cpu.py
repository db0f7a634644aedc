"""CPU-only patches: let OpenRLHF 0.11.2's TRAINING path run without CUDA (gloo, CPU tensors).

Upstream hard-wires CUDA in a few run-time calls (read from the 0.11.2 sources):
``torch.cuda.current_device()`` as a device (replay buffer, ``ActorPPOTrainer.ppo_train``,
``PolicyModelActor.forward``, ``DeepspeedStrategy.all_reduce/all_gather``), ``torch.cuda.set_device`` and
``init_device_mesh("cuda")`` in ``DeepspeedStrategy.setup_distributed``, ``torch.cuda.synchronize`` in
``torch_dist_barrier_and_cuda_sync`` and ``PolicyModelActor.fit``.

Rather than rewrite those functions, the patches are as narrow as possible and keep every upstream body
running verbatim:

- the module-global name ``torch`` of the four modules that use it is swapped for :data:`CPU_TORCH`, a view of
  ``torch`` whose ``cuda`` namespace maps "the current CUDA device" to ``"cpu"`` and makes
  ``set_device``/``synchronize``/``empty_cache`` no-ops. Only code in those modules sees it; ``torch`` itself
  is untouched. The replay buffer's view also turns the ``torch.device("cuda:cpu")`` it then builds into
  ``torch.device("cpu")``.
- ``init_device_mesh`` as imported by ``openrlhf.utils.deepspeed.deepspeed`` builds a ``"cpu"`` mesh.
- ``torch_dist_barrier_and_cuda_sync`` (imported by name into three modules) only synchronises CUDA when
  there is CUDA.
- DeepSpeed ZeRO-3's blocking gather of several parameters (``Init._allgather_params_coalesced``: a
  ``GatheredParameters`` over more than one parameter, e.g. transformers' ZeRO-3 ``from_pretrained``, which
  gathers each module's weight and bias together) waits only for the LAST of its async all-gathers, which
  orders them on one CUDA stream but not on gloo, whose worker threads run them concurrently. The earlier
  gathers can then land after the caller's writes (measured with two gloo ranks: about one run in three
  loaded a q/k/v projection weight as uninitialised memory on one or both ranks, so the first forward pass
  gave NaN). Without CUDA it takes DeepSpeed's own blocking sequential gather instead.

``convert_to_torch_dtype`` also accepts ``"fp32"`` (the CPU launch's default ``--ds.param_dtype``).

Every other replacement checks ``torch.cuda.is_available()`` at call time and, when CUDA is there, does exactly the
upstream thing, so applying these on a GPU machine changes nothing. Apply with
``openrlhf_populora.patches.openrlhf_0_11_2.apply(cpu_patches())``; revert with ``revert()``.

:func:`install_flash_attn_shim` is separate: Ray workers on CPU machines import OpenRLHF, whose
``models/ring_attn_utils.py`` imports ``flash_attn`` at module level, which cannot install without CUDA.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from typing import Any

import torch

from . import Patch

# modules whose module-global ``torch`` is swapped (all of them call torch.cuda.* on the training path)
_TORCH_USERS = (
    "openrlhf.trainer.ray.ppo_actor",  # ppo_train:171, PolicyModelActor.fit/forward:627
    "openrlhf.trainer.ray.launcher",  # BaseModelActor.empty_cache, ref/reward forward:136,190
    "openrlhf.utils.deepspeed.deepspeed",  # setup_distributed:97, all_reduce:614, all_gather:633
)
_REPLAY_BUFFER = "openrlhf.trainer.ppo_utils.replay_buffer"  # __init__:40, setup_dynamic_batch:104-165
_BARRIER_USERS = (
    "openrlhf.utils.distributed_util",
    "openrlhf.utils.deepspeed.deepspeed",
    "openrlhf.trainer.ray.ppo_actor",
)


def _no_op(*args, **kwargs) -> None:
    return None


class _CudaOnCpu:
    """``torch.cuda`` as the patched modules see it: the real one when CUDA is available; otherwise the
    current device is ``"cpu"`` and device selection / synchronisation are no-ops."""

    _cpu_overrides = {
        "current_device": lambda: "cpu",
        "set_device": _no_op,
        "synchronize": _no_op,
        "empty_cache": _no_op,
    }

    def __getattr__(self, name: str) -> Any:
        if not torch.cuda.is_available() and name in self._cpu_overrides:
            return self._cpu_overrides[name]
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """A read-only view of ``torch`` with :class:`_CudaOnCpu` as ``cuda``; every other name is torch's."""

    def __init__(self, name: str, map_cuda_device_strings: bool = False):
        super().__init__(name)
        self.__dict__["cuda"] = _CudaOnCpu()
        self.__dict__["_map_cuda_device_strings"] = map_cuda_device_strings
        if map_cuda_device_strings:
            self.__dict__["device"] = _device_on_cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def __reduce__(self):
        # Ray pickles actor classes by value, with the globals of inherited upstream methods: travel as a
        # reference to this module's instance
        return _cpu_torch, (self._map_cuda_device_strings,)


def _cpu_torch(map_cuda_device_strings: bool) -> _TorchOnCpu:
    return CPU_TORCH_REPLAY_BUFFER if map_cuda_device_strings else CPU_TORCH


def _device_on_cpu(*args, **kwargs) -> torch.device:
    """``torch.device``, except that the ``"cuda:cpu"`` spelled by ``f"cuda:{torch.cuda.current_device()}"``
    under :data:`CPU_TORCH` means the CPU."""
    if args and args[0] == "cuda:cpu":
        return torch.device("cpu")
    return torch.device(*args, **kwargs)


CPU_TORCH = _TorchOnCpu("openrlhf_populora.cpu_torch")
CPU_TORCH_REPLAY_BUFFER = _TorchOnCpu("openrlhf_populora.cpu_torch_replay_buffer", map_cuda_device_strings=True)


def init_device_mesh_any_device(device_type: str, *args, **kwargs):
    """``init_device_mesh``, building a ``"cpu"`` mesh when ``"cuda"`` is asked for and there is no CUDA."""
    from torch.distributed.device_mesh import init_device_mesh

    if device_type == "cuda" and not torch.cuda.is_available():
        device_type = "cpu"
    return init_device_mesh(device_type, *args, **kwargs)


def barrier_and_cuda_sync() -> None:
    """``torch_dist_barrier_and_cuda_sync`` that synchronises CUDA only when there is CUDA."""
    torch.distributed.barrier()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


ZERO3_COALESCED_GATHER = "deepspeed.runtime.zero.partition_parameters:Init._allgather_params_coalesced"


def allgather_params_coalesced_blocking(self, param_list, hierarchy=0, quantize=False):
    """``Init._allgather_params_coalesced`` that, without CUDA, really blocks until every parameter is gathered.

    Upstream launches one async all-gather per parameter and waits only for the last one ("Wait ensures the
    operation is enqueued"), relying on CUDA stream order. Gloo runs async collectives on a thread pool, so
    the earlier parameters may still be in flight when the caller writes them (``GatheredParameters(...,
    modifier_rank=0)``) and overwrite the write. Without CUDA this runs upstream's synchronous
    ``_allgather_params_sequential`` (what ``stage3_allgather_sequential`` selects); with CUDA, when nothing
    needs gathering, and for quantized weights (CUDA only), it is the upstream method."""
    from . import original

    if torch.cuda.is_available() or quantize or all(self._partition_world_size(p) == 1 for p in param_list):
        return original(ZERO3_COALESCED_GATHER)(self, param_list, hierarchy=hierarchy, quantize=quantize)
    return self._allgather_params_sequential(param_list, hierarchy=hierarchy)


DTYPE_CONVERTER = "openrlhf.utils.utils:convert_to_torch_dtype"


def convert_to_torch_dtype_with_fp32(param_dtype: str) -> torch.dtype:
    """``convert_to_torch_dtype`` that also takes ``"fp32"``. On CPU, bf16 matmuls are slow (SmolLM2-135M's
    training step took ~10x longer than in fp32 here) and vLLM's CPU build serves fp32, so the CPU launch
    trains in fp32; DeepSpeed then runs without its bf16/fp16 sections, as its config enables them only for
    ``"bf16"``/``"fp16"``. Every other value is upstream's."""
    from . import original

    if param_dtype == "fp32":
        return torch.float32
    return original(DTYPE_CONVERTER)(param_dtype)


def cpu_patches() -> list[Patch]:
    """The patches that let OpenRLHF's training path (strategy set-up, replay buffer, ``ppo_train``, the
    policy actor's ``fit``/``forward``, metric all-reduce, barriers, ZeRO-3 parameter gathers) run on CPU
    with gloo."""
    patches = [
        Patch(f"{module}:torch", CPU_TORCH, "torch.cuda.current_device()/set_device/synchronize -> CPU when no CUDA")
        for module in _TORCH_USERS
    ]
    patches.append(Patch(f"{_REPLAY_BUFFER}:torch", CPU_TORCH_REPLAY_BUFFER,
                         "replay buffer target device cuda:<current> -> cpu when no CUDA"))
    patches.append(Patch("openrlhf.utils.deepspeed.deepspeed:init_device_mesh", init_device_mesh_any_device,
                         "DeepspeedStrategy.setup_distributed builds a 'cuda' device mesh"))
    patches += [
        Patch(f"{module}:torch_dist_barrier_and_cuda_sync", barrier_and_cuda_sync,
              "torch.cuda.synchronize() after every barrier")
        for module in _BARRIER_USERS
    ]
    patches.append(Patch(DTYPE_CONVERTER, convert_to_torch_dtype_with_fp32,
                         "param_dtype 'fp32' for CPU training (upstream knows bf16 and fp16 only)"))
    patches.append(Patch(ZERO3_COALESCED_GATHER, allgather_params_coalesced_blocking,
                         "ZeRO-3 multi-parameter gathers wait for their last all-gather only (unordered on gloo)"))
    return patches


def apply_cpu_patches() -> bool:
    """Apply :func:`cpu_patches` when CUDA is unavailable; returns whether they were applied."""
    if torch.cuda.is_available():
        return False
    from . import apply

    apply(cpu_patches())
    return True


# --- flash_attn shim for CPU Ray workers ---------------------------------------------------------------


def _unavailable(what: str):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what}: flash_attn is not installed (a CPU shim stands in for imports only)")

    fail.__name__ = what.rsplit(".", 1)[-1]
    return fail


def _shim_module(name: str, package: bool = False, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        module.__path__ = []
    module.__dict__.update(attrs)
    module.__populora_shim__ = True
    sys.modules[name] = module
    return module


def install_flash_attn_shim() -> bool:
    """Make ``import flash_attn`` (and the names OpenRLHF imports from it at module level) work where the real
    package cannot import. Every shimmed function raises if called. Does nothing, and returns False, when the
    real package imports. For Ray: ``runtime_env={"worker_process_setup_hook":
    "openrlhf_populora.patches.openrlhf_0_11_2.cpu.install_flash_attn_shim"}``."""
    existing = sys.modules.get("flash_attn")
    if existing is not None:
        return bool(getattr(existing, "__populora_shim__", False) or getattr(existing, "__populora_stub__", False))
    try:
        importlib.import_module("flash_attn")
        return False
    except Exception:  # not installed, or a broken CUDA build
        for key in [k for k in sys.modules if k == "flash_attn" or k.startswith("flash_attn.")]:
            del sys.modules[key]
    from einops import rearrange

    pkg = _shim_module("flash_attn", package=True)
    pkg.bert_padding = _shim_module(
        "flash_attn.bert_padding",
        index_first_axis=_unavailable("flash_attn.bert_padding.index_first_axis"),
        pad_input=_unavailable("flash_attn.bert_padding.pad_input"),
        unpad_input=_unavailable("flash_attn.bert_padding.unpad_input"),
        rearrange=rearrange,
    )
    pkg.utils = _shim_module("flash_attn.utils", package=True)
    pkg.utils.distributed = _shim_module(
        "flash_attn.utils.distributed", all_gather=_unavailable("flash_attn.utils.distributed.all_gather")
    )
    return True


def setup_cpu_worker() -> None:
    """One ``worker_process_setup_hook`` for CPU Ray workers: the ``flash_attn`` shim, then, where there is
    no CUDA, :func:`cpu_patches`. Does nothing on a machine with CUDA and a real ``flash_attn``."""
    install_flash_attn_shim()
    apply_cpu_patches()
