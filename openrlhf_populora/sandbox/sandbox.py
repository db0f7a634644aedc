"""The host side: a pool of fork-server workers that runs batches of ``(code, expr)`` jobs.

``Sandbox.run(jobs)`` groups jobs that share the same ``code`` (the code is exec'd once per group in a fresh
child, one grandchild per expression: see ``server.py``), deals the groups to the workers in chunks, and
collects one bounded verdict per job, in input order. Workers are separate processes that this process
only talks to through pipes carrying JSON frames; a worker that dies, hangs past the backstop deadline or
sends a malformed frame is killed and replaced, its unreported jobs are re-dealt (the job it was running
is reported as ``killed``), and the batch completes.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections import deque

from . import isolation as iso
from .result import ExecResult
from .server import RESULT_HEAD, FrameTooLarge, encode_frame, split_frames, unpack_verdict
from .stats import SandboxStats

_START_TIMEOUT_S = 60.0
_MAX_CHUNK = 64
_KEEP_WHOLE = 16  # answers to one program up to this many always share one exec of it


class _Worker:
    """One fork-server process (under bwrap or not) and the jobs it has been sent but not yet answered."""

    def __init__(self, argv: list[str], env: dict, config: dict, isolation: str):
        self.uid = config["uid"]
        self.max_frame = 8 * config["max_output_chars"] + 65536  # a verdict is far smaller: anything longer is a bug
        self.isolation = isolation
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     env=env, cwd="/", start_new_session=True, close_fds=True)
        self.fd = self.proc.stdout.fileno()
        self.buf = bytearray()
        self.inflight: deque[int] = deque()
        self.last_progress = time.monotonic()
        self.proc.stdin.write(encode_frame({"config": config}))
        self.proc.stdin.flush()
        os.set_blocking(self.fd, False)

    def wait_ready(self, deadline: float) -> None:
        while True:
            frames = self.read()
            if frames is None:
                raise RuntimeError(f"sandbox worker failed to start: {self.stderr_tail()}")
            if frames:
                hello = json.loads(frames[0])
                if not isinstance(hello, dict) or hello.get("ready") is None:
                    raise RuntimeError(f"sandbox worker sent {hello!r} instead of ready")
                self.network_isolated = hello.get("network_isolated") is True
                if hello.get("jobs_uid") is None:
                    self.uid = None
                return
            if time.monotonic() > deadline:
                raise RuntimeError("sandbox worker did not start in time")
            self.wait_readable(0.05)

    def self_test(self, deadline: float) -> str | None:
        """Run one trivial job through this worker; None if it answers "2", else what went wrong."""
        self.send([["", [[0, "1 + 1"]]]])
        while time.monotonic() < deadline:
            frames = self.read()
            if frames is None:
                return f"the worker died: {self.stderr_tail()}"
            if frames:
                verdict = unpack_verdict(frames[0][RESULT_HEAD.size:])
                return None if verdict[:2] == ("ok", "2") else f"'1 + 1' gave {verdict[:3]}"
            self.wait_readable(0.05)
        return "no answer in time"

    def wait_readable(self, seconds: float) -> None:
        poller = select.poll()  # not select.select: our fds may be past FD_SETSIZE in a big host process
        poller.register(self.fd, select.POLLIN)
        poller.poll(seconds * 1000.0)

    def read(self) -> list[bytes] | None:
        """Bodies of the frames that have arrived (possibly none); None once the worker's output is closed."""
        try:
            chunk = os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not chunk:
            return None
        self.buf += chunk
        return split_frames(self.buf, self.max_frame)

    def send(self, groups: list) -> None:
        self.proc.stdin.write(encode_frame({"groups": groups}))
        self.proc.stdin.flush()
        self.last_progress = time.monotonic()

    def stderr_tail(self) -> str:
        try:
            self.stderr.seek(0, os.SEEK_END)
            size = self.stderr.tell()
            self.stderr.seek(max(0, size - 2000))
            return self.stderr.read().decode(errors="replace").strip() or "no message"
        except (OSError, ValueError):
            return "no message"

    def kill(self) -> None:
        """Kill the worker and everything it started; reap it."""
        if self.isolation == "bwrap" and self.proc.poll() is None:
            # kill bwrap's inner init (pid 1 of the namespace: everything in it dies with it) first, so that
            # the outer bwrap reaps it and exits by itself: no zombie is left for the container's init
            try:
                with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                    for pid in f.read().split():
                        os.kill(int(pid), signal.SIGKILL)
                self.proc.wait(timeout=2.0)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        if self.uid is not None and self.isolation == "rlimits":
            iso.kill_uids(self.uid, iso.UIDS_PER_WORKER)  # anything jobs left behind, had the server died first
        self.close_pipes()

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Ask politely (close stdin: the server cleans up and exits), then kill."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def close_pipes(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout, self.stderr):
            try:
                stream.close()
            except OSError:
                pass


def _shutdown_all(workers: list) -> None:
    while workers:
        workers.pop().shutdown()


class Sandbox:
    """Runs untrusted Python ``(code, expr)`` jobs: ``exec(code)`` in a fresh namespace, then ``repr(eval(expr))``.

    Args (defaults in the signature):
        workers: fork-server processes, i.e. jobs running at once.
        timeout_s: wall-clock limit per job (code + expr); also sets RLIMIT_CPU to ceil(timeout_s)+1 s.
        memory_mb: address-space (RLIMIT_AS) and data limit per job process.
        isolation: "auto" (bubblewrap when it works here, else rlimits, logged once), "bwrap" (required) or
            "rlimits" (no namespaces: fresh process, rlimits, uid drop when root, scrubbed env, temp dir).
        max_output_chars: longest repr returned (longer -> "output_limit"); error messages are cut to it.
        max_stdout_chars: most characters a job may print (more -> "output_limit"); printed text is discarded.
        hash_seed: PYTHONHASHSEED of every job, so set iteration order is reproducible across runs.
        max_procs: RLIMIT_NPROC of a job's uid (processes + threads) when it has its own uid.
        max_open_files: RLIMIT_NOFILE per job.
        max_file_mb: RLIMIT_FSIZE per job (largest file it may write).
        site_packages: let jobs import the host interpreter's installed packages (numpy, ...); by default
            they get the standard library only, which also makes every fork cheaper.

    Attributes: ``isolation`` ("bwrap" or "rlimits", what "auto" resolved to), ``network_isolated`` (True
    when every worker reported being in a network namespace of its own).

    Use as a context manager or call ``close()``; either leaves no process behind. ``run`` may be called any
    number of times; concurrent calls are serialised. Workers die with the thread that created them
    (PR_SET_PDEATHSIG / bwrap --die-with-parent); a dead worker is replaced on the next ``run``.
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, memory_mb: int = 512, *,
                 isolation: str = "auto", max_output_chars: int = 10_000, max_stdout_chars: int = 1_000_000,
                 hash_seed: int = 0, max_procs: int = 64, max_open_files: int = 64, max_file_mb: int = 16,
                 site_packages: bool = False):
        for name, value in (("workers", workers), ("memory_mb", memory_mb), ("max_output_chars", max_output_chars),
                            ("max_stdout_chars", max_stdout_chars), ("max_procs", max_procs),
                            ("max_open_files", max_open_files), ("max_file_mb", max_file_mb)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number, got {type(timeout_s).__name__}")
        if not 0 < timeout_s < 1e6 or math.isnan(timeout_s):
            raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
        if memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (a Python process needs that much), got {memory_mb}")
        if max_open_files < 8:
            raise ValueError(f"max_open_files must be >= 8, got {max_open_files}")
        if isinstance(hash_seed, bool) or not isinstance(hash_seed, int) or not 0 <= hash_seed <= 4294967295:
            raise ValueError(f"hash_seed must be an int in [0, 2**32), got {hash_seed!r}")
        self.isolation = iso.resolve(isolation)
        self.workers, self.timeout_s = workers, float(timeout_s)
        self._limits = {"memory_mb": memory_mb, "max_output_chars": max_output_chars,
                        "max_stdout_chars": max_stdout_chars, "max_procs": max_procs,
                        "max_open_files": max_open_files, "max_file_mb": max_file_mb}
        self._env = iso.scrubbed_env(hash_seed)
        self._argv = iso.server_argv(self.isolation, site_packages)
        self._stats = SandboxStats()
        self._lock = threading.Lock()
        self._closed = False
        self._pool: list[_Worker] = []
        self.network_isolated: bool | None = None  # set once the workers report
        self._finalizer = weakref.finalize(self, _shutdown_all, self._pool)
        try:
            self._start_workers(workers)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker and everything they started. Idempotent."""
        self._closed = True
        self._finalizer()

    def _new_worker(self) -> _Worker:
        uid = iso.job_uids()
        nproc = self._limits["max_procs"] if uid is not None else iso.user_task_count() + self._limits["max_procs"]
        config = {**self._limits, "timeout_s": self.timeout_s, "uid": uid, "uid_count": iso.UIDS_PER_WORKER,
                  "max_procs": nproc, "sweep_dirs": iso.sweep_dirs(self.isolation, uid),
                  "tmp_root": iso.tmp_root(self.isolation),
                  "unshare_net": self.isolation == "rlimits" and os.geteuid() == 0,
                  "private_mounts": self.isolation == "rlimits" and uid is not None,
                  "reveal": iso.hidden_interpreter_paths(iso.sweep_dirs(self.isolation, uid))
                  if self.isolation == "rlimits" and uid is not None
                  else {}}
        return _Worker(self._argv, self._env, config, self.isolation)

    def _start_workers(self, n: int) -> list[_Worker]:
        fresh = [self._new_worker() for _ in range(n)]
        self._pool.extend(fresh)
        deadline = time.monotonic() + _START_TIMEOUT_S
        try:
            for worker in fresh:
                worker.wait_ready(deadline)
                problem = worker.self_test(deadline)
                if problem is not None:
                    raise RuntimeError(f"sandbox worker ({self.isolation}) failed its self-test: {problem}")
        except BaseException:
            for worker in fresh:
                worker.kill()
                self._pool.remove(worker)
            raise
        isolated = all(w.network_isolated for w in self._pool)
        if not isolated and self.network_isolated is not False:
            iso.log.warning("sandbox: jobs are not in a network namespace (isolation=%s, uid %d): they can "
                            "reach the network", self.isolation, os.geteuid())
        self.network_isolated = isolated
        return fresh

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._pool.remove(worker)
        self._stats.worker_restarts += 1
        self._start_workers(1)

    # ------------------------------------------------------------ running jobs

    def run(self, jobs) -> list[ExecResult]:
        """Run ``[(code, expr), ...]``; returns one ExecResult per job, in input order."""
        jobs = _validate(jobs)
        if not jobs:
            return []
        with self._lock:
            if self._closed:
                raise RuntimeError("this Sandbox is closed")
            try:
                results = self._run(jobs)
            except BaseException:
                for worker in list(self._pool):  # state unknown (e.g. KeyboardInterrupt): start afresh
                    if worker.inflight:
                        self._replace(worker)
                raise
        self._stats.batches += 1
        for result in results:
            self._stats.record(result.status, result.wall_s)
        return results

    def stats(self) -> dict:
        """Counters for logging: executions, failures, status_<name> counts, latency mean/p50/p95 (seconds)."""
        return self._stats.as_dict()

    def _run(self, jobs: list[tuple[str, str]]) -> list[ExecResult]:
        results: list[ExecResult | None] = [None] * len(jobs)
        queue = deque(_chunks(jobs, _chunk_size(len(jobs), self.workers)))
        for worker in list(self._pool):
            if worker.proc.poll() is not None:
                self._replace(worker)
        backstop = self.timeout_s * 1.5 + 5.0
        while queue or any(w.inflight for w in self._pool):
            for worker in list(self._pool):
                if queue and not worker.inflight:
                    self._dispatch(worker, queue.popleft(), jobs, queue)
            busy = {w.fd: w for w in self._pool if w.inflight}
            if not busy:
                continue
            poller = select.poll()
            for fd in busy:
                poller.register(fd, select.POLLIN)
            wait = min(w.last_progress for w in busy.values()) + backstop - time.monotonic()
            for fd, _ in poller.poll(max(wait, 0.0) * 1000.0):
                if busy[fd] in self._pool:
                    self._receive(busy[fd], jobs, results, queue)
            now = time.monotonic()
            for worker in busy.values():
                if worker in self._pool and worker.inflight and now > worker.last_progress + backstop:
                    self._fail(worker, "timeout", jobs, results, queue)
        return results  # type: ignore[return-value]

    def _dispatch(self, worker: _Worker, chunk: list[int], jobs: list, queue: deque) -> None:
        groups: dict[str, list] = {}
        for i in chunk:
            groups.setdefault(jobs[i][0], []).append([i, jobs[i][1]])
        worker.inflight.extend(i for ids in groups.values() for i, _ in ids)
        try:
            worker.send([[code, ids] for code, ids in groups.items()])
        except OSError:  # died while idle: re-deal the whole chunk on a fresh worker
            queue.appendleft(list(worker.inflight))
            worker.inflight.clear()
            self._replace(worker)

    def _receive(self, worker: _Worker, jobs: list, results: list, queue: deque) -> None:
        try:
            frames = worker.read()
        except FrameTooLarge:
            frames = None
        for body in frames or ():
            if len(body) < RESULT_HEAD.size:
                self._fail(worker, "killed", jobs, results, queue)
                return
            job_id, wall = RESULT_HEAD.unpack_from(body)
            if not worker.inflight or job_id != worker.inflight[0]:
                self._fail(worker, "killed", jobs, results, queue)
                return
            worker.inflight.popleft()
            worker.last_progress = time.monotonic()
            results[job_id] = self._decode(body[RESULT_HEAD.size:], wall)
        if frames is None:
            self._fail(worker, "killed", jobs, results, queue)

    def _decode(self, verdict: bytes, wall: float) -> ExecResult:
        """The verdict bytes come from a job process, i.e. untrusted: decode strictly, bound every field."""
        cap = self._limits["max_output_chars"]
        try:
            status, value, error, _ = unpack_verdict(verdict)
        except (ValueError, UnicodeDecodeError):
            return ExecResult("killed", None, "malformed result from the job process", wall)
        if status == "ok" and (value is None or len(value) > cap):
            return ExecResult("output_limit", None, "result value missing or over the limit", wall)
        if error is not None and len(error) > cap:
            error = error[: cap - 3] + "..."
        return ExecResult(status, value if status == "ok" else None, error, wall)

    def _fail(self, worker: _Worker, status: str, jobs: list, results: list, queue: deque) -> None:
        """The worker is gone or untrustworthy: its current job gets ``status``, the rest are re-dealt."""
        if worker.inflight:
            culprit = worker.inflight.popleft()
            elapsed = time.monotonic() - worker.last_progress
            results[culprit] = ExecResult(status=status, error=f"sandbox worker lost ({status})", wall_s=elapsed)
            if worker.inflight:
                queue.appendleft(list(worker.inflight))
            worker.inflight.clear()
        self._replace(worker)


def _validate(jobs) -> list[tuple[str, str]]:
    if isinstance(jobs, (str, bytes)) or not hasattr(jobs, "__iter__"):
        raise TypeError(f"jobs must be a sequence of (code, expr) pairs of str, got {type(jobs).__name__}")
    out = []
    for k, job in enumerate(jobs):
        if not isinstance(job, (tuple, list)) or len(job) != 2:
            raise TypeError(f"job {k} must be a (code, expr) pair, got {type(job).__name__}")
        code, expr = job
        if not isinstance(code, str) or not isinstance(expr, str):
            raise TypeError(f"job {k}: code and expr must be str, got ({type(code).__name__}, "
                            f"{type(expr).__name__})")
        out.append((code, expr))
    return out


def _chunk_size(n_jobs: int, n_workers: int) -> int:
    """Jobs per message: a few messages per worker per batch, so that load balances and overhead stays low."""
    return max(1, min(_MAX_CHUNK, math.ceil(n_jobs / (4 * n_workers))))


def _chunks(jobs: list[tuple[str, str]], size: int) -> list[list[int]]:
    """Job indices dealt in chunks of about ``size``. Jobs with equal code stay together (the code is then
    exec'd once for all of them); only a group larger than max(size, _KEEP_WHOLE) is cut, into such pieces."""
    by_code: dict[str, list[int]] = {}
    for i, (code, _) in enumerate(jobs):
        by_code.setdefault(code, []).append(i)
    piece_size = max(size, _KEEP_WHOLE)
    chunks, current = [], []
    for ids in by_code.values():
        for start in range(0, len(ids), piece_size):
            piece = ids[start:start + piece_size]
            if current and len(current) + len(piece) > size:
                chunks.append(current)
                current = []
            current += piece
    if current:
        chunks.append(current)
    return chunks
