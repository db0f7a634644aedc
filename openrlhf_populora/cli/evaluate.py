"""``python -m openrlhf_populora.cli.evaluate``: greedy pass@1 of every member on the paper's benchmarks.

    python -m openrlhf_populora.cli.evaluate --run runs/4t4s --baseline runs/baseline \\
        --model stock=runs/stock-openrlhf --benchmarks paper --data-dir ~/bench-data --members all --base

evaluates the base model, the selected members of ``--run``, the PopuLoRA baseline (B1) and full fine-tuned models
such as stock OpenRLHF's (B2), and writes the table into ``--out`` (default ``<run>/eval``). The flags, the
files it writes and how each number is computed: docs/usage.md, "The pass@1 table". The work is
``eval.run.evaluate``; this module parses the flags and prints.
"""

from __future__ import annotations

import argparse
import sys

from openrlhf_populora.errors import InputError
from openrlhf_populora.eval.prompts import AUTO, TEMPLATE_CHOICES
from openrlhf_populora.eval.published import format_check
from openrlhf_populora.eval.report import markdown_table
from openrlhf_populora.eval.run import evaluate


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
    src.add_argument("--arm", action="append", default=[], metavar="NAME=RUN_DIR",
                     help="another arm's run (e.g. a control, or a 1T+1S population): its solvers (students, or "
                          "its single agent) are evaluated as rows 'NAME-<id>', beside the population and never "
                          "averaged into it (repeatable; needs --run or --baseline, on the same base model)")
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
        summary, paths, checks = evaluate(args)
    except InputError as exc:
        parser.exit(2, f"error: {exc}\n")
    print(markdown_table(summary))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    for record in checks:
        print(format_check(record))
    return 1 if any(record["verdict"] != "PASS" for record in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
