"""The PopuLoRA iteration and the single-agent baseline, written once against the engine protocol.

``loop.SelfPlay`` runs one step; ``runner.run`` runs a whole run (resume, checkpoints, Ctrl-C, export), and
``runner.run_on`` with ``RunHooks`` the same for a study;
``advantages`` whitens rewards per (member, role, task type); ``summary`` builds the tracker's records;
``checkpoint`` writes checkpoints atomically.
"""

from openrlhf_populora.selfplay.advantages import whiten_by_group
from openrlhf_populora.selfplay.loop import SelfPlay, StepOutput

__all__ = ["SelfPlay", "StepOutput", "whiten_by_group"]
