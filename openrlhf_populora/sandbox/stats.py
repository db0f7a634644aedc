"""Counters a Sandbox keeps for logging: executions, outcomes by status, latency (mean and p95)."""

from __future__ import annotations

import math
from collections import deque

from .result import STATUSES


class SandboxStats:
    """Running counters; ``as_dict()`` is a flat, JSON-friendly snapshot.

    Mean latency is over every job ever run; p50/p95 over the most recent ``window`` jobs (nearest-rank).
    """

    def __init__(self, window: int = 10_000):
        self.executions = 0
        self.batches = 0
        self.worker_restarts = 0
        self.by_status = dict.fromkeys(STATUSES, 0)
        self.total_wall_s = 0.0
        self.recent = deque(maxlen=window)

    def record(self, status: str, wall_s: float) -> None:
        self.executions += 1
        self.by_status[status] += 1
        self.total_wall_s += wall_s
        self.recent.append(wall_s)

    def as_dict(self) -> dict:
        ordered = sorted(self.recent)

        def pct(q: float) -> float:
            return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0

        return {
            "executions": self.executions,
            "failures": self.executions - self.by_status["ok"],
            **{f"status_{name}": count for name, count in self.by_status.items()},
            "batches": self.batches,
            "worker_restarts": self.worker_restarts,
            "latency_mean_s": self.total_wall_s / self.executions if self.executions else 0.0,
            "latency_p50_s": pct(0.50),
            "latency_p95_s": pct(0.95),
        }
