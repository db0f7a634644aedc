"""Metrics: what a run collects while it runs (what is computed from finished runs is in ``analysis/``).

Light to import: ribs (coverage) loads only when used.

- ``program_complexity(code) -> dict``                     (complexity.py)
- ``CoverageArchive.create(directory, seed=0)``            (coverage.py)
- ``Tracker(run_dir, tensorboard_dir=None, wandb=None)``   (tracker.py)
- learning diagnostics: update size and probe KL           (learning.py)
- what a run ran with: commit, packages, CPU               (provenance.py)
- the run-directory schema and key builders                (keys.py)
"""

from openrlhf_populora.metrics import keys
from openrlhf_populora.metrics.complexity import program_complexity
from openrlhf_populora.metrics.coverage import CoverageArchive, program_descriptor, program_fingerprint
from openrlhf_populora.metrics.tracker import Tracker, progress_postfix

__all__ = ["CoverageArchive", "Tracker", "keys", "program_complexity", "program_descriptor",
           "program_fingerprint", "progress_postfix"]
