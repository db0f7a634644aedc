"""``python -m openrlhf_populora.cli.retention``: do evolved children keep what their parents learned?

    python -m openrlhf_populora.cli.retention --run runs/signature --snapshots 10 20 30 40 --parents t0 \\
        --steps 50 --out runs/retention-t0
    python -m openrlhf_populora.cli.retention --run runs/signature --list      # checkpoints and their members

The operator retention study (the paper's Figs 6, 16 and 17): for every snapshot step S (a checkpoint of
``--run``) and operator, a child of the parents is made as evolution makes one, then retrained for ``--steps``
self-play steps with the run's settings against one frozen opponent; ``copy_parent``, the parent retrained alike,
is the reference. ``--out`` gets one run directory per child, the table (``retention.md``) and the figures.
Rerun the same command to resume. What it measures and writes: docs/usage.md ("The operator retention study").

Runs on the local engine (CPU, or one GPU with ``--populora.device cuda``); a run written by the Ray engine
is refused. Exit status: 0 when every child ran, 1 when a child failed (its error.log says why), 2 on bad input
(one line on stderr), 130 when interrupted (rerun to resume).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from openrlhf_populora.cli.errors import InputError, OneLineParser
from openrlhf_populora.config import Config
from openrlhf_populora.studies import retention as study


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m openrlhf_populora.cli.retention", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="the run directory (config.yaml, checkpoints/)")
    parser.add_argument("--snapshots", type=int, nargs="+", metavar="STEP", help="checkpoint steps to start from")
    parser.add_argument("--parents", nargs="+", metavar="MEMBER",
                        help="one member id (mutations) or two (crossovers too); the second may be "
                             "OTHER_RUN_DIR:MEMBER, a member of another run at the same step")
    parser.add_argument("--operators", nargs="+", default=["all"], metavar="OP",
                        help="readable names or paper codes (M1-M6, X1-X9, copy_parent, linear_0_5); default all: "
                             "the mutations and copy_parent, and with two parents the crossovers and linear_0_5 "
                             "too; copy_parent (the reference) is always run")
    parser.add_argument("--steps", type=int, default=study.Request.steps, help="retraining steps per child")
    parser.add_argument("--out", type=Path, help="the study directory (created; rerun into it to resume)")
    parser.add_argument("--opponent", default=None, metavar="MEMBER",
                        help="the frozen opponent, a member of the other role alive at every snapshot "
                             "(default: the best-rated one of each snapshot)")
    parser.add_argument("--probe-samples", type=int, default=study.Request.probe_samples, metavar="K",
                        help="completions each parent samples at a snapshot for the log-prob retention measure")
    parser.add_argument("--tolerance", type=float, default=study.Request.tolerance,
                        help="recovery: the child's metric >= copy_parent's - tolerance x |copy_parent's|")
    parser.add_argument("--smooth", type=int, default=study.Request.smooth,
                        help="trailing mean, in retraining steps, for the table")
    parser.add_argument("--at", type=int, nargs="+", default=None, metavar="K",
                        help="the table's retraining steps (default: 20 and --steps)")
    parser.add_argument("--populora.device", dest="device", choices=("cpu", "cuda"), default=None,
                        help="where the local engine runs (default: the run's)")
    parser.add_argument("--populora.num_threads", dest="num_threads", type=int, default=None,
                        help="torch threads (default: the run's)")
    parser.add_argument("--actor.model_name_or_path", dest="model", default=None,
                        help="the base model, when the run's is elsewhere on this machine (default: the run's)")
    parser.add_argument("--ds.param_dtype", dest="dtype", choices=("auto", "fp32", "bf16"), default=None,
                        help="the frozen base's dtype (default: the run's)")
    parser.add_argument("--list", action="store_true", help="list the run's checkpoints and living members, then exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None, engine_factory: Callable[[Config], Any] | None = None,
         sandbox_factory: Callable[[Config], Any] | None = None) -> int:
    """The command line. ``engine_factory`` (default ``build.build_engine``) and ``sandbox_factory`` build
    the engine and sandbox from the run's config (tests pass scripted ones)."""
    from openrlhf_populora.selfplay.runner import RunFailed

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("POPULORA_LOG", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.list:
            print("\n".join(study.describe_run(study.load_source(args.run, "--run"))))
            return 0
        request = study.Request(**{f.name: getattr(args, f.name) for f in fields(study.Request)})
        plan = study.make_plan(request)
        outcome = study.run_study(plan, engine_factory, sandbox_factory, progress=not args.quiet)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunFailed:  # the runner logged its one-line report; the child's error.log has the traceback
        return 1
    if outcome.status == 130:
        print(f"[retention] interrupted; rerun the same command to resume into {plan.out}", file=sys.stderr)
    for warning in outcome.rendered.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print((plan.out / "retention.md").read_text(), end="")
    print("wrote " + ", ".join(str(p) for p in outcome.rendered.files))
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
