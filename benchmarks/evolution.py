"""Benchmark: LoRA evolution operators on real Qwen2.5-7B module shapes vs a dense-SVD merge.

Qwen2.5-7B: hidden 3584, intermediate 18944, 28 layers, LoRA on q/k/v/o/gate/up/down (GQA k/v out 512).
For each rank (default 16 and 64) this times one full-adapter crossover (``svd_mean``: QR of the stacked
factors + SVD of the small core) and mutations, and measures the peak extra memory of the crossover.
The baseline is what PEFT's ``add_weighted_adapter(combination_type="svd")`` does per module: materialise
the merged ``d x k`` delta and run a full ``torch.linalg.svd``. It is too slow to run on every module, so it
runs on a small sample (``--dense-modules``), and the per-module ratio is printed side by side.

    python benchmarks/evolution.py                 # ranks 16 and 64; dense sample q_proj, k_proj, gate_proj
    python benchmarks/evolution.py --ranks 16 --layers 4 --dense-modules q_proj --threads 1

Targets (issue 7, 2 CPU cores): full rank-16 crossover <= 3 s, rank 64 <= 15 s; >= 200x faster than the
dense SVD per module; peak extra memory <= 3x one adapter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from openrlhf_populora.evolution import crossover, mutate

HIDDEN, INTERMEDIATE, LAYERS, KV = 3584, 18944, 28, 512
MODULES = {  # name: (out, in)
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (KV, HIDDEN),
    "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}


def make_adapter(rank: int, layers: int, seed: int, modules: dict | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(layers):
        for name, (out, inp) in (modules or MODULES).items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            sd[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp**0.5
            sd[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    return sd


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _memory_child(kind: str, name: str, rank: int, layers: int) -> None:
    """Run in a fresh process: build the parents, then print the peak RSS growth of one operator call."""
    parents = [make_adapter(rank, layers, seed) for seed in (0, 1)]
    warm = [make_adapter(rank, 1, seed) for seed in (2, 3)]  # load LAPACK etc. before measuring
    crossover(name, warm, seed=0) if kind == "crossover" else mutate(name, warm[0], seed=0)
    del warm
    open("/proc/self/clear_refs", "w").write("5")  # reset the kernel's peak-RSS counter
    before = _status_kb("VmRSS")
    child = crossover(name, parents, seed=0) if kind == "crossover" else mutate(name, parents[0], seed=0)
    print((max(_status_kb("VmHWM"), _status_kb("VmRSS")) - before) * 1024, len(child))


def peak_extra_bytes(kind: str, name: str, rank: int, layers: int) -> int:
    """Peak resident-memory growth of one operator call, measured in a fresh process in which glibc serves
    every allocation over 64 KiB by mmap and returns it on free (``MALLOC_MMAP_THRESHOLD_``), so the
    resident set tracks live tensors instead of reusing freed heap pages. -1 where that is unsupported."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, "--memory-child", kind, name, str(rank), str(layers)]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=900)
        return int(out.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return -1


def timed(fn, repeat: int = 1) -> tuple[float, float, object]:
    """Best (wall seconds, CPU seconds of this process) over ``repeat`` calls, and the last result.

    On a shared machine the wall time includes waiting for a core; with one thread the CPU time is what the
    wall time would be on an idle core."""
    wall, cpu, result = float("inf"), float("inf"), None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu, result


def dense_svd_merge(parents, weights, rank, key_a, key_b):
    """PEFT-style svd merge of one module: dense delta, full SVD, truncate (B = U S, A = Vh)."""
    delta = sum(w * (p[key_b] @ p[key_a]) for w, p in zip(weights, parents, strict=True))
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    return u[:, :rank] * s[:rank], vh[:rank]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--dense-modules", nargs="*", default=["q_proj", "k_proj", "gate_proj"],
                        help="module names (layer 0) for the dense-SVD comparison; none to skip it")
    parser.add_argument("--mutations", nargs="*", default=["gaussian", "sv_lognormal"])
    parser.add_argument("--memory-child", nargs=4, metavar=("KIND", "NAME", "RANK", "LAYERS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        kind, name, rank, layers = args.memory_child
        torch.set_num_threads(args.threads)
        _memory_child(kind, name, int(rank), int(layers))
        return
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.layers} layers x {len(MODULES)} "
          f"modules, Qwen2.5-7B shapes, fp32")
    ours_per_module: dict[tuple[int, str], tuple[float, float]] = {}

    for rank in args.ranks:
        parents = [make_adapter(rank, args.layers, seed) for seed in (0, 1)]
        size = nbytes(parents[0])
        info: dict = {}
        crossover("svd_mean", [make_adapter(rank, 1, 2), make_adapter(rank, 1, 3)], seed=0)  # warm-up
        wall, cpu, _ = timed(lambda p=parents, i=info: crossover("svd_mean", p, seed=0, info=i))
        extra = peak_extra_bytes("crossover", "svd_mean", rank, args.layers)
        print(f"\nrank {rank}: one adapter = {size / 2**20:.0f} MiB (fp32)")
        print(f"  crossover svd_mean      wall {wall:6.2f} s  cpu {cpu:6.2f} s   peak extra memory (child "
              f"included) {extra / 2**20:5.0f} MiB = {extra / size:.2f}x one adapter   "
              f"truncation energy {info['truncation_energy']:.3f}")
        for name in args.mutations:
            wall, cpu, _ = timed(lambda n=name, p=parents: mutate(n, p[0], seed=0))
            extra = peak_extra_bytes("mutation", name, rank, args.layers)
            print(f"  mutation {name:14s} wall {wall:6.2f} s  cpu {cpu:6.2f} s   peak extra memory (child "
                  f"included) {extra / 2**20:5.0f} MiB = {extra / size:.2f}x one adapter")
        del parents
        for short in args.dense_modules:
            name = next(n for n in MODULES if n.endswith(short))
            small = [make_adapter(rank, 1, seed, {name: MODULES[name]}) for seed in (0, 1)]
            wall, cpu, _ = timed(lambda s=small: crossover("svd_mean", s, seed=0), repeat=3)
            ours_per_module[(rank, short)] = (wall, cpu)

    if args.dense_modules:
        print("\nper module, layer 0: ours (QR + small SVD) vs dense delta + full SVD (PEFT svd merge)")
        for short in args.dense_modules:
            name = next(n for n in MODULES if n.endswith(short))
            rank = args.ranks[0]
            small = [make_adapter(rank, 1, seed, {name: MODULES[name]}) for seed in (0, 1)]
            key = f"base_model.model.model.layers.0.{name}"
            dense_wall, dense_cpu, (b, a) = timed(
                lambda s=small, k=key, r=rank: dense_svd_merge(s, [0.5, 0.5], r, k + ".lora_A.weight",
                                                              k + ".lora_B.weight"))
            # the exact answer: our method in float64 (it matches a float64 dense SVD to ~1e-14 in the tests)
            exact = crossover("svd_mean", [{k: v.double() for k, v in p.items()} for p in small], seed=0)
            exact_delta = exact[key + ".lora_B.weight"] @ exact[key + ".lora_A.weight"]
            ours = crossover("svd_mean", small, seed=0)
            errors = [float((d.double() - exact_delta).norm() / exact_delta.norm())
                      for d in (ours[key + ".lora_B.weight"] @ ours[key + ".lora_A.weight"], b @ a)]
            out, inp = MODULES[name]
            print(f"  {short:9s} ({out}x{inp}): dense wall {dense_wall:6.2f} s  cpu {dense_cpu:6.2f} s;  "
                  f"rank-{rank} error vs exact: ours {errors[0]:.1e}, dense fp32 SVD {errors[1]:.1e}")
            for r in args.ranks:
                wall, cpu = ours_per_module[(r, short)]
                print(f"      rank {r:3d}: ours wall {wall * 1000:7.1f} ms  cpu {cpu * 1000:7.1f} ms   "
                      f"speed-up wall {dense_wall / wall:6.0f}x  cpu {dense_cpu / cpu:6.0f}x")


if __name__ == "__main__":
    main()
