"""The fork server: one per sandbox worker, run *inside* the isolation layer, standard library only.

The host starts it (under bubblewrap when available). It imports the modules ordinary programs use once,
freezes its heap for copy-on-write, then serves requests on stdin/stdout as length-prefixed JSON frames
(4-byte big-endian length, then ASCII JSON):

    host -> server   {"config": {...}}                                   once, first
    server -> host   {"ready": pid}
    host -> server   {"groups": [[code, [[job_id, expr], ...]], ...]}
    server -> host   length + RESULT_HEAD (job_id, wall_s) + a verdict (see pack_verdict)    one per job

The verdict bytes a job process wrote are forwarded as they are: the host decodes and checks them
(``unpack_verdict``). Work in the server is kept small on purpose: every page it writes while a forked
child shares its memory costs a copy-on-write fault.

Per group of jobs sharing ``code`` the server forks a fresh child C, which enters the jail (own process group,
stdio on /dev/null, every other fd closed, rlimits (most set once in the server and inherited), its own
unprivileged uid when the server is root, a fresh private working directory, capped stdout) and only then
compiles and ``exec``s the code. C evaluates the last
expression itself; for every other one it forks a grandchild G (one per expression, run and reaped one after
another, C being their subreaper), so no expression can see or tamper with another's process. The *server*
(never C) enforces the wall-clock deadline: it kills C's process group when a result is late, and re-runs the
group's unreported expressions in a fresh child. The server is a child subreaper too, so daemons that
double-fork out of a job are reparented to it and killed; each job has its own uid (from a block of
``uid_count`` per worker), so a process of one job that is still dying cannot touch the next one.

Model text is compiled and run only in the forked children; the server and the host only see bounded strings.
"""

import builtins
import gc
import io
import json
import os
import resource
import select
import signal
import struct
import sys
import time

# The harness inside a job process uses these bindings, not the builtins module that model code may rebind.
from builtins import compile, eval, exec, isinstance, len, repr, set, type  # noqa: E402, I001, UP029

HEADER = struct.Struct(">I")
RESULT_HEAD = struct.Struct(">Id")  # a server -> host result frame's body: job id, wall seconds, then a verdict
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed")
_CHANNEL_FD = 3  # in a job process: the write end of its result pipe
_MAX_FD = 1 << 16
_GRACE_S = 0.25  # extra time the server allows a grouped child to report (it enforces per-expr limits itself)
# Imported once by the server, so jobs get them for free: what short programs use most. Each extension module
# adds mappings that every fork copies, so rarer ones (decimal, fractions, array, ...) are left for jobs to
# import; random/threading/statistics also register at-fork hooks (a reseed per fork).
_WARM_MODULES = ("bisect", "collections", "copy", "functools", "heapq", "itertools", "math", "operator", "re",
                 "string", "typing")
# Trusted code the server compiles and runs once before freezing its heap. CPython builds its compiler's state
# (the AST types, the parser's tables) on the first compile, and fills type and method caches on first use;
# done in the server, every forked job shares that work instead of redoing it (about 1 ms per job here).
_WARM_PROGRAM = """
from collections import Counter, defaultdict, deque


def f(xs, s="abc", n=3, *args, **kw):
    out = [x * 2 for x in xs if x % 2 == 1]
    seen = {k: v for k, v in enumerate(xs)}
    total = sum(i for i in range(n))
    d = defaultdict(list)
    for i, ch in enumerate(s):
        d[ch].append(i)
    q = deque(sorted(set(xs), reverse=True))
    while q and total > 0:
        total -= q.popleft()
    try:
        return (max(out or [0]), len(seen), "".join(reversed(s)).upper(), sorted(Counter(s).items()),
                dict(d), tuple(q), round(3.5 / 2, 2), str(n).zfill(2), abs(-n), [*args], {**kw})
    except (ValueError, KeyError) as exc:
        raise RuntimeError(str(exc)) from exc
"""


# ---------------------------------------------------------------- framing (shared with the host)

def encode_frame(obj) -> bytes:
    """One frame: 4-byte big-endian length, then compact ASCII JSON (lone surrogates escaped)."""
    body = json.dumps(obj, separators=(",", ":")).encode("ascii")
    return HEADER.pack(len(body)) + body


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, need = [], n
    while need:
        chunk = os.read(fd, need)
        if not chunk:
            return None
        chunks.append(chunk)
        need -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int):
    head = _read_exact(fd, HEADER.size)
    if head is None:
        return None
    body = _read_exact(fd, HEADER.unpack(head)[0])
    return None if body is None else json.loads(body)


class FrameTooLarge(ValueError):
    """A peer announced a frame longer than the reader accepts."""


def split_frames(buf: bytearray, max_frame: int) -> list[bytes]:
    """Pop the body of every complete frame off the front of ``buf``; FrameTooLarge on a longer one."""
    out = []
    while len(buf) >= HEADER.size:
        (n,) = HEADER.unpack_from(buf)
        if n > max_frame:
            raise FrameTooLarge(f"frame of {n} bytes exceeds the limit of {max_frame}")
        if len(buf) < HEADER.size + n:
            break
        out.append(bytes(buf[HEADER.size:HEADER.size + n]))
        del buf[:HEADER.size + n]
    return out


def parse_frames(buf: bytearray, max_frame: int) -> list:
    """Pop every complete JSON frame (host <-> server) off ``buf``; ValueError on bytes that are not one."""
    return [json.loads(body) for body in split_frames(buf, max_frame)]


def pack_verdict(status: str, value: str | None = None, error: str | None = None, every: bool = False) -> bytes:
    """A job process's verdict as one frame, without JSON (lighter in a freshly forked child):
    status index, flags (1: value, 2: error, 4: applies to every remaining expression), value length,
    value and error as UTF-8 (lone surrogates passed through)."""
    v = b"" if value is None else value.encode("utf-8", "surrogatepass")
    e = b"" if error is None else error.encode("utf-8", "surrogatepass")
    flags = (value is not None) | (error is not None) << 1 | every << 2
    body = bytes((STATUSES.index(status), flags)) + len(v).to_bytes(4, "big") + v + e
    return len(body).to_bytes(4, "big") + body


def unpack_verdict(body: bytes) -> tuple[str, str | None, str | None, bool]:
    """Inverse of pack_verdict for untrusted bytes: ValueError unless well formed."""
    if len(body) < 6 or body[0] >= len(STATUSES) or body[1] > 7:
        raise ValueError("malformed verdict")
    n = int.from_bytes(body[2:6], "big")
    if 6 + n > len(body) or (not body[1] & 1 and n) or (not body[1] & 2 and len(body) > 6 + n):
        raise ValueError("malformed verdict")
    value = body[6:6 + n].decode("utf-8", "surrogatepass") if body[1] & 1 else None
    error = body[6 + n:].decode("utf-8", "surrogatepass") if body[1] & 2 else None
    return STATUSES[body[0]], value, error, bool(body[1] & 4)


# ---------------------------------------------------------------- inside a job process (untrusted from exec on)

class _OutputLimitExceeded(BaseException):
    """Raised by the capped stdout; a BaseException so that ``except Exception`` in model code misses it."""


class _CappedText(io.TextIOBase):
    """sys.stdout/sys.stderr of a job: counts characters, keeps none, trips once over ``cap``."""

    def __init__(self, cap: int):
        self.cap, self.used, self.exceeded = cap, 0, False

    def writable(self) -> bool:
        return True

    def write(self, s) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        self.used += len(s)
        if self.used > self.cap:
            self.exceeded = True
            raise _OutputLimitExceeded(f"printed output exceeds {self.cap} chars")
        return len(s)


def _enter_jail(jail: dict, uid: int | None, channel_fd: int) -> _CappedText:
    """Everything that must hold before model text is touched. Runs first thing in the forked child C.

    The rlimits other than CPU seconds, the capped sys.stdout/sys.stderr and an empty sys.stdin are set
    once in the server and inherited (cheaper per fork); here: own process group, stdio on /dev/null, every
    other fd closed, CPU seconds, the job's uid (which drops every capability: rlimits cannot be raised
    back, the server cannot be signalled), its private working directory.
    """
    os.setpgid(0, 0)
    for fd in (0, 1, 2):
        os.dup2(jail["devnull"], fd)
    if channel_fd != _CHANNEL_FD:
        os.dup2(channel_fd, _CHANNEL_FD)
    os.closerange(_CHANNEL_FD + 1, _MAX_FD)
    resource.setrlimit(resource.RLIMIT_CPU, jail["cpu"])
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    os.chdir(jail["workdir"])
    return sys.stdout


def _describe(exc: BaseException, cap: int) -> str:
    try:
        text = f"{type(exc).__name__}: {exc}"
    except BaseException:  # noqa: B036 - a hostile __str__ may raise anything
        text = f"{type(exc).__name__}: <unprintable>"
    return text if len(text) <= cap else text[: cap - 3] + "..."


def _failure(exc: BaseException, out: _CappedText, cap: int) -> tuple:
    if out.exceeded or isinstance(exc, _OutputLimitExceeded):
        return "output_limit", None, f"printed output exceeds {out.cap} chars"
    if isinstance(exc, MemoryError):
        return "memory", None, "MemoryError"
    return "error", None, _describe(exc, cap)


def _evaluate(ns: dict, expr, out: _CappedText, cap: int) -> tuple:
    """The verdict of ``expr`` (source text or a code object compiled from it) in ``ns``."""
    try:
        if isinstance(expr, str):
            expr = compile(expr, "<expr>", "eval")
        text = "".join((repr(eval(expr, ns)),))  # an exact str, even from a subclass
        if out.exceeded:
            raise _OutputLimitExceeded
    except BaseException as exc:  # noqa: B036 - every outcome of model text is a verdict
        return _failure(exc, out, cap)
    if len(text) > cap:
        return "output_limit", None, f"repr of {len(text)} chars exceeds {cap}"
    return "ok", text, None


def _send(frame: bytes) -> None:
    _write_all(_CHANNEL_FD, frame)


def _job_main(jail: dict, uid: int | None, code: str, exprs: list, channel_fd: int) -> None:
    """Child C: jail, exec the code once, then one verdict per expression, in order.

    Each job may take ``timeout_s`` for code + expression together, as if it ran alone: each grandchild gets
    ``timeout_s - (code exec time)``. C enforces that for its grandchildren (only C's own jobs depend on it);
    the server kills C if a result is late anyway.
    """
    started = time.monotonic()
    cap = jail["max_output_chars"]
    out = _enter_jail(jail, uid, channel_fd)
    if len(exprs) > 1 and _LIBC is not None:
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<sandbox>", "exec"), ns)
        if out.exceeded:
            raise _OutputLimitExceeded
    except BaseException as exc:  # noqa: B036
        _send(pack_verdict(*_failure(exc, out, cap), every=True))
        return
    if len(exprs) > 1:
        budget = max(0.0, jail["timeout_s"] - (time.monotonic() - started))
        children = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
        keep = set(os.listdir("."))
        for expr in exprs[:-1]:
            # Compiled here, before the fork: compiling runs none of its code, and a freshly forked process
            # pays a copy-on-write fault for every page the compiler writes (most of a small job's cost).
            # An answer that does not compile needs no process at all.
            try:
                compiled = compile(expr, "<expr>", "eval")
            except BaseException as exc:  # noqa: B036
                _send(pack_verdict(*_failure(exc, out, cap)))
                continue
            _send(_grandchild(ns, compiled, out, cap, budget))
            _kill_children(children, wait=True)  # nothing of this answer survives into the next one
            for name in set(os.listdir(".")) - keep:  # nor any file it left
                _remove(name)
    _send(pack_verdict(*_evaluate(ns, exprs[-1], out, cap)))


def _grandchild(ns: dict, expr, out: _CappedText, cap: int, budget_s: float) -> bytes:
    """Fork G, evaluate one expression in it; returns its verdict frame (G writes only to its own pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setpgid(0, 0)
            os.dup2(w, _CHANNEL_FD)
            os.close(w)
            _send(pack_verdict(*_evaluate(ns, expr, out, cap)))
        finally:
            os._exit(0)
    os.close(w)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    limit = 4 * cap + 4096
    deadline = time.monotonic() + budget_s
    data, timed_out = _drain(r, deadline, limit)
    os.close(r)
    if timed_out:
        verdict = pack_verdict("timeout")
    elif len(data) > limit:
        verdict = pack_verdict("output_limit")
    else:
        try:
            bodies = split_frames(bytearray(data), limit)
            verdict = HEADER.pack(len(bodies[0])) + bodies[0] if bodies else None
        except FrameTooLarge:
            verdict = pack_verdict("output_limit")
    if verdict is None:  # G closed its pipe without a verdict: let it finish dying to learn why
        return pack_verdict(_reap(pid, deadline))
    _reap(pid, None)
    return verdict


def _drain(fd: int, deadline: float, limit: int) -> tuple[bytes, bool]:
    """Read ``fd`` until one whole frame, EOF or more than ``limit`` bytes arrived, before ``deadline``;
    returns (data, timed_out). Not waiting for EOF spares the time the writer takes to finish exiting."""
    buf = bytearray()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while len(buf) <= limit:
        if len(buf) >= HEADER.size and len(buf) >= HEADER.size + HEADER.unpack_from(buf)[0]:
            break
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000.0):
            return bytes(buf), True
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    return bytes(buf), False


def _reap(pid: int, wait_until: float | None) -> str:
    """Kill and reap child ``pid`` with its process group. With ``wait_until``, first give it until then to
    exit by itself so that the cause can be told: CPU limit -> "timeout", else -> "killed"; still alive
    then -> "timeout"."""
    verdict = "timeout"
    while wait_until is not None:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            cpu_limit = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU
            verdict = "timeout" if cpu_limit else "killed"
            _kill(pid)
            return verdict
        if time.monotonic() >= wait_until:
            break
        time.sleep(0.0005)
    _kill(pid)
    os.waitpid(pid, 0)
    return verdict


def _kill(pid: int) -> None:
    """SIGKILL process ``pid`` and its process group (if it leads one)."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, signal.SIGKILL)
        except OSError:
            pass


def _kill_children(children_file: str, wait: bool) -> None:
    """SIGKILL every child of this process (orphans reparented to us, as subreaper, included). With ``wait``
    reap them and repeat until none is left; without, reap only those already dead."""
    for _ in range(100_000):
        try:
            fd = os.open(children_file, os.O_RDONLY)
            try:
                pids = [int(p) for p in os.read(fd, 1 << 16).split()]
            finally:
                os.close(fd)
        except OSError:
            pids = []
        for pid in pids:
            _kill(pid)
        if not wait or not pids:
            break
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _rmtree(path: str) -> None:
    """shutil.rmtree, imported on first use. shutil loads bz2, lzma and zlib with their C libraries, and each
    mapping of the server is copied by every fork and torn down by every exit; it is only needed once a job
    leaves files behind, which ordinary programs do not (from then on this server keeps it loaded)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        _rmtree(path)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


# ---------------------------------------------------------------- the server itself (trusted)

class Server:
    """Serves groups of jobs; see the module docstring for the protocol."""

    def __init__(self, cfg: dict, base: str):
        self.timeout = cfg["timeout_s"]
        self.cap = cfg["max_output_chars"]
        self.max_frame = 4 * self.cap + 4096  # UTF-8 of a repr and an error message of at most cap chars
        self.uid_base, self.uid_count = cfg["uid"], cfg["uid_count"]
        self.base, self.seq = base, 0
        mem = cfg["memory_mb"] << 20
        cpu = int(cfg["timeout_s"]) + 1
        self.jail = {
            "devnull": os.open(os.devnull, os.O_RDWR),
            "workdir": os.path.join(base, "job"),
            "timeout_s": cfg["timeout_s"],
            "max_output_chars": self.cap,
            "max_stdout_chars": cfg["max_stdout_chars"],
            "cpu": (cpu, cpu + 1),
        }
        self.limits = [  # inherited by every job; soft == hard, so an unprivileged job cannot raise them
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_AS, (mem, mem)),
            (resource.RLIMIT_DATA, (mem, mem)),
            (resource.RLIMIT_FSIZE, (cfg["max_file_mb"] << 20,) * 2),
            (resource.RLIMIT_NOFILE, (cfg["max_open_files"],) * 2),
            (resource.RLIMIT_NPROC, (cfg["max_procs"],) * 2),  # root (the server) is exempt, jobs are not
            (resource.RLIMIT_MEMLOCK, (0, 0)),
            (resource.RLIMIT_MSGQUEUE, (0, 0)),
        ]
        self.children_file = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
        self.sweep_dirs = [d for d in cfg["sweep_dirs"] if os.path.isdir(d)]
        self.sweep_mtimes = {d: os.stat(d).st_mtime_ns for d in self.sweep_dirs}
        for name in ("PWD", "LD_BIND_NOW"):  # bubblewrap sets PWD, the host LD_BIND_NOW for the server alone
            os.environ.pop(name, None)
        os.environ["HOME"] = os.environ["TMPDIR"] = self.jail["workdir"]

    def run_group(self, code: str, jobs: list) -> None:
        pending = list(jobs)
        while pending:
            results = self._run_child(code, [expr for _, expr in pending])
            out = [HEADER.pack(RESULT_HEAD.size + len(body)) + RESULT_HEAD.pack(job_id, wall) + body
                   for (job_id, _), (body, wall) in zip(pending, results, strict=False)]
            _write_all(1, b"".join(out))
            pending = pending[len(results):]

    def _run_child(self, code: str, exprs: list) -> list:
        """Fork C for ``exprs``; returns [(result, wall_s)] for a non-empty prefix of them."""
        self.seq += 1
        uid = None if self.uid_base is None else self.uid_base + self.seq % self.uid_count
        workdir = self.jail["workdir"]
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        r, w = os.pipe()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                _job_main(self.jail, uid, code, exprs, w)
            finally:
                os._exit(0)
        os.close(w)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        results, verdict = self._collect(r, pid, t0, len(exprs))
        os.close(r)
        if verdict is not None:  # the first unreported expression is the one that broke C
            since = t0 + sum(wall for _, wall in results)
            results.append((pack_verdict(verdict)[HEADER.size:], time.monotonic() - since))
        self._cleanup(workdir)
        return results

    def _collect(self, fd: int, pid: int, t0: float, n: int) -> tuple[list, str | None]:
        """Read C's verdict frames, each within its deadline; returns ([(body, wall_s)], verdict), where
        verdict says why C stopped early ("timeout", "output_limit", "killed") and is None when complete.
        C is killed (not waited for) once done: its uid is not reused soon, so its dying cannot matter."""
        results, buf, last = [], bytearray(), t0
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        verdict = "eof"
        while len(results) < n:
            left = last + self.timeout + (_GRACE_S if results or n > 1 else 0.0) - time.monotonic()
            if left <= 0 or not poller.poll(max(left, 0.0) * 1000.0):
                verdict = "timeout"
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            try:
                bodies = split_frames(buf, self.max_frame)
            except FrameTooLarge:
                verdict = "output_limit"
                break
            for body in bodies[: n - len(results)]:  # decoded and checked by the host, which never forks
                now = time.monotonic()
                every = len(body) > 1 and body[1] & 4
                results += [(body, now - last)] * (n - len(results) if every else 1)
                last = now
        if len(results) >= n:
            _kill(pid)
            return results[:n], None
        if verdict == "eof":  # C closed its pipe early: let it finish dying to learn why
            return results, _reap(pid, last + self.timeout + _GRACE_S)
        _kill(pid)
        return results, verdict

    def _cleanup(self, workdir: str) -> None:
        """Kill every process reparented to us, reap the dead, remove what the job wrote."""
        _kill_children(self.children_file, wait=False)
        try:
            os.rmdir(workdir)
        except OSError:
            _rmtree(workdir)
        for d in self.sweep_dirs:
            mtime = os.stat(d).st_mtime_ns
            if mtime != self.sweep_mtimes[d]:
                self._sweep(d)
                self.sweep_mtimes[d] = os.stat(d).st_mtime_ns

    def _sweep(self, directory: str) -> None:
        """Remove entries a job created in a shared writable folder (owned by a job uid of this worker)."""
        for entry in os.scandir(directory):
            if entry.path == self.base:
                continue
            try:
                owner = entry.stat(follow_symlinks=False).st_uid
            except OSError:
                continue
            if self.uid_base is None or self.uid_base <= owner < self.uid_base + self.uid_count:
                _remove(entry.path)

    def shutdown(self) -> None:
        _kill_children(self.children_file, wait=True)
        _rmtree(self.base)


def _load_libc():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):  # pragma: no cover - non-Linux
        return None


_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER, _CLONE_NEWNET = 1, 36, 0x40000000
_LIBC = None


def _private_mounts(shared_dirs: list, reveal: dict) -> bool:
    """Without bubblewrap, as root: a private mount namespace in which each world-writable folder
    (``shared_dirs``: /tmp, /dev/shm, ...) is a fresh tmpfs of this worker's own, and each folder others
    cannot enter (``reveal`` keys, e.g. /root, 0700) is covered by an enterable tmpfs holding only the
    interpreter folders bound back, so jobs under their own uid can import the standard library but see
    nothing else there. The host's mounts are untouched. False if any step fails."""
    import ctypes

    libc = _LIBC
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    ms_bind, ms_rec, ms_private, clone_newns = 4096, 16384, 1 << 18, 0x00020000
    if libc.unshare(clone_newns) != 0 or libc.mount(None, b"/", None, ms_rec | ms_private, None) != 0:
        return False
    # open what is to be revealed before any tmpfs can cover it (a virtualenv under /tmp, say)
    fds_by_hidden = {hidden: {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in paths}
                     for hidden, paths in reveal.items()}
    for folder in shared_dirs:
        if os.path.isdir(folder) and not os.path.islink(folder):
            if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, b"mode=1777") != 0:
                return False
    for hidden, fds in fds_by_hidden.items():
        if libc.mount(b"tmpfs", hidden.encode(), b"tmpfs", 0, b"mode=0755") != 0:
            return False
        for path, fd in fds.items():
            os.makedirs(path, mode=0o755, exist_ok=True)
            if libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, ms_bind | ms_rec, None) != 0:
                return False
            os.close(fd)
    return True


def _can_drop_to(uid: int) -> bool:
    """Whether a child of ours can switch to ``uid`` (tried in a throwaway child)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        except BaseException:  # noqa: B036
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _network_isolated() -> bool:
    """True when every network interface we can see is a loopback (i.e. we are in a network namespace of
    our own: nothing outside is reachable)."""
    try:
        with open("/proc/net/dev") as f:  # per network namespace, unlike /sys/class/net
            visible = [line.split(":")[0].strip() for line in f.readlines()[2:]]
    except OSError:
        return False
    return all(name == "lo" for name in visible)


def _import_warm_modules() -> None:
    for name in _WARM_MODULES:
        try:
            __import__(name)
        except ImportError:
            pass


def _warm_interpreter() -> None:
    """Compile and run _WARM_PROGRAM (ours, trusted) so jobs start with a warm compiler and warm caches."""
    ns = {"__name__": "__warm__", "__builtins__": builtins}
    exec(compile(_WARM_PROGRAM, "<warm>", "exec"), ns)
    repr(eval(compile("f([3, 1, 4, 1, 5], 'hello', 4, 1, k=2)", "<warm>", "eval"), ns))


def main() -> None:
    global _LIBC
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # jobs: a write to a closed pipe raises, as usual
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # jobs: a write over RLIMIT_FSIZE fails with EFBIG
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    hello = _read_frame(0)
    if not isinstance(hello, dict) or "config" not in hello:
        sys.exit("sandbox server: expected a config frame")
    cfg = hello["config"]
    _LIBC = _load_libc()
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # double-fork daemons of jobs come back to us
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # die with the host
        if cfg["unshare_net"]:  # without bubblewrap: a network namespace of our own (only a down loopback)
            _LIBC.unshare(_CLONE_NEWNET)
        if cfg["private_mounts"]:
            if _private_mounts(cfg["sweep_dirs"], cfg["reveal"]):
                cfg["sweep_dirs"] = []  # nothing a job writes there is visible outside this worker
            elif cfg["reveal"]:
                cfg["uid"] = None  # jobs could not import the standard library under their own uid
    _import_warm_modules()
    if cfg["uid"] is not None and not _can_drop_to(cfg["uid"]):
        cfg["uid"] = None  # e.g. root without CAP_SETUID in a nested container: jobs keep our uid
    base = os.path.join(cfg["tmp_root"], f"populora-sandbox-{os.getpid()}-{os.urandom(6).hex()}")
    os.mkdir(base, 0o711)  # jobs may enter their own folder in it, not list or write it
    server = Server(cfg, base)
    for which, value in server.limits:
        resource.setrlimit(which, value)
    sys.stdout = sys.stderr = _CappedText(cfg["max_stdout_chars"])  # the server itself never prints
    sys.stdin = io.StringIO("")
    _warm_interpreter()
    gc.collect()
    gc.freeze()  # the warm heap stays shared copy-on-write with every forked job
    _write_all(1, encode_frame({"ready": os.getpid(), "network_isolated": _network_isolated(),
                                "jobs_uid": cfg["uid"], "sweeping": server.sweep_dirs}))
    try:
        while True:
            request = _read_frame(0)
            if request is None:
                break
            for code, jobs in request["groups"]:
                server.run_group(code, jobs)
    finally:
        server.shutdown()


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: B036 - sys.stderr is capped and silent here: leave a trace on fd 2
        import traceback

        os.write(2, traceback.format_exc().encode(errors="replace"))
        raise
