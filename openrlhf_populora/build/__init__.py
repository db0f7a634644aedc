"""Composition: a run put together from its ``Config``, for either engine.

``build.local``: the local engine (``local_engine_config``, ``build_engine``), re-exported here. ``build.ray``: the
Ray engine, through OpenRLHF's own ``train_ppo_ray`` (upstream's parser with the ``--populora.*`` flags, the class
swaps, ``config_from_args`` and the trainer's run function ``run_selfplay``); imported by name, as it loads
upstream's modules. ``build`` may import every layer below it; nothing below imports it (engines least of all).
"""

from openrlhf_populora.build.local import build_engine, local_engine_config

__all__ = ["build_engine", "local_engine_config"]
