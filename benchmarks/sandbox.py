"""Sandbox throughput, measured side by side (not a timed test).

Runs the same batch of ordinary AZR-like programs (a small function and a call, as in a validity check)
through these executors in one run and prints jobs/s, ratios and p50/p95 latency:

  (a) fresh      a fresh ``python -c`` subprocess per job (no isolation beyond the process);
  (b) azr        AZR's executor set-up: a persistent ``pebble.ProcessPool(max_workers=1)`` whose worker
                 ``exec``s job after job with a per-job timeout, checking that the value pickles (needs the
                 ``bench`` extra: ``pip install -e .[bench]``), with 1 worker as AZR runs it and with N;
  (l) loop       the leanest reused interpreter: long-lived workers that ``exec`` jobs read from a pipe, no
                 timeout, no isolation (an upper bound for any reused-interpreter executor), 1 and N workers;
  (f) fork floor a warm worker (same warm modules and compiler warm-up as the sandbox server) that forks
                 per job with no isolation at all: the cost floor of any fresh-process-per-job design;
  (c) sandbox    ``openrlhf_populora.sandbox.Sandbox`` with full isolation (bwrap when usable here).

(b) and (l) are speed references, not designs to copy: a reused interpreter lets one job tamper with the next.

Two batches: "unique" (every job its own program) and "answers" (a few programs, many expressions each,
as when verifying the students' answers to one task: the sandbox execs each program once).

    python benchmarks/sandbox.py [--programs 200] [--workers 2] [--fresh-jobs 60] [--rounds 3]

Numbers on a shared 2-core machine are noisy: compare the ratios printed by one run, not runs. Each
executor is timed ``--rounds`` times, interleaved with the others, and its best round is reported. Besides
wall-clock jobs/s the script prints CPU seconds per job (this process + every worker process and the jobs
they reaped), which depends far less on what else runs on the machine: jobs/s on an idle machine with C
cores is about C / (CPU per job) for the parallel executors.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from openrlhf_populora.sandbox import Sandbox  # noqa: E402
from openrlhf_populora.sandbox import server as sandbox_server  # noqa: E402

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


# ---------------------------------------------------------------- executors: run(jobs) -> values, pids, close()

class Fresh:
    """(a) a fresh ``python -c`` per job."""

    key, name = "a", "(a) fresh python -c"
    pids: list[int] = []

    def run(self, jobs: list[tuple[str, str]]) -> list[str]:
        values = []
        for code, expr in jobs:
            src = code + f"\nimport sys\nsys.stdout.write(repr({expr}))\n"
            proc = subprocess.run([sys.executable, "-c", src], capture_output=True, timeout=30, check=False)
            values.append(proc.stdout.decode())
        return values

    def close(self) -> None:
        pass


def _children() -> set[int]:
    """Pids of this process's live children (any thread's)."""
    pids = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            pids.update(int(p) for p in f.read().split())
    return pids


def _azr_style_job(job: tuple[str, str]) -> str:
    """What an AZR executor worker does per job: exec the program, eval the expression, make sure the value
    pickles (it must travel back), return its repr."""
    code, expr = job
    ns = {"__name__": "__main__"}
    try:
        exec(code, ns)
        value = eval(expr, ns)
        pickle.dumps(value)
        return repr(value)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


class AzrPool:
    """(b) AZR's set-up: a persistent pebble ProcessPool, one ``map`` per batch with a per-job timeout."""

    def __init__(self, workers: int):
        from pebble import ProcessPool

        self.key, self.name = f"b{workers}", f"(b{workers}) azr pebble, {workers} worker(s)"
        before = _children()
        self.pool = ProcessPool(max_workers=workers)
        list(self.pool.map(_azr_style_job, [("", "1")] * 4 * workers).result())  # start the workers
        self.pids = sorted(_children() - before)  # for their CPU time

    def run(self, jobs: list[tuple[str, str]]) -> list[str]:
        return list(self.pool.map(_azr_style_job, jobs, timeout=10).result())

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def _worker_script(prologue: str, run_job: str) -> str:
    """A long-lived worker: ``prologue``, then a loop answering length-prefixed JSON ``[code, expr]`` frames
    on stdin with length-prefixed ``run_job(code, expr)`` strings on stdout."""
    return prologue + run_job + r"""
import json, struct, sys
H = struct.Struct(">I")
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(4)
    if len(head) < 4:
        break
    body = run_job(*json.loads(inp.read(H.unpack(head)[0]))).encode()
    out.write(H.pack(len(body)) + body)
    out.flush()
"""


_LOOP_WORKER = _worker_script("", r"""
def run_job(code, expr):
    try:
        ns = {"__name__": "__main__"}
        exec(code, ns)
        return repr(eval(expr, ns))
    except BaseException as e:
        return f"{type(e).__name__}: {e}"
""")

# The sandbox server's own warm-up (its modules, its compiler warm-up), so that (f) differs from (c) only by
# isolation.
_FORK_FLOOR = _worker_script(f"""
import gc, runpy
_server = runpy.run_path({sandbox_server.__file__!r}, run_name="fork_floor")
_server["_import_warm_modules"]()
_server["_warm_interpreter"]()
gc.collect()
gc.freeze()
""", r"""
import os


def run_job(code, expr):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ns = {"__name__": "__main__"}
        exec(compile(code, "<job>", "exec"), ns)
        os.write(w, repr(eval(expr, ns)).encode())
        os._exit(0)
    os.close(w)
    body = b""
    while chunk := os.read(r, 65536):
        body += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return body.decode()
""")


class PipeWorkers:
    """Long-lived worker processes running ``script``, fed round-robin, one job in flight per worker."""

    def __init__(self, key: str, name: str, script: str, workers: int):
        self.key, self.name = key, f"({key}) {name}"
        self.procs = [subprocess.Popen([sys.executable, "-S", "-c", script], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE) for _ in range(workers)]
        self.pids = [p.pid for p in self.procs]
        self.h = struct.Struct(">I")

    def run(self, jobs: list[tuple[str, str]]) -> list[str]:
        values: list[str] = []
        k = len(self.procs)
        for start in range(0, len(jobs), k):
            batch = jobs[start:start + k]
            for job, proc in zip(batch, self.procs, strict=False):
                body = json.dumps(job).encode()
                proc.stdin.write(self.h.pack(len(body)) + body)
                proc.stdin.flush()
            for _, proc in zip(batch, self.procs, strict=False):
                n = self.h.unpack(proc.stdout.read(4))[0]
                values.append(proc.stdout.read(n).decode())
        return values

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait()


class SandboxExecutor:
    """(c) the sandbox."""

    def __init__(self, workers: int):
        self.sb = Sandbox(workers=workers, timeout_s=5.0, memory_mb=512)
        self.key, self.name = "c", f"(c) sandbox [{self.sb.isolation}], {workers} workers"
        self.pids = [w.proc.pid for w in self.sb._pool]

    def run(self, jobs: list[tuple[str, str]]) -> list[str]:
        results = self.sb.run(jobs)
        bad = [r for r in results if r.status != "ok"]
        assert not bad, f"sandbox failures: {bad[:3]}"
        return [r.value for r in results]

    def close(self) -> None:
        self.sb.close()


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


def cpu_now(pids: list[int]) -> float:
    """CPU seconds spent by this process, its reaped children and the given live process trees."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + sum(tree_cpu(p) for p in pids)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))]


def timed(ex, jobs: list) -> tuple[list[str], float, float]:
    """(values, wall seconds, CPU seconds) of one batch."""
    c0, t = cpu_now(ex.pids), time.perf_counter()
    values = ex.run(jobs)
    return values, time.perf_counter() - t, cpu_now(ex.pids) - c0


def latencies(ex, jobs: list) -> list[float]:
    """Round trip of single jobs, one at a time: what a caller waits for one job on an idle executor."""
    out = []
    for job in jobs:
        t = time.perf_counter()
        ex.run([job])
        out.append(time.perf_counter() - t)
    return out


def measure(label: str, jobs: list, args: argparse.Namespace) -> None:
    print(f"\n{label}: {len(jobs)} jobs ({len({c for c, _ in jobs})} distinct programs)")
    executors = []
    try:
        executors.append(AzrPool(1))
        if args.workers != 1:
            executors.append(AzrPool(args.workers))
    except ImportError:
        print("  (b) skipped: pebble is not installed (pip install -e .[bench])")
    for w in sorted({1, args.workers}):
        executors.append(PipeWorkers(f"l{w}", f"lean loop, {w} worker(s)", _LOOP_WORKER, w))
    floor = PipeWorkers("f", f"fork floor, {args.workers} workers", _FORK_FLOOR, args.workers)
    executors += [floor, SandboxExecutor(args.workers)]
    try:
        reference = floor.run(jobs)
        for ex in executors:
            assert ex.run(jobs[:8]) == reference[:8], f"{ex.name} disagrees"  # and warms it up
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.rounds):  # interleaved, so that a slow spell of the machine hits every executor
            for ex in executors:
                values, wall, cpu = timed(ex, jobs)
                assert values == reference, f"{ex.name} disagrees"
                if ex.name not in best or wall < best[ex.name][0]:
                    best[ex.name] = (wall, cpu)
        fresh = Fresh()
        sub = jobs[:args.fresh_jobs]
        values, wall, cpu = timed(fresh, sub)
        assert values == reference[:len(sub)], "fresh python -c disagrees"
        rows = [(fresh.key, f"{fresh.name} [{len(sub)}]", len(sub) / wall, cpu / len(sub),
                 latencies(fresh, sub[:10]))]
        rows += [(ex.key, ex.name, len(jobs) / best[ex.name][0], best[ex.name][1] / len(jobs),
                  latencies(ex, jobs[:args.latency_jobs])) for ex in executors]
    finally:
        for ex in executors:
            ex.close()
    for _, name, rate, cpu_per_job, lat in rows:
        print(f"  {name:<34s} {rate:8.1f} jobs/s   p50 {pct(lat, .5) * 1e3:7.2f} ms   p95 {pct(lat, .95) * 1e3:7.2f} ms"
              f"   cpu {cpu_per_job * 1e3:6.2f} ms/job")
    rate = {key: r for key, _, r, _, _ in rows}
    cpu = {key: c for key, _, _, c, _ in rows}
    refs = [k for k in rate if k[0] in "bl"]
    print(f"  jobs/s:  (c)/(a) = {ratio(rate['c'], rate['a'])}   "
          + "   ".join(f"({k})/(c) = {ratio(rate[k], rate['c'])}" for k in refs))
    print(f"  cpu/job: (c)/(f) = {ratio(cpu['c'], cpu['f'])}   "
          + "   ".join(f"(c)/({k}) = {ratio(cpu['c'], cpu[k])}" for k in refs))


def ratio(a: float, b: float) -> str:
    """``a / b`` for printing; "n/a" when ``b`` is 0 (CPU time below the clock tick in a short batch)."""
    return f"{a / b:.2f}x" if b else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fresh-jobs", type=int, default=60, help="(a) is slow: time it on this many jobs")
    ap.add_argument("--answers", type=int, default=8, help="expressions per program in the answers batch")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per executor, interleaved; best kept")
    ap.add_argument("--latency-jobs", type=int, default=50, help="jobs timed one at a time for p50/p95")
    args = ap.parse_args()
    print(f"cpus: {os.cpu_count()}  load average: {os.getloadavg()}  python {sys.version.split()[0]}")
    measure("unique programs", programs(args.programs), args)
    measure("answers", answer_batch(max(1, args.programs // args.answers), args.answers), args)


if __name__ == "__main__":
    main()
