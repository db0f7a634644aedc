"""Sandbox throughput, measured side by side (not a timed test).

Runs the same batch of ordinary AZR-like programs (a small function and a call, as in a validity check)
through three executors in one run and prints jobs/s, ratios and p50/p95 latency:

  (a) fresh      a fresh ``python -c`` subprocess per job (no isolation beyond the process);
  (b) reused     AZR-style: long-lived worker interpreters that ``exec`` job after job, no isolation at all
                 (the speed reference, not a design to copy), with 1 worker (AZR's default) and with N;
  (c) sandbox    ``openrlhf_populora.sandbox.Sandbox`` with full isolation (bwrap when usable here);
  (f) bare fork  for reference: a warm worker that forks per job with no isolation at all, the cost floor
                 of any fresh-process-per-job design in CPython.

Two batches: "unique" (every job its own program) and "answers" (a few programs, many expressions each,
as when verifying the students' answers to one task: the sandbox execs each program once).

    python benchmarks/sandbox.py [--programs 200] [--workers 2] [--fresh-jobs 60]

Numbers on a shared 2-core machine are noisy: compare the ratios printed by one run, not runs. Besides
wall-clock jobs/s the script prints CPU seconds per job (this process + every worker process and the jobs
they reaped), which depends far less on what else runs on the machine: jobs/s on an idle machine with C
cores is about C / (CPU per job) for the parallel executors.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from openrlhf_populora.sandbox import Sandbox  # noqa: E402

TEMPLATES = [
    "def f(xs):\n    total = 0\n    for i, x in enumerate(xs):\n        total += (i + {k}) * x\n    return total\n",
    "def f(s):\n    out = []\n    for ch in s:\n        out.append(chr((ord(ch) - 97 + {k}) % 26 + 97))\n"
    "    return ''.join(out)\n",
    "from collections import Counter\n\ndef f(xs):\n    c = Counter(x % {m} for x in xs)\n"
    "    return sorted(c.items())\n",
    "def f(n):\n    a, b = 0, 1\n    for _ in range(n + {k}):\n        a, b = b, a + b\n    return a\n",
    "import math\n\ndef f(xs):\n    return [math.isqrt(x * {m}) for x in xs if x % 2 == {p}]\n",
]
ARGS = ["[3, 1, 4, 1, 5, 9, 2, 6]", "'hello'", "[5, 8, 13, 21, 34, 55]", "10", "[4, 9, 16, 25, 36]"]


def programs(n: int) -> list[tuple[str, str]]:
    out = []
    for i in range(n):
        t = i % len(TEMPLATES)
        code = TEMPLATES[t].format(k=i + 1, m=i % 97 + 2, p=i % 2)  # every program distinct
        out.append((code, f"f({ARGS[t]})"))
    return out


def answer_batch(n_programs: int, answers: int) -> list[tuple[str, str]]:
    return [(code, expr) for code, expr in programs(n_programs) for _ in range(answers)]


# ---------------------------------------------------------------- (a) a fresh python -c per job

def run_fresh(jobs: list[tuple[str, str]]) -> tuple[list[str], list[float]]:
    values, lat = [], []
    for code, expr in jobs:
        t = time.perf_counter()
        src = code + f"\nimport sys\nsys.stdout.write(repr({expr}))\n"
        proc = subprocess.run([sys.executable, "-c", src], capture_output=True, timeout=30, check=False)
        lat.append(time.perf_counter() - t)
        values.append(proc.stdout.decode())
    return values, lat


# ---------------------------------------------------------------- (b) AZR-style reused interpreters

_REUSED_WORKER = r"""
import json, struct, sys
H = struct.Struct(">I")
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(4)
    if len(head) < 4:
        break
    code, expr = json.loads(inp.read(H.unpack(head)[0]))
    try:
        ns = {"__name__": "__main__"}
        exec(code, ns)
        res = ["ok", repr(eval(expr, ns))]
    except BaseException as e:
        res = ["error", f"{type(e).__name__}: {e}"]
    body = json.dumps(res).encode()
    out.write(H.pack(len(body)) + body)
    out.flush()
"""


class ReusedPool:
    """Long-lived worker interpreters that exec one job after another (no isolation)."""

    def __init__(self, workers: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", _REUSED_WORKER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE) for _ in range(workers)]
        self.h = struct.Struct(">I")

    def run(self, jobs: list[tuple[str, str]]) -> tuple[list[str], list[float]]:
        """Round-robin over the workers, one job in flight per worker (pebble-like)."""
        values: list[str | None] = [None] * len(jobs)
        lat = [0.0] * len(jobs)
        k = len(self.procs)
        for start in range(0, len(jobs), k):
            t = time.perf_counter()
            batch = list(enumerate(jobs[start:start + k], start))
            for (_, (code, expr)), proc in zip(batch, self.procs, strict=False):
                body = json.dumps([code, expr]).encode()
                proc.stdin.write(self.h.pack(len(body)) + body)
                proc.stdin.flush()
            for (i, _), proc in zip(batch, self.procs, strict=False):
                n = self.h.unpack(proc.stdout.read(4))[0]
                values[i] = self.decode(proc.stdout.read(n))
                lat[i] = time.perf_counter() - t
        return values, lat

    def decode(self, body: bytes) -> str:
        return json.loads(body)[1]

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait()


# ---------------------------------------------------------------- (f) the floor of any fork-per-job design

_FORK_FLOOR = r"""
import json, os, struct, sys
H = struct.Struct(">I")
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(4)
    if len(head) < 4:
        break
    code, expr = json.loads(inp.read(H.unpack(head)[0]))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ns = {"__name__": "__main__"}
        exec(code, ns)
        os.write(w, repr(eval(expr, ns)).encode())
        os._exit(0)
    os.close(w)
    body = b""
    while chunk := os.read(r, 65536):
        body += chunk
    os.close(r)
    os.waitpid(pid, 0)
    out.write(H.pack(len(body)) + body)
    out.flush()
"""


class ForkFloor(ReusedPool):
    """A bare fork per job from a warm worker, no isolation at all: what fork + exit cost by themselves."""

    def __init__(self, workers: int):
        self.procs = [subprocess.Popen([sys.executable, "-S", "-c", _FORK_FLOOR], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE) for _ in range(workers)]
        self.h = struct.Struct(">I")

    def decode(self, body: bytes) -> str:
        return body.decode()


# ---------------------------------------------------------------- measurement

_TCK = os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid``, of the children it reaped, and (recursively) of its live children."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total = sum(int(x) for x in fields[11:15]) / _TCK  # utime, stime, cutime, cstime
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return total + sum(tree_cpu(int(c)) for c in f.read().split())
    except OSError:
        return 0.0


class CpuMeter:
    """CPU seconds spent by this process, its reaped children and the given live process trees."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    def now(self) -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system + sum(tree_cpu(p) for p in self.pids)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))]


def report(name: str, n: int, seconds: float, lat: list[float], cpu: float) -> tuple[float, float]:
    rate, cpu_ms = n / seconds, cpu / n * 1e3
    print(f"  {name:<30s} {rate:8.1f} jobs/s   p50 {pct(lat, .5) * 1e3:7.2f} ms   p95 {pct(lat, .95) * 1e3:7.2f} ms"
          f"   cpu {cpu_ms:6.2f} ms/job")
    return rate, cpu_ms


def measure(label: str, jobs: list, fresh_jobs: int, workers: int) -> None:
    print(f"\n{label}: {len(jobs)} jobs ({len({c for c, _ in jobs})} distinct programs)")
    rates, cpus = {}, {}
    sub = jobs[:fresh_jobs]
    meter = CpuMeter([])
    c0, t = meter.now(), time.perf_counter()
    fresh_vals, lat = run_fresh(sub)
    rates["a"], cpus["a"] = report(f"(a) fresh python -c [{len(sub)}]", len(sub), time.perf_counter() - t, lat,
                                   meter.now() - c0)
    for w in sorted({1, workers}):
        pool = ReusedPool(w)
        pool.run(jobs[:8])  # warm
        meter = CpuMeter([p.pid for p in pool.procs])
        c0, t = meter.now(), time.perf_counter()
        reused_vals, lat = pool.run(jobs)
        rates[f"b{w}"], cpus[f"b{w}"] = report(f"(b) reused, {w} worker(s)", len(jobs), time.perf_counter() - t,
                                               lat, meter.now() - c0)
        pool.close()
    floor = ForkFloor(workers)
    floor.run(jobs[:8])
    meter = CpuMeter([p.pid for p in floor.procs])
    c0, t = meter.now(), time.perf_counter()
    floor_vals, lat = floor.run(jobs)
    rates["f"], cpus["f"] = report(f"(f) bare fork, {workers} workers", len(jobs), time.perf_counter() - t, lat,
                                   meter.now() - c0)
    floor.close()
    assert floor_vals == reused_vals, "bare fork and reused executor disagree"
    with Sandbox(workers=workers, timeout_s=5.0, memory_mb=512) as sb:
        sb.run(jobs[:8])  # warm
        meter = CpuMeter([w.proc.pid for w in sb._pool])
        c0, t = meter.now(), time.perf_counter()
        results = sb.run(jobs)
        rates["c"], cpus["c"] = report(f"(c) sandbox [{sb.isolation}], {workers} workers", len(jobs),
                                       time.perf_counter() - t, [r.wall_s for r in results], meter.now() - c0)
    bad = [r for r in results if r.status != "ok"]
    assert not bad, f"sandbox failures: {bad[:3]}"
    assert [r.value for r in results] == reused_vals, "sandbox and reused executor disagree"
    assert fresh_vals == reused_vals[:len(fresh_vals)], "fresh and reused executor disagree"
    bs = [k for k in rates if k.startswith("b")]
    print("  jobs/s ratios: (c)/(a) = %.1fx   " % (rates["c"] / rates["a"])
          + "   ".join(f"({k})/(c) = {rates[k] / rates['c']:.2f}x" for k in bs))
    print("  cpu/job ratios: (a)/(c) = %.1fx   " % (cpus["a"] / cpus["c"])
          + "   ".join(f"(c)/({k}) = {cpus['c'] / cpus[k]:.2f}x" for k in bs)
          + f"   (c)/(f) = {cpus['c'] / cpus['f']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fresh-jobs", type=int, default=60, help="(a) is slow: time it on this many jobs")
    ap.add_argument("--answers", type=int, default=8, help="expressions per program in the answers batch")
    args = ap.parse_args()
    print(f"cpus: {os.cpu_count()}  load average: {os.getloadavg()}  python {sys.version.split()[0]}")
    measure("unique programs", programs(args.programs), args.fresh_jobs, args.workers)
    measure("answers", answer_batch(max(1, args.programs // args.answers), args.answers), args.fresh_jobs,
            args.workers)


if __name__ == "__main__":
    main()
