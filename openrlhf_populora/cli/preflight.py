"""``python -m openrlhf_populora.cli.preflight <the flags of cli.train --populora.engine ray>``: check a Ray launch
before anything heavy starts, and print one table (check | status | detail | fix). Exit status 0 when nothing is
refused, 2 when something is (each refused row names the flag or variable that fixes it), 2 for bad flags too.

It parses the flags as the launcher does, joins the running Ray cluster the launcher would join (``RAY_ADDRESS``,
or ``ray start`` on this machine; with none, it checks this machine), probes every node with a tiny task and runs
the checks of ``openrlhf_populora/preflight.py``. ``launch/lib.sh`` runs it as a Ray job of its own before it
submits the run (``PREFLIGHT=0`` skips it).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from openrlhf_populora import preflight
    from openrlhf_populora.build.ray import config_from_args, parse_launch_args
    from openrlhf_populora.engines.ray import cluster
    from openrlhf_populora.selfplay.runner import check_run_dir

    args = parse_launch_args(argv)  # bad flags and the launcher's refusals exit 2 here, as they would at launch
    requested = args.populora.cluster_device
    gathered = preflight.gather(preflight.Plan.from_args(args), requested, cluster.cluster_address())
    if gathered.cpu != cluster.planned_cpu(requested):
        args = parse_launch_args(argv, cpu=gathered.cpu)  # the defaults of what the workers really are
    plan = preflight.Plan.from_args(args)
    print(f"[populora] preflight of {plan.describe()}, model {plan.model}, on "
          f"{gathered.address or 'this machine'}", flush=True)
    rows = preflight.run_checks(plan, gathered, existing=lambda: check_run_dir(config_from_args(args)))
    print(preflight.format_table(rows), flush=True)
    return 2 if preflight.refused(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
