"""Run untrusted, model-written Python safely and fast, in batches. Standard library only; knows nothing of AZR.

    from openrlhf_populora.sandbox import Sandbox
    with Sandbox(workers=2, timeout_s=5.0, memory_mb=512) as sb:
        results = sb.run([(code, expr), ...])  # exec(code) in a fresh namespace, then repr(eval(expr))
    r = results[0]
    r.status   # "ok" | "error" | "timeout" | "memory" | "output_limit" | "killed"   (see ExecResult)
    r.value    # repr() of expr's value when ok (a str of at most max_output_chars), else None
    r.error    # "ExceptionType: message" when status == "error"
    r.wall_s   # seconds
    sb.stats() # {"executions", "failures", "status_<name>", "batches", "worker_restarts",
               #  "latency_mean_s", "latency_p50_s", "latency_p95_s"}

Results come back in input order, one per job; one bad job never affects another. Jobs that share the same
``code`` are grouped transparently: the code is exec'd once in a fresh child and each expression is evaluated
in its own forked grandchild (the last one in the child itself), so answers cannot see or tamper with each
other. Model text is never compiled in the calling process; values cross back only as bounded strings.

Layers (``Sandbox.isolation`` says which outer layer is in use):
- every job: a fresh process forked from a pre-warmed fork server (never a reused interpreter), killed with
  its process group by the server on a wall-clock deadline (signals the job ignores do not matter);
  rlimits (address space + data = memory_mb, CPU seconds, processes, file size, open files, no core dumps,
  no locked memory or message queues); stdio on /dev/null with printed output counted and capped; a fresh
  private working directory; the host's environment scrubbed (fixed PATH/LANG/PYTHONHASHSEED only);
  orphans and double-fork daemons reparented to the server (a child subreaper) and killed.
- as root: each job runs under a uid of its own (a block per worker), so it cannot signal the server or
  other jobs, raise rlimits back, read root's files or exceed RLIMIT_NPROC with a fork bomb.
- "bwrap" (bubblewrap, default when it works here): the fork server lives in new PID, network, IPC, UTS and
  cgroup namespaces (plus user namespace when not root), read-only ``/``, private ``/tmp``, fresh ``/dev``
  and ``/proc``, its own session, dying with its parent. Set up once per worker, not per job.
- "rlimits" (fallback, logged once): no bubblewrap. As root the server still unshares a network namespace
  and a mount namespace with private tmpfs ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``; not as
  root, jobs share our uid, filesystem and network (``Sandbox.network_isolated`` is then False).

Speed (``benchmarks/sandbox.py`` measures it): a job costs about what a bare ``fork`` + ``exec`` of it costs,
and most of that is copy-on-write page faults: every page a freshly forked interpreter writes (reference
counts, allocator pools, the compiler's scratch memory) is copied. So the server does once what every job
would otherwise repeat: it imports common modules, compiles and runs a warm-up program (CPython builds its
compiler state on first use), resolves its dynamic symbols at load and freezes its heap; a grouped child
compiles each answer before forking the grandchild that runs it, and an answer that does not compile needs
no process at all.
"""

from .protocol import Executor
from .result import STATUSES, ExecResult
from .sandbox import Sandbox

__all__ = ["STATUSES", "ExecResult", "Executor", "Sandbox"]
