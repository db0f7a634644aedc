"""Data parallelism of the Ray engine's training: the same samples trained at 1 rank and at 2 ranks.

Each run is the real DeepSpeed policy actor (``engines/ray/policy_actor.py``, gloo on CPU) holding every adapter,
fed the micro-batches the controller hands upstream's actor group: :func:`build_experiences`, then
:func:`deal_experiences` for the ranks (each adapter's micro-batches dealt across the ranks, every rank padded
to the same count), then upstream's contiguous chunk per rank. ``--layout contiguous`` feeds the chunks without
dealing, as the engine did before (each adapter's micro-batches on one or two ranks, the others padding).

Printed per run: the training time of ``fit`` (mean of ``--repeats`` after one warm-up), each rank's real
micro-batches per adapter, the window length per adapter (micro-steps every rank runs), and the ratio of the
2-rank time to the 1-rank time. On 2 CPU cores each rank gets one core, so the ideal ratio is about 0.5; a
layout that stacks an adapter on one rank shows it as windows as long as at 1 rank.

    .venv/bin/python benchmarks/ray_dp.py                          # ZeRO-2, dealt
    .venv/bin/python benchmarks/ray_dp.py --layout contiguous      # the old layout, for comparison
    .venv/bin/python benchmarks/ray_dp.py --zero-stage 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

WORKER = "--worker"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _upstream_args(argv: list[str]):
    """OpenRLHF's own parser (captured by the launcher) and the two values its validation derives."""
    from openrlhf.utils.config import hierarchize

    from openrlhf_populora.build.ray import upstream_parser

    args = hierarchize(upstream_parser().parse_args(argv))
    args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)
    if len(args.algo.advantage.is_correction_threshold) == 1:
        args.algo.advantage.is_correction_threshold.insert(0, 0.0)
    return args


def _trajectories(names: list[str], per_adapter: int, prompt: int, response: int, seed: int):
    import torch

    from openrlhf_populora.engines.base import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for name in names:
        for i in range(per_adapter):
            ids = torch.randint(3, 250, (prompt + response,), generator=g).tolist()
            out.append(Trajectory(name, ids[:prompt], ids[prompt:], 1.0 if i % 2 else -1.0, group=name))
    return out


def worker(options: dict) -> None:
    """One rank: build the actor, append this rank's chunk, time ``fit``; rank 0 writes the result."""
    import torch
    from openrlhf_populora.patches.openrlhf_0_11_2 import cpu

    cpu.setup_cpu_worker()  # the flash_attn shim before OpenRLHF imports it, and the CPU patches
    torch.set_num_threads(1)
    from openrlhf.utils import get_strategy

    from openrlhf_populora.engines.ray import policy_actor as pa
    from openrlhf_populora.engines.ray.experience import build_experiences, deal_experiences, is_padding

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    names = [f"a{i}" for i in range(options["adapters"])]
    out = Path(options["out"])
    args = _upstream_args([
        "--actor.model_name_or_path", options["model"], "--ds.lora.rank", "8", "--ds.lora.alpha", "16",
        "--ds.attn_implementation", "eager", "--ds.zero_stage", str(options["zero_stage"]),
        "--train.micro_batch_size", str(options["micro"]), "--actor.adam.lr", "1e-4",
        "--actor.lr_scheduler", "constant", "--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0",
        "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "run"), "--vllm.num_engines", "0"])
    args.ds.param_dtype = "fp32"
    args.populora = SimpleNamespace(adapter_names=names, seed=7)
    actor = pa.PopuLoRAPolicyActor.__ray_actor_class__.__new__(pa.PopuLoRAPolicyActor.__ray_actor_class__)
    actor.init_model_from_pretrained(get_strategy(args), options["model"], max_steps=100)
    built = build_experiences(_trajectories(names, options["per_adapter"], options["prompt"], options["response"], 0),
                              names, 0, options["micro"], ranks=world)
    for experience in built:  # the trajectory's advantage on each response token (what the maker computes)
        mask = experience.action_mask.float()
        experience.advantages = experience.rewards.float()[:, None] * mask
        experience.returns = experience.advantages.clone()
    ordered = deal_experiences(built, world, 0) if options["layout"] == "dealt" else built
    chunk = -(-len(ordered) // world)  # upstream's async_run_method_batch: ceil(total / ranks), contiguous
    mine = ordered[rank * chunk:(rank + 1) * chunk]
    for experience in mine:
        # old log-probs from the actor itself (ratio 1), as experience making computes them
        name = names[int(experience.info["populora_adapter"][0])]
        experience.action_log_probs = actor.forward(experience.sequences, experience.action_mask,
                                                    experience.attention_mask, adapter_name=name)
    real = {name: sum(1 for e in mine if not is_padding(e) and names[int(e.info["populora_adapter"][0])] == name)
            for name in names}
    times = []
    for repeat in range(options["repeats"] + 1):
        for experience in mine:
            actor.append(experience)
        torch.distributed.barrier()
        tic = time.perf_counter()
        status = actor.fit(0.0)
        torch.distributed.barrier()
        if repeat:  # the first fit warms up (allocations, DeepSpeed's first step)
            times.append(time.perf_counter() - tic)
    trained = sorted(k.split("/")[1] for k in status if k.startswith("populora/") and k.endswith("/updates"))
    result = {"rank": rank, "world": world, "seconds": sum(times) / len(times), "real_micro_batches": real,
              "micro_batches_sent": len(mine), "trained": trained}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def run(world: int, options: dict) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix=f"ray-dp-{world}-"))
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        procs.append(subprocess.Popen([sys.executable, __file__, WORKER, json.dumps({**options, "out": str(out)})],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("\n".join(log[-4000:] for log in logs))
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == WORKER:
        worker(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a model name of this package or a local HF folder")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--per-adapter", type=int, default=16, help="samples per adapter")
    parser.add_argument("--micro", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--zero-stage", type=int, default=2, choices=(2, 3))
    parser.add_argument("--layout", default="dealt", choices=("dealt", "contiguous"))
    parser.add_argument("--repeats", type=int, default=2)
    options = vars(parser.parse_args())
    from openrlhf_populora.models.embedded import is_builtin_model, resolve_model

    if is_builtin_model(options["model"]):
        options["model"] = str(resolve_model(options["model"]))
    print(f"ray_dp: {options['adapters']} adapters x {options['per_adapter']} samples "
          f"({options['prompt']}+{options['response']} tokens), micro-batch {options['micro']}, "
          f"ZeRO-{options['zero_stage']}, layout {options['layout']}")
    one, two = run(1, options), run(2, options)
    for results in (one, two):
        for r in results:
            print(f"  {r['world']} rank(s), rank {r['rank']}: fit {r['seconds']:.2f} s, "
                  f"{r['micro_batches_sent']} micro-batches sent, real per adapter {r['real_micro_batches']}")
    for results in (one, two):  # every rank runs each adapter's window for the longest rank's share
        windows = {name: max(r["real_micro_batches"][name] for r in results) for name in results[0]["real_micro_batches"]}
        print(f"  {len(results)} rank(s): window per adapter (micro-steps on every rank) {windows}, "
              f"{sum(windows.values())} in all")
    ratio = max(r["seconds"] for r in two) / one[0]["seconds"]
    print(f"training time, 2 ranks / 1 rank: {ratio:.2f} (ideal on 2 cores: ~0.5)")


if __name__ == "__main__":
    main()
