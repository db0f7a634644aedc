"""What a population costs on the embedded engine, measured side by side in one run (not a test).

0. self-play step time: whole PopuLoRA steps (propose, check, solve, verify, train, rate) of 1T+1S, 2T+2S
   and 4T+4S against the single-agent baseline **at equal total samples per step** (the population's
   proposals and answers are split over its members), through the real loop, engine and sandbox;

1. generation: N adapters x R rows each, greedy, all in one mixed-adapter batch vs adapter by adapter
   (outputs must be equal; tokens/s and the speed-up are printed);
2. training: one ``train_step`` on B trajectories of one adapter vs the same B split over N adapters;
3. memory: peak RSS of a fresh process holding 1 vs N adapters (each trained once, so its AdamW state
   exists), next to what the extra adapters' own tensors need (weights + grads + 2 Adam moments, fp32)
   and what N full model copies would need.

    python benchmarks/population_overhead.py --model tiny
    python benchmarks/population_overhead.py --model embedded --max-new-tokens 32

Timings are CPU seconds of this process (``time.process_time``; torch runs on ``--threads 1``), the best
of ``--repeats``: on a shared machine wall-clock time mostly measures the neighbours. Wall-clock
tokens/s are printed too. Memory uses Linux's peak-RSS reset (``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from openrlhf_populora.build import local_engine_config  # noqa: E402
from openrlhf_populora.config import Config  # noqa: E402
from openrlhf_populora.engines.base import GenerationRequest, SamplingParams, Trajectory  # noqa: E402
from openrlhf_populora.engines.local import LocalEngine  # noqa: E402

TASK = "Write a Python function f(x) that returns the sum of the digits of x, then show f(1234).\n"


def make_engine(args, n_adapters: int) -> LocalEngine:
    config = local_engine_config(Config(),
        model_name_or_path=args.model, lora_rank=args.lora_rank, policy_loss="native", lr=1e-4,
        micro_batch_size=args.train_batch, generation_batch_size=1024, num_threads=args.threads,
    )
    engine = LocalEngine(config)
    gen = torch.Generator().manual_seed(0)
    for k in range(n_adapters):
        name = f"m{k}"
        engine.add_adapter(name)
        weights = engine.get_adapter(name)  # non-zero B so every adapter really is different
        engine.set_adapter(name, {key: torch.randn(v.shape, generator=gen) * 0.02 for key, v in weights.items()})
    return engine


def best_time(fn, repeats: int, wall: list | None = None):
    """Best CPU time of ``repeats`` calls (and, in ``wall``, the matching wall-clock time)."""
    best, best_wall, result = float("inf"), float("inf"), None
    for _ in range(repeats):
        start, start_wall = time.process_time(), time.perf_counter()
        result = fn()
        cpu, elapsed = time.process_time() - start, time.perf_counter() - start_wall
        if cpu < best:
            best, best_wall = cpu, elapsed
    if wall is not None:
        wall.append(best_wall)
    return best, result


def bench_generation(args, engine: LocalEngine) -> dict:
    names = engine.adapter_names()
    prompt = engine.render_prompt(TASK)
    reqs = [GenerationRequest(name, prompt + "#" * r, n=1) for name in names for r in range(args.rows)]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    wall: list[float] = []
    t_mixed, mixed = best_time(lambda: engine.generate(reqs, params), args.repeats, wall)

    def per_adapter():
        return [g for name in names for g in engine.generate([r for r in reqs if r.adapter == name], params)]

    t_single, single = best_time(per_adapter, args.repeats, wall)
    # the same rows all on one adapter: what a single agent's batch costs (forced to the same length)
    one = [GenerationRequest(names[0], r.prompt) for r in reqs]
    forced = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    t_one, one_out = best_time(lambda: engine.generate(one, forced), args.repeats, wall)
    tokens = sum(len(g[0].response_ids) for g in mixed)
    one_tokens = sum(len(g[0].response_ids) for g in one_out)
    same = [g[0].response_ids for g in mixed] == [g[0].response_ids for g in single]
    return {"rows": len(reqs), "tokens": tokens, "mixed_tok_s": tokens / t_mixed,
            "per_adapter_tok_s": tokens / t_single, "speedup": t_single / t_mixed, "outputs_equal": same,
            "one_adapter_tok_s": one_tokens / t_one, "mixed_wall_tok_s": tokens / wall[0],
            "per_adapter_wall_tok_s": tokens / wall[1]}


def bench_training(args, engine: LocalEngine) -> dict:
    names = engine.adapter_names()
    # a distinct prompt per sequence (as proposals have): the engine shares the forward of a prompt repeated on
    # one adapter, which would flatter the one-adapter side
    prompts = [engine.encode(engine.render_prompt(f"{TASK}(variant {i})")) for i in range(args.train_batch)]
    prompt_ids = prompts[0]
    response = engine.encode("def f(x):\n    return sum(int(d) for d in str(x))\n" * 8)[: args.response_tokens]
    batch = args.train_batch

    def trajs(adapters):
        return [Trajectory(adapters[i % len(adapters)], prompts[i], response, (-1.0) ** i) for i in range(batch)]

    t_one = t_all = float("inf")
    for _ in range(args.repeats):  # interleaved, so that drift on a shared machine hits both sides alike
        t_one = min(t_one, best_time(lambda: engine.train_step(trajs(names[:1])), 1)[0])
        t_all = min(t_all, best_time(lambda: engine.train_step(trajs(names)), 1)[0])
    seq = len(prompt_ids) + len(response)
    return {"batch": batch, "seq_len": seq, "one_adapter_s": t_one, "n_adapters_s": t_all,
            "ratio": t_all / t_one}


def _proc_status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def memory_child(args) -> None:
    """Runs in a fresh process: load the base, reset the peak-RSS counter, then hold N adapters, train
    each once and generate once; print the peak RSS above the loaded base."""
    import gc

    engine = make_engine(args, 0)
    gc.collect()
    loaded = _proc_status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    gen = torch.Generator().manual_seed(0)
    for k in range(args.memory_child):
        engine.add_adapter(f"m{k}")
        w = engine.get_adapter(f"m{k}")
        engine.set_adapter(f"m{k}", {key: torch.randn(v.shape, generator=gen) * 0.02 for key, v in w.items()})
    prompt_ids = engine.encode(engine.render_prompt(TASK))
    engine.train_step([Trajectory(n, prompt_ids, prompt_ids[:16], 1.0) for n in engine.adapter_names()])
    engine.generate([GenerationRequest(n, TASK) for n in engine.adapter_names()], SamplingParams(max_new_tokens=4))
    adapter_params = sum(p.numel() for p in engine._adapters["m0"].values())
    base_params = sum(p.numel() for name, p in engine.peft.named_parameters() if "lora_" not in name)
    print(json.dumps({"loaded_rss_mb": loaded, "peak_above_loaded_mb": _proc_status_mb("VmHWM") - loaded,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "adapter_params": adapter_params, "base_params": base_params}))


def bench_memory(args) -> dict:
    out = {}
    for n in (1, args.adapters):
        cmd = [sys.executable, __file__, "--memory-child", str(n), "--model", args.model,
               "--lora-rank", str(args.lora_rank), "--threads", str(args.threads)]
        line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        out[n] = json.loads(line)
    one, many = out[1], out[args.adapters]
    extra_adapters = args.adapters - 1
    own_mb = extra_adapters * one["adapter_params"] * 16 / 2**20  # weight + grad + 2 Adam moments, fp32
    delta_mb = many["peak_above_loaded_mb"] - one["peak_above_loaded_mb"]
    return {"loaded_mb": one["loaded_rss_mb"], "above_1_mb": one["peak_above_loaded_mb"],
            "above_n_mb": many["peak_above_loaded_mb"], "delta_mb": delta_mb,
            "extra_adapters_own_mb": own_mb, "delta_over_own": delta_mb / own_mb if own_mb else float("nan"),
            f"{args.adapters}_full_copies_mb": args.adapters * one["base_params"] * 4 / 2**20,
            "adapter_params": one["adapter_params"], "base_params": one["base_params"]}


def bench_selfplay(args) -> dict:
    """Mean wall-clock step time per population size, at equal total samples per step."""
    import tempfile

    from openrlhf_populora.build import build_engine
    from openrlhf_populora.config import Config
    from openrlhf_populora.sandbox import Sandbox
    from openrlhf_populora.selfplay.loop import SelfPlay

    proposals, tasks = args.proposals, args.tasks  # per task type per step, for the whole population
    sizes = [(0, 0), *[(n, n) for n in args.population_sizes]]
    results = {}
    with Sandbox(workers=2, timeout_s=5.0, memory_mb=512) as sandbox:
        for nt, ns in sizes:
            config = Config()
            p = config.populora
            config.actor.model_name_or_path = args.model
            config.rollout.max_new_tokens = args.max_new_tokens
            config.ds.lora.rank = args.lora_rank
            if nt == 0:
                p.mode, p.proposals_per_teacher, p.solver_tasks = "baseline", proposals, tasks
            else:
                if proposals % nt or tasks % ns:
                    raise SystemExit(f"--proposals and --tasks must divide by {nt}")
                p.num_teachers, p.num_students = nt, ns
                p.proposals_per_teacher, p.solver_tasks = proposals // nt, tasks // ns
            p.solver_samples, p.references, p.prompts = args.solver_samples, 1, "compact"
            # the shipped seed tasks fill every solver batch, so all sizes really draw equal samples
            p.seed_file = str(Path(__file__).resolve().parent.parent / "configs" / "seeds" / "basic.jsonl")
            p.skip_zero_advantage = False  # a random model's rewards are constant: train on everything anyway
            p.evolution.enabled = False
            p.num_threads = args.threads
            engine: LocalEngine = build_engine(config)
            with tempfile.TemporaryDirectory() as run_dir:
                loop = SelfPlay(config, engine, sandbox, run_dir)
                loop.create_adapters()
                loop.seed_buffers()
                loop.run_step()  # warm-up
                times, samples = [], []
                for _ in range(args.steps):
                    out = loop.run_step()
                    times.append(out.timings["step"])
                    samples.append(len(out.proposals) + len(out.attempts))
            engine.close()
            label = "baseline" if nt == 0 else f"{nt}T+{ns}S"
            results[label] = {"step_s": sum(times) / len(times), "samples": sum(samples) / len(samples)}
    base = results["baseline"]["step_s"]
    for r in results.values():
        r["ratio"] = r["step_s"] / base
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny | embedded | a local HF directory")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rows", type=int, default=1, help="rows per adapter in the generation benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip", nargs="*", default=[], choices=["selfplay", "generation", "training", "memory"])
    parser.add_argument("--population-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--proposals", type=int, default=8, help="proposals per task type per step (all teachers)")
    parser.add_argument("--tasks", type=int, default=8, help="tasks solved per task type per step (all students)")
    parser.add_argument("--solver-samples", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="measured self-play steps (after one warm-up)")
    parser.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        return memory_child(args)
    print(f"model={args.model} adapters={args.adapters} lora_rank={args.lora_rank} threads={args.threads}")
    if "selfplay" not in args.skip:
        for label, r in bench_selfplay(args).items():
            print(f"selfplay    {label:>8}: {r['step_s']:.2f} s/step at {r['samples']:.0f} samples/step, "
                  f"x{r['ratio']:.2f} the baseline (target for 4T+4S: <= x1.15; the paper reports x1.31)")
    engine = None
    if not {"generation", "training"} <= set(args.skip):
        engine = make_engine(args, args.adapters)
    if "generation" not in args.skip:
        g = bench_generation(args, engine)
        print(f"generation  {g['rows']} rows x {args.max_new_tokens} new tokens, greedy, tokens per CPU-second: "
              f"mixed {g['mixed_tok_s']:.1f}, adapter by adapter {g['per_adapter_tok_s']:.1f} "
              f"(mixed is x{g['speedup']:.2f} faster; outputs equal: {g['outputs_equal']}); all rows on one "
              f"adapter {g['one_adapter_tok_s']:.1f} (mixed costs x{g['one_adapter_tok_s'] / g['mixed_tok_s']:.2f})."
              f" Wall-clock tok/s: mixed {g['mixed_wall_tok_s']:.1f}, by adapter {g['per_adapter_wall_tok_s']:.1f}")
    if "training" not in args.skip:
        t = bench_training(args, engine)
        print(f"train_step  {t['batch']} seqs x {t['seq_len']} tokens, CPU-seconds: one adapter "
              f"{t['one_adapter_s']:.3f}, split over {args.adapters} adapters {t['n_adapters_s']:.3f} (x{t['ratio']:.2f})")
    if "memory" not in args.skip:
        m = bench_memory(args)
        n = args.adapters
        print(f"memory      base loaded: {m['loaded_mb']:.0f} MB RSS; peak above it with 1 adapter "
              f"{m['above_1_mb']:.1f} MB, with {n} adapters {m['above_n_mb']:.1f} MB: +{m['delta_mb']:.1f} MB for the "
              f"{n - 1} extra adapters, whose own tensors (weights, grads, 2 Adam moments, fp32) are "
              f"{m['extra_adapters_own_mb']:.1f} MB (x{m['delta_over_own']:.2f}); {n} full model copies would "
              f"need {m[f'{n}_full_copies_mb']:.0f} MB (fp32 weights alone)")


if __name__ == "__main__":
    main()
