"""Benchmark: the multi-LoRA vLLM rollout actor with LoRA on every linear layer against LoRA on the adapters' own
layers only (``lora_target_modules``, what the project starts), side by side in one run, in-process (no Ray).

Builds two actors exactly as upstream's ``create_vllm_engines`` would (``MultiLoRARollout.create_in_process``),
alive together: ``all_layers`` without ``lora_target_modules`` (vLLM's default: every LoRA-capable linear layer
wrapped, as the engines ran before), ``served`` with the layers of ``--targets`` in vLLM's packed names. Both get
the same N random rank-r adapters on ``--targets`` (PEFT tensors, as the trainer sends them), then the same
calls, alternating between the engines, ``--repeats`` times (``--one-at-a-time``: the second engine starts after
the first is shut down, for models whose two engines do not fit in memory together):

- ``sampled``: ``--requests`` prompts spread over the N adapters in one mixed batch, T=1, seeded;
- ``greedy``: the same, T=0;
- ``prefill``: the same prompts, one new token each.

Prompts are windows of ``--prompt-len`` tokens of this file's own source, in the model's tokenizer.

    python benchmarks/vllm_multilora.py                                   # tiny model built in code, 4 adapters
    python benchmarks/vllm_multilora.py --model embedded-coder --dtype bfloat16 --requests 8 --prompt-len 128 \
        --max-tokens 32 --one-at-a-time

Prints one JSON object: per engine its start and upload times, per call the best seconds of the repeats and the
tokens generated, and ``all_layers / served`` per call. Each engine's KV cache is ``--kv-cache-mib``; one engine of
Qwen2.5-Coder-0.5B in bf16 takes about 3.5 GB (its engine-core and worker processes).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import tempfile
import time


def tiny_vllm_model(path: str) -> str:
    """The tiny test model with one attention head (head_dim 64, which vLLM's CPU attention supports)."""
    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    return str(save_tiny_model(path, seed=0, heads=VLLM_HEADS))


def random_adapters(model_path: str, names, rank: int, targets, seed: int = 0):
    """PEFT saved-state tensors for each name on the ``targets`` projections of a Qwen2/Llama model (A and B
    random), shaped from its config alone (the model is not loaded here)."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (fan_in, fan_out) in shapes.items():
                if module.rsplit(".", 1)[1] in targets:
                    key = f"base_model.model.model.layers.{layer}.{module}"
                    tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
                    tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.05
        out[name] = tensors
    return out


def source_prompts(model_path: str, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens of this file's source (distinct, code-like, deterministic)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_path).encode(open(__file__).read(), add_special_tokens=False)
    while len(ids) < length + count:
        ids = ids + ids
    step = max(1, (len(ids) - length) // count)
    return [ids[i * step:i * step + length] for i in range(count)]


async def start(variant: str, kwargs: dict, config):
    """A rollout actor; ``all_layers``: the same config without ``lora_target_modules``."""
    from openrlhf_populora.engines.ray.vllm_rollout import MultiLoRAConfig, MultiLoRARollout

    if variant == "all_layers":
        @dataclasses.dataclass(frozen=True)
        class EveryLayer(MultiLoRAConfig):
            def engine_kwargs(self, cpu: bool):
                extra = super().engine_kwargs(cpu)
                del extra["lora_target_modules"]
                return extra

        config = EveryLayer(**dataclasses.asdict(config))
    tic = time.perf_counter()
    actor = await MultiLoRARollout.create_in_process(**kwargs, multilora=config)
    return actor, time.perf_counter() - tic


async def run(args) -> dict:
    from openrlhf_populora.engines.adapter_files import lora_config_dict
    from openrlhf_populora.engines.ray.vllm_rollout import make_multilora_config
    from openrlhf_populora.engines.vllm_targets import vllm_lora_targets
    from openrlhf_populora.models.embedded import resolve_model

    model = resolve_model(args.model, for_vllm=True) if args.model else tiny_vllm_model(
        tempfile.mkdtemp(prefix="vllm-bench-model-"))
    names = [f"m{i}" for i in range(args.adapters)]
    adapters = random_adapters(model, names, args.rank, args.targets)
    lora_config = lora_config_dict(args.rank, 2 * args.rank, args.targets)
    config = make_multilora_config(args.adapters, args.rank, args.targets, dtype=args.dtype)
    kwargs = {
        "model": model, "enforce_eager": True,
        "worker_extension_cls": "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap", "tensor_parallel_size": 1,
        "seed": 0, "distributed_executor_backend": "uni", "max_model_len": args.max_model_len,
        "enable_prefix_caching": False, "dtype": "bfloat16", "trust_remote_code": True, "full_determinism": False,
        "gpu_memory_utilization": args.gpu_memory_utilization, "bundle_indices": None, "num_gpus": 1,
        "enable_sleep_mode": False, "agent_func_path": None, "remote_rm_url": None, "mm_pad_token_ids": set(),
        "kv_cache_memory_bytes": args.kv_cache_mib << 20,
    }
    variants = ("all_layers", "served")
    result = {"model": args.model or "tiny (hidden 64, 2 layers, head_dim 64)", "targets": args.targets,
              "served_lora_target_modules": vllm_lora_targets(args.targets), "adapters": args.adapters,
              "rank": args.rank, "requests": args.requests, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "threads": args.threads,
              "engines_alive": "one at a time" if args.one_at_a_time else "both, calls alternating", "engines": {}}
    prompts = source_prompts(model, args.requests, args.prompt_len)
    routes = [names[i % len(names)] for i in range(args.requests)]
    calls = {"sampled": {"temperature": 1.0, "max_tokens": args.max_tokens, "seed": 0},
             "greedy": {"temperature": 0.0, "max_tokens": args.max_tokens},
             "prefill": {"temperature": 0.0, "max_tokens": 1}}
    best = {call: dict.fromkeys(variants, float("inf")) for call in calls}
    tokens, outputs = {call: {} for call in calls}, {}

    async def up(variant):
        actor, start_s = await start(variant, kwargs, config)
        uploads = []
        for name in names:
            tic = time.perf_counter()
            await actor.load_adapter(name, adapters[name], lora_config)
            uploads.append(time.perf_counter() - tic)
        result["engines"][variant] = {
            "lora_target_modules": actor.llm.vllm_config.lora_config.target_modules,
            "dtype": str(actor.llm.vllm_config.model_config.dtype), "start_s": round(start_s, 1),
            "load_adapter_s_median": round(sorted(uploads)[len(uploads) // 2], 3)}
        await actor.generate_batch(prompts[:2], routes[:2], {"temperature": 0.0, "max_tokens": 2})  # warm-up
        return actor

    async def timed(variant, actor, call):
        tic = time.perf_counter()
        out = await actor.generate_batch(prompts, routes, {"top_p": 1.0, "n": 1, **calls[call]})
        best[call][variant] = min(best[call][variant], time.perf_counter() - tic)
        tokens[call][variant] = sum(len(s["response_ids"]) for samples in out for s in samples)
        outputs[(call, variant)] = [s["response_ids"] for samples in out for s in samples]

    if args.one_at_a_time:  # the memory of one engine; the machine's load may differ between the two
        for variant in variants:
            actor = await up(variant)
            for _ in range(args.repeats):
                for call in calls:
                    await timed(variant, actor, call)
            actor.llm.shutdown()
    else:
        actors = {variant: await up(variant) for variant in variants}
        for _ in range(args.repeats):
            for call in calls:
                for variant in variants:
                    await timed(variant, actors[variant], call)
        for actor in actors.values():
            actor.llm.shutdown()
    result["seconds"] = {call: {v: round(t, 2) for v, t in times.items()} for call, times in best.items()}
    result["tokens"] = tokens
    result["all_layers_over_served"] = {call: round(t["all_layers"] / t["served"], 2) for call, t in best.items()}
    result["same_outputs"] = {call: outputs[(call, "all_layers")] == outputs[(call, "served")] for call in calls}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="embedded-coder, embedded, tiny or a local HF model dir (default: the tiny model)")
    parser.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"],
                        help="the adapters' modules, as --ds.lora.target_modules (default: the CPU presets' q v)")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--dtype", default=None, help="engine dtype (default: the actor's, float32 on CPU)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, set before vLLM starts")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="each engine's KV cache")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="start the second engine after the first is shut down (half the memory; the calls "
                             "then no longer alternate)")
    args = parser.parse_args()
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # else it overrides kv_cache_memory_bytes on CPU (GiB steps)
    os.environ.setdefault("RAY_ADDRESS", "local")  # upstream's __init__ asks a running Ray otherwise
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine-core processes vLLM spawns read it
    from openrlhf_populora.engines.torch_threads import set_torch_threads

    set_torch_threads(args.threads)  # before vLLM: an engine core in this process would freeze the count
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":  # vLLM spawns its engine-core process: the guard is required
    main()
