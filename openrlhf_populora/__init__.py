"""openrlhf-populora: PopuLoRA (population-based asymmetric self-play with LoRA adapters) for OpenRLHF.

The layout follows the data flow of one iteration (see DESIGN.md):
``population`` (who plays whom) -> ``engines`` (generate per adapter) -> ``tasks`` + ``sandbox`` (propose,
check, solve, verify) -> ``rewards`` -> ``selfplay`` (advantages, train, ratings, evolution) -> ``metrics``.
"""

__version__ = "0.1.0"
