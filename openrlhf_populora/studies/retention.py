"""The operator retention study: do evolved children keep what their parents learned? (the paper's Figs 6, 16, 17)

For every snapshot (a checkpoint of a run) and operator, the child is made from the parents by the loop's own
``SelfPlay.apply_evolution`` and retrained through the runner (``runner.run_on`` with ``RunHooks``: its start, a
frozen opponent, the retention measures after every step); ``analysis/retention.py`` reads the study directory
back. ``cli/retention.py`` is its command line; the method and the outputs are in ``docs/usage.md``.
"""

from __future__ import annotations

import copy
import json
import signal
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openrlhf_populora.analysis.retention import (
    CHILD_FILE,
    CHILD_ID,
    DONE_FILE,
    PARENT_WEIGHTS_FILE,
    PARENTS_FILE,
    PROBE_FILE,
    REFERENCE,
    ROLE_METRICS,
    STUDY_FILE,
    RetentionResult,
    child_dir,
    delta_distance,
    distance_key,
    logprob_key,
    mean_token_logprob,
    member_metric_key,
    snapshot_dir,
)
from openrlhf_populora.config import Config, config_from_dict
from openrlhf_populora.errors import InputError
from openrlhf_populora.population.operators import (
    CROSSOVER_NAMES,
    FITNESS_AWARE,
    MUTATION_NAMES,
    canonical_operator,
    operator_code,
    operator_kind,
)

PROBE_ADAPTER = "retention_probe"  # the temporary adapter slot a parent samples its probe from
OTHER_ROLE = {"teacher": "student", "student": "teacher"}
IDENTITY = ("run", "parents", "role", "opponent", "steps", "probe_samples")  # what a resumed study must repeat


@dataclass
class Request:
    """What a study is asked to do: ``cli/retention.py``'s flags (the error messages name them), whose defaults
    are these."""

    run: Path
    snapshots: list[int] | None = None
    parents: list[str] | None = None
    operators: list[str] = field(default_factory=lambda: ["all"])
    steps: int = 50
    out: Path | None = None
    opponent: str | None = None
    probe_samples: int = 8
    tolerance: float = 0.1
    smooth: int = 5
    at: list[int] | None = None
    device: str | None = None  # where the local engine runs (default: the run's)
    num_threads: int | None = None
    model: str | None = None  # the base model, when the run's is elsewhere on this machine
    dtype: str | None = None  # the frozen base's dtype


# ------------------------------------------------------------------------------------------------- inputs

@dataclass
class Source:
    """A run directory with local-engine checkpoints."""

    path: Path
    config: Config
    checkpoints: dict[int, Path]

    def checkpoint(self, step: int, flag: str = "--snapshots") -> Path:
        if step not in self.checkpoints:
            have = ", ".join(map(str, sorted(self.checkpoints)))
            raise InputError(f"{flag} {step}: {self.path} has no checkpoint at step {step} (it has: {have})")
        return self.checkpoints[step]


def load_source(path: Path, flag: str) -> Source:
    """A run directory's config and complete checkpoints; InputError when it has none."""
    import yaml

    from openrlhf_populora.engines.local import STATE_FILE
    from openrlhf_populora.selfplay.checkpoint import checkpoint_step

    if not path.is_dir():
        raise InputError(f"{flag} {path}: no such directory")
    if not (path / "config.yaml").is_file():
        raise InputError(f"{flag} {path}: no config.yaml, not a run directory")
    try:
        config = config_from_dict(yaml.safe_load((path / "config.yaml").read_text()))
    except (ValueError, yaml.YAMLError, AttributeError) as err:
        raise InputError(f"{flag} {path}: unreadable config.yaml ({err})") from None
    root = path / "checkpoints"
    if not root.is_dir() and config.ckpt.path:
        root = Path(config.ckpt.path)
    checkpoints = {}
    for directory in sorted(root.glob("step_*")) if root.is_dir() else []:
        if (directory / "COMPLETE").is_file():
            checkpoints[checkpoint_step(directory)] = directory
    if not checkpoints:
        raise InputError(f"{flag} {path}: the run has no checkpoints (under {root}); it needs some: run it with "
                         f"--ckpt.save_steps N")
    if config.populora.mode == "baseline":
        raise InputError(f"{flag} {path}: a baseline run has one member playing both roles, so no opponent to "
                         f"retrain a child against; give a population run")
    if not all((c / "engine" / STATE_FILE).is_file() for c in checkpoints.values()):
        raise InputError(f"{flag} {path}: its checkpoints hold no local-engine state (engine/{STATE_FILE}); a run "
                         f"of the Ray engine (DeepSpeed checkpoints) cannot be studied")
    return Source(path.resolve(), config, checkpoints)


@dataclass
class Parent:
    source: Source
    member: str
    label: str  # "t0", or "<other run>:t0"


@dataclass
class SnapshotPlan:
    """What one snapshot's children need: the checkpoint, the parents' slots and ratings, the opponent."""

    step: int
    checkpoint: Path
    slots: list[str]  # each parent's adapter slot in its run's checkpoint
    ratings: list[float | None]  # each parent's conservative rating there
    opponent: str
    opponent_slot: str
    opponent_rating: float | None


@dataclass
class Plan:
    source: Source
    parents: list[Parent]
    role: str
    operators: list[str]
    snapshots: list[SnapshotPlan]
    out: Path
    steps: int
    probe_samples: int
    opponent: str | None
    settings: dict[str, Any] = field(default_factory=dict)  # study.json

    @property
    def config(self) -> Config:
        return self.source.config


def parse_parents(texts: list[str], main: Source) -> list[Parent]:
    if not 1 <= len(texts) <= 2:
        raise InputError(f"--parents takes one member (mutations) or two (crossovers), got {len(texts)}")
    parents = []
    for index, text in enumerate(texts):
        run_text, sep, member = text.rpartition(":")
        if not sep:
            parents.append(Parent(main, text, text))
            continue
        if index == 0:
            raise InputError(f"--parents {text}: the first parent is a member of --run (its settings retrain the "
                             f"child); only the second may come from another run")
        if not member:
            raise InputError(f"--parents {text}: expected OTHER_RUN_DIR:MEMBER")
        other = load_source(Path(run_text), "--parents")
        parents.append(Parent(main if other.path == main.path else other, member, text))
    if len(parents) == 2 and parents[0].source is parents[1].source and parents[0].member == parents[1].member:
        raise InputError(f"--parents names {parents[0].member} twice; a crossover needs two different parents")
    return parents


def choose_operators(names: list[str], parents: int) -> list[str]:
    """The operators to run, by readable name, copy_parent first; InputError for an unknown one, or for a
    crossover with one parent."""
    if [n.lower() for n in names] == ["all"]:
        chosen = list(MUTATION_NAMES) + (list(CROSSOVER_NAMES) if parents == 2 else [])
    else:
        chosen = []
        for name in names:
            try:
                canonical = canonical_operator(name)
            except ValueError as err:
                raise InputError(f"--operators: {err}") from None
            if operator_kind(canonical) == "crossover" and parents < 2:
                raise InputError(f"--operators {name}: {canonical} is a crossover and needs two parents; "
                                 f"--parents names one")
            chosen.append(canonical)
    ordered = [REFERENCE] + [op for op in chosen if op != REFERENCE]
    return list(dict.fromkeys(ordered))


def _living(population, role: str) -> str:
    return ", ".join(m.id for m in population.alive() if m.role == role) or "none"


def plan_snapshot(step: int, parents: list[Parent], opponent: str | None) -> tuple[SnapshotPlan, str]:
    """Check the parents and the opponent at one snapshot; returns the plan and the parents' role."""
    from openrlhf_populora.engines.local.state import read_state
    from openrlhf_populora.evolution.lowrank import check_adapters
    from openrlhf_populora.population import Population, Ratings

    slots, ratings, roles, weights, loras = [], [], [], [], []
    main_checkpoint = parents[0].source.checkpoint(step)
    for parent in parents:
        flag = "--snapshots" if parent is parents[0] else f"--parents {parent.label}: --snapshots"
        checkpoint = parent.source.checkpoint(step, flag)
        population = Population.load(checkpoint / "population.json")
        try:
            member = population.get(parent.member)
        except KeyError:
            raise InputError(f"--parents {parent.label}: no member {parent.member!r} in {parent.source.path} "
                             f"(living at step {step}: {', '.join(m.id for m in population.alive())})") from None
        if not member.alive:
            raise InputError(f"--parents {parent.label}: {member.id} is not alive at step {step} (retired at step "
                             f"{member.retired_step}); living {member.role}s there: {_living(population, member.role)}")
        rating_table = Ratings.from_json((checkpoint / "ratings.json").read_text())
        state = read_state(checkpoint / "engine")
        slots.append(member.adapter)
        roles.append(member.role)
        ratings.append(rating_table.conservative(member.id) if rating_table.has(member.id) else None)
        weights.append(state["weights"][member.adapter])
        loras.append((dict(state["lora"]), list(parent.source.config.ds.lora.target_modules),
                      parent.source.config.actor.model_name_or_path))
        if parent is parents[0]:
            main_population, main_ratings = population, rating_table
    if len(set(roles)) > 1:
        raise InputError(f"--parents: {parents[0].label} is a {roles[0]} and {parents[1].label} a {roles[1]}; the "
                         f"parents of a child play one role")
    if len(parents) == 2:
        (lora0, targets0, model0), (lora1, targets1, model1) = loras
        for what, a, b in (("LoRA rank/alpha", lora0, lora1), ("LoRA target modules", targets0, targets1),
                           ("base model", model0, model1)):
            if a != b:
                raise InputError(f"incompatible parents: {what} {a} for {parents[0].label}, {b} for {parents[1].label}")
        try:
            check_adapters(weights)
        except ValueError as err:
            raise InputError(f"incompatible parents at step {step}: {err}") from None
    role = roles[0]
    other = OTHER_ROLE[role]
    candidates = [m for m in main_population.alive() if m.role == other]
    if not candidates:
        raise InputError(f"no living {other} at step {step} to retrain against")
    if opponent is not None:
        chosen = next((m for m in candidates if m.id == opponent), None)
        if chosen is None:
            raise InputError(f"--opponent {opponent}: not a living {other} at step {step} (living {other}s: "
                             f"{_living(main_population, other)})")
    else:
        chosen = max(candidates, key=lambda m: (main_ratings.conservative(m.id) if main_ratings.has(m.id)
                                                else float("-inf"), m.id))
    rating = main_ratings.conservative(chosen.id) if main_ratings.has(chosen.id) else None
    return SnapshotPlan(step, main_checkpoint, slots, ratings, chosen.id, chosen.adapter, rating), role


def make_plan(request: Request) -> Plan:
    """Every check before anything is written or loaded (InputError for bad input)."""
    source = load_source(request.run, "--run")
    for name, value in (("--steps", request.steps), ("--probe-samples", request.probe_samples),
                        ("--smooth", request.smooth)):
        if value < 1:
            raise InputError(f"{name} must be >= 1, got {value}")
    if not 0 <= request.tolerance < 1:
        raise InputError(f"--tolerance must be in [0, 1), got {request.tolerance}")
    if request.num_threads is not None and request.num_threads < 0:
        raise InputError("--populora.num_threads must be >= 0")
    if not request.snapshots:
        raise InputError("--snapshots: give at least one checkpoint step (--list shows them)")
    if not request.parents:
        raise InputError("--parents: name one member (mutations) or two (crossovers too)")
    if request.out is None:
        raise InputError("--out: the study directory is required")
    parents = parse_parents(request.parents, source)
    operators = choose_operators(request.operators, len(parents))
    snapshots, role = [], None
    for step in sorted(set(request.snapshots)):
        snapshot, role = plan_snapshot(step, parents, request.opponent)
        unrated = [p.label for p, r in zip(parents, snapshot.ratings, strict=True) if r is None]
        for operator in FITNESS_AWARE.intersection(operators):
            if unrated and len(parents) == 2:
                raise InputError(f"--operators {operator} weighs the parents by rating, and {', '.join(unrated)} "
                                 f"has none at step {step}")
        snapshots.append(snapshot)
    config = source.config
    for attr, value in (("device", request.device), ("num_threads", request.num_threads)):
        if value is not None:
            setattr(config.populora, attr, value)
    if request.model is not None:
        config.actor.model_name_or_path = request.model
    if request.dtype is not None:
        config.ds.param_dtype = request.dtype
    plan = Plan(source, parents, role, operators, snapshots, request.out, request.steps, request.probe_samples,
                request.opponent)
    plan.settings = study_settings(plan, request)
    return plan


def study_settings(plan: Plan, request: Request) -> dict[str, Any]:
    """study.json: the identity of the study (a resume must repeat it), the snapshots and operators run so far,
    and the table's settings (the latest invocation's)."""
    previous: dict[str, Any] = {}
    path = plan.out / STUDY_FILE
    if path.is_file():
        try:
            previous = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise InputError(f"--out {plan.out}: unreadable {STUDY_FILE} ({err})") from None
    elif plan.out.exists() and (not plan.out.is_dir() or any(plan.out.iterdir())):
        raise InputError(f"--out {plan.out}: not empty and not a retention study; choose another directory")
    settings = {
        "version": 1,
        "run": str(plan.source.path),
        "parents": [{"run": str(p.source.path), "member": p.member, "label": p.label} for p in plan.parents],
        "role": plan.role,
        "opponent": plan.opponent,
        "steps": plan.steps,
        "probe_samples": plan.probe_samples,
    }
    for key in IDENTITY:
        if previous and previous.get(key) != settings[key]:
            raise InputError(f"--out {plan.out} holds a study with {key} {previous.get(key)!r}, not "
                             f"{settings[key]!r}; rerun it with the same settings to resume, or choose another --out")
    settings["snapshots"] = sorted(set(previous.get("snapshots", [])) | {s.step for s in plan.snapshots})
    settings["operators"] = list(dict.fromkeys([*previous.get("operators", []), *plan.operators]))
    settings.update(tolerance=request.tolerance, smooth=request.smooth, at=request.at,
                    metric=ROLE_METRICS[plan.role][0])
    return settings


# ------------------------------------------------------------------------------------------------- the study

def parent_curves(plan: Plan) -> dict[str, Any]:
    """Each parent's role metrics over its run's steps (parents.json), read again at every invocation."""
    from openrlhf_populora.analysis.runs import load_run

    out = []
    for parent in plan.parents:
        run = load_run(parent.source.path)
        series = {}
        for metric in ROLE_METRICS[plan.role]:
            xs, ys = run.series(member_metric_key(parent.member, plan.role, metric))
            series[metric] = [[int(x), float(y)] for x, y in zip(xs, ys, strict=True)]
        out.append({"run": str(parent.source.path), "member": parent.member, "label": parent.label, "series": series})
    return {"parents": out}


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def probe_prompts(engine, config: Config, buffers, role: str, count: int, rng) -> list[tuple[str, str]]:
    """``count`` prompts of ``role``'s own kind, spread over the run's task types: (task type, rendered prompt)."""
    from openrlhf_populora.tasks import (
        COMPACT_TEMPLATES,
        DEFAULT_TEMPLATES,
        proposer_prompt,
        render_raw,
        solver_prompt,
    )

    p = config.populora
    templates = COMPACT_TEMPLATES if p.prompts == "compact" else DEFAULT_TEMPLATES
    prompts = []
    for index in range(count):
        task_type = p.task_types[index % len(p.task_types)]
        if role == "teacher":
            if task_type == "code_f":
                program = buffers.induction_program(rng)
                if program is None:
                    continue
                context: dict[str, Any] = {"references": [], "program": program}
            else:
                context = {"references": buffers.references(task_type, p.references, rng)}
            text = proposer_prompt(task_type, **context, timeout_s=p.sandbox.timeout_s, templates=templates)
        else:
            pool = buffers.tasks(task_type)
            if not pool:
                continue
            text = solver_prompt(rng.choice(pool), templates)
        prompts.append((task_type, engine.render_prompt(text, chat_template=True) if p.chat_template
                        else render_raw(text)))
    return prompts


def sample_probe(engine, parent: Parent, step: int, weights, role: str, count: int) -> dict[str, Any]:
    """The parent's ``count`` completions on its role's prompts at ``step`` (its run's buffers and sampling), with
    their per-token log-probs under the parent itself (the reference of the log-prob measure)."""
    from openrlhf_populora.engines.base import GenerationRequest, SamplingParams, Trajectory
    from openrlhf_populora.selfplay.loop import step_rng, step_seed
    from openrlhf_populora.tasks import TaskBuffers

    config = parent.source.config
    buffers = TaskBuffers.load(parent.source.checkpoint(step) / "buffers.jsonl",
                               capacity=config.populora.buffer_capacity)
    prompts = probe_prompts(engine, config, buffers, role, count, step_rng(config.train.seed, step, "retention/probe"))
    samples: list[dict[str, Any]] = []
    if prompts:
        params = SamplingParams(config.rollout.temperature, config.rollout.top_p, config.rollout.max_new_tokens,
                                seed=step_seed(config.train.seed, step, "retention/probe"))
        engine.add_adapter(PROBE_ADAPTER, weights)
        try:
            outputs = engine.generate([GenerationRequest(PROBE_ADAPTER, prompt) for _, prompt in prompts], params)
            completions = [(task_type, out[0]) for (task_type, _), out in zip(prompts, outputs, strict=True)
                           if out[0].response_ids]
            logprobs = engine.token_log_probs([Trajectory(PROBE_ADAPTER, c.prompt_ids, c.response_ids, 0.0)
                                               for _, c in completions]) if completions else []
        finally:
            engine.remove_adapter(PROBE_ADAPTER)
        samples = [{"task_type": task_type, "prompt_ids": c.prompt_ids, "response_ids": c.response_ids,
                    "text": c.text, "logprob": mean_token_logprob([lp])}
                   for (task_type, c), lp in zip(completions, logprobs, strict=True)]
        reference = mean_token_logprob(logprobs)
    else:
        reference = None
    return {"run": str(parent.source.path), "member": parent.member, "label": parent.label, "step": step,
            "logprob": reference, "samples": samples}


def prepare_snapshot(plan: Plan, snapshot: SnapshotPlan, engine) -> tuple[list[dict], list[dict]]:
    """The parents' weights and probes of one snapshot: made once (``snapshots/step_NNNNNN/``), then read."""
    import torch

    from openrlhf_populora.engines.local.state import read_state

    directory = snapshot_dir(plan.out, snapshot.step)
    if (directory / PROBE_FILE).is_file() and (directory / PARENT_WEIGHTS_FILE).is_file():
        weights = torch.load(directory / PARENT_WEIGHTS_FILE, map_location="cpu", weights_only=True)
        return weights, json.loads((directory / PROBE_FILE).read_text())["parents"]
    weights = [read_state(p.source.checkpoint(snapshot.step) / "engine")["weights"][slot]
               for p, slot in zip(plan.parents, snapshot.slots, strict=True)]
    probes = [sample_probe(engine, p, snapshot.step, w, plan.role, plan.probe_samples)
              for p, w in zip(plan.parents, weights, strict=True)]
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (PARENT_WEIGHTS_FILE + ".tmp")
    torch.save(weights, tmp)
    tmp.replace(directory / PARENT_WEIGHTS_FILE)
    _write_json(directory / PROBE_FILE, {"opponent": snapshot.opponent, "parents": probes})  # written last: the mark
    return weights, probes


def measure(engine, slot: str, parent_weights: list[dict], probes: list[dict]) -> dict[str, float | None]:
    """The retention measures of the child in ``slot``: per parent, the delta distance and the log-prob of the
    parent's probe samples."""
    from openrlhf_populora.engines.base import Trajectory

    child = engine.get_adapter(slot)
    out: dict[str, float | None] = {}
    for index, (weights, probe) in enumerate(zip(parent_weights, probes, strict=True)):
        out[distance_key(index)] = delta_distance(child, weights)
        trajectories = [Trajectory(slot, s["prompt_ids"], s["response_ids"], 0.0) for s in probe["samples"]]
        out[logprob_key(index)] = mean_token_logprob(engine.token_log_probs(trajectories)) if trajectories else None
    return out


def child_config(plan: Plan, directory: Path) -> Config:
    """The run's config for one child's retraining: 1 teacher + 1 student, evolution off, its own directory,
    a checkpoint after every step (the latest kept). ``populora.total_steps`` stays the run's: the learning-rate
    schedule spans it (the child stops at S + N by ``RunHooks.last_step``)."""
    from openrlhf_populora.config import WandbConfig

    config = copy.deepcopy(plan.config)
    p = config.populora
    p.evolution.enabled = False
    p.num_teachers = p.num_students = 1
    p.report = False
    config.ckpt.output_dir, config.ckpt.path = str(directory), ""
    config.ckpt.save_steps, config.ckpt.max_num, config.ckpt.load_enable = 1, 1, True
    config.ckpt.keep_every = 0
    config.logger.tensorboard_dir, config.logger.wandb = None, WandbConfig()
    return config


def start_child(plan: Plan, snapshot: SnapshotPlan, operator: str, loop, parent_weights: list[dict],
                probes: list[dict], directory: Path) -> None:
    """The child's first state, at step S (the runner's ``start``; the runner checkpoints it): the snapshot's
    checkpoint with the child in the first parent's slot (fresh optimizer), the opponent, and no other adapter;
    its record at S."""
    from openrlhf_populora.population import EvolutionAction, Member, Population
    from openrlhf_populora.selfplay.loop import step_seed

    step, slot = snapshot.step, snapshot.slots[0]
    loop.load_state(snapshot.checkpoint)
    opponent = loop.population.get(snapshot.opponent)
    params: dict[str, Any] = plan.config.populora.evolution.params.for_operator(operator)
    if operator in FITNESS_AWARE:
        params["fitness"] = list(snapshot.ratings)  # checked by make_plan: every parent is rated
    parents = plan.parents if operator_kind(operator) == "crossover" else plan.parents[:1]
    seed = step_seed(plan.config.train.seed, step, f"retention/{operator}")
    action = EvolutionAction(step=step, slot=slot, replaced=plan.parents[0].member, new_id=CHILD_ID, role=plan.role,
                             operator=operator, parents=tuple(p.label for p in parents),
                             parent_adapters=tuple(snapshot.slots[:len(parents)]), seed=seed, params=params)
    info = loop.apply_evolution(action, parent_weights[:len(parents)])  # as evolution makes and installs a child
    for name in loop.engine.adapter_names():
        if name not in (slot, opponent.adapter):
            loop.engine.remove_adapter(name)
    scalars = {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool)) or v is None}
    loop.population = Population([
        Member(CHILD_ID, plan.role, slot, birth_step=step, parents=[p.label for p in parents], operator=operator,
               op_seed=seed, info=scalars),
        Member(**asdict(opponent)),
    ])
    if loop.ratings.has(plan.parents[0].member):
        loop.ratings.add_child(CHILD_ID, [plan.parents[0].member], step=step)
    else:
        loop.ratings.add(CHILD_ID, step=step)
    _write_json(directory / CHILD_FILE, {
        "operator": operator, "operator_code": operator_code(operator), "kind": operator_kind(operator),
        "snapshot": step, "steps": plan.steps, "role": plan.role, "child_id": CHILD_ID, "slot": slot,
        "parents": [{"run": str(p.source.path), "member": p.member, "label": p.label, "slot": s, "rating": r}
                    for p, s, r in zip(plan.parents, snapshot.slots, snapshot.ratings, strict=True)],
        "opponent": {"id": opponent.id, "role": opponent.role, "slot": opponent.adapter,
                     "rating": snapshot.opponent_rating},
        "seed": seed, "params": params, "info": scalars, "source_checkpoint": str(snapshot.checkpoint),
    })
    loop.tracker.truncate_after(step - 1)  # a start that stopped before its checkpoint may have logged step S
    loop.tracker.log(step, measure(loop.engine, slot, parent_weights, probes))


def run_child(plan: Plan, snapshot: SnapshotPlan, operator: str, engine, sandbox, parent_weights: list[dict],
              probes: list[dict], progress: bool) -> int:
    """Retrain one child to step S + N through the runner, from its start or from its last checkpoint; DONE when
    finished. Returns the runner's status: 130 when a signal stopped it (its last step checkpointed)."""
    import yaml

    from openrlhf_populora.selfplay.checkpoint import checkpoint_step, latest_checkpoint
    from openrlhf_populora.selfplay.runner import RunHooks, run_on

    directory = child_dir(plan.out, snapshot.step, operator)
    directory.mkdir(parents=True, exist_ok=True)
    config = child_config(plan, directory)
    (directory / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    latest = latest_checkpoint(config.checkpoint_dir)
    if latest is not None:
        _say(f"[retention] step {snapshot.step} {operator}: resuming at step {checkpoint_step(latest)}")
    slot, end = snapshot.slots[0], snapshot.step + plan.steps

    def freeze_the_opponent(loop) -> None:  # SelfPlay.frozen is not in a checkpoint: set again on every resume
        loop.frozen = {snapshot.opponent}

    hooks = RunHooks(
        start=lambda loop: start_child(plan, snapshot, operator, loop, parent_weights, probes, directory),
        ready=freeze_the_opponent,
        on_step=lambda loop, output: measure(loop.engine, slot, parent_weights, probes),
        last_step=end,
        meta={"mode": "retention", "label": f"{operator}@{snapshot.step}"})
    status = run_on(engine, config, lambda: nullcontext(sandbox), progress, hooks)  # the study owns both
    if status == 0:  # the runner exported the child's adapter (adapters/child/) with its run's files
        (directory / DONE_FILE).write_text(f"{end}\n")
    return status


def lock_study(out: Path):
    """The study directory's lock, held while the study writes there (``dirlock``, as the runner locks a run)."""
    from openrlhf_populora.dirlock import DirectoryBusy, claim_directory

    try:
        return claim_directory(out, "--out", "study")
    except DirectoryBusy as busy:
        raise InputError(str(busy)) from None


@dataclass
class Outcome:
    """What :func:`run_study` did: its exit status (0, or 130 when interrupted) and the table and figures."""

    status: int
    rendered: RetentionResult  # the files written, and what the table left out


def run_study(plan: Plan, engine_factory: Callable[[Config], Any] | None = None,
              sandbox_factory: Callable[[Config], Any] | None = None, progress: bool = True) -> Outcome:
    """Run every child not yet finished, then write the table and figures. The engine is built only when some
    child still needs it, once for all of them (``engine_factory``, default ``build.build_engine``; tests pass
    scripted ones), and so is the sandbox. A failing child raises the runner's ``RunFailed``."""
    from openrlhf_populora.analysis.retention import render_retention

    plan.out.mkdir(parents=True, exist_ok=True)
    with lock_study(plan.out):
        _write_json(plan.out / STUDY_FILE, plan.settings)
        _write_json(plan.out / PARENTS_FILE, parent_curves(plan))
        status = _run_children(plan, engine_factory, sandbox_factory, progress)
        return Outcome(status, render_retention(plan.out))


def _interrupt(signum, frame):  # between children a scheduler's SIGTERM stops like Ctrl-C (the runner defers both)
    raise KeyboardInterrupt


def _run_children(plan: Plan, engine_factory, sandbox_factory, progress: bool) -> int:
    from openrlhf_populora.selfplay.runner import default_sandbox

    engine = sandbox = None
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for snapshot in plan.snapshots:
            todo = [op for op in plan.operators
                    if not (child_dir(plan.out, snapshot.step, op) / DONE_FILE).is_file()]
            for op in plan.operators:
                if op not in todo:
                    _say(f"[retention] step {snapshot.step} {op}: finished, skipped")
            if not todo:
                continue
            if engine is None:
                from openrlhf_populora.build import build_engine

                engine = (engine_factory or build_engine)(plan.config)
                sandbox = (sandbox_factory or default_sandbox)(plan.config)
                sandbox.__enter__()
            weights, probes = prepare_snapshot(plan, snapshot, engine)
            for op in todo:
                _say(f"[retention] step {snapshot.step} {op}: retraining {plan.steps} steps against "
                     f"{snapshot.opponent} (frozen)")
                if run_child(plan, snapshot, op, engine, sandbox, weights, probes, progress) != 0:
                    return 130
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if sandbox is not None:
            sandbox.__exit__(None, None, None)
        if engine is not None:
            engine.close()


def describe_run(source: Source) -> list[str]:
    """Each checkpoint's living members, with roles and conservative ratings: one line each."""
    from openrlhf_populora.population import Population, Ratings

    lines = [f"{source.path}: {len(source.checkpoints)} checkpoint(s)"]
    for step, checkpoint in sorted(source.checkpoints.items()):
        population = Population.load(checkpoint / "population.json")
        ratings = Ratings.from_json((checkpoint / "ratings.json").read_text())
        members = [f"{m.id} ({m.role}, slot {m.adapter}, rating {ratings.conservative(m.id):.2f})"
                   if ratings.has(m.id) else f"{m.id} ({m.role}, slot {m.adapter})" for m in population.alive()]
        lines.append(f"  step {step}: {', '.join(members)}")
    return lines


def _say(text: str) -> None:
    print(text, flush=True)
