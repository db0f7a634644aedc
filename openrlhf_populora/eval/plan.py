"""The plan of an evaluation from its command line (``cli/evaluate.py``): which members to evaluate, grouped
(base, PopuLoRA baseline, stock full models, other arms, population), on which base model, into which directory; the prompt
templates; the published scores to check against; the benchmarks' problems to grade; and which engine generates
for which members. Bad input raises ``ValueError`` with a message naming the flag.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

from openrlhf_populora.eval.benchmarks import BENCHMARKS, benchmark_key, sample_problems
from openrlhf_populora.eval.evaluator import EvalSettings
from openrlhf_populora.eval.members import (
    BASE_MEMBER,
    SOLVER_ROLES,
    STOCK_ROLE,
    EvalMember,
    check_model_dir,
    load_run_members,
    same_model,
    select_members,
)
from openrlhf_populora.eval.problems import CODE, Problem
from openrlhf_populora.eval.prompts import model_has_chat_template, resolve_templates
from openrlhf_populora.eval.published import (
    PUBLISHED,
    PublishedScore,
    check_published,
    find_published,
    is_shipped_gguf,
)

BASELINE_PREFIX = "baseline-"  # baseline members are named baseline-<id> in results
MODEL_USAGE = "--model NAME=DIR"
ARM_USAGE = "--arm NAME=RUN_DIR"


def _adapter_members(specs: list[str]) -> list[EvalMember]:
    members = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapter {spec!r}: expected NAME=DIR")
        if not (Path(path) / "adapter_config.json").is_file():
            raise ValueError(f"--adapter {spec!r}: {Path(path) / 'adapter_config.json'} not found (not a PEFT adapter)")
        members.append(EvalMember(name, Path(path)))
    return members


def _named_path(flag: str, spec: str, usage: str, what: str, seen: list[str]) -> tuple[str, str]:
    """``NAME=PATH`` of a repeatable flag: a NAME fit for member names (no '/', no outer spaces) not in ``seen``
    (the flag's earlier names), and a PATH (``what`` it should be, for the message)."""
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{flag} {spec!r}: expected {usage} (a name for the table, then {what})")
    if name != name.strip() or "/" in name:
        raise ValueError(f"{flag} {spec!r}: NAME may not contain '/' or begin or end with spaces")
    if name in seen:
        raise ValueError(f"{flag} {spec!r}: the name {name!r} is given twice")
    return name, path


def _model_members(specs: list[str], taken: set[str]) -> list[EvalMember]:
    """The full models of ``--model NAME=DIR``, each checked to be an HF model directory; ``taken``: the member
    ids of ``--run`` and the ``--adapter`` names (a full model may not share one)."""
    members: list[EvalMember] = []
    for spec in specs:
        name, path = _named_path("--model", spec, MODEL_USAGE, "the model directory", [m.name for m in members])
        if name == BASE_MEMBER or name.startswith(BASELINE_PREFIX):
            raise ValueError(f"--model {spec!r}: the name {name!r} is reserved ({BASE_MEMBER!r} is the base model, "
                             f"{BASELINE_PREFIX}<id> the baseline's members); pick another NAME")
        if name in taken:
            raise ValueError(f"--model {spec!r}: the name {name!r} is already a member's (a member id of --run, or "
                             "an --adapter name); pick another NAME (samples are stored by name)")
        try:
            check_model_dir(Path(path))
        except ValueError as exc:
            raise ValueError(f"--model {spec!r}: {exc}") from None
        members.append(EvalMember(name, None, STOCK_ROLE, model_dir=Path(path)))
    return members


def _arm_specs(specs: list[str]) -> list[tuple[str, Path]]:
    """``--arm NAME=RUN_DIR`` -> (NAME, RUN_DIR), each NAME usable as a prefix of member names."""
    arms: list[tuple[str, Path]] = []
    for spec in specs:
        name, path = _named_path("--arm", spec, ARM_USAGE, "a run directory", [n for n, _ in arms])
        if name in (BASE_MEMBER, BASELINE_PREFIX.rstrip("-")):
            raise ValueError(f"--arm {spec!r}: the name {name!r} is reserved; pick another NAME")
        arms.append((name, Path(path)))
    return arms


def _resolve(base_model: str) -> str:
    from openrlhf_populora.models.embedded import resolve_model

    return resolve_model(base_model)


class Plan(NamedTuple):
    base_model: str | None  # resolved: a local HF directory (None: only full models, --model, are evaluated)
    groups: dict[str, list[EvalMember]]  # base / baseline / stock / arm / population
    out: Path
    sources: dict[str, bool | None]  # each source of adapters -> populora.chat_template of its training
    model_name: str | None  # the base model as named (--base-model or the run's), before resolving
    untrained: dict[str, str]  # member -> why it never took an update (evaluated or, without
    # --include-untrained, left out)


def plan(args: argparse.Namespace) -> Plan:
    """The resolved base model, members per group, output directory and adapter sources of a command line."""
    groups: dict[str, list[EvalMember]] = {"base": [], "baseline": [], "population": []}  # + "stock" with --model
    sources: dict[str, bool | None] = {}
    taken: set[str] = set()  # every member id of --run (selected or not) and every --adapter name
    base_model: str | None
    untrained: dict[str, str] = {}
    if args.run:
        run = load_run_members(args.run, args.base_model)
        base_model = run.base_model
        groups["population"] = _drop_untrained(select_members(run.members, args.members), args, untrained)
        default_out = run.run_dir / "eval"
        sources[f"--run {args.run}"] = run.chat_template
        taken.update(m.name for m in run.members)
    elif args.adapter or args.base:
        if not args.base_model:
            raise ValueError("--adapter/--base without --run needs --base-model")
        base_model, default_out = args.base_model, None
    elif args.model:
        base_model, default_out = args.base_model, None  # full models are their own base
    else:
        raise ValueError("nothing to evaluate: pass --run RUN_DIR (or --base-model with --adapter NAME=DIR / --base, "
                         f"or {MODEL_USAGE})")
    adapters = _adapter_members(args.adapter)
    groups["population"] += adapters
    sources.update({f"--adapter {m.name}": None for m in adapters})  # how a bare adapter was trained is unknown
    taken.update(m.name for m in adapters)
    resolved = _resolve(base_model) if base_model else None
    if args.baseline:
        baseline = load_run_members(args.baseline, args.base_model)
        if resolved is None:  # --model and --baseline without --run: the baseline's base model
            base_model, resolved = baseline.base_model, _resolve(baseline.base_model)
        elif not same_model(_resolve(baseline.base_model), resolved):
            raise ValueError(f"--baseline {args.baseline} was trained on {baseline.base_model!r} but --run on "
                             f"{base_model!r}: compare runs of the same base model.")
        groups["baseline"] = _drop_untrained([EvalMember(BASELINE_PREFIX + m.name, m.adapter_dir, m.role, m.rating,
                                                         untrained=m.untrained) for m in baseline.members],
                                             args, untrained)
        sources[f"--baseline {args.baseline}"] = baseline.chat_template
    for name, run_dir in _arm_specs(args.arm):  # another arm's solvers (students, or its single agent): a row each
        arm = load_run_members(run_dir, args.base_model)
        if resolved is None:
            raise ValueError(f"--arm {name}={run_dir} needs --run or --baseline (the model its rows stand beside)")
        if not same_model(_resolve(arm.base_model), resolved):
            raise ValueError(f"--arm {name}={run_dir} was trained on {arm.base_model!r} but --run on "
                             f"{base_model!r}: compare runs of the same base model.")
        solvers = [m for m in arm.members if m.role in SOLVER_ROLES] or arm.members  # no roles known: every one
        groups.setdefault("arm", []).extend(_drop_untrained(
            [EvalMember(f"{name}-{m.name}", m.adapter_dir, m.role, m.rating, untrained=m.untrained)
             for m in solvers], args, untrained))
        sources[f"--arm {name}"] = arm.chat_template
    stock = _model_members(args.model, taken)
    if stock:
        groups["stock"] = stock
    if args.base:
        groups["base"] = [EvalMember(BASE_MEMBER, None, "base")]
    names = [m.name for ms in groups.values() for m in ms]
    if len(set(names)) != len(names):
        raise ValueError(f"member names collide: {names}")
    out = Path(args.out) if args.out else default_out
    if out is None:
        raise ValueError("pass --out DIR when evaluating without --run")
    return Plan(resolved, groups, out, sources, base_model, untrained)


def _drop_untrained(members: list[EvalMember], args: argparse.Namespace, untrained: dict[str, str]) -> list[EvalMember]:
    """``members`` without the untrained ones (all of them with ``--include-untrained``); records why in
    ``untrained``."""
    untrained.update({m.name: m.untrained for m in members if m.untrained})
    return list(members) if args.include_untrained else [m for m in members if not m.untrained]


def choose_prompt_templates(args: argparse.Namespace, base_model: str | None, sources: dict[str, bool | None],
                            members: list[EvalMember] | None = None) -> tuple[dict[str, str], str]:
    """``--code-template`` / ``--math-template`` with ``auto`` resolved (see ``eval.prompts``), and why.

    The tokenizers that render prompts: the base model's (when a member generates with it; always when
    ``members`` is not given) and every full model's (``--model``); ``chat`` needs a chat template in each."""
    requested = {"code": args.code_template, "math": args.math_template}
    members = members or []
    renderers: dict[str, str] = {}  # who -> model directory
    if base_model is not None and (not members or any(m.model_dir is None for m in members)):
        renderers["the base model"] = base_model
    for member in members:
        if member.model_dir is not None:
            renderers[f"--model {member.name}"] = str(member.model_dir)
    has_chat = {who: _has_chat_template(who, path) for who, path in renderers.items()}
    lacking = [who for who, chat in has_chat.items() if not chat]
    return resolve_templates(requested, not lacking, sources, lacking or list(has_chat) or ["the base model"])


def _has_chat_template(who: str, model_dir: str) -> bool:
    try:
        return model_has_chat_template(model_dir)
    except (OSError, ValueError) as exc:  # a tokenizer transformers cannot load
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{who}: cannot load the tokenizer of {model_dir}: {first}") from None


def plan_published_checks(args: argparse.Namespace, benchmarks: list[str], model_name: str) -> list[PublishedScore]:
    """The published scores ``--check-published`` compares with (one per benchmark that has one)."""
    if not args.check_published:
        return []
    if not args.base:
        raise ValueError("--check-published compares the base model with its published pass@1: add --base")
    scores = [s for s in (find_published(model_name, b) for b in benchmarks) if s is not None]
    if not scores:
        known = ", ".join(f"{s.model} on {s.benchmark}" for s in PUBLISHED)
        raise ValueError(f"--check-published: no published pass@1 of {model_name!r} on {', '.join(benchmarks)}; "
                         f"known: {known}")
    return scores


def device_type(engine: str, device: str) -> str:
    """``cpu`` or ``cuda``: where the samples are generated (vLLM: wherever its build runs)."""
    if engine == "vllm":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.split(":", 1)[0]


def parse_samples(specs: list[str], benchmarks: list[str]) -> dict[str, int]:
    """``["mbpp=200"]`` -> ``{"mbpp": 200}``; each named benchmark must be one of this invocation's."""
    samples: dict[str, int] = {}
    for spec in specs:
        name, _, size = spec.partition("=")
        name = benchmark_key(name)
        if not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--sample {spec!r}: expected BENCH=N with N a positive whole number, e.g. mbpp=200")
        if name not in benchmarks:
            raise ValueError(f"--sample {spec!r}: {name!r} is not among this invocation's benchmarks "
                             f"({', '.join(benchmarks)})")
        samples[name] = int(size)
    return samples


def narrow(problems: list[Problem], name: str, args: argparse.Namespace, samples: dict[str, int]) -> list[Problem]:
    """Benchmark ``name``'s problems to grade: its fixed sample when ``--sample`` names it, then ``--limit``'s
    head."""
    if name in samples:
        problems = sample_problems(problems, samples[name])
    return problems[:args.limit] if args.limit else problems


def engine_jobs(base_model: str | None, members: list[EvalMember]) -> list[tuple[str, list[EvalMember]]]:
    """(model directory, members generated with it) per engine, in order: the base model with every adapter
    (and the bare base), then each full model (``--model``) on its own, with no adapter."""
    jobs: list[tuple[str, list[EvalMember]]] = []
    on_base = [m for m in members if m.model_dir is None]
    if on_base:
        assert base_model is not None, "members on the base model need a base model"
        jobs.append((base_model, on_base))
    jobs += [(str(m.model_dir), [m]) for m in members if m.model_dir is not None]
    return jobs


def published_check(score: PublishedScore, records: list[dict], problems: list[Problem], total: int,
                     base_model: str, settings: EvalSettings) -> dict:
    """The base model's graded samples of this invocation's problems against the published pass@1; ``total``:
    the whole benchmark's problem count, not --limit's head."""
    ids = {p.problem_id for p in problems}
    graded = [r for r in records
              if r["member"] == BASE_MEMBER and r["benchmark"] == score.benchmark and str(r["problem_id"]) in ids]
    kind = BENCHMARKS[score.benchmark].kind
    return check_published(score, sum(bool(r["passed"]) for r in graded), len(graded), total,
                           quantised=is_shipped_gguf(base_model),
                           template=settings.code_template if kind == CODE else settings.math_template)
