"""``--populora.engine ray``: launch a PopuLoRA run on OpenRLHF 0.11.2's own ``train_ppo_ray``.

``python -m openrlhf_populora.cli.train --populora.engine ray <train_ppo_ray flags> <--populora.* flags>`` lands
here. The composition (upstream's parser and the plugin's flags, refusals, class swaps and run function) is in
``build/ray.py``; this parses the command line, refuses an existing run, joins or starts Ray and runs upstream's
``__main__`` with the plugin's classes swapped in.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from openrlhf_populora.build.ray import (
    PROG,
    config_from_args,
    launch_swaps,
    parse_launch_args,
    run_on_ray,
)
from openrlhf_populora.errors import InputError
from openrlhf_populora.patches import openrlhf_0_11_2 as patches


def main(argv: Sequence[str] | None = None) -> int:
    """Launch a PopuLoRA run on Ray: ``python -m openrlhf_populora.cli.train --populora.engine ray <flags>``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        patches.check_version()
    except patches.UpstreamVersionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    args = parse_launch_args(argv)  # bad flags exit 2 here, before Ray
    from openrlhf_populora.engines.ray import cluster
    from openrlhf_populora.selfplay.runner import RunDirError, check_run_dir

    try:  # an existing run is refused before Ray and the models start
        check_run_dir(config_from_args(args))
    except RunDirError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    try:  # join the running cluster (and ask it whether its GPU workers are CPUs), or start a local CPU Ray
        run_on_ray(args, cluster.planned_cpu(args.populora.cluster_device),
                   lambda cpu: parse_launch_args(argv, cpu=cpu), lambda args, _cpu: launch_swaps(args),
                   requested=args.populora.cluster_device)
    except InputError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
