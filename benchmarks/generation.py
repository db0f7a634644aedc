"""The local engine against the machine's limit and against the engine it replaced, side by side (not a test).

1. **Record** one real self-play step of a preset (default: ``configs/laptop.yaml``, the ``make run`` run)
   through the real loop, engine and sandbox: every ``generate`` call (prompts, n, sampling seeds) and the
   ``train_step`` call (the scored trajectories).
2. **Replay** exactly those calls, interleaved call by call, on each engine variant:
   - ``today``: the engine before this rewrite (``engines/local.py`` at ``--legacy-commit``, read from git),
     configured as ``make run`` configured it then (fp32 base);
   - ``new``: the engine as the preset builds it now (``build.build_engine``);
   - ``new-fp32``, ``new-unshared``: the new engine with the bf16 base, or prefill/prompt sharing, turned off.
   For each: wall time of the propose, solve and train phases, new tokens/s, prompt tokens/s, training
   tokens/s, and effective GFLOP/s as a fraction of the matmul peak measured here (fp32 and bf16).
3. **bf16 against fp32** on the recorded prompts: greedy tokens (how many rows agree, and for how long) and the
   per-token log-probs of the recorded trajectories, against the stated tolerances.

    python benchmarks/generation.py                       # the make-run preset, ~15 minutes on 2 cores
    python benchmarks/generation.py --variants today new  # only the headline ratio

FLOPs are counted as 2 x (parameters a token passes through) per token: every linear layer but the output
matrix for prompt tokens (only the last prompt position reaches it), all of them for generated tokens; a
training token costs a forward and a backward through the frozen base (activation gradients only), about 2x
its forward. Attention scores are left out (under 3% at these lengths). The machine is shared and noisy:
compare the ratios, which come from one run, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LEGACY_COMMIT = "a18f978"  # main before the engine rewrite: engines/local.py, one file
# bf16 against fp32: what "the same model" means here
TOLERANCE = {"identical_greedy_rows": 0.75, "logp_mean_abs": 0.05, "logp_p99_abs": 0.5}


# ----------------------------------------------------------------------------------------- the limit


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of the best of ``repeats`` size^3 matmuls: the ceiling an engine's GFLOP/s is compared with."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        tic = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - tic)
    return 2 * size**3 / best / 1e9


def linear_params(model) -> tuple[int, int]:
    """(parameters of every linear layer but the output matrix, parameters of the output matrix)."""
    head = model.get_output_embeddings().weight.numel()
    body = sum(m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings())
    return body, head


# ----------------------------------------------------------------------------------------- engines


def load_legacy_engine_module(commit: str):
    """``engines/local.py`` as it was at ``commit`` (a module of its own, read with ``git show``)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:openrlhf_populora/engines/local.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="populora-legacy-")) / "legacy_local_engine.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("legacy_local_engine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their (string) annotations through it
    spec.loader.exec_module(module)
    return module


def build_variants(config, names: list[str], commit: str) -> dict:
    from openrlhf_populora.build import build_engine

    engines = {}
    new = build_engine(config)
    base_fields = dataclasses.asdict(new.config)
    for name in names:
        if name == "new":
            engines[name] = new
        elif name == "today":
            legacy = load_legacy_engine_module(commit)
            known = {f.name for f in dataclasses.fields(legacy.LocalEngineConfig)}
            settings = {k: v for k, v in base_fields.items() if k in known}
            settings["dtype"] = "fp32"  # the old laptop preset's base dtype
            engines[name] = legacy.LocalEngine(legacy.LocalEngineConfig(**settings))
        elif name == "new-fp32":
            engines[name] = type(new)(dataclasses.replace(new.config, dtype="fp32"))
        elif name == "new-unshared":
            engines[name] = type(new)(dataclasses.replace(new.config, share_prefill=False, share_prompts=False))
        else:
            raise SystemExit(f"unknown variant {name!r}")
    return engines


# ----------------------------------------------------------------------------------------- record & replay


def record_step(config, engine) -> list[tuple[str, str, list, object]]:
    """Run the preset's first step for real, recording (phase, kind, items, params) of every engine call."""
    from openrlhf_populora.sandbox import Sandbox
    from openrlhf_populora.selfplay.loop import SelfPlay

    calls: list = []
    real_generate, real_train = engine.generate, engine.train_step
    phase = {"now": "seed"}

    def generate(requests, params):
        calls.append((phase["now"], "generate", list(requests), params))
        return real_generate(requests, params)

    def train_step(trajectories):
        calls.append(("train", "train", list(trajectories), None))
        return real_train(trajectories)

    engine.generate, engine.train_step = generate, train_step
    sb = config.populora.sandbox
    try:
        with Sandbox(workers=sb.workers, timeout_s=sb.timeout_s, memory_mb=sb.memory_mb) as sandbox, \
                tempfile.TemporaryDirectory() as run_dir:
            loop = SelfPlay(config, engine, sandbox, run_dir)
            loop.on_phase = lambda name: phase.__setitem__("now", name)
            loop.create_adapters()
            loop.seed_buffers()
            loop.run_step()
    finally:
        engine.generate, engine.train_step = real_generate, real_train
    return [c for c in calls if c[0] != "seed"]


def replay(engines: dict, calls, body: int, head: int, repeats: int = 1) -> dict:
    """Each call on every engine in turn (interleaved), ``repeats`` times, keeping each call's fastest run;
    per engine and phase: seconds, tokens and FLOPs. Every repeat starts from the same fresh adapters."""
    from openrlhf_populora.engines.base import BASE_ADAPTER

    stats = {name: {} for name in engines}
    adapters = dict.fromkeys(x.adapter for _, _, items, _ in calls for x in items if x.adapter != BASE_ADAPTER)
    for engine in engines.values():
        for adapter in adapters:  # fresh adapters, as at the recorded step (a fresh run's first step)
            if adapter not in engine.adapter_names():
                engine.add_adapter(adapter)
    fresh = {name: {a: e.get_adapter(a) for a in adapters} for name, e in engines.items()}
    for phase, kind, items, params in calls:
        for name, engine in engines.items():
            s = stats[name].setdefault(phase, {"seconds": 0.0, "prompt_tokens": 0, "new_tokens": 0,
                                               "train_tokens": 0, "flop": 0.0})
            seconds = float("inf")
            for _ in range(repeats):
                if kind == "train":  # the same update every time: from the fresh adapters, fresh AdamW
                    for adapter, weights in fresh[name].items():
                        engine.set_adapter(adapter, weights)
                tic = time.perf_counter()
                out = engine.generate(items, params) if kind == "generate" else engine.train_step(items)
                seconds = min(seconds, time.perf_counter() - tic)
            s["seconds"] += seconds
            if kind == "generate":
                prompts = sum(len(g[0].prompt_ids) * len(g) for g in out)
                new = sum(len(c.response_ids) for g in out for c in g)
                s["prompt_tokens"] += prompts
                s["new_tokens"] += new
                s["flop"] += 2 * (body * prompts + (body + head) * new)
            else:
                prompts = sum(len(t.prompt_ids) for t in items)
                responses = sum(len(t.response_ids) for t in items)
                s["train_tokens"] += prompts + responses
                s["flop"] += 2 * 2 * (body * prompts + (body + head) * responses)  # forward + backward
    return stats


# ----------------------------------------------------------------------------------------- bf16 vs fp32


def bf16_against_fp32(engines: dict, calls) -> dict:
    bf16, fp32 = engines["new"], engines["new-fp32"]
    from openrlhf_populora.engines.base import GenerationRequest, SamplingParams

    requests = [GenerationRequest(r.adapter, r.prompt) for phase, kind, items, _ in calls if kind == "generate"
                for r in items]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    a, b = bf16.generate(requests, greedy), fp32.generate(requests, greedy)
    prefixes = []
    for ga, gb in zip(a, b, strict=True):
        agree = 0  # leading tokens the two greedy completions share
        for p, q in zip(ga[0].response_ids, gb[0].response_ids, strict=False):
            if p != q:
                break
            agree += 1
        prefixes.append(agree)
    trajectories = [t for _, kind, items, _ in calls if kind == "train" for t in items]
    diffs = []
    for t in trajectories:
        per_token_a = _token_logprobs(bf16, t)
        per_token_b = _token_logprobs(fp32, t)
        diffs.append((per_token_a - per_token_b).abs())
    diffs = torch.cat(diffs)
    same = sum(ga[0].response_ids == gb[0].response_ids for ga, gb in zip(a, b, strict=True))
    return {"rows": len(requests), "identical_rows": same,
            "median_prefix": float(torch.tensor(prefixes, dtype=torch.float).median()),
            "logp_mean_abs": float(diffs.mean()), "logp_p99_abs": float(diffs.quantile(0.99)),
            "tokens": int(diffs.numel())}


def _token_logprobs(engine, trajectory) -> torch.Tensor:
    from openrlhf_populora.engines.local.training import score

    groups = [[0]]
    context, mixer = engine._mixer(engine.adapter_names())
    with torch.no_grad(), context:
        s = score(engine._forward(mixer), [trajectory], groups, pad_id=engine.tokenizer.pad_token_id,
                  temperature=engine.config.logprob_temperature, entropy=None, device=engine.device)
    return s.logp[0, : len(trajectory.response_ids)]


# ----------------------------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=str(ROOT / "configs" / "laptop.yaml"))
    parser.add_argument("--model", default=None, help="override the preset's --actor.model_name_or_path")
    parser.add_argument("--variants", nargs="+", default=["today", "new", "new-fp32", "new-unshared"])
    parser.add_argument("--legacy-commit", default=LEGACY_COMMIT)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each call per variant; the fastest counts")
    args = parser.parse_args()
    os.chdir(ROOT)  # the preset's seed file is relative to the repository
    from openrlhf_populora.config import parse_config

    argv = ["--config", args.preset] + (["--actor.model_name_or_path", args.model] if args.model else [])
    config = parse_config(argv)
    threads = config.populora.num_threads or 1
    torch.set_num_threads(threads)
    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    print(f"preset {args.preset}, model {config.actor.model_name_or_path}, {threads} threads; matmul peak "
          f"(2048^3): fp32 {peaks['fp32']:.0f} GFLOP/s, bf16 {peaks['bf16']:.0f} GFLOP/s")
    engines = build_variants(config, list(dict.fromkeys(["new", *args.variants])), args.legacy_commit)
    body, head = linear_params(engines["new"].base)
    calls = record_step(config, engines["new"])
    engines["new"] = build_variants(config, ["new"], args.legacy_commit)["new"]  # fresh adapters, like the others
    engines = {name: engines[name] for name in args.variants}
    print(f"recorded one step: {sum(k == 'generate' for _, k, _, _ in calls)} generate calls, "
          f"{sum(k == 'train' for _, k, _, _ in calls)} train call; replaying it on {', '.join(engines)}")
    stats = replay(engines, calls, body, head, args.repeats)
    header = f"{'variant':<13}{'dtype':<6}{'propose s':>10}{'solve s':>9}{'train s':>9}{'step s':>8}" \
             f"{'new tok/s':>11}{'prompt tok/s':>14}{'train tok/s':>13}{'GFLOP/s':>9}{'of peak':>9}" \
             f"{'train GFLOP/s':>15}{'of peak':>9}"
    print(header)
    totals = {}
    for name, phases in stats.items():
        dtype = "fp32" if name in ("today", "new-fp32") else engines[name].dtype
        gen = [phases[p] for p in ("propose", "solve") if p in phases]
        seconds = sum(p["seconds"] for p in phases.values())
        totals[name] = seconds
        gen_s = sum(p["seconds"] for p in gen)
        flop = sum(p["flop"] for p in phases.values())
        train = phases.get("train", {"seconds": float("nan"), "train_tokens": 0, "flop": float("nan")})
        print(f"{name:<13}{dtype:<6}{phases.get('propose', {}).get('seconds', 0):>10.1f}"
              f"{phases.get('solve', {}).get('seconds', 0):>9.1f}{train['seconds']:>9.1f}{seconds:>8.1f}"
              f"{sum(p['new_tokens'] for p in gen) / gen_s:>11.1f}{sum(p['prompt_tokens'] for p in gen) / gen_s:>14.1f}"
              f"{train['train_tokens'] / train['seconds']:>13.1f}{flop / seconds / 1e9:>9.1f}"
              f"{flop / seconds / 1e9 / peaks[dtype]:>9.0%}{train['flop'] / train['seconds'] / 1e9:>15.1f}"
              f"{train['flop'] / train['seconds'] / 1e9 / peaks[dtype]:>9.0%}")
    if "today" in totals and "new" in totals:
        print(f"the default preset's step (propose + solve + train, same prompts, seeds and trajectories): "
              f"{totals['today']:.1f} s today -> {totals['new']:.1f} s now: x{totals['today'] / totals['new']:.2f} faster "
              f"(goal: >= x2)")
    if {"new", "new-fp32"} <= set(engines):
        c = bf16_against_fp32(engines, calls)
        ok = (c["identical_rows"] >= TOLERANCE["identical_greedy_rows"] * c["rows"]
              and c["logp_mean_abs"] <= TOLERANCE["logp_mean_abs"] and c["logp_p99_abs"] <= TOLERANCE["logp_p99_abs"])
        print(f"bf16 base vs fp32 base: greedy completions (up to 32 tokens) identical on {c['identical_rows']}/"
              f"{c['rows']} rows (tolerance: {TOLERANCE['identical_greedy_rows']:.0%}; median agreeing prefix "
              f"{c['median_prefix']:.0f} tokens); log-prob per token over {c['tokens']} trajectory tokens: mean |diff| "
              f"{c['logp_mean_abs']:.4f} (tolerance {TOLERANCE['logp_mean_abs']}), p99 {c['logp_p99_abs']:.3f} "
              f"(tolerance {TOLERANCE['logp_p99_abs']}): {'within' if ok else 'OUTSIDE'} tolerance")


if __name__ == "__main__":
    sys.exit(main())
