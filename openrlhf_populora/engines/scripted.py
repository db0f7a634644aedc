"""An engine whose completions come from a function instead of the model: for tests and demos of the loop.

``scripted_engine(policy)`` returns a ``LocalEngine`` subclass (``scripted_engine(policy, base=RayEngine)`` one
of the Ray engine) whose ``generate`` returns ``policy(adapter, prompt, sample, rng)`` for every requested
sample, tokenised with the engine's tokenizer (EOS appended); ``rng`` is a ``random.Random`` seeded by (sampling
seed, request, sample, adapter), so a script is as reproducible as sampling. Everything else -- adapters,
training, evolution, uploads, state -- is the real engine's, so a loop test sees real updates on completions of
known validity and correctness (a random tiny model writes none).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from openrlhf_populora.engines.base import Completion

Policy = Callable[[str, str, int, random.Random], str]


def scripted_engine(policy: Policy, base: type | None = None) -> type:
    """A subclass of ``base`` (default ``LocalEngine``) that generates with ``policy``."""
    if base is None:
        from openrlhf_populora.engines.local import LocalEngine

        base = LocalEngine

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, requests, params):
        outputs = []
        for index, request in enumerate(requests):
            prompt_ids = encode(self, request.prompt)
            completions = []
            for sample in range(request.n):
                rng = random.Random(f"{params.seed}/{index}/{sample}/{request.adapter}")
                text = policy(request.adapter, request.prompt, sample, rng)
                response = encode(self, text) + [self.tokenizer.eos_token_id]
                completions.append(Completion(request.adapter, prompt_ids, response, text, True))
            outputs.append(completions)
        return outputs

    return type(f"Scripted{base.__name__}", (base,), {"generate": generate, "__doc__": __doc__})
