"""What a checkpoint costs on `make run`'s preset (configs/laptop.yaml, Qwen2.5-Coder-0.5B-Instruct, 2 teachers +
2 students, LoRA rank 8 on q/v), as a share of the step it follows.

Builds the run's real state: the engine with its four adapters, each after one AdamW update (so every Adam state
exists, as after step 1), the population, ratings, the seeded buffers and the coverage archive; then times
``save_checkpoint`` of it (``SelfPlay.save_state``: write, fsync every file and directory, publish, prune) ``--repeat``
times and prints the median against docs/usage.md's measured step time (85-104 s on 2 cores).

    .venv/bin/python benchmarks/checkpoint.py [--model embedded-coder] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from openrlhf_populora.build import build_engine
from openrlhf_populora.config import parse_config
from openrlhf_populora.engines.base import Trajectory
from openrlhf_populora.sandbox import Sandbox
from openrlhf_populora.selfplay.checkpoint import save_checkpoint
from openrlhf_populora.selfplay.loop import SelfPlay

STEP_SECONDS = (85.0, 104.0)  # README: each step of `make run`, measured on this 2-core machine


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded-coder")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = parse_config(["--config", "configs/laptop.yaml", "--ckpt.output_dir", tmp,
                               "--actor.model_name_or_path", args.model])
        engine = build_engine(config)
        with Sandbox(workers=2) as sandbox:
            loop = SelfPlay(config, engine, sandbox, tmp)
            loop.create_adapters()
            loop.seed_buffers()
            ids = engine.tokenizer("def f(x):\n    return x + 1\n", add_special_tokens=False)["input_ids"]
            engine.train_step([Trajectory(m.adapter, ids, ids, 1.0) for m in loop.population.alive()])
            root = Path(tmp) / "checkpoints"
            seconds = []
            for step in range(1, args.repeat + 1):
                tic = time.perf_counter()
                final = save_checkpoint(root, step, loop.save_state, max_num=config.ckpt.max_num)
                seconds.append(time.perf_counter() - tic)
            size = _size(final)
        engine.close()
    median = statistics.median(seconds)
    print(f"checkpoint: {size / 1e6:.1f} MB, median {median:.3f} s over {len(seconds)} saves "
          f"(min {min(seconds):.3f}, max {max(seconds):.3f})")
    low, high = STEP_SECONDS
    print(f"per step of make run ({low:.0f}-{high:.0f} s): {100 * median / high:.2f}-{100 * median / low:.2f}% "
          f"of the step's time")


if __name__ == "__main__":
    main()
