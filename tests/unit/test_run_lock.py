"""The run-directory lock (and the retention study's) on filesystems without flock: Lustre mounted without
``-o flock`` answers ENOSYS, NFS without its lock daemon ENOLCK. ``fcntl.flock`` is made to raise that; the
lock must fall back to an owner file and still keep a second writer out."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from paths import ROOT

from openrlhf_populora.config import parse_config
from openrlhf_populora.errors import InputError
from openrlhf_populora.selfplay.runner import claim_run_dir

SECOND_CLAIM = """
import errno, fcntl, sys
if sys.argv[2] == "no-flock":
    def flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")
    fcntl.flock = flock
from openrlhf_populora.config import parse_config
from openrlhf_populora.selfplay.runner import claim_run_dir
claim_run_dir(parse_config(["--actor.model_name_or_path", "tiny", "--ckpt.output_dir", sys.argv[1]]))
print("claimed")
"""


def _config(run_dir: Path):
    return parse_config(["--actor.model_name_or_path", "tiny", "--ckpt.output_dir", str(run_dir)])


def _without_flock(monkeypatch, code: int) -> None:
    def flock(fd, operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", flock)


def _second_process(run_dir: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SECOND_CLAIM, str(run_dir), mode], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.ENOLCK])
def test_without_flock_the_run_directory_is_still_locked(tmp_path, monkeypatch, code):
    """Catches: only BlockingIOError handled (the controller died at start with OSError ENOSYS/ENOLCK), and a
    fallback that lets a second run in (in this process or another, with or without flock) or never releases."""
    _without_flock(monkeypatch, code)
    run_dir = tmp_path / "run"
    first = claim_run_dir(_config(run_dir))
    with pytest.raises(SystemExit) as second:
        claim_run_dir(_config(run_dir))
    message = str(second.value)
    assert "another run is writing into" in message and f"pid {os.getpid()} on host {socket.gethostname()}" in message
    for mode in ("no-flock", "flock"):  # another process, on a mount without flock or with it
        other = _second_process(run_dir, mode)
        assert other.returncode != 0 and "another run is writing into" in other.stderr, (mode, other.stderr[-2000:])
    first.close()
    assert not (run_dir / ".lock.owner").exists()
    claim_run_dir(_config(run_dir)).close()  # released: the next run goes ahead


def test_a_stale_owner_file_is_refused_naming_the_file(tmp_path, monkeypatch):
    """A run killed outright (SIGKILL, a lost node) leaves its owner file: the next claim says it is stale and
    which file to delete, instead of waiting or taking over silently."""
    _without_flock(monkeypatch, errno.ENOSYS)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner = run_dir / ".lock.owner"
    owner.write_text(f"{done.stdout.strip()} {socket.gethostname()} 1700000000\n")  # its process has exited
    with pytest.raises(SystemExit) as refused:
        claim_run_dir(_config(run_dir))
    assert "stale lock" in str(refused.value) and f"Delete {owner}" in str(refused.value)
    assert "another run is writing" not in str(refused.value)
    owner.unlink()
    claim_run_dir(_config(run_dir)).close()


def test_the_retention_studys_lock_falls_back_too(tmp_path, monkeypatch):
    from openrlhf_populora.studies import retention

    _without_flock(monkeypatch, errno.ENOLCK)
    held = retention.lock_study(tmp_path)
    with pytest.raises(InputError, match=f"another study is writing into {tmp_path}"):
        retention.lock_study(tmp_path)
    held.close()
    retention.lock_study(tmp_path).close()
