"""The learning probe: a fixed set of (prompt, base response) pairs per role, and each member's distance from
the base measured on it (``metrics/learning.py`` defines the two numbers).

Built once, right after seeding: ``size`` proposer prompts (task types in turn, references drawn from the
buffers) and ``size`` solver prompts (seed tasks played as each task type in turn), one response to each sampled
from the frozen base at the run's temperature with a seed of its own. The base's per-token log-probs of those
responses are stored with them (``probe.json`` in each checkpoint), so every later step, and every resume,
scores exactly the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openrlhf_populora.engines.base import BASE_ADAPTER, GenerationRequest, SamplingParams, Trajectory
from openrlhf_populora.metrics.learning import adapted_modules, base_weight_norms, probe_kl, update_size

PROBE_FILE = "probe.json"


@dataclass
class ProbeItem:
    prompt_ids: list[int]
    response_ids: list[int]
    base_log_probs: list[float]


@dataclass
class Probe:
    roles: dict[str, list[ProbeItem]] = field(default_factory=dict)  # "teacher" / "student" -> items

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({role: [asdict(item) for item in items] for role, items in self.roles.items()}))

    @classmethod
    def load(cls, path: Path) -> Probe:
        data = json.loads(path.read_text())
        return cls({role: [ProbeItem(**item) for item in items] for role, items in data.items()})


def build_probe(engine, prompts: dict[str, Sequence[str]], params: SamplingParams) -> Probe:
    """Sample one base response to each rendered prompt (``role -> prompts``) and score it under the base.
    Empty responses (an immediate end of sequence) are left out: they have no token to score."""
    roles = list(prompts)
    requests = [GenerationRequest(BASE_ADAPTER, text) for role in roles for text in prompts[role]]
    completions = [out[0] for out in engine.generate(requests, params)] if requests else []
    kept: dict[str, list[tuple[list[int], list[int]]]] = {role: [] for role in roles}
    k = 0
    for role in roles:
        for _ in prompts[role]:
            c = completions[k]
            k += 1
            if c.response_ids:
                kept[role].append((list(c.prompt_ids), list(c.response_ids)))
    flat = [(role, p, r) for role in roles for p, r in kept[role]]
    base = engine.token_log_probs([Trajectory(BASE_ADAPTER, p, r, 0.0) for _, p, r in flat]) if flat else []
    probe = Probe({role: [] for role in roles})
    for (role, p, r), logps in zip(flat, base, strict=True):
        probe.roles[role].append(ProbeItem(p, r, [float(x) for x in logps]))
    return probe


class LearningMeter:
    """Measures members against the base: ``measure(members)`` with ``members`` = (id, adapter, roles)."""

    def __init__(self, engine, model_dir: str | Path, scaling: float) -> None:
        self.engine = engine
        self.model_dir = model_dir
        self.scaling = scaling
        self._base_norms: dict[str, float] | None = None

    def _norms(self, adapter: dict) -> dict[str, float]:
        if self._base_norms is None:
            self._base_norms = base_weight_norms(self.model_dir, adapted_modules(adapter))
        return self._base_norms

    def measure(self, probe: Probe, members: Sequence[tuple[str, str, Sequence[str]]],
                on_member: Callable[[], None] | None = None) -> dict[tuple[str, str], dict[str, float]]:
        """``(member id, role) -> {"update_size", "probe_kl"}``; ``probe_kl`` only where the role's probe has
        responses. One ``token_log_probs`` call for every member and role together."""
        trajectories: list[Trajectory] = []
        spans: dict[tuple[str, str], tuple[int, int]] = {}
        for member_id, adapter, roles in members:
            for role in roles:
                items = probe.roles.get(role, [])
                if items:
                    spans[(member_id, role)] = (len(trajectories), len(trajectories) + len(items))
                    trajectories += [Trajectory(adapter, it.prompt_ids, it.response_ids, 0.0) for it in items]
        logps = self.engine.token_log_probs(trajectories) if trajectories else []
        out: dict[tuple[str, str], dict[str, float]] = {}
        for member_id, adapter, roles in members:
            weights = self.engine.get_adapter(adapter)
            size = update_size(weights, self._norms(weights), self.scaling)
            for role in roles:
                values = {"update_size": size}
                if (member_id, role) in spans:
                    lo, hi = spans[(member_id, role)]
                    values["probe_kl"] = probe_kl([it.base_log_probs for it in probe.roles[role]], logps[lo:hi])
                out[(member_id, role)] = values
            if on_member is not None:
                on_member()
        return out
