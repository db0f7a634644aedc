"""``python -m openrlhf_populora.cli.stock_ppo <train_ppo_ray flags>``: stock OpenRLHF, also on a CPU machine.

This runs OpenRLHF 0.11.2's own ``openrlhf.cli.train_ppo_ray`` ``__main__`` -- its parser, validation, ``train()``,
``PPOTrainer``, ``PolicyModelActor``, ``RolloutRayActor`` and ``SingleTurnAgentExecutor``, none of the plugin's
classes swapped in -- so that stock OpenRLHF (baseline B2) can be run, and tested, where the plugin runs. It takes
exactly upstream's flags. Where CUDA is available it changes nothing: it runs upstream's ``__main__`` as
``python -m openrlhf.cli.train_ppo_ray`` would (on a GPU cluster you may as well call that directly).

Without CUDA it first does what upstream cannot do on a CPU: CPU defaults (a flag you pass still wins), a local
Ray with as many *logical* GPUs as upstream's placement asks for, and the patches of
``patches/openrlhf_0_11_2/stock_cpu.py`` in this process and every Ray worker (its docstring says why each exists).

The reward file (``--reward.remote_url <openrlhf_populora/openrlhf_reward.py>``) is loaded by upstream's
``SingleTurnAgentExecutor`` inside each vLLM actor, unchanged. Run ``python -m openrlhf_populora.cli.tasks
export`` for the prompt dataset and ``python -m openrlhf_populora.cli.tasks reward-file`` for that path.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from openrlhf_populora.build.ray import run_on_ray
from openrlhf_populora.engines.ray import cluster
from openrlhf_populora.errors import InputError
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
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        patches.check_version()
    except patches.UpstreamVersionError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    cpu.install_flash_attn_shim()  # upstream's modules import flash_attn at the top; a shim where it cannot install
    args = parse_stock_args(argv)  # exits 2 on a bad flag, before Ray starts
    try:  # join the running cluster and ask it whether its GPU workers are CPUs, or start a local Ray with
        # logical GPUs on a machine without CUDA, or leave Ray to upstream (engines/ray/cluster.py)
        run_on_ray(args, not _cuda(), lambda on_cpu: parse_stock_args(argv, cpu=on_cpu),
                   lambda _args, on_cpu: all_cpu_patches() if on_cpu else [], worker_setup_hook=WORKER_SETUP_HOOK)
    except InputError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
