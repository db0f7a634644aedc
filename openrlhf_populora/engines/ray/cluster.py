"""Starting or joining Ray for the distributed engine, and deciding whether its GPU workers are CPUs.

Three cases, decided in this order (:func:`connect`):

- **A running cluster** (``RAY_ADDRESS`` is set, as in every ``ray job submit`` entrypoint, or ``ray start`` ran
  on this machine): the launch connects to it itself, before upstream's ``train()``, which then skips its own
  ``ray.init``. Upstream's ``ray.init`` asks for three env vars in its runtime env (``TOKENIZERS_PARALLELISM``,
  ``NCCL_DEBUG``, ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS``); inside a job Ray merges that with the job's runtime env
  and refuses ("Failed to merge the Job's runtime env") when both name the same key, whatever the values
  (``ray/runtime_env/runtime_env.py`` ``_merge_runtime_env``). So the launch asks for the same keys *minus* every
  key the job's runtime env already sets (the job's value wins), and never passes ``num_cpus``/``num_gpus``
  (Ray refuses them when joining a cluster). Whether the workers are CPUs is asked of the cluster: a one-GPU
  task reports whether its worker sees CUDA. Logical GPUs on CPU machines look like GPUs in the cluster's
  resources; only a worker can tell.
- **No cluster, no CUDA here** (a laptop, CI): a local Ray whose *logical* GPU count covers upstream's
  placement (its bundles ask for ``{"GPU": 1, "CPU": 1}``): no process touches CUDA, but the actors schedule
  exactly as on a cluster.
- **No cluster, CUDA here**: nothing; upstream's ``train()`` starts Ray as usual.

``--populora.cluster_device cpu|cuda`` overrides the decision. Only in CPU mode does the launch give Ray's
workers the CPU worker environment (:data:`CPU_WORKER_ENV`: one thread, vLLM's CPU build with multiprocessing
off and a 1 GiB KV cache; a key the launching shell sets wins) and :func:`setup_worker` as ``worker_process_setup_hook``, which runs first in every
worker: where it sees no CUDA, the same environment (keys not already set), the ``flash_attn`` import shim and
the CPU patches (``patches/openrlhf_0_11_2/cpu.py``: gloo instead of NCCL, CPU
tensors instead of ``torch.cuda.current_device()``). A worker with CUDA is left alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from openrlhf_populora.patches.openrlhf_0_11_2.cpu import setup_cpu_worker

CPU_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",  # 2-core machines: torch's default threads slow everything down 15-40x when shared
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine start ~2 s instead of ~15 s
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

# the env vars upstream's train() puts in its ray.init runtime env (openrlhf/cli/train_ppo_ray.py:21-32), with
# its fallbacks; the launch asks for the same when it connects in its place
UPSTREAM_ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN",
                         "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}

# Upstream defaults that cannot run without CUDA, replaced in CPU mode (a flag the user passes still wins, except
# a flash-attn implementation: :func:`cpu_attention`).
CPU_DEFAULTS = {
    "ds.attn_implementation": "sdpa",  # upstream: flash_attention_2
    "ds.param_dtype": "fp32",  # upstream: bf16 (slow on CPU; vLLM's CPU build serves fp32); cpu.py allows it
}



def cpu_attention(implementation: str) -> str:
    """The attention implementation CPU workers use for ``implementation``: ``sdpa`` for the flash-attn ones
    (``flash_attention_2``/``_3``, which transformers refuses without CUDA), else ``implementation`` itself. The
    CPU mode applies it even over a flag: the cluster presets name flash-attn for GPUs."""
    return CPU_DEFAULTS["ds.attn_implementation"] if implementation.startswith("flash_attention") else implementation


JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor in a job's entrypoint
PROBE_TIMEOUT_S = 300.0


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def setup_worker() -> None:
    """``worker_process_setup_hook`` of the CPU mode: in a worker without CUDA, the CPU worker environment
    (only keys not already set), one torch thread, the ``flash_attn`` shim and the CPU patches. Does nothing
    where there is CUDA and a real ``flash_attn``."""
    if not cuda_available():
        for key, value in CPU_WORKER_ENV.items():
            os.environ.setdefault(key, value)
        from openrlhf_populora.engines.torch_threads import set_torch_threads

        set_torch_threads(int(os.environ["OMP_NUM_THREADS"]))  # before any vLLM in this worker can freeze it
    setup_cpu_worker()


def cpu_worker_env() -> dict[str, str]:
    """The CPU workers' environment: :data:`CPU_WORKER_ENV`, where the launching shell has not set a key itself
    (``VLLM_CPU_KVCACHE_SPACE=4 OMP_NUM_THREADS=2 python -m ...`` reaches every worker)."""
    return {key: os.environ.get(key, value) for key, value in CPU_WORKER_ENV.items()}


WORKER_SETUP_HOOK = f"{setup_worker.__module__}.{setup_worker.__name__}"


def cluster_address() -> str | None:
    """The running Ray cluster a launch joins: ``RAY_ADDRESS`` (every ``ray job submit`` entrypoint has it), else
    the cluster of the last ``ray start`` on this machine (Ray's own lookup, ``ray_current_cluster`` in Ray's
    default temp dir). None when there is none."""
    from ray._private import services

    try:
        return services.get_ray_address_from_environment(None, None)
    except Exception:  # noqa: BLE001 - a stale address file: no cluster to join
        return None


def job_runtime_env() -> dict[str, Any]:
    """The runtime env of the Ray job this process is the entrypoint of ({} outside a job)."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return {}
    return dict(json.loads(raw).get("runtime_env") or {})


def driver_runtime_env(env_vars: dict[str, str], extra: dict[str, Any] | None = None,
                       job: dict[str, Any] | None = None) -> dict[str, Any]:
    """A runtime env for the launch's ``ray.init`` that Ray can merge with the job's (``job``; default: this
    process's job): every key the job sets, top-level or env var, is left to the job."""
    job = job_runtime_env() if job is None else job
    taken = set(job.get("env_vars") or {})
    env = {"env_vars": {k: v for k, v in env_vars.items() if k not in taken}}
    env.update({k: v for k, v in (extra or {}).items() if k not in job})
    return {k: v for k, v in env.items() if v}


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


def planned_cpu(requested: str = "auto") -> bool:
    """What the launch will decide, judged before any connection: ``requested`` (``cpu``/``cuda``), else no CUDA
    in this process. Joining a cluster asks the cluster instead (:func:`connect`)."""
    if requested != "auto":
        return requested == "cpu"
    return not cuda_available()


def _worker_sees_cuda() -> bool:
    import ray

    @ray.remote(num_gpus=1, num_cpus=0)
    def probe() -> bool:
        import torch

        return torch.cuda.is_available()

    return bool(ray.get(probe.remote(), timeout=PROBE_TIMEOUT_S))


@dataclass
class RayLaunch:
    """How Ray was set up: ``cpu`` (the GPU workers are CPUs: CPU defaults and patches), ``initialized`` (this
    process called ``ray.init``: it calls ``ray.shutdown`` at the end), ``address`` (the cluster joined, or None)."""

    cpu: bool
    initialized: bool
    address: str | None = None


def connect(args: Any, requested: str = "auto", worker_setup_hook: str = WORKER_SETUP_HOOK) -> RayLaunch:
    """Join the running cluster, or start a local CPU Ray, or leave Ray to upstream (see the module docstring).
    ``requested``: ``auto``, ``cpu`` or ``cuda`` (``--populora.cluster_device``)."""
    import ray

    if ray.is_initialized():
        return RayLaunch(cpu=planned_cpu(requested), initialized=False)
    address = cluster_address()
    if address is not None:
        env = {k: os.environ.get(k, v) for k, v in UPSTREAM_ENV_DEFAULTS.items()}
        if requested == "auto":  # ask the cluster, over a plain connection (no CPU hook on a GPU cluster)
            ray.init(address=address, runtime_env=driver_runtime_env(env))
            try:
                if ray.cluster_resources().get("GPU", 0) < 1:
                    raise RuntimeError(
                        f"the Ray cluster at {address} has no GPU resources: start its nodes with --num-gpus N (on "
                        "machines without CUDA these are logical GPUs, and the engine runs on CPU)")
                cpu = not _worker_sees_cuda()
            except BaseException:
                ray.shutdown()
                raise
            if not cpu:
                return RayLaunch(cpu=False, initialized=True, address=address)
            ray.shutdown()  # again, with the CPU workers' environment and setup hook
        elif requested == "cuda":
            ray.init(address=address, runtime_env=driver_runtime_env(env))
            return RayLaunch(cpu=False, initialized=True, address=address)
        setup_worker()  # the driver imports OpenRLHF too (and takes the CPU environment's defaults)
        ray.init(address=address, runtime_env=driver_runtime_env(
            {**env, **cpu_worker_env()}, {"worker_process_setup_hook": worker_setup_hook}))
        return RayLaunch(cpu=True, initialized=True, address=address)
    cpu = planned_cpu(requested)
    if not cpu:
        return RayLaunch(cpu=False, initialized=False)  # upstream's train() starts Ray
    setup_worker()  # the driver imports OpenRLHF too (and takes the CPU environment's defaults)
    gpus = logical_gpus_needed(args)
    ray.init(
        num_cpus=max(4, 2 * gpus + 2),  # logical: the trainer, the policy actors and the engines each take one
        num_gpus=gpus,
        include_dashboard=False,
        runtime_env={
            "env_vars": cpu_worker_env(),
            "worker_process_setup_hook": worker_setup_hook,
        },
    )
    return RayLaunch(cpu=True, initialized=True)


def init_ray(args: Any, worker_setup_hook: str = WORKER_SETUP_HOOK) -> bool:
    """:func:`connect` with the decision left to it; True when this process called ``ray.init``."""
    return connect(args, worker_setup_hook=worker_setup_hook).initialized
