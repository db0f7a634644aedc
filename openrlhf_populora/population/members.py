"""Population members and their lineage.

A **member** is one LoRA adapter with a role: ``"teacher"`` (proposes problems), ``"student"`` (solves
problems), or ``"both"`` (the single-agent baseline, AZR-style, which proposes and solves). Members have
stable ids: ``t0, t1, ...`` for teachers, ``s0, s1, ...`` for students, ``b0`` for the baseline agent.

An **adapter slot** is the engine-side adapter name a member lives in. Founders get ``adapter == id``. When
evolution replaces a member, the child gets a NEW id (the next free one of its role, e.g. ``t4``) and takes
over the retired member's adapter slot, so engines keep a fixed set of adapter names. Retired members stay
in ``Population.members`` (with ``retired_step`` set) so the whole lineage is kept and serialised to JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("teacher", "student", "both")
ID_PREFIX = {"teacher": "t", "student": "s", "both": "b"}
FOUNDER = "init"  # ``operator`` of members created at the start of a run


@dataclass
class Member:
    """One adapter of the population.

    ``parents`` are member ids (empty for founders); ``operator`` is the evolution operator that made the
    member (``"init"`` for founders) and ``op_seed`` its seed. ``rating`` is a snapshot of the member's
    rating (``{"mu", "sigma", "conservative"}``), refreshed by ``Population.snapshot_ratings``; the live
    ratings belong to the ratings object. ``info`` holds what the operator reported (e.g. truncation energy).
    """

    id: str
    role: str
    adapter: str
    birth_step: int = 0
    parents: list[str] = field(default_factory=list)
    operator: str = FOUNDER
    op_seed: int | None = None
    retired_step: int | None = None
    rating: dict[str, float] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"member {self.id!r}: role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.id or not self.adapter:
            raise ValueError("a member needs a non-empty id and adapter name")

    @property
    def alive(self) -> bool:
        return self.retired_step is None

    @property
    def teaches(self) -> bool:
        return self.role in ("teacher", "both")

    @property
    def solves(self) -> bool:
        return self.role in ("student", "both")

    def age(self, step: int) -> int:
        """Steps played since birth, at the end of step ``step``.

        A member born at ``birth_step`` (founders: the run's start, 0; a child: the step whose evolution event
        made it, which runs after that step's training) first plays step ``birth_step + 1``, so by the end of
        step ``step`` it has played ``step - birth_step`` steps. Selection's ``min_age`` counts these."""
        return step - self.birth_step


class Population:
    """All members ever created (alive and retired), in creation order.

    Build one with ``Population.create(num_teachers, num_students)`` or ``Population.baseline()``.
    A population is either teachers + students, or exactly one ``"both"`` member (the baseline).
    """

    def __init__(self, members: list[Member] | None = None) -> None:
        self.members: list[Member] = []
        for member in members or []:
            self.add(member)

    # construction -------------------------------------------------------------------------------------
    @classmethod
    def create(cls, num_teachers: int, num_students: int, step: int = 0) -> Population:
        """Founders ``t0..t{T-1}`` and ``s0..s{S-1}``, each in the adapter slot named like its id."""
        if num_teachers < 1 or num_students < 1:
            raise ValueError(f"a population needs >= 1 teacher and >= 1 student, got "
                             f"{num_teachers} teachers and {num_students} students")
        members = [Member(f"t{i}", "teacher", f"t{i}", birth_step=step) for i in range(num_teachers)]
        members += [Member(f"s{i}", "student", f"s{i}", birth_step=step) for i in range(num_students)]
        return cls(members)

    @classmethod
    def baseline(cls, step: int = 0) -> Population:
        """The single-agent baseline: one member ``b0`` playing both roles."""
        return cls([Member("b0", "both", "b0", birth_step=step)])

    def add(self, member: Member) -> Member:
        if any(m.id == member.id for m in self.members):
            raise ValueError(f"duplicate member id {member.id!r}")
        if member.alive and any(m.alive and m.adapter == member.adapter for m in self.members):
            raise ValueError(f"adapter slot {member.adapter!r} is already held by a living member")
        living_roles = [m.role for m in self.alive()]
        if member.alive and living_roles and (member.role == "both" or "both" in living_roles):
            raise ValueError("a baseline population holds exactly one living 'both' member and nothing else")
        self.members.append(member)
        return member

    # queries ------------------------------------------------------------------------------------------
    def get(self, member_id: str) -> Member:
        for member in self.members:
            if member.id == member_id:
                return member
        raise KeyError(f"no member {member_id!r} in the population")

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.alive]

    def teachers(self) -> list[Member]:
        """Living members that propose problems (role teacher, or the baseline's both)."""
        return [m for m in self.alive() if m.teaches]

    def students(self) -> list[Member]:
        """Living members that solve problems (role student, or the baseline's both)."""
        return [m for m in self.alive() if m.solves]

    @property
    def is_baseline(self) -> bool:
        return any(m.role == "both" for m in self.alive())

    def adapter_of(self, member_id: str) -> str:
        return self.get(member_id).adapter

    def member_in(self, adapter: str) -> Member:
        """The living member that holds adapter slot ``adapter``."""
        for member in self.alive():
            if member.adapter == adapter:
                return member
        raise KeyError(f"no living member holds adapter {adapter!r}")

    def next_ids(self, role: str, count: int = 1) -> list[str]:
        """The next ``count`` unused ids for ``role`` (pure: nothing is reserved)."""
        prefix = ID_PREFIX[role]
        used = [int(m.id[len(prefix):]) for m in self.members
                if m.id.startswith(prefix) and m.id[len(prefix):].isdigit()]
        start = max(used, default=-1) + 1
        return [f"{prefix}{start + i}" for i in range(count)]

    def lineage(self, member_id: str) -> list[str]:
        """All ancestors of a member (breadth first, nearest first, each once)."""
        seen: list[str] = []
        frontier = list(self.get(member_id).parents)
        while frontier:
            parent = frontier.pop(0)
            if parent not in seen:
                seen.append(parent)
                frontier.extend(self.get(parent).parents)
        return seen

    # changes ------------------------------------------------------------------------------------------
    def record(self, action: Any, info: dict[str, Any] | None = None) -> Member:
        """Apply an evolution action to the lineage: retire ``action.replaced`` and add the child.

        ``action`` is a ``population.selection.EvolutionAction`` (duck-typed: ``step, slot, replaced,
        new_id, role, operator, parents, seed``). Everything is checked before anything changes.
        """
        old = self.get(action.replaced)
        if not old.alive:
            raise ValueError(f"member {old.id!r} was already retired at step {old.retired_step}")
        if old.adapter != action.slot or old.role != action.role:
            raise ValueError(f"action does not match member {old.id!r}: slot {action.slot!r} / role "
                             f"{action.role!r} vs {old.adapter!r} / {old.role!r}")
        if any(m.id == action.new_id for m in self.members):
            raise ValueError(f"duplicate member id {action.new_id!r}")
        for parent in action.parents:
            self.get(parent)
        child = Member(action.new_id, action.role, action.slot, birth_step=action.step,
                       parents=list(action.parents), operator=action.operator, op_seed=action.seed,
                       info=dict(info or {}))
        old.retired_step = action.step
        self.members.append(child)
        return child

    def snapshot_ratings(self, ratings: Any) -> None:
        """Copy each living member's current rating into ``member.rating`` (for the saved lineage)."""
        for member in self.alive():
            if ratings.has(member.id):
                member.rating = {"mu": ratings.mu(member.id), "sigma": ratings.sigma(member.id),
                                 "conservative": ratings.conservative(member.id)}

    # JSON ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": 1, "members": [asdict(m) for m in self.members]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Population:
        if not isinstance(data, dict) or "members" not in data:
            raise ValueError("population JSON must be an object with a 'members' list")
        return cls([Member(**m) for m in data["members"]])

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Population:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Population:
        return cls.from_json(Path(path).read_text())

    def __len__(self) -> int:
        return len(self.alive())

    def __repr__(self) -> str:
        alive = ", ".join(f"{m.id}@{m.adapter}" for m in self.alive())
        return f"Population([{alive}], {len(self.members)} ever)"
