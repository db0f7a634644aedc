"""The PopuLoRA iteration, written once against the engine protocol (``engines/base.py``).

One step, for all task types at once so that generation batches are as large as possible:

1. **match**    the matchmaker pairs teachers with students for every task type (cross-evaluation only);
2. **propose**  every teacher writes ``proposals_per_teacher`` tasks per type (K references from the buffers);
3. **check**    proposals run twice in the sandbox; valid tasks enter the buffers;
4. **solve**    every student answers the valid tasks of its matched teachers (``solver_samples`` each),
                topped up to at least ``solver_tasks`` per type from the buffers' tasks of those same teachers
                (this step's and earlier ones, recent first) and the seed tasks: never another teacher's;
5. **verify**   answers are verified in the sandbox; student reward = correctness (with format penalties),
                teacher reward = failure rate of its matched students on its valid task;
6. **train**    advantages whitened per (member, role, task type); one update (``--train.max_epochs``) for
                every adapter (samples with advantage 0 carry no gradient and are left out unless
                ``skip_zero_advantage`` is off); members in ``SelfPlay.frozen`` play and are scored as
                usual, but their samples are never trained on, so their adapters stay bit-identical;
7. **rate**     ratings updated from the matchups; every ``evolve_every`` steps the evolution plan replaces
                the weakest members with mutated / crossed-over children (fresh optimizer state).

The **baseline** (``mode: baseline``) is the same loop with one member playing both roles: it solves its
own valid proposals, and its proposer reward is AZR's learnability (``teacher_reward: auto``). It is
compute-matched *per adapter*: with the population's settings (``--populora.baseline_for <preset>``) it
generates as many proposals as one teacher and as many answers as one student every step, and takes the same
``--train.max_epochs`` updates, exactly like every member of the population.

Every random choice of step ``t`` comes from an RNG derived from ``(train.seed, t, purpose)``, so a run
resumed from a checkpoint makes the same choices as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import fmean
from typing import Any

from openrlhf_populora.config import Config
from openrlhf_populora.engines.base import (
    BASE_ADAPTER,
    Completion,
    Engine,
    GenerationRequest,
    SamplingParams,
    Trajectory,
)
from openrlhf_populora.metrics import CoverageArchive, Tracker, program_complexity
from openrlhf_populora.population import (
    EvolutionAction,
    Matchup,
    Member,
    Population,
    Ratings,
    apply_plan,
    make_ratings,
    matchmake,
    plan_evolution,
    should_evolve,
)
from openrlhf_populora.rewards import student_reward, teacher_reward
from openrlhf_populora.sandbox import Executor
from openrlhf_populora.selfplay.advantages import whiten_by_group
from openrlhf_populora.selfplay.probe import PROBE_FILE, LearningMeter, Probe, build_probe
from openrlhf_populora.tasks import (
    COMPACT_TEMPLATES,
    DEFAULT_TEMPLATES,
    ProposalCheck,
    Seeder,
    Task,
    TaskBuffers,
    Verdict,
    check_proposals,
    proposer_prompt,
    render_raw,
    solver_prompt,
    verify_answers,
)
from openrlhf_populora.tasks.seeds import load_seed_file

log = logging.getLogger(__name__)


def step_rng(seed: int, step: int, purpose: str) -> random.Random:
    """A fresh RNG for one purpose at one step: reproducible, and independent of what ran before."""
    return random.Random(f"{seed}/{step}/{purpose}")


def step_seed(seed: int, step: int, purpose: str) -> int:
    return step_rng(seed, step, purpose).randrange(2**31)


@dataclass
class ProposalPlan:
    """One proposal to ask for: which teacher, which task type, and its prompt's context (references, or for
    code_f the program to study)."""

    teacher: Member
    task_type: str
    context: dict[str, Any]


@dataclass
class Proposal:
    teacher: str
    adapter: str
    task_type: str
    completion: Completion
    check: ProposalCheck
    solve_rates: dict[str, float] = field(default_factory=dict)  # matched student id -> solve rate
    reward: float = 0.0
    complexity: dict[str, Any] = field(default_factory=dict)


@dataclass
class Attempt:
    student: str
    adapter: str
    task: Task
    completion: Completion
    proposal: int | None  # index into the step's proposals; None for a task topped up from the buffers
    verdict: Verdict | None = None
    reward: float = 0.0


@dataclass
class StepOutput:
    """Everything a step produced, for metrics, problem archives and tests."""

    step: int
    proposals: list[Proposal]
    attempts: list[Attempt]
    matchups: list[Matchup]
    games: list[str]  # rating games of this step: "teacher", "student" or "draw" (who won)
    train_stats: dict[str, dict[str, float]]  # adapter -> the engine's training diagnostics
    trained: dict[str, str]  # adapter -> the member that trained in it this step (before evolution)
    evolution: list[dict[str, Any]]
    timings: dict[str, float]
    # (member id, role) -> update_size / probe_kl (metrics/learning.py), on the steps they are measured
    learning: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)


class SelfPlay:
    """Holds the run's state (population, ratings, buffers, archive, step) and runs steps on an engine."""

    def __init__(self, config: Config, engine: Engine, sandbox: Executor, run_dir: str | Path,
                 tracker: Tracker | None = None) -> None:
        self.config = config
        self.p = config.populora
        self.engine = engine
        self.sandbox = sandbox
        self.run_dir = Path(run_dir)
        self.tracker = tracker
        self.baseline = self.p.mode == "baseline"
        self.population = (Population.baseline() if self.baseline
                           else Population.create(self.p.num_teachers, self.p.num_students))
        self.ratings = make_ratings(self.p.rating)
        for member in self.population.alive():
            self.ratings.add(member.id)
        self.buffers = TaskBuffers(capacity=self.p.buffer_capacity)
        self.archive = CoverageArchive.create(self.run_dir / "archive", seed=0)
        self.step = 0
        self.evolution_pending = False  # the last step was due to evolve and did not (evolve_pending)
        self.templates = COMPACT_TEMPLATES if self.p.prompts == "compact" else DEFAULT_TEMPLATES
        self.on_phase: Callable[[str], None] | None = None  # told each phase as it starts (progress bars)
        # member ids that play but never train (the retention study's fixed opponent, studies/retention.py);
        # not part of the saved state: whoever freezes members sets this again after load_state
        self.frozen: set[str] = set()
        self._sampling = SamplingParams(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                                        max_new_tokens=config.rollout.max_new_tokens)
        self.probe: Probe | None = None  # the learning probe (selfplay/probe.py), built after seeding
        self._meter: LearningMeter | None = None

    # ---------------------------------------------------------------------------------------------
    # set-up

    def create_adapters(self) -> None:
        """One engine adapter per living member (fresh PEFT initialisation)."""
        existing = set(self.engine.adapter_names())
        for member in self.population.alive():
            if member.adapter not in existing:
                self.engine.add_adapter(member.adapter)

    def seed_buffers(self) -> dict[str, int]:
        """Fill the task buffers before step 1: a seed file, or proposals from the frozen base model.

        Starts from AZR's zero triplet (the identity function) and asks the base model (no adapter) for
        proposals until the buffers hold ``seed_tasks`` triplets and ``seed_tasks`` induction tasks, or
        ``seed_max_rounds`` rounds have run.
        """
        if self.p.seed_file:
            self.buffers = load_seed_file(self.p.seed_file, self.sandbox, capacity=self.p.buffer_capacity)
        else:
            seeder = Seeder(self.buffers, triplets=self.p.seed_tasks,
                            induction=self.p.seed_tasks if "code_f" in self.p.task_types else 0,
                            rng=step_rng(self.config.train.seed, 0, "seed"), references=self.p.references,
                            max_rounds=self.p.seed_max_rounds, timeout_s=self.p.sandbox.timeout_s,
                            templates=self.templates)
            batch = self.p.proposals_per_teacher * max(1, len(self.population.teachers()))
            while not seeder.done:
                requests = seeder.requests(batch)
                params = self._params(0, f"seed{seeder.rounds}")
                outputs = self.engine.generate(
                    [GenerationRequest(BASE_ADAPTER, self._render(r.prompt)) for r in requests], params)
                seeder.feed(requests, [out[0].text for out in outputs], self.sandbox)
        sizes = {tt: self.buffers.size(tt) for tt in self.p.task_types}
        log.info("seeded the task buffers: %s", sizes)
        if self.p.probe_size > 0:
            self.probe = self._build_probe()
        return sizes

    def _build_probe(self) -> Probe:
        """``probe_size`` proposer and solver prompts from the buffers (task types in turn), each answered once
        by the frozen base at the run's temperature and top-p 1 (so the probe KL is the tempered policies')."""
        rng = step_rng(self.config.train.seed, 0, "probe")
        types = list(self.p.task_types)
        teacher, student = [], []
        for i in range(self.p.probe_size):
            task_type = types[i % len(types)]
            context = self._proposer_context(task_type, rng)
            teacher.append(self._render(self._proposer_prompt(task_type, context)))
            tasks = self.buffers.tasks(task_type)
            if tasks:
                task = rng.choice(tasks)
                if task.task_type != task_type:  # a triplet played as the other triplet type
                    task = replace(task, task_type=task_type)
                student.append(self._render(solver_prompt(task, self.templates)))
        params = SamplingParams(self._sampling.temperature, 1.0, self._sampling.max_new_tokens,
                                seed=step_seed(self.config.train.seed, 0, "probe"))
        return build_probe(self.engine, {"teacher": teacher, "student": student}, params)

    def _learning_due(self, t: int) -> bool:
        return self.probe is not None and (t % self.p.probe_every == 0 or t == self.p.total_steps)

    def _measure_learning(self) -> dict[tuple[str, str], dict[str, float]]:
        """Each living member's update size and probe KL, in the roles it plays (metrics/learning.py)."""
        if self._meter is None:
            from openrlhf_populora.models.embedded import resolve_model

            lora = self.config.ds.lora
            self._meter = LearningMeter(self.engine, resolve_model(self.config.actor.model_name_or_path),
                                        lora.alpha / lora.rank)
        members = [(m.id, m.adapter, [r for r, plays in (("teacher", m.teaches), ("student", m.solves)) if plays])
                   for m in self.population.alive()]
        return self._meter.measure(self.probe, members)

    # ---------------------------------------------------------------------------------------------
    # one step

    def run_step(self) -> StepOutput:
        t = self.step + 1
        seed = self.config.train.seed
        timings: dict[str, float] = {}
        tic = time.perf_counter()

        # 1. match
        self._enter("match")
        matchups = self._match(t)
        timings["match"] = time.perf_counter() - tic

        # 2. propose
        self._enter("propose")
        tic = time.perf_counter()
        rng = step_rng(seed, t, "references")
        plans = [ProposalPlan(teacher, task_type, self._proposer_context(task_type, rng))
                 for task_type in self.p.task_types for teacher in self.population.teachers()
                 for _ in range(self.p.proposals_per_teacher)]
        requests = [GenerationRequest(plan.teacher.adapter, self._render(self._proposer_prompt(plan.task_type, plan.context)))
                    for plan in plans]
        generated = self.engine.generate(requests, self._params(t, "propose"))
        timings["generate_propose"] = time.perf_counter() - tic

        # 3. check
        self._enter("check")
        tic = time.perf_counter()
        proposals: list[Proposal] = [None] * len(plans)  # type: ignore[list-item]
        for task_type in self.p.task_types:
            index = [i for i, plan in enumerate(plans) if plan.task_type == task_type]
            if not index:
                continue
            programs = [plans[i].context.get("program") for i in index] if task_type == "code_f" else None
            checks = check_proposals(task_type, [generated[i][0].text for i in index], self.sandbox,
                                     programs=programs, proposer=[plans[i].teacher.id for i in index], step=t)
            for i, check in zip(index, checks, strict=True):
                teacher = plans[i].teacher
                proposals[i] = Proposal(teacher.id, teacher.adapter, task_type, generated[i][0], check)
        for proposal in proposals:
            if proposal.check.valid:
                self.buffers.add(proposal.check.task)
        timings["execute_check"] = time.perf_counter() - tic
        tic = time.perf_counter()
        self._measure_programs(proposals)
        timings["metrics"] = time.perf_counter() - tic

        # 4. solve
        self._enter("solve")
        tic = time.perf_counter()
        attempts = self._plan_attempts(t, matchups, proposals)
        unique: dict[tuple[str, str], list[int]] = defaultdict(list)  # (adapter, task key) -> attempt indices
        for i, attempt in enumerate(attempts):
            unique[(attempt.adapter, attempt.task.key())].append(i)
        groups = list(unique.values())
        requests = [GenerationRequest(attempts[g[0]].adapter,
                                      self._render(solver_prompt(attempts[g[0]].task, self.templates)), n=len(g))
                    for g in groups]
        outputs = self.engine.generate(requests, self._params(t, "solve"))
        for g, outs in zip(groups, outputs, strict=True):
            for i, completion in zip(g, outs, strict=True):
                attempts[i].completion = completion
        timings["generate_solve"] = time.perf_counter() - tic

        # 5. verify and reward
        self._enter("verify")
        tic = time.perf_counter()
        verdicts = verify_answers([a.task for a in attempts], [a.completion.text for a in attempts], self.sandbox)
        for attempt, verdict in zip(attempts, verdicts, strict=True):
            attempt.verdict = verdict
            attempt.reward = student_reward(verdict, self.p.reward)
        self._reward_teachers(proposals, attempts)
        timings["execute_verify"] = time.perf_counter() - tic

        # 6. train
        self._enter("train")
        tic = time.perf_counter()
        trajectories = self._trajectories(proposals, attempts)
        train_stats = self.engine.train_step(trajectories) if trajectories else {}
        trained = {adapter: self.population.member_in(adapter).id for adapter in train_stats}
        timings["train"] = time.perf_counter() - tic

        # 7. rate and evolve
        self._enter("evolve")
        tic = time.perf_counter()
        games = [] if self.baseline else self._rate(t, matchups, proposals)
        # never at the last step: a child made there would be exported without a single update (a resume that
        # extends the run makes it then: evolve_pending)
        due = not self.baseline and should_evolve(t, self.p.evolution)
        events = self._evolve(t) if due and t < self.p.total_steps else []
        self.evolution_pending = due and t >= self.p.total_steps
        timings["evolve"] = time.perf_counter() - tic

        # 8. how far each member has moved from the base (diagnostics only)
        learning = {}
        if self._learning_due(t):
            self._enter("probe")
            tic = time.perf_counter()
            learning = self._measure_learning()
            timings["probe"] = time.perf_counter() - tic

        self.step = t
        timings["step"] = sum(timings.values())
        return StepOutput(t, proposals, attempts, matchups, games, train_stats, trained, events, timings, learning)

    # ---------------------------------------------------------------------------------------------
    # pieces of a step

    def _enter(self, phase: str) -> None:
        if self.on_phase is not None:
            self.on_phase(phase)

    def _match(self, t: int) -> list[Matchup]:
        if self.baseline:
            return []
        return matchmake(self.population, self.ratings, self.p.task_types, self.p.matchmaking,
                         step_rng(self.config.train.seed, t, "match"), step=t)

    def _proposer_context(self, task_type: str, rng: random.Random) -> dict[str, Any]:
        """Keyword arguments of ``proposer_prompt``: K references, or for code_f one program to study."""
        if task_type == "code_f":
            return {"references": [], "program": self.buffers.induction_program(rng)}
        return {"references": self.buffers.references(task_type, self.p.references, rng)}

    def _proposer_prompt(self, task_type: str, context: dict[str, Any]) -> str:
        return proposer_prompt(task_type, **context, timeout_s=self.p.sandbox.timeout_s, templates=self.templates)

    def _measure_programs(self, proposals: list[Proposal]) -> None:
        """Complexity of every valid program, and the coverage archive (diagnostics, not rewards)."""
        valid = [pr for pr in proposals if pr.check.valid]
        for pr in valid:
            pr.complexity = program_complexity(pr.check.task.program)
        if valid:
            self.archive.add([{"program": pr.check.task.program, "inputs": pr.check.task.inputs,
                               "outputs": pr.check.task.outputs, "complexity": pr.complexity} for pr in valid],
                             teacher=[pr.teacher for pr in valid])

    def _render(self, user_text: str) -> str:
        """The model's chat template, or AZR's plain-text R1 conversation (for base models)."""
        if self.p.chat_template:
            return self.engine.render_prompt(user_text, chat_template=True)
        return render_raw(user_text)

    def _params(self, t: int, purpose: str) -> SamplingParams:
        return SamplingParams(self._sampling.temperature, self._sampling.top_p, self._sampling.max_new_tokens,
                              seed=step_seed(self.config.train.seed, t, purpose))

    def _plan_attempts(self, t: int, matchups: list[Matchup], proposals: list[Proposal]) -> list[Attempt]:
        """Which student answers which task: its matched teachers' valid tasks, topped up from the buffers with
        tasks those teachers proposed (this step or before) and seed tasks, so that no student ever trains on an
        unmatched teacher's task. The baseline's one member is its own teacher: it tops up from everything."""
        rng = step_rng(self.config.train.seed, t, "solver_batch")
        attempts: list[Attempt] = []
        n = self.p.solver_samples
        for task_type in self.p.task_types:
            if self.baseline:
                solver = self.population.alive()[0]
                assigned = {solver.id: [i for i, pr in enumerate(proposals)
                                        if pr.task_type == task_type and pr.check.valid]}
            else:
                assigned = defaultdict(list)
                for m in matchups:
                    if m.task_type != task_type:
                        continue
                    assigned[m.student] += [i for i, pr in enumerate(proposals)
                                            if pr.teacher == m.teacher and pr.task_type == task_type
                                            and pr.check.valid]
            for student in self.population.students():
                indices = assigned.get(student.id, [])
                tasks = [(proposals[i].check.task, i) for i in indices]
                missing = self.p.solver_tasks - len(tasks)
                if missing > 0:
                    teachers = None if self.baseline else {m.teacher for m in matchups
                                                           if m.student == student.id and m.task_type == task_type}
                    fill = self.buffers.solver_batch(task_type, missing, t, rng, window=self.p.recency_window,
                                                     proposers=teachers)
                    tasks += [(task, None) for task in fill]
                for task, index in tasks:
                    attempts += [Attempt(student.id, student.adapter, task, None, index)  # type: ignore[arg-type]
                                 for _ in range(n)]
        return attempts

    def _reward_teachers(self, proposals: list[Proposal], attempts: list[Attempt]) -> None:
        correct: dict[tuple[int, str], list[bool]] = defaultdict(list)
        for attempt in attempts:
            if attempt.proposal is not None:
                correct[(attempt.proposal, attempt.student)].append(bool(attempt.verdict.correct))
        for (index, student), results in correct.items():
            proposals[index].solve_rates[student] = fmean(results)
        mode = self.p.teacher_reward_mode()
        for proposal in proposals:
            rate = fmean(proposal.solve_rates.values()) if proposal.solve_rates else None
            proposal.reward = teacher_reward(proposal.check, rate, self.p.reward, mode=mode)

    def _trajectories(self, proposals: list[Proposal], attempts: list[Attempt]) -> list[Trajectory]:
        """Every scored completion of a member not in ``frozen``, its advantage whitened within its (member, role,
        task type) group."""
        scored = [(f"{pr.teacher}/propose/{pr.task_type}", pr.adapter, pr.completion, pr.reward) for pr in proposals
                  if pr.teacher not in self.frozen]
        scored += [(f"{a.student}/solve/{a.task.task_type}", a.adapter, a.completion, a.reward) for a in attempts
                   if a.student not in self.frozen]
        advantages = whiten_by_group([reward for *_, reward in scored], [group for group, *_ in scored])
        keep_zero = not self.p.skip_zero_advantage
        return [Trajectory(adapter, c.prompt_ids, c.response_ids, adv, group=group)
                for (group, adapter, c, _), adv in zip(scored, advantages, strict=True)
                if c.response_ids and (keep_zero or adv != 0.0)]

    def _rate(self, t: int, matchups: list[Matchup], proposals: list[Proposal]) -> list[str]:
        games: list[str] = []
        for m in matchups:
            rates = [pr.solve_rates[m.student] for pr in proposals
                     if pr.teacher == m.teacher and pr.task_type == m.task_type and m.student in pr.solve_rates]
            if rates:
                games += self.ratings.record_matchup(m.teacher, m.student, rates, step=t)
        return games

    def evolve_pending(self) -> list[dict[str, Any]]:
        """The evolution the run's last step left for later (``run_step``), when a resume has extended the
        run past that step: the same actions on the same state as a run this long from the start takes at that
        step. Returns the events (none when nothing is pending or the run does not go on)."""
        if not self.evolution_pending or self.step >= self.p.total_steps:
            return []
        self.evolution_pending = False
        return self._evolve(self.step)

    def apply_evolution(self, action: EvolutionAction, parents: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Make ``action``'s child with its operator from ``parents`` (the parents' adapter weights, aligned with
        ``action.parents``, best first) and install it in ``action.slot`` with a fresh optimizer state. Returns
        the operator's info for the lineage. The population and ratings are the caller's to update (``_evolve``:
        ``apply_plan``; the retention study: its child and opponent)."""
        from openrlhf_populora.evolution import apply_action

        child, info = apply_action(action, parents)
        self.engine.set_adapter(action.slot, child)
        return info

    def _evolve(self, t: int) -> list[dict[str, Any]]:
        actions = plan_evolution(self.population, self.ratings, t, self.p.evolution,
                                 seed=step_seed(self.config.train.seed, t, "evolve"))
        # read every parent before writing any child: a child may take the slot of another action's parent
        parents = {slot: self.engine.get_adapter(slot) for a in actions for slot in a.parent_adapters}
        infos = [self.apply_evolution(action, [parents[slot] for slot in action.parent_adapters])
                 for action in actions]
        apply_plan(self.population, self.ratings, actions, infos)
        return [{**action.to_dict(), "child": action.new_id, **{k: v for k, v in info.items() if _is_scalar(v)}}
                for action, info in zip(actions, infos, strict=True)]

    # ---------------------------------------------------------------------------------------------
    # state

    def save_state(self, directory: Path) -> None:
        """Everything needed to resume exactly (the engine writes adapters and optimizer states)."""
        self.engine.save_state(str(directory / "engine"))
        self.population.save(directory / "population.json")
        (directory / "ratings.json").write_text(self.ratings.to_json())
        self.buffers.save(directory / "buffers.jsonl")
        self.archive.save(directory / "archive")
        (directory / "loop.json").write_text(json.dumps({"step": self.step,
                                                         "evolution_pending": self.evolution_pending}))
        if self.probe is not None:
            self.probe.save(directory / PROBE_FILE)

    def load_state(self, directory: Path) -> None:
        self.engine.load_state(str(directory / "engine"))
        self.population = Population.load(directory / "population.json")
        self.ratings = Ratings.from_json((directory / "ratings.json").read_text())
        self.buffers = TaskBuffers.load(directory / "buffers.jsonl", capacity=self.p.buffer_capacity)
        self.archive = CoverageArchive.load(directory / "archive")
        state = json.loads((directory / "loop.json").read_text())
        self.step = state["step"]
        self.evolution_pending = bool(state.get("evolution_pending", False))  # older checkpoints: none pending
        # a checkpoint from before the probe existed (or with it off) resumes without one
        probe = directory / PROBE_FILE
        self.probe = Probe.load(probe) if probe.exists() and self.p.probe_size > 0 else None


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None
