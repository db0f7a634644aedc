"""An exclusive lock on a directory, held by one process for as long as it writes there (a run directory, a
study's output directory): two writers would interleave their files.

The lock is ``flock`` on ``<directory>/.lock``, released by the kernel when the process ends, however it ends.
Shared filesystems do not always have it: Lustre mounted without ``-o flock`` answers ENOSYS, NFS without its
lock daemon ENOLCK. There the lock is ``<directory>/.lock.owner``, created with ``O_EXCL`` (atomic on local
filesystems, NFSv3+ and Lustre) and holding the owner's pid, host and start time; it is removed when the owner
releases it or exits normally. A process killed outright (SIGKILL, a lost node) leaves it behind: the next
claim is refused with a message naming the file to delete, and saying whether its owner is known to be gone
(same host, pid not running). A process that does get ``flock`` still honours an owner file (a writer on
another mount of the same filesystem).
"""

from __future__ import annotations

import errno
import os
import socket
import time
import weakref
from pathlib import Path

LOCK_FILE = ".lock"
OWNER_FILE = ".lock.owner"
# flock is not there on this filesystem (not: someone else holds it)
NO_FLOCK = frozenset({errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP})


class DirectoryBusy(Exception):  # noqa: N818 - a state, reported to the user as it is
    """The directory is locked by another process (``str()`` says by whom), or by a stale owner file left by a
    process that was killed (``stale``: its pid is not running on this host; the message names the file)."""

    def __init__(self, message: str, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a live process of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _holder(path: Path) -> DirectoryBusy:
    """Why ``path`` (an owner file) blocks a claim."""
    try:
        pid_text, host, since = (path.read_text().split() + ["?", "?", "?"])[:3]
    except OSError:
        pid_text = host = since = "?"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(int(since))) if since.isdigit() else "?"
    if host == socket.gethostname() and pid_text.isdigit() and not pid_running(int(pid_text)):
        return DirectoryBusy(f"{path} is a stale lock: it names pid {pid_text} on this host (since {when}), which is "
                             f"not running (a process killed before it could release it). Delete {path} and start "
                             "again", stale=True)
    return DirectoryBusy(f"locked by pid {pid_text} on host {host} since {when} (lock file {path}, used where the "
                         f"filesystem has no flock; if that process is gone, delete the file)")


def _release(path: str, token: str) -> None:
    """Remove the owner file ``path`` if it is still this process's (``token``: its content)."""
    if os.getpid() != int(token.split()[0]):  # a forked child exiting must not release its parent's lock
        return
    try:
        if Path(path).read_text() == token:
            os.unlink(path)
    except OSError:
        pass


class DirectoryLock:
    """A held lock: ``close()`` (or the end of a ``with`` block, or of the process) releases it."""

    def __init__(self, handle=None, owner: Path | None = None, token: str = "") -> None:
        self._handle = handle
        self.owner = owner  # the owner file, where the filesystem has no flock
        self._finalizer = weakref.finalize(self, _release, str(owner), token) if owner is not None else None

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        if self._handle is not None:
            self._handle.close()

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _claim_owner_file(directory: Path) -> DirectoryLock:
    path = directory / OWNER_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise _holder(path) from None
    token = f"{os.getpid()} {socket.gethostname()} {int(time.time())}\n"
    with os.fdopen(fd, "w") as owner:
        owner.write(token)
    return DirectoryLock(owner=path, token=token)


def lock_directory(directory: str | os.PathLike) -> DirectoryLock:
    """Lock ``directory`` (which must exist) for this process: ``flock``, else an owner file (module docstring).
    Raises :class:`DirectoryBusy` when another process holds it."""
    directory = Path(directory)
    handle = open(directory / LOCK_FILE, "a")  # noqa: SIM115 - kept open while the lock is held
    import fcntl

    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise DirectoryBusy(f"locked by another process (flock on {directory / LOCK_FILE})") from None
    except OSError as err:
        handle.close()
        if err.errno not in NO_FLOCK:
            raise
        return _claim_owner_file(directory)
    if (directory / OWNER_FILE).exists():
        handle.close()
        raise _holder(directory / OWNER_FILE)
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return DirectoryLock(handle=handle)


def claim_directory(directory: str | os.PathLike, flag: str, writer: str) -> DirectoryLock:
    """:func:`lock_directory` for an entry point (the runner's run directory, a study's ``--out``): a refusal is a
    :class:`DirectoryBusy` whose message is the one line to show, naming the ``flag`` that chose the directory and
    the other ``writer`` ("run", "study")."""
    try:
        return lock_directory(directory)
    except DirectoryBusy as busy:
        if busy.stale:
            raise DirectoryBusy(f"{flag} {directory}: {busy}", stale=True) from None
        raise DirectoryBusy(f"another {writer} is writing into {directory} right now ({busy}); wait for it or "
                            f"choose another {flag}") from None
