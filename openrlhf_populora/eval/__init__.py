"""Evaluation: greedy pass@1 of every population member on the paper's code and math benchmarks.

    problems = load_benchmark("humaneval")                       # benchmarks: offline loaders, validated
    backend = build_local_backend(base_model, members, lora)     # generation: local engine or vLLM multi-LoRA
    store = ResultStore(out_dir, settings_identity)              # store: append-only, resumable samples
    run_evaluation(backend, assign_slots(members), {"humaneval": problems}, store, EvalSettings())
    write_report(summarize(store.records(), groups, ["humaneval"]), out_dir)   # report: table + chart

A full fine-tuned model (stock OpenRLHF's checkpoint, the B2 baseline) is an ``EvalMember`` with ``model_dir`` set:
it gets its own backend, built on that directory with no adapter (``plan.engine_jobs``).

The command line is ``python -m openrlhf_populora.cli.evaluate`` (see ``cli/evaluate.py``). Which prompt template
fits which model: ``prompts``; the published pass@1 of known models and the check against it: ``published``.
"""

from openrlhf_populora.eval.benchmarks import (
    BENCHMARKS,
    PAPER_BENCHMARKS,
    BenchmarkFormatError,
    load_benchmark,
    parse_benchmark_names,
)
from openrlhf_populora.eval.evaluator import EvalSettings, grade, run_evaluation
from openrlhf_populora.eval.members import EvalMember, check_adapters, load_run_members, select_members
from openrlhf_populora.eval.problems import Problem
from openrlhf_populora.eval.report import report_from_results, summarize, write_report
from openrlhf_populora.eval.store import ResultStore

__all__ = [
    "BENCHMARKS", "PAPER_BENCHMARKS", "BenchmarkFormatError", "EvalMember", "EvalSettings", "Problem",
    "ResultStore", "check_adapters", "grade", "load_benchmark", "load_run_members", "parse_benchmark_names",
    "report_from_results", "run_evaluation", "select_members", "summarize", "write_report",
]
