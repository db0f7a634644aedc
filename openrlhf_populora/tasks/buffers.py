"""Task buffers (one per task type) and the seeding phase that fills them before training.

Buffer semantics:
- de-duplication on ``Task.key()`` (type, program, pairs, message; not who proposed it);
- capacity: when full, the OLDEST tasks are dropped and the newest kept (AZR's ``[:max_programs]``
  kept the oldest and silently dropped every new program once full);
- ``references(task_type, k, rng)``: K tasks uniformly without replacement from that type's buffer
  (proposer examples); ``induction_program(rng)``: one program uniformly from code_i ∪ code_o;
- ``solver_batch(task_type, size, step, rng, window, proposers)``: tasks added within the last ``window``
  steps (``step - task.step <= window``) first, sampled without replacement, the rest filled uniformly from
  the older tasks (AZR's ``max_new`` mix); with ``proposers``, only from the tasks those members proposed
  and the seed tasks (``step`` 0: held before self-play began);
- ``save``/``load``: one JSON task per line.

Seeding (AZR): start from the identity "zero triplet"; ask the base model for triplet proposals with up to
K references from the seed pool until ``triplets`` distinct valid ones exist (they fill BOTH the code_o
and code_i buffers), then induction proposals on seed programs until ``induction`` valid ones exist.
``Seeder`` is driven by the caller, who owns generation: ``requests()`` -> generate -> ``feed()``.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from openrlhf_populora.tasks.checks import ProposalCheck, check_proposals
from openrlhf_populora.tasks.prompts import DEFAULT_TEMPLATES, PromptTemplates, proposer_prompt
from openrlhf_populora.tasks.records import TASK_TYPES, TRIPLET_TYPES, Task, check_task_type, zero_triplet
from openrlhf_populora.tasks.rules import TaskRules


class TaskBuffers:
    """Per-type task buffers with de-duplication and newest-kept capacity."""

    def __init__(self, capacity: int = 16384):
        if capacity < 1:
            raise ValueError(f"TaskBuffers capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._buffers: dict[str, OrderedDict[str, Task]] = {t: OrderedDict() for t in TASK_TYPES}

    def add(self, task: Task) -> bool:
        """Add a task; False if an identical one is already held. Evicts the oldest when over capacity."""
        if not isinstance(task, Task):
            raise TypeError(f"TaskBuffers.add expects a Task, got {type(task).__name__}")
        buffer = self._buffers[task.task_type]
        key = task.key()
        if key in buffer:
            return False
        buffer[key] = task
        while len(buffer) > self.capacity:
            buffer.popitem(last=False)
        return True

    def extend(self, tasks: Iterable[Task]) -> int:
        """Add many tasks; returns how many were new."""
        return sum(self.add(t) for t in tasks)

    def tasks(self, task_type: str) -> list[Task]:
        """The tasks of one type, oldest first."""
        return list(self._buffers[check_task_type(task_type)].values())

    def size(self, task_type: str) -> int:
        return len(self._buffers[check_task_type(task_type)])

    def __len__(self) -> int:
        return sum(len(b) for b in self._buffers.values())

    def sizes(self) -> dict[str, int]:
        """Tasks held per type (for logging)."""
        return {t: len(b) for t, b in self._buffers.items()}

    def __contains__(self, task: Task) -> bool:
        return task.key() in self._buffers[task.task_type]

    def references(self, task_type: str, k: int, rng: random.Random) -> list[Task]:
        """Up to ``k`` tasks of ``task_type`` drawn uniformly without replacement."""
        pool = self.tasks(task_type)
        return rng.sample(pool, min(k, len(pool)))

    def induction_program(self, rng: random.Random) -> Task | None:
        """One program for a code_f proposer, uniformly from the code_i and code_o buffers (None if empty)."""
        pool = self.tasks("code_i") + self.tasks("code_o")
        return rng.choice(pool) if pool else None

    def solver_batch(self, task_type: str, size: int, step: int, rng: random.Random,
                     window: int = 1, proposers: Collection[str] | None = None) -> list[Task]:
        """``size`` tasks (fewer if the buffer is smaller): recent ones first, then older ones uniformly. With
        ``proposers``, drawn only from the tasks one of them proposed and the seed tasks (step 0)."""
        pool = self.tasks(task_type)
        if proposers is not None:
            allowed = set(proposers)
            pool = [t for t in pool if t.step == 0 or t.proposer in allowed]
        recent = [t for t in pool if step - t.step <= window]
        older = [t for t in pool if step - t.step > window]
        chosen = rng.sample(recent, min(size, len(recent)))
        chosen += rng.sample(older, min(size - len(chosen), len(older)))
        return chosen

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as fh:
            for task_type in TASK_TYPES:
                for task in self._buffers[task_type].values():
                    fh.write(task.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path, capacity: int = 16384) -> TaskBuffers:
        buffers = cls(capacity)
        with Path(path).open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    buffers.add(Task.from_dict(json.loads(line)))
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: not a task record ({e})") from None
        return buffers


@dataclass
class SeedRequest:
    """One proposer prompt the seeding phase wants completed (``program`` is set for code_f)."""

    task_type: str
    prompt: str
    program: Task | None = None


@dataclass
class Seeder:
    """Fills ``buffers`` from base-model proposals before training.

    Loop::

        seeder = Seeder(buffers, triplets=256, induction=256, rng=random.Random(0))
        while not seeder.done:
            reqs = seeder.requests(64)
            seeder.feed(reqs, generate([r.prompt for r in reqs]), sandbox)

    ``done`` also turns True after ``max_rounds`` calls of ``feed`` (check ``complete``).
    """

    buffers: TaskBuffers
    triplets: int = 256
    induction: int = 256
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    references: int = 6
    max_rounds: int = 100
    rules: TaskRules = field(default_factory=TaskRules)
    proposer: str = "seed"
    timeout_s: float = 10.0
    templates: PromptTemplates = DEFAULT_TEMPLATES
    rounds: int = 0
    pool: list[Task] = field(default_factory=list)  # distinct valid triplets (stored as code_o)
    last_checks: list[ProposalCheck] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.triplets < 1 or self.induction < 0:
            raise ValueError("Seeder needs triplets >= 1 and induction >= 0")
        if not self.pool:
            self._add_triplet(zero_triplet("code_o"))

    def _add_triplet(self, task: Task) -> None:
        task = task if task.task_type == "code_o" else task.retyped("code_o")
        if all(task.key() != t.key() for t in self.pool):
            self.pool.append(task)
            for task_type in TRIPLET_TYPES:
                self.buffers.add(task.retyped(task_type))

    @property
    def phase(self) -> str:
        if len(self.pool) < self.triplets:
            return "triplets"
        if self.buffers.size("code_f") < self.induction:
            return "induction"
        return "done"

    @property
    def complete(self) -> bool:
        return self.phase == "done"

    @property
    def done(self) -> bool:
        return self.complete or self.rounds >= self.max_rounds

    def requests(self, batch_size: int) -> list[SeedRequest]:
        """The next ``batch_size`` proposer prompts (empty when done)."""
        if self.done or batch_size < 1:
            return []
        out = []
        for i in range(batch_size):
            if self.phase == "triplets":
                task_type = TRIPLET_TYPES[i % 2]
                refs = self.rng.sample(self.pool, min(self.references, len(self.pool)))
                out.append(SeedRequest(task_type, proposer_prompt(task_type, refs, rules=self.rules,
                                                                  timeout_s=self.timeout_s,
                                                                  templates=self.templates)))
            else:
                program = self.rng.choice(self.pool)
                out.append(SeedRequest("code_f", proposer_prompt("code_f", [], program=program,
                                                                 rules=self.rules, templates=self.templates),
                                       program))
        return out

    def feed(self, requests: Sequence[SeedRequest], completions: Sequence[str], sandbox) -> int:
        """Check the completions of ``requests``; valid tasks join the pool/buffers. Returns how many."""
        if len(requests) != len(completions):
            raise ValueError(f"Seeder.feed: {len(requests)} requests for {len(completions)} completions")
        self.rounds += 1
        added = 0
        self.last_checks = [ProposalCheck(False, "unchecked")] * len(requests)
        for task_type in TASK_TYPES:
            idx = [i for i, r in enumerate(requests) if r.task_type == task_type]
            if not idx:
                continue
            programs = [requests[i].program for i in idx] if task_type == "code_f" else None
            checks = check_proposals(task_type, [completions[i] for i in idx], sandbox, programs=programs,
                                     proposer=self.proposer, step=0, rules=self.rules)
            for i, check in zip(idx, checks, strict=True):
                self.last_checks[i] = check
                if not check.valid:
                    continue
                if task_type == "code_f":
                    if self.buffers.size("code_f") < self.induction:
                        added += self.buffers.add(check.task)
                elif len(self.pool) < self.triplets:
                    before = len(self.pool)
                    self._add_triplet(check.task)
                    added += len(self.pool) - before
        return added
