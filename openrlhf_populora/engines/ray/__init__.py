"""The distributed engine: OpenRLHF 0.11.2's Ray trainer holding N LoRA policies on one frozen base.

- ``launch``         ``--populora.engine ray``: upstream's parser and ``train()`` with the plugin's classes swapped in
- ``policy_actor``   DeepSpeed policy actor whose one engine holds every adapter (one adapter per micro-batch)
- ``vllm_rollout``   vLLM rollout actor with multi-LoRA: each request carries its member's ``LoRARequest``
- ``experience``     trajectories -> OpenRLHF experiences, advantages grouped per (member, role, task type)
- ``trainer``        the controller: a PPOTrainer subclass that runs the self-play loop through ``RayEngine``

Importing this package does not import Ray, vLLM or DeepSpeed; each module does when it is imported.
"""

# Keys of ``Experience.info`` that route a sample to its adapter and its advantage group. OpenRLHF logs every
# info entry as a metric, so both are numeric tensors (indices into the run's adapter and group lists).
ADAPTER_INFO_KEY = "populora_adapter"
GROUP_INFO_KEY = "populora_group"
