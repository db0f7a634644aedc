"""Metrics: program complexity, CVT coverage archive, run tracker, report figures.

Light to import: ribs (coverage) and matplotlib (report) load only when used.

- ``program_complexity(code) -> dict``                     (complexity.py)
- ``CoverageArchive.create(directory, seed=0)``            (coverage.py)
- ``Tracker(run_dir, tensorboard_dir=None, wandb=None)``   (tracker.py)
- ``render_report(run_dirs, out_dir, smooth=1)``           (report.py)
- the run-directory schema and key builders                (keys.py)
"""

from openrlhf_populora.metrics import keys
from openrlhf_populora.metrics.complexity import program_complexity
from openrlhf_populora.metrics.coverage import CoverageArchive, program_descriptor, program_fingerprint
from openrlhf_populora.metrics.tracker import Tracker, progress_postfix

__all__ = ["CoverageArchive", "Tracker", "keys", "program_complexity", "program_descriptor",
           "program_fingerprint", "progress_postfix", "render_report"]


def __getattr__(name: str):
    if name == "render_report":  # imports matplotlib: only on demand
        from openrlhf_populora.metrics.report import render_report

        return render_report
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
