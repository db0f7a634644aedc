"""``python -m openrlhf_populora.cli.retention``: do evolved children keep what their parents learned?

    python -m openrlhf_populora.cli.retention --run runs/signature --snapshots 10 20 30 40 --parents t0 \\
        --steps 50 --out runs/retention-t0
    python -m openrlhf_populora.cli.retention --run runs/signature --list      # checkpoints and their members

The operator retention study (the paper's Figs 6, 16 and 17). For every snapshot step S (a checkpoint of
``--run``, as the runner writes them under ``checkpoints/step_NNNNNN/``) and every operator:

1. **The child.** The operator is applied to the parents' weights in that checkpoint's engine state (member
   id -> adapter slot from its ``population.json``) by the function evolution itself uses
   (``evolution.apply_action``), with the run's ``populora.evolution.params`` and a seed derived from
   (``train.seed``, S, operator). A mutation takes the first parent; a crossover takes both, the first as the
   better one (``extrapolate`` steps past it, ``sv_splice`` keeps its top components). The second parent may
   come from another run at the same step (``OTHER_RUN_DIR:MEMBER``, e.g. a specialist trained on one task
   type); it must have the same base model, LoRA rank, alpha and target modules, and play the same role.
2. **Retraining.** ``--steps N`` self-play steps, global steps S+1 .. S+N, with the run's own settings
   (``config.yaml``: role, task types, learning rate at the checkpoint's position in its schedule -- the
   engine's update count is restored --, batch sizes, sampling, and the run's per-step seeds). The child sits
   in the first parent's adapter slot with a fresh AdamW state, as evolution leaves a child, and plays against
   ONE opponent of the other role from the same checkpoint (``--opponent``; default: that checkpoint's
   best-rated one by conservative rating), which is frozen (``SelfPlay.frozen``: it plays and is scored, it
   never trains), with evolution off: only the child changes. The task buffers, ratings and coverage archive
   are the checkpoint's. ``copy_parent`` always runs: it is the reference, the parent retrained the same way.
3. **Measures**, written into the child's own ``metrics.jsonl`` (``analysis/retention.py`` lists the keys): the
   child's game metrics at every step (a student's solve rate; a teacher's validity and teacher reward), and,
   at S (as made) and after every update, (a) the mean per-token log-prob under the child of K completions
   each parent sampled once at the snapshot on its own role's prompts (``--probe-samples K``; a retention
   measure that needs no weight space), and (b) the relative Frobenius distance of the child's summed LoRA
   deltas B A to each parent's.

Outputs in ``--out`` (layout: ``analysis/retention.py``): one run directory per child under
``children/step_NNNNNN/<operator>/``, then ``retention.md`` / ``retention.json`` (each operator's metric after
k steps as a fraction of copy_parent's with a 95% bootstrap interval over each step's answers and, for the
means, the snapshots; the number of seeds; and the retraining step from which it stays within
``--tolerance``), ``retention_grid.png`` (rows: operators, columns: snapshots; the parent's curve in its run in
grey, the child's in colour on the same global-step axis) and ``retention_measures.png``. ``cli/report.py
--retention DIR`` draws the same from the directory.

**Resuming.** Rerun the same command: finished children (``DONE``) are skipped, and a half-done child resumes
exactly from its last step, since every child checkpoints after every step (``checkpoints/``, the latest kept)
and its ``metrics.jsonl`` is cut back to that checkpoint, as ``cli.train --ckpt.load_enable`` resumes a run.
More snapshots or operators may be added to a study; a different run, parents, opponent, ``--steps`` or
``--probe-samples`` is refused. The run's checkpoints must stay until every child has started.

Runs on the local engine (CPU, or one GPU with ``--populora.device cuda``); a run written by the Ray engine
(DeepSpeed checkpoints) is refused. Exit status: 0 when every child ran, 2 on bad input (one line on stderr),
130 when interrupted (rerun to resume).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
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
    child_dir,
    delta_distance,
    distance_key,
    logprob_key,
    mean_token_logprob,
    member_metric_key,
    snapshot_dir,
)
from openrlhf_populora.cli.errors import InputError, OneLineParser
from openrlhf_populora.config import Config, config_from_dict
from openrlhf_populora.population.operators import (
    CROSSOVER_NAMES,
    FITNESS_AWARE,
    MUTATION_NAMES,
    canonical_operator,
    operator_code,
    operator_kind,
)

log = logging.getLogger("openrlhf_populora.retention")

PROBE_ADAPTER = "retention_probe"  # the temporary adapter slot a parent samples its probe from
OTHER_ROLE = {"teacher": "student", "student": "teacher"}
IDENTITY = ("run", "parents", "role", "opponent", "steps", "probe_samples")  # what a resumed study must repeat


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m openrlhf_populora.cli.retention", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="the run directory (config.yaml, checkpoints/)")
    parser.add_argument("--snapshots", type=int, nargs="+", metavar="STEP", help="checkpoint steps to start from")
    parser.add_argument("--parents", nargs="+", metavar="MEMBER",
                        help="one member id (mutations) or two (crossovers too); the second may be "
                             "OTHER_RUN_DIR:MEMBER, a member of another run at the same step")
    parser.add_argument("--operators", nargs="+", default=["all"], metavar="OP",
                        help="readable names or paper codes (M1-M6, X1-X9, copy_parent, linear_0_5); default all: "
                             "the mutations and copy_parent, and with two parents the crossovers and linear_0_5 "
                             "too; copy_parent (the reference) is always run")
    parser.add_argument("--steps", type=int, default=50, help="retraining steps per child")
    parser.add_argument("--out", type=Path, help="the study directory (created; rerun into it to resume)")
    parser.add_argument("--opponent", default=None, metavar="MEMBER",
                        help="the frozen opponent, a member of the other role alive at every snapshot "
                             "(default: the best-rated one of each snapshot)")
    parser.add_argument("--probe-samples", type=int, default=8, metavar="K",
                        help="completions each parent samples at a snapshot for the log-prob retention measure")
    parser.add_argument("--tolerance", type=float, default=0.1,
                        help="recovery: the child's metric >= copy_parent's - tolerance x |copy_parent's|")
    parser.add_argument("--smooth", type=int, default=5, help="trailing mean, in retraining steps, for the table")
    parser.add_argument("--at", type=int, nargs="+", default=None, metavar="K",
                        help="the table's retraining steps (default: 20 and --steps)")
    parser.add_argument("--populora.device", dest="device", choices=("cpu", "cuda"), default=None,
                        help="where the local engine runs (default: the run's)")
    parser.add_argument("--populora.num_threads", dest="num_threads", type=int, default=None,
                        help="torch threads (default: the run's)")
    parser.add_argument("--actor.model_name_or_path", dest="model", default=None,
                        help="the base model, when the run's is elsewhere on this machine (default: the run's)")
    parser.add_argument("--ds.param_dtype", dest="dtype", choices=("auto", "fp32", "bf16"), default=None,
                        help="the frozen base's dtype (default: the run's)")
    parser.add_argument("--list", action="store_true", help="list the run's checkpoints and living members, then exit")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


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


def make_plan(args: argparse.Namespace) -> Plan:
    """Every check before anything is written or loaded (InputError for bad input)."""
    source = load_source(args.run, "--run")
    for name, value in (("--steps", args.steps), ("--probe-samples", args.probe_samples), ("--smooth", args.smooth)):
        if value < 1:
            raise InputError(f"{name} must be >= 1, got {value}")
    if not 0 <= args.tolerance < 1:
        raise InputError(f"--tolerance must be in [0, 1), got {args.tolerance}")
    if args.num_threads is not None and args.num_threads < 0:
        raise InputError("--populora.num_threads must be >= 0")
    if not args.snapshots:
        raise InputError("--snapshots: give at least one checkpoint step (--list shows them)")
    if not args.parents:
        raise InputError("--parents: name one member (mutations) or two (crossovers too)")
    if args.out is None:
        raise InputError("--out: the study directory is required")
    parents = parse_parents(args.parents, source)
    operators = choose_operators(args.operators, len(parents))
    snapshots, role = [], None
    for step in sorted(set(args.snapshots)):
        snapshot, role = plan_snapshot(step, parents, args.opponent)
        unrated = [p.label for p, r in zip(parents, snapshot.ratings, strict=True) if r is None]
        for operator in FITNESS_AWARE.intersection(operators):
            if unrated and len(parents) == 2:
                raise InputError(f"--operators {operator} weighs the parents by rating, and {', '.join(unrated)} "
                                 f"has none at step {step}")
        snapshots.append(snapshot)
    config = source.config
    for attr, value in (("device", args.device), ("num_threads", args.num_threads)):
        if value is not None:
            setattr(config.populora, attr, value)
    if args.model is not None:
        config.actor.model_name_or_path = args.model
    if args.dtype is not None:
        config.ds.param_dtype = args.dtype
    plan = Plan(source, parents, role, operators, snapshots, args.out, args.steps, args.probe_samples, args.opponent)
    plan.settings = study_settings(plan, args)
    return plan


def study_settings(plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
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
    settings.update(tolerance=args.tolerance, smooth=args.smooth, at=args.at, metric=ROLE_METRICS[plan.role][0])
    return settings


# ------------------------------------------------------------------------------------------------- the study

def default_sandbox(config: Config):
    from openrlhf_populora.sandbox import Sandbox

    sb = config.populora.sandbox
    return Sandbox(workers=sb.workers, timeout_s=sb.timeout_s, memory_mb=sb.memory_mb, isolation=sb.isolation)


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
    """The run's config for one child's retraining: 1 teacher + 1 student, evolution off, its own directory."""
    from openrlhf_populora.config import WandbConfig

    config = copy.deepcopy(plan.config)
    p = config.populora
    p.evolution.enabled = False
    p.num_teachers = p.num_students = 1
    p.report = False
    config.ckpt.output_dir, config.ckpt.path = str(directory), ""
    config.ckpt.save_steps, config.ckpt.max_num, config.ckpt.load_enable = 1, 1, True
    config.logger.tensorboard_dir, config.logger.wandb = None, WandbConfig()
    return config


def start_child(plan: Plan, snapshot: SnapshotPlan, operator: str, loop, parent_weights: list[dict],
                probes: list[dict], directory: Path) -> None:
    """The child's first state, at step S: the snapshot's checkpoint with the child in the first parent's slot
    (fresh optimizer), the opponent, and no other adapter; its record at S and its checkpoint at S."""
    from openrlhf_populora.evolution import apply_action
    from openrlhf_populora.population import EvolutionAction, Member, Population
    from openrlhf_populora.selfplay.checkpoint import save_checkpoint
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
    child, info = apply_action(action, parent_weights[:len(parents)])
    loop.engine.set_adapter(slot, child)  # a fresh AdamW state, as evolution gives a child
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
    loop.tracker.truncate_after(step - 1)
    loop.tracker.log(step, measure(loop.engine, slot, parent_weights, probes))
    save_checkpoint(directory / "checkpoints", step, loop.save_state, max_num=1)


def run_child(plan: Plan, snapshot: SnapshotPlan, operator: str, engine, sandbox, parent_weights: list[dict],
              probes: list[dict], progress: bool) -> None:
    """Retrain one child to step S + N, from its start or from its last checkpoint; DONE when finished."""
    import yaml
    from tqdm.auto import tqdm

    from openrlhf_populora.metrics import Tracker
    from openrlhf_populora.selfplay.checkpoint import latest_checkpoint, save_checkpoint
    from openrlhf_populora.selfplay.loop import SelfPlay
    from openrlhf_populora.selfplay.summary import problem_records, step_metrics

    directory = child_dir(plan.out, snapshot.step, operator)
    directory.mkdir(parents=True, exist_ok=True)
    config = child_config(plan, directory)
    (directory / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    tracker = Tracker(directory, meta={"mode": "retention", "label": f"{operator}@{snapshot.step}"})
    end = snapshot.step + plan.steps
    try:
        loop = SelfPlay(config, engine, sandbox, directory, tracker)
        latest = latest_checkpoint(directory / "checkpoints")
        if latest is None:
            start_child(plan, snapshot, operator, loop, parent_weights, probes, directory)
        else:
            loop.load_state(latest)
            tracker.truncate_after(loop.step)
            print(f"[retention] step {snapshot.step} {operator}: resuming at step {loop.step}", flush=True)
        loop.frozen = {snapshot.opponent}
        slot = loop.population.get(CHILD_ID).adapter
        bar = tqdm(total=plan.steps, initial=loop.step - snapshot.step, disable=not progress, unit="step",
                   desc=f"{operator} @ {snapshot.step}", dynamic_ncols=True)
        try:
            while loop.step < end:
                output = loop.run_step()
                metrics = step_metrics(loop, output)
                metrics.update(measure(engine, slot, parent_weights, probes))
                tracker.log(output.step, metrics)
                tracker.log_problems(output.step, problem_records(output))
                save_checkpoint(directory / "checkpoints", loop.step, loop.save_state, max_num=1)
                bar.update(1)
        finally:
            bar.close()
        engine.save_adapter(slot, str(directory / "adapters" / CHILD_ID))
        (directory / DONE_FILE).write_text(f"{end}\n")
    finally:
        tracker.close()


def _lock(out: Path):
    """The study directory's lock, held for the process's lifetime (``dirlock``: flock, or an owner file where the
    filesystem has none)."""
    from openrlhf_populora.dirlock import DirectoryBusy, lock_directory

    try:
        return lock_directory(out)
    except DirectoryBusy as busy:
        if busy.stale:
            raise InputError(f"--out {out}: {busy}") from None
        raise InputError(f"--out {out}: another study is writing into it right now ({busy})") from None


def run_study(plan: Plan, engine_factory: Callable[[Config], Any] | None = None,
              sandbox_factory: Callable[[Config], Any] | None = None, progress: bool = True) -> int:
    """Run every child not yet finished, then write the table and figures. Returns an exit status. The engine
    is built only when some child still needs it."""
    from openrlhf_populora.analysis.retention import render_retention

    plan.out.mkdir(parents=True, exist_ok=True)
    lock = _lock(plan.out)  # noqa: F841 - released when the process exits
    _write_json(plan.out / STUDY_FILE, plan.settings)
    _write_json(plan.out / PARENTS_FILE, parent_curves(plan))
    engine = sandbox = None
    status = 0

    def on_sigterm(signum, frame):  # a scheduler's SIGTERM stops like Ctrl-C: every finished step is kept
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        for snapshot in plan.snapshots:
            todo = [op for op in plan.operators
                    if not (child_dir(plan.out, snapshot.step, op) / DONE_FILE).is_file()]
            for op in plan.operators:
                if op not in todo:
                    print(f"[retention] step {snapshot.step} {op}: finished, skipped", flush=True)
            if not todo:
                continue
            if engine is None:
                from openrlhf_populora.build import build_engine

                engine = (engine_factory or build_engine)(plan.config)
                sandbox = (sandbox_factory or default_sandbox)(plan.config)
                sandbox.__enter__()
            weights, probes = prepare_snapshot(plan, snapshot, engine)
            for op in todo:
                print(f"[retention] step {snapshot.step} {op}: retraining {plan.steps} steps against "
                      f"{snapshot.opponent} (frozen)", flush=True)
                run_child(plan, snapshot, op, engine, sandbox, weights, probes, progress)
    except KeyboardInterrupt:
        print(f"[retention] interrupted; rerun the same command to resume into {plan.out}", file=sys.stderr)
        status = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if sandbox is not None:
            sandbox.__exit__(None, None, None)
        if engine is not None:
            engine.close()
    result = render_retention(plan.out)
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print((plan.out / "retention.md").read_text(), end="")
    print("wrote " + ", ".join(str(p) for p in result.files))
    return status


def list_run(source: Source) -> None:
    """Each checkpoint's living members, with roles and conservative ratings."""
    from openrlhf_populora.population import Population, Ratings

    print(f"{source.path}: {len(source.checkpoints)} checkpoint(s)")
    for step, checkpoint in sorted(source.checkpoints.items()):
        population = Population.load(checkpoint / "population.json")
        ratings = Ratings.from_json((checkpoint / "ratings.json").read_text())
        members = [f"{m.id} ({m.role}, slot {m.adapter}, rating {ratings.conservative(m.id):.2f})"
                   if ratings.has(m.id) else f"{m.id} ({m.role}, slot {m.adapter})" for m in population.alive()]
        print(f"  step {step}: {', '.join(members)}")


def main(argv: list[str] | None = None, engine_factory: Callable[[Config], Any] | None = None,
         sandbox_factory: Callable[[Config], Any] | None = None) -> int:
    """The command line. ``engine_factory`` (default ``build.build_engine``) and ``sandbox_factory`` build
    the engine and sandbox from the run's config (tests pass scripted ones)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("POPULORA_LOG", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.list:
            list_run(load_source(args.run, "--run"))
            return 0
        plan = make_plan(args)
        return run_study(plan, engine_factory, sandbox_factory, progress=not args.quiet)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
