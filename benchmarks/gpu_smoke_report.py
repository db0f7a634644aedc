"""Prints what ``gpu_smoke.sh`` measured: steps, phase wall-clock, population / baseline step time, GPU memory.

    python benchmarks/gpu_smoke_report.py RUN_DIR_POPULATION RUN_DIR_BASELINE

Each run directory holds ``metrics.jsonl`` (one JSON object per step, ``time/<phase>`` keys in seconds) and ``events.jsonl``;
``<run dir>.mem`` holds nvidia-smi's memory samples (MiB, one per line). The first step is left out of the
step-time means (it includes vLLM's warm-up and the first adapter uploads).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import fmean


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evolution_events(run_dir: Path) -> int:
    path = run_dir / "events.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return sum(1 for row in rows if row.get("kind") == "evolution")


def peak_mib(run_dir: Path) -> float | None:
    path = run_dir.with_suffix(".mem")
    values = [float(v) for v in path.read_text().split()] if path.exists() else []
    return max(values) if values else None


def main(population: str, baseline: str) -> int:
    runs = {"population (2T+2S)": Path(population), "baseline (1 adapter)": Path(baseline)}
    step_time = {}
    for label, run_dir in runs.items():
        rows = steps(run_dir)
        print(f"\n== {label}: {len(rows)} steps done ({run_dir})")
        phases = sorted({k for row in rows for k in row if k.startswith("time/")})
        for key in phases:
            values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
            print(f"  {key:32s} mean {fmean(values):8.2f} s   per step: {' '.join(f'{v:.1f}' for v in values)}")
        timed = [row["time/step"] for row in rows[1:] if isinstance(row.get("time/step"), (int, float))]
        step_time[label] = fmean(timed) if timed else None
        print(f"  evolution events: {evolution_events(run_dir)}")
        peak = peak_mib(run_dir)
        print(f"  peak GPU memory: {peak:.0f} MiB" if peak is not None else "  peak GPU memory: (no samples)")
    pop, base = step_time.values()
    if pop and base:
        print(f"\nstep time, steps 2..: population {pop:.2f} s, baseline {base:.2f} s -> x{pop / base:.2f} "
              f"(target <= x1.15; the paper reports x1.31 for 4T+4S)")
    peaks = [peak_mib(p) for p in runs.values()]
    if all(p is not None for p in peaks):
        print(f"GPU memory, 4 adapters vs 1: {peaks[0]:.0f} vs {peaks[1]:.0f} MiB (x{peaks[0] / peaks[1]:.2f})")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
