"""Step 0's answer format, measured: how often the frozen base model's answers parse, and why the rest do not.

At step 0 every member is the base model (fresh LoRA adapters are zero), so the base model's answers to the
preset's own prompts are what the first steps play with. This script asks it, exactly as the loop would (the
preset's templates, chat rendering, temperature, top-p and token budget; fixed sampling seeds), to

- solve every seed task of the preset's seed file as each of its task types (``--samples`` answers each), and
- propose ``--proposals`` tasks of each type, with references drawn from the seed tasks,

then grades the answers with the project's verifier and proposal checks and prints the format rate (an answer of
the right kind found and parsed) per role and task type, the solve rate, and a count of each failure reason.

    python benchmarks/format_rate.py generate --config configs/signature.yaml --out /tmp/fmt.json
    python benchmarks/format_rate.py score /tmp/fmt.json     # re-grade the SAME answers with today's parser

``generate`` keeps every prompt and answer in ``--out``, so a parser change is measured on identical answers
(``score``), and a prompt change by generating again with the same seeds. Not a test: it loads the real model
(about 5 minutes on 2 cores for the signature preset).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openrlhf_populora.config import parse_config  # noqa: E402
from openrlhf_populora.sandbox import Sandbox  # noqa: E402
from openrlhf_populora.tasks import (  # noqa: E402
    COMPACT_TEMPLATES,
    DEFAULT_TEMPLATES,
    Task,
    check_proposals,
    proposer_prompt,
    solver_prompt,
    verify_answers,
)


def _templates(config):
    return COMPACT_TEMPLATES if config.populora.prompts == "compact" else DEFAULT_TEMPLATES


def _seed_tasks(path: str) -> list[Task]:
    with open(path) as fh:
        return [Task.from_json(line) for line in fh if line.strip()]


def _solver_items(config, seeds: list[Task]) -> list[dict]:
    """One item per (seed task, task type it can be played as) among the preset's task types."""
    items = []
    for task in seeds:
        types = [t for t in ("code_o", "code_i") if t in config.populora.task_types] \
            if task.task_type in ("code_o", "code_i") else \
            [t for t in (task.task_type,) if t in config.populora.task_types]
        for task_type in types:
            played = dataclasses.replace(task, task_type=task_type)
            items.append({"task": played.to_json(), "prompt": solver_prompt(played, _templates(config))})
    return items


def _proposer_items(config, seeds: list[Task], count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    triplets = [t for t in seeds if t.task_type in ("code_o", "code_i")]
    items = []
    for task_type in config.populora.task_types:
        for _ in range(count):
            refs = rng.sample(triplets, min(config.populora.references, len(triplets)))
            kwargs = {"program": refs[0]} if task_type == "code_f" else {}
            text = proposer_prompt(task_type, refs, timeout_s=config.populora.sandbox.timeout_s,
                                   templates=_templates(config), **kwargs)
            items.append({"task_type": task_type, "prompt": text,
                          "program": refs[0].to_json() if task_type == "code_f" else None})
    return items


def generate(args) -> None:
    from openrlhf_populora.build import build_engine
    from openrlhf_populora.engines.base import BASE_ADAPTER, GenerationRequest, SamplingParams

    config = parse_config(["--config", args.config, *args.flags])
    seeds = _seed_tasks(config.populora.seed_file)
    solver, proposer = _solver_items(config, seeds), _proposer_items(config, seeds, args.proposals, args.seed)
    engine = build_engine(config)
    chat = config.populora.chat_template
    params = SamplingParams(config.rollout.temperature, config.rollout.top_p, config.rollout.max_new_tokens,
                            seed=args.seed)
    from tqdm import tqdm

    for name, items, n in (("proposer", proposer, 1), ("solver", solver, args.samples)):
        for start in tqdm(range(0, len(items), args.batch), desc=f"{name} answers", unit="batch"):
            chunk = items[start:start + args.batch]
            requests = [GenerationRequest(BASE_ADAPTER, engine.render_prompt(it["prompt"], chat_template=chat), n=n)
                        for it in chunk]
            for it, outs in zip(chunk, engine.generate(requests, params), strict=True):
                it["answers"] = [c.text for c in outs]
                it["finished"] = [c.finished for c in outs]
                it["tokens"] = [len(c.response_ids) for c in outs]
    record = {"config": args.config, "flags": args.flags, "seed": args.seed, "samples": args.samples,
              "prompts": config.populora.prompts, "max_new_tokens": config.rollout.max_new_tokens,
              "temperature": config.rollout.temperature, "top_p": config.rollout.top_p,
              "solver": solver, "proposer": proposer}
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    score(argparse.Namespace(record=args.out, examples=args.examples))


def score(args) -> None:
    record = json.loads(Path(args.record).read_text())
    by_type: dict[str, Counter] = defaultdict(Counter)
    examples: dict[tuple[str, str], str] = {}
    with Sandbox(workers=2) as sandbox:
        tasks, texts, cut = [], [], []
        for it in record["solver"]:
            task = Task.from_json(it["task"])
            for text, done in zip(it["answers"], it["finished"], strict=True):
                tasks.append(task)
                texts.append(text)
                cut.append(not done)
        for task, text, was_cut, v in zip(tasks, texts, cut, verify_answers(tasks, texts, sandbox), strict=True):
            c = by_type[f"solver {task.task_type}"]
            c["n"] += 1
            c["format_ok"] += v.format_ok
            c["correct"] += v.correct
            c["cut at the token budget"] += was_cut
            if not v.format_ok:
                c[f"reason: {v.reason}"] += 1
                examples.setdefault((task.task_type, v.reason), text)
        for task_type in sorted({it["task_type"] for it in record["proposer"]}):
            items = [it for it in record["proposer"] if it["task_type"] == task_type]
            texts = [it["answers"][0] for it in items]
            programs = [Task.from_json(it["program"]) for it in items] if task_type == "code_f" else None
            checks = check_proposals(task_type, texts, sandbox, programs=programs)
            c = by_type[f"proposer {task_type}"]
            for it, check in zip(items, checks, strict=True):
                c["n"] += 1
                c["valid"] += check.valid
                c["cut at the token budget"] += not it["finished"][0]
                if not check.valid:
                    c[f"reason: {check.reason}"] += 1
                    examples.setdefault((f"propose {task_type}", check.reason), it["answers"][0])
    print(f"{record['config']} {' '.join(record['flags'])}: prompts={record['prompts']}, T={record['temperature']}, "
          f"top-p={record['top_p']}, max_new_tokens={record['max_new_tokens']}, seed={record['seed']}")
    summary = {}
    for key in sorted(by_type):
        c = by_type[key]
        n = c["n"]
        rate_key = "format_ok" if key.startswith("solver") else "valid"
        line = f"{key:18s} n={n:4d}  {rate_key}={c[rate_key] / n:.3f}"
        if key.startswith("solver"):
            line += f"  solved={c['correct'] / n:.3f}"
        line += f"  cut={c['cut at the token budget'] / n:.3f}"
        print(line)
        for reason, count in sorted(((k, v) for k, v in c.items() if k.startswith("reason")), key=lambda kv: -kv[1]):
            print(f"    {reason[8:]:30s} {count:4d}")
        summary[key] = dict(c)
    if args.examples:
        print("\none answer per failure reason:")
        for (kind, reason), text in sorted(examples.items()):
            print(f"--- {kind} / {reason} ---\n{text[:600]}\n")
    out = Path(args.record).with_suffix(".summary.json")
    out.write_text(json.dumps(summary, indent=1, sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="ask the base model with the preset's prompts, then score")
    g.add_argument("--config", default="configs/signature.yaml")
    g.add_argument("--out", required=True)
    g.add_argument("--samples", type=int, default=2, help="answers per (seed task, task type)")
    g.add_argument("--proposals", type=int, default=8, help="proposals per task type")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--batch", type=int, default=8, help="prompts per generate call")
    g.add_argument("--examples", action="store_true", help="print one answer per failure reason")
    g.add_argument("flags", nargs="*", help="more dotted flags after --, e.g. -- --rollout.max_new_tokens 384")
    s = sub.add_parser("score", help="re-grade saved answers with today's parser")
    s.add_argument("record")
    s.add_argument("--examples", action="store_true")
    args = parser.parse_args(argv)
    (generate if args.command == "generate" else score)(args)


if __name__ == "__main__":
    main()
