"""How a sandbox worker is started: the isolation layer, its command line, environment and job identity.

Layers, outermost first:
- ``bwrap`` (bubblewrap): the fork server runs in new PID, network, IPC, UTS and cgroup namespaces (plus a
  user namespace when the host is not root), on a read-only view of ``/`` with a private ``/tmp``, fresh
  ``/dev`` and ``/proc``, in its own session, dying with its parent. Set up once per worker, not per job.
- always: per job a fresh forked process with rlimits, a private working directory and a scrubbed
  environment (see ``server.py``); when the host is root, each job also runs under an unprivileged uid/gid
  of its own (from a block of UIDS_PER_WORKER per worker), so it cannot signal the server or other jobs,
  raise rlimits back or read root's files. Without bubblewrap but as root, the server still unshares a
  network namespace and a mount namespace (private tmpfs over the world-writable folders).

``isolation="auto"`` uses bubblewrap when a probe run succeeds and otherwise logs, once per process, that it
fell back to rlimits only.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

log = logging.getLogger("openrlhf_populora.sandbox")

ISOLATIONS = ("auto", "bwrap", "rlimits")
SERVER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py")
# -S (or -s: no user site); -B: no .pyc writes. Not -I/-E: they would ignore PYTHONHASHSEED, and the
# environment is ours anyway. The bootstrap drops sys.path[0] so the server's folder is not importable by jobs.
_BOOT = "import runpy, sys; del sys.path[0]; runpy.run_path(sys.argv[1], run_name='__main__')"
_UID_BASE = 1 << 20  # job uids live in [2**20, 2**31): far above any login account
UIDS_PER_WORKER = 1024
_uid_counter = itertools.count()
_fallback_logged = False


def _bwrap_args(as_root: bool) -> list[str]:
    namespaces = (
        ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        if as_root  # a user namespace would map only uid 0, and jobs need uids of their own
        else ["--unshare-all"]
    )
    return [
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--perms", "0755", "--tmpfs", "/tmp",
        "--perms", "0755", "--tmpfs", "/run",
        *namespaces,
        "--die-with-parent",
        "--new-session",
        "--chdir", "/tmp",
    ]


def server_argv(isolation: str, site_packages: bool = False) -> list[str]:
    """The command that starts one fork server under ``isolation`` ("bwrap" or "rlimits"). Without
    ``site_packages`` the interpreter runs with -S: jobs import the standard library only, and every fork
    is lighter (no site machinery in the warm heap)."""
    argv = [sys.executable, "-S" if not site_packages else "-s", "-B", "-c", _BOOT, SERVER_PATH]
    if isolation == "bwrap":
        return [*_bwrap_command(), "--", *argv]
    return argv


def _bwrap_command() -> list[str]:
    """bwrap and its options: namespaces, read-only root, private tmpfs mounts, and the interpreter's
    folders bound back where those mounts (or folders other uids cannot enter) would hide them."""
    reveal: list[str] = []
    private = ("/tmp", "/run")  # the tmpfs mounts of _bwrap_args
    hidden_paths = hidden_interpreter_paths(private)
    if os.geteuid() != 0:  # jobs share our uid: only what the private tmpfs mounts hide needs revealing
        hidden_paths = {k: v for k, v in hidden_paths.items() if k in private}
    for hidden, paths in hidden_paths.items():
        reveal += ["--perms", "0755", "--tmpfs", hidden]
        made = set()
        for path in paths:
            parts = path[len(hidden):].strip("/").split("/")
            for k in range(1, len(parts)):  # enterable folders on the way (bwrap would make them 0700)
                folder = hidden + "/" + "/".join(parts[:k])
                if folder not in made:
                    made.add(folder)
                    reveal += ["--perms", "0755", "--dir", folder]
            reveal += ["--ro-bind", path, path]
    return [shutil.which("bwrap") or "bwrap", *_bwrap_args(os.geteuid() == 0), *reveal]


def hidden_interpreter_paths(private_dirs: tuple[str, ...] | list[str] = ()) -> dict[str, list[str]]:
    """Folders that hide files the sandboxed interpreter needs (base installation, virtualenv, this
    package): {hidden folder: [needed paths under it]}.

    Two kinds: folders other users cannot enter (e.g. /root, mode 0700; jobs run under their own uid when
    we are root, and a pyenv Python under /root is the common case), and ``private_dirs``, the folders the
    sandbox covers with a fresh tmpfs (a checkout or virtualenv under /tmp, as CI clones often are). Each is
    covered by a tmpfs with only the needed paths bound back.
    """
    needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
                                            os.path.dirname(os.path.realpath(sys.executable)),
                                            os.path.dirname(SERVER_PATH))}
    hidden: dict[str, list[str]] = {}
    for path in sorted(needed):
        covering = [d for d in private_dirs if path.startswith(d.rstrip("/") + "/")]
        if covering:
            hidden.setdefault(covering[0], []).append(path)
            continue
        current = ""
        for part in path.strip("/").split("/"):
            current += "/" + part
            try:
                enterable = os.stat(current).st_mode & stat.S_IXOTH
            except OSError:
                break
            if not enterable:
                if current != path:
                    hidden.setdefault(current, []).append(path)
                break
    return {h: [p for p in sorted(set(ps)) if not any(p.startswith(q + "/") for q in ps)]
            for h, ps in hidden.items()}


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """None when bubblewrap works here (probed once per process), else why it does not."""
    path = shutil.which("bwrap")
    if path is None:
        return "no `bwrap` executable on PATH (Debian package `bubblewrap`)"
    probe = [*_bwrap_command(), "--", sys.executable, "-s", "-c", "print('ok')"]
    try:
        proc = subprocess.run(probe, capture_output=True, timeout=30, env=scrubbed_env(0), check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`bwrap` failed to start: {exc}"
    if proc.returncode != 0 or proc.stdout.strip() != b"ok":
        err = proc.stderr.decode(errors="replace").strip()[-300:]
        return f"`bwrap` probe exited with {proc.returncode}: {err or 'no message'}"
    return None


def resolve(isolation: str) -> str:
    """Map the requested isolation to the one used: "bwrap" or "rlimits"."""
    global _fallback_logged
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "rlimits":
        return "rlimits"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    if isolation == "bwrap":
        raise RuntimeError(f"isolation='bwrap' requested but bubblewrap is unusable: {problem}")
    if not _fallback_logged:
        _fallback_logged = True
        log.warning("sandbox: bubblewrap unusable (%s); falling back to rlimits only: "
                    "no network, mount or PID namespaces", problem)
    return "rlimits"


def scrubbed_env(hash_seed: int) -> dict[str, str]:
    """The whole environment a worker and its jobs see: nothing inherited from the host."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": str(hash_seed),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        # Resolve every symbol when the server loads, not lazily: a libc call first made in a job (setuid,
        # chdir, ...) would otherwise run the dynamic linker and dirty a page of the GOT in every job.
        # The server drops it from the environment its jobs inherit.
        "LD_BIND_NOW": "1",
    }


def job_uids() -> int | None:
    """The first of ``UIDS_PER_WORKER`` fresh uids for one worker's jobs (job k runs as base + k mod count),
    when we are root and they are mapped in our user namespace; else None (jobs keep our uid).

    Unique per live worker on this machine (derived from our pid and a counter), so two workers, sandboxes
    or processes never share a uid, and RLIMIT_NPROC counts only one job's processes.
    """
    if os.geteuid() != 0:
        return None
    blocks = ((1 << 31) - _UID_BASE) // UIDS_PER_WORKER
    base = _UID_BASE + ((os.getpid() * 64 + next(_uid_counter)) % blocks) * UIDS_PER_WORKER
    return base if _uid_mapped(base) and _uid_mapped(base + UIDS_PER_WORKER - 1) else None


def _uid_mapped(uid: int) -> bool:
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inner, _outer, count = (int(x) for x in line.split())
                if inner <= uid < inner + count:
                    return True
    except (OSError, ValueError):
        return False
    return False


def user_task_count() -> int:
    """Processes + threads of our real uid (what RLIMIT_NPROC counts) when jobs cannot get a uid of their own."""
    uid, total = os.getuid(), 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid == uid:
                total += len(os.listdir(f"/proc/{name}/task"))
        except OSError:
            continue
    return total


def sweep_dirs(isolation: str, uid_base: int | None) -> list[str]:
    """World-writable folders the server cleans after a job that touched them (the job's own files only)."""
    if isolation == "bwrap":
        return [] if uid_base is not None else ["/tmp", "/dev/shm"]  # root: read-only; else private to the worker
    # as root the server first tries to make these private tmpfs mounts (then it needs no sweeping)
    return ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"] if uid_base is not None else []


def tmp_root(isolation: str) -> str:
    """Where a worker keeps its jobs' working folders: a tmpfs (creating and removing folders there is
    cheap; on a disk it can cost milliseconds per job)."""
    if isolation == "bwrap":
        return "/tmp"  # the worker's private tmpfs
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def kill_uids(first: int, count: int) -> None:
    """SIGKILL every process whose real uid is in [first, first + count): whatever a worker's jobs left
    behind should their server have died first. Scans /proc; used only when a worker is torn down."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if first <= os.stat(f"/proc/{name}").st_uid < first + count:
                os.kill(int(name), signal.SIGKILL)
        except OSError:
            continue
