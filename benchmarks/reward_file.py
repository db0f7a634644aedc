"""Throughput of the OpenRLHF reward file (``openrlhf_populora/openrlhf_reward.py``), measured side by side
(not a timed test).

The file is loaded the way OpenRLHF 0.11.2 loads ``--reward.remote_url <file>.py`` (``spec_from_file_location``)
and its ``reward_func`` scores completions of the seed tasks (``configs/seeds/basic.jsonl``: each triplet as
code_o and as code_i, and the code_f tasks), right and wrong answers mixed, in the solver's answer format. Two
call shapes, each with 1 thread and with ``--threads`` threads calling at once (fresh threads every round, as
callers come and go):

  batched     reward_func on ``--batch`` completions per call (one sandbox batch per call);
  per sample  reward_func on ONE completion per call, as upstream calls it (``asyncio.to_thread`` per sample).

Every thread makes ``--calls`` calls of the same shape. Printed: rewards/s (wall clock) for 1 and N threads, the
ratio N/1, and CPU milliseconds per reward (this process + the sandbox's worker processes and the jobs they
reaped). The rewards of every call are checked against the expected ones (1.0 right, -0.5 wrong): a speed-up
that changed a score would be a bug, not a speed-up.

    python benchmarks/reward_file.py [--batch 64] [--calls 8] [--threads 4] [--workers 2] [--rounds 3]
    python benchmarks/reward_file.py --reward-file old_openrlhf_reward.py   # another version, same measurements

Numbers on a shared 2-core machine are noisy: compare the ratios printed by one run, not runs. The shapes and
thread counts are timed ``--rounds`` times, interleaved, and the best round of each is reported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from openrlhf_populora.tasks import Task, solver_prompt  # noqa: E402

REWARD_FILE = ROOT / "openrlhf_populora" / "openrlhf_reward.py"
SEED_FILE = ROOT / "configs" / "seeds" / "basic.jsonl"
TRIPLET_TYPES = ("code_o", "code_i")


def load_reward_file(path: Path):
    """As OpenRLHF 0.11.2's SingleTurnAgentExecutor does: by path, not registered in sys.modules."""
    spec = importlib.util.spec_from_file_location("reward_func", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answer_block(task: Task, correct: bool) -> str:
    if task.task_type == "code_o":
        return f"```output\n{task.outputs[0] if correct else repr('not the output')}\n```"
    if task.task_type == "code_i":
        return f"```input\n{task.inputs[0] if correct else repr('not the input')}\n```"
    wrong = "def f(x):\n    return None"
    return f"```python\n{task.program.strip() if correct else wrong}\n```"


def samples() -> list[tuple[str, str, str, float]]:
    """(query, prompt, label, expected reward) for every seed task, right and wrong: 56 distinct samples."""
    seen, tasks = set(), []
    for line in SEED_FILE.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        task = Task.from_dict(json.loads(line))
        played = [task.retyped(t) for t in TRIPLET_TYPES] if task.task_type in TRIPLET_TYPES else [task]
        for t in played:
            if t.key() not in seen:
                seen.add(t.key())
                tasks.append(t)
    out = []
    for task in tasks:
        prompt = solver_prompt(task)
        for correct in (True, False):
            query = f"{prompt}<think>Let me work it out.</think>\n<answer>\n{answer_block(task, correct)}\n</answer>"
            out.append((query, prompt, task.to_json(), 1.0 if correct else -0.5))
    return out


def batches(pool: list, size: int, count: int, offset: int) -> list[list]:
    """``count`` batches of ``size`` samples, taken cyclically from ``pool`` (right and wrong interleaved)."""
    return [[pool[(offset + b * size + k) % len(pool)] for k in range(size)] for b in range(count)]


def cpu_seconds() -> float:
    """CPU seconds of this process and of every live process under it (each with the children it reaped)."""
    me = psutil.Process()
    total = me.cpu_times().user + me.cpu_times().system
    for proc in me.children(recursive=True):
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def timed(reward_func, work: list[list[list]]) -> tuple[float, float, int]:
    """Run each thread's list of calls (one thread per entry, all started at once); wall s, CPU s, rewards."""
    errors: list[str] = []

    def worker(calls: list[list], barrier: threading.Barrier) -> None:
        barrier.wait()
        for batch in calls:
            out = reward_func([s[0] for s in batch], [s[1] for s in batch], [s[2] for s in batch])
            got, want = out["rewards"].tolist(), [s[3] for s in batch]
            if got != want:
                errors.append(f"rewards {got} != expected {want}")

    barrier = threading.Barrier(len(work) + 1)
    threads = [threading.Thread(target=worker, args=(calls, barrier)) for calls in work]
    for t in threads:
        t.start()
    cpu0 = cpu_seconds()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    if errors:
        raise SystemExit(f"wrong rewards ({len(errors)} calls), e.g. {errors[0]}")
    return wall, cpu, sum(len(batch) for calls in work for batch in calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="completions per call in the batched shape")
    parser.add_argument("--calls", type=int, default=8, help="calls per thread per round")
    parser.add_argument("--threads", type=int, default=4, help="threads calling at once (compared with 1)")
    parser.add_argument("--workers", type=int, default=2, help="sandbox workers (POPULORA_SANDBOX_WORKERS)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds; the best of each is reported")
    parser.add_argument("--reward-file", type=Path, default=REWARD_FILE,
                        help="the reward file to load (default: this repository's; e.g. an older version of it)")
    args = parser.parse_args()
    os.environ["POPULORA_SANDBOX_WORKERS"] = str(args.workers)
    os.environ.pop("POPULORA_REWARD_MODE", None)

    module = load_reward_file(args.reward_file)
    pool = samples()
    # warm-up: starts the sandbox and scores every sample once
    warm = module.reward_func([s[0] for s in pool], [s[1] for s in pool], [s[2] for s in pool])
    assert warm["rewards"].tolist() == [s[3] for s in pool], "the reward file scores the seed samples wrong"

    shapes = {"batched": args.batch, "per sample": 1}
    best: dict[tuple[str, int], tuple[float, float, int]] = {}
    for round_no in range(args.rounds):
        for shape, size in shapes.items():
            calls = args.calls if size > 1 else args.calls * args.batch  # the same rewards per thread
            for n in (1, args.threads):
                work = [batches(pool, size, calls, offset=round_no * 7 + i * 13) for i in range(n)]
                result = timed(module.reward_func, work)
                key = (shape, n)
                if key not in best or result[2] / result[0] > best[key][2] / best[key][0]:
                    best[key] = result

    stats = module.sandbox_stats() if hasattr(module, "sandbox_stats") else {}
    print(f"reward file: {args.reward_file}; {len(pool)} distinct samples (seed tasks, right and "
          f"wrong); sandbox workers={args.workers}; best of {args.rounds} rounds; {os.cpu_count()} CPUs")
    for shape, size in shapes.items():
        rates = {}
        for n in (1, args.threads):
            wall, cpu, rewards = best[(shape, n)]
            rates[n] = rewards / wall
            label = f"{size} completion{'s' if size > 1 else ''}/call"
            print(f"{shape:<10} {label:<18} {n} thread{'s' if n > 1 else ' '}: {rewards / wall:8.1f} rewards/s "
                  f"({rewards} rewards in {wall:.2f} s; {1000 * cpu / rewards:.2f} CPU ms/reward)")
        print(f"{shape:<10} {args.threads} threads / 1 thread: {rates[args.threads] / rates[1]:.2f}x")
    if stats:
        print(f"sandbox: {stats.get('batches', 0)} batches, {stats.get('executions', 0)} jobs, "
              f"{stats.get('worker_restarts', 0)} worker restarts")


if __name__ == "__main__":
    main()
