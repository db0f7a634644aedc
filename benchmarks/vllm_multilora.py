"""Benchmark: the multi-LoRA vLLM rollout actor, in-process (no Ray), on the vLLM build installed here.

Builds the actor exactly as upstream's ``create_vllm_engines`` would (``MultiLoRARollout.create_in_process``),
uploads N random rank-r adapters (PEFT tensors, as the trainer sends them) and times:

- engine start (upstream's ``__init__`` + LoRA slots; vLLM's ``AsyncLLM`` spawns its engine-core process);
- ``load_adapter`` per upload (tmpfs write + ``add_lora`` + retiring the previous version);
- generation throughput (sampled, T=1) for the same number of requests: all on the base, all on one
  adapter, and spread over all N adapters in one mixed batch.

    python benchmarks/vllm_multilora.py                        # tiny model built in code, 4 adapters
    python benchmarks/vllm_multilora.py --model /path/to/hf --adapters 8 --rank 16 --requests 64

Prints one JSON object. On CPU set ``VLLM_CPU_KVCACHE_SPACE`` (GiB; default here 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time


def tiny_vllm_model(path: str) -> str:
    """The tiny test model with one attention head (head_dim 64, which vLLM's CPU attention supports)."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from openrlhf_populora.models.tiny import build_tiny_tokenizer, tiny_config

    tokenizer = build_tiny_tokenizer()
    config = tiny_config(len(tokenizer))
    config.num_attention_heads = config.num_key_value_heads = 1
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def random_adapters(model_path: str, names, rank: int, seed: int = 0):
    """PEFT saved-state tensors for each name (all-linear, A and B random), built with peft on the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    template = get_peft_model_state_dict(model)
    gen = torch.Generator().manual_seed(seed)
    return {name: {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in template.items()} for name in names}


async def run(args) -> dict:
    from openrlhf_populora.engines.adapter_files import lora_config_dict
    from openrlhf_populora.engines.ray.vllm_rollout import MultiLoRARollout, make_multilora_config

    model = args.model or tiny_vllm_model(tempfile.mkdtemp(prefix="vllm-bench-model-"))
    names = [f"m{i}" for i in range(args.adapters)]
    adapters = random_adapters(model, names, args.rank)
    lora_config = lora_config_dict(args.rank, 2 * args.rank, ["all-linear"])
    kwargs = {
        "model": model, "enforce_eager": True,
        "worker_extension_cls": "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap", "tensor_parallel_size": 1,
        "seed": 0, "distributed_executor_backend": "uni", "max_model_len": args.max_model_len,
        "enable_prefix_caching": False, "dtype": "bfloat16", "trust_remote_code": True, "full_determinism": False,
        "gpu_memory_utilization": args.gpu_memory_utilization, "bundle_indices": None, "num_gpus": 1,
        "enable_sleep_mode": False, "agent_func_path": None, "remote_rm_url": None, "mm_pad_token_ids": set(),
    }
    tic = time.perf_counter()
    actor = await MultiLoRARollout.create_in_process(
        **kwargs, multilora=make_multilora_config(args.adapters, args.rank))
    start_s = time.perf_counter() - tic
    uploads = []
    for _ in range(2):  # the second round swaps every adapter to a new version (fresh ids)
        for name in names:
            tic = time.perf_counter()
            await actor.load_adapter(name, adapters[name], lora_config)
            uploads.append(time.perf_counter() - tic)
    prompt = list(range(40, 40 + args.prompt_len))
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": args.max_tokens, "n": 1, "seed": 0}

    async def throughput(adapter_of) -> float:
        best = 0.0
        for _ in range(args.repeats):
            tic = time.perf_counter()
            out = await actor.generate_batch([prompt] * args.requests,
                                             [adapter_of(i) for i in range(args.requests)], sampling)
            tokens = sum(len(s["response_ids"]) for samples in out for s in samples)
            best = max(best, tokens / (time.perf_counter() - tic))
        return best

    await throughput(lambda i: None)  # warm-up
    result = {
        "model": args.model or "tiny (hidden 64, 2 layers, head_dim 64)",
        "adapters": args.adapters, "rank": args.rank, "requests": args.requests, "max_tokens": args.max_tokens,
        "engine_start_s": round(start_s, 2),
        "load_adapter_s_median": round(sorted(uploads)[len(uploads) // 2], 4),
        "tokens_per_s": {
            "base": round(await throughput(lambda i: None)),
            "one_adapter": round(await throughput(lambda i: names[0])),
            "mixed_all_adapters": round(await throughput(lambda i: names[i % len(names)])),
        },
    }
    result["mixed_over_one_adapter"] = round(
        result["tokens_per_s"]["mixed_all_adapters"] / result["tokens_per_s"]["one_adapter"], 3)
    actor.llm.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local HF model dir (default: the tiny model)")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("RAY_ADDRESS", "local")  # upstream's __init__ asks a running Ray otherwise
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(json.dumps(asyncio.run(run(args)), indent=1))


if __name__ == "__main__":  # vLLM spawns its engine-core process: the guard is required
    main()
