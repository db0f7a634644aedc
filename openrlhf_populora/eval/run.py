"""One evaluation invocation: plan it, generate and grade what the store lacks, summarize, write the table.

``evaluate(args)`` does what ``python -m openrlhf_populora.cli.evaluate`` asks (the flags are that command's;
docs/usage.md, "The pass@1 table"); bad input raises :class:`~openrlhf_populora.errors.InputError` before any
model loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from openrlhf_populora.errors import InputError
from openrlhf_populora.eval.benchmarks import BenchmarkFormatError, load_benchmark, parse_benchmark_names
from openrlhf_populora.eval.evaluator import EvalSettings, missing_samples, regrade_samples, run_evaluation
from openrlhf_populora.eval.generation import (
    VLLMBackend,
    assign_slots,
    build_local_backend,
    vllm_adapter_targets,
    vllm_available,
)
from openrlhf_populora.eval.members import check_adapters, member_digest
from openrlhf_populora.eval.plan import (
    choose_prompt_templates,
    device_type,
    engine_jobs,
    narrow,
    parse_samples,
    plan,
    plan_published_checks,
    published_check,
)
from openrlhf_populora.eval.report import summarize, write_report
from openrlhf_populora.eval.store import ResultStore


def evaluate(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Path], list[dict]]:
    """Run the evaluation ``args`` describes; returns the summary (``results.json``'s content), the files written
    and the published-pass@1 checks (empty without ``--check-published``)."""
    try:
        benchmarks = parse_benchmark_names(args.benchmarks)
        select_on = parse_benchmark_names(args.select_on) if args.select_on else []
        overlap = [b for b in select_on if b in benchmarks]
        if overlap:
            raise ValueError(f"--select-on {','.join(overlap)} is also in --benchmarks: a best picked on the benchmark "
                             "it is reported on is optimistic; select on benchmarks outside the table")
        base_model, groups, out, sources, model_name, untrained = plan(args)
        if untrained and not args.include_untrained:
            print("[eval] not evaluated, untrained (--include-untrained evaluates them): "
                  + "; ".join(f"{name} ({why})" for name, why in untrained.items()))
        members = [m for group in groups.values() for m in group]
        lora = check_adapters(members, base_model) if base_model else {}
        samples = parse_samples(args.sample, [*benchmarks, *select_on])
        whole = {b: load_benchmark(b, args.data_dir) for b in [*benchmarks, *select_on]}  # fail before loading a model
        problems = {b: narrow(whole[b], b, args, samples) for b in benchmarks}
        selectors = {b: narrow(whole[b], b, args, samples) for b in select_on}
        published = plan_published_checks(args, benchmarks, model_name)
        templates, why = choose_prompt_templates(args, base_model, sources, members)
        print(f"[eval] prompt templates: code {templates['code']}, math {templates['math']} ({why})")
        settings = EvalSettings(
            code_template=templates["code"], math_template=templates["math"], max_new_tokens=args.max_new_tokens,
            per_test_timeout_s=args.test_timeout_s, code_sanitizer=args.code_sanitizer, batch_size=args.batch_size,
            sandbox_timeout_s=args.sandbox_timeout_s, sandbox_workers=args.sandbox_workers,
            sandbox_memory_mb=args.sandbox_memory_mb,
        )
        settings.validate()
        identity = {**settings.identity(), "members": {m.name: member_digest(m) for m in members}}
        generating = not args.report_only  # a report (--regrade included) generates nothing: the stored keys stand
        if generating:
            engine = args.engine
            if engine == "auto":
                engine = "vllm" if vllm_available() else "local"
            if engine == "vllm" and lora:  # adapters vLLM cannot serve are refused before any engine starts
                vllm_adapter_targets(lora, [m.adapter_dir for m in members if m.adapter_dir is not None])
            # what generates the samples: greedy decoding still differs in the last bits between dtypes, engines
            # and devices (vLLM and the local engine disagreed on 1 of 32 HumanEval completions here)
            identity.update(dtype=args.dtype, engine=engine, device=device_type(engine, args.device))
        if base_model is not None:  # absent when only full models are evaluated (a later run may add it)
            identity["base_model"] = base_model
        store = ResultStore(out, identity, regrade=args.regrade, read_only=args.report_only and not args.regrade)
        if args.regrade:
            regrade_samples(store, whole, settings)
    except (ValueError, BenchmarkFormatError) as exc:
        raise InputError(str(exc)) from None
    if generating:
        population = {m.name for m in groups["population"]}
        _generate(args, engine, base_model, members, population, lora, problems, selectors, store, settings)
    # the table covers this invocation's problems: samples stored for others (a whole benchmark graded earlier,
    # before --sample or --limit narrowed it) stay in samples.jsonl
    wanted = {(b, p.problem_id) for b, ps in {**problems, **selectors}.items() for p in ps}
    records = [r for r in store.records() if (r["benchmark"], str(r["problem_id"])) in wanted]
    try:
        summary = summarize(
            records, {g: [m.name for m in ms] for g, ms in groups.items()}, benchmarks,
            totals={b: len(p) for b, p in {**problems, **selectors}.items()}, roles={m.name: m.role for m in members},
            untrained=untrained, select_on=select_on,
        )
    except ValueError as exc:  # e.g. --report-only before the selection benchmarks were graded
        raise InputError(str(exc)) from None
    summary["settings"] = store.settings  # provenance: templates, lengths, base model, adapter hashes
    # the fixed sample's size (before --limit takes its head) and the benchmark's, per sampled benchmark
    summary["samples"] = {b: {"size": samples[b], "of": len(whole[b])} for b in samples if b in problems}
    summary["limit"] = {b: {"size": len(problems[b]), "of": len(whole[b])} for b in problems} if args.limit else {}
    checks = [published_check(score, records, problems[score.benchmark], len(whole[score.benchmark]), base_model,
                               settings)
              for score in published]
    if checks:
        summary["published_checks"] = checks
    paths = write_report(summary, out)
    return summary, paths, checks


def _generate(args, engine, base_model, members, population, lora, problems, selectors, store, settings):
    """Generate and grade every missing sample, one engine per model directory (the base model with its
    adapters, then each full model), the selection benchmarks for the population's members after the table's."""
    for model_dir, engine_members in engine_jobs(base_model, members):
        choosers = [m.name for m in engine_members if m.name in population] if selectors else []
        if not (missing_samples(store, [m.name for m in engine_members], problems)
                or missing_samples(store, choosers, selectors)):
            total = len(engine_members) * sum(len(p) for p in problems.values())
            print(f"[eval] {', '.join(m.name for m in engine_members)}: {total}/{total} samples already graded; "
                  "0 to go")
            continue
        job_lora = lora if any(m.adapter_dir is not None for m in engine_members) else {}  # full model: none
        if engine == "vllm":
            backend = VLLMBackend(model_dir, engine_members, job_lora,
                                  dtype="float32" if args.dtype == "fp32" else "bfloat16")
        else:
            backend = build_local_backend(model_dir, engine_members, job_lora, device=args.device,
                                          dtype=args.dtype, batch_size=args.batch_size)
        try:
            slots = assign_slots(engine_members)
            run_evaluation(backend, slots, problems, store, settings)
            if choosers:
                print(f"[eval] selection benchmarks {', '.join(selectors)} (population members only)")
                run_evaluation(backend, {n: slots[n] for n in choosers}, selectors, store, settings)
        finally:
            backend.close()
