"""The worker pool: survives workers dying under it, serialises concurrent callers, picks its isolation."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time

import pytest

from openrlhf_populora.sandbox import Sandbox
from openrlhf_populora.sandbox import isolation as iso


def test_batch_completes_when_a_worker_is_killed_from_outside():
    with Sandbox(workers=2, timeout_s=5.0, isolation="rlimits") as sb:
        victim = sb._pool[0].proc.pid  # it gets the first chunk: the sleeper, alone (its code differs)

        def kill_worker():
            time.sleep(0.6)
            os.killpg(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_worker)
        killer.start()
        jobs = [("import time\n", "time.sleep(3)")] + [("", f"{k} * 3") for k in range(20)]
        results = sb.run(jobs)
        killer.join()
        assert results[0].status == "killed"
        assert [r.value for r in results[1:]] == [str(k * 3) for k in range(20)]
        assert sb.stats()["worker_restarts"] == 1
        assert victim not in {w.proc.pid for w in sb._pool}
        assert sb.run([("", "'still fine'")])[0].value == "'still fine'"


def test_worker_dead_between_batches_is_replaced():
    with Sandbox(workers=1, isolation="rlimits") as sb:
        os.killpg(sb._pool[0].proc.pid, signal.SIGKILL)
        sb._pool[0].proc.wait()
        assert sb.run([("", "6 * 7")])[0].value == "42"


def test_concurrent_callers_are_serialised():
    with Sandbox(workers=2, isolation="rlimits") as sb:
        out: dict[int, list] = {}

        def call(k: int) -> None:
            out[k] = sb.run([("", f"{k} + {j}") for j in range(10)])

        threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert {k: [r.value for r in v] for k, v in out.items()} == {
            k: [str(k + j) for j in range(10)] for k in range(3)}


def test_auto_falls_back_to_rlimits_and_says_so_once(monkeypatch, caplog):
    """The fallback decision itself (the probe is replaced by a failing one: it is what this test is about)."""
    monkeypatch.setattr(iso, "bwrap_problem", lambda: "no `bwrap` executable on PATH")
    monkeypatch.setattr(iso, "_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="openrlhf_populora.sandbox"):
        assert iso.resolve("auto") == "rlimits"
        assert iso.resolve("auto") == "rlimits"
    assert sum("falling back to rlimits" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="bubblewrap is unusable"):
        iso.resolve("bwrap")
    assert iso.resolve("rlimits") == "rlimits"


@pytest.mark.skipif(iso.bwrap_problem() is not None, reason=f"bubblewrap unusable here: {iso.bwrap_problem()}")
def test_auto_uses_bwrap_when_it_works():
    with Sandbox(workers=1) as sb:
        assert sb.isolation == "bwrap" and sb.network_isolated
        value = sb.run([("import os\n", "(os.getpid() < 100, os.path.exists('/proc/1/environ'), "
                                         "open('/proc/1/cmdline', 'rb').read().split(b'\\0')[0])")])[0].value
    assert value == "(True, True, b'" + shutil.which("bwrap") + "')"  # own PID namespace, bwrap is pid 1


def test_hidden_interpreter_paths_are_under_unenterable_folders():
    for hidden, paths in iso.hidden_interpreter_paths().items():
        assert not os.stat(hidden).st_mode & 0o001
        assert all(p.startswith(hidden + "/") for p in paths)


def test_chunks_cover_every_job_once_and_keep_answer_groups_whole():
    from openrlhf_populora.sandbox.sandbox import _chunk_size, _chunks

    jobs = [(f"c{k % 5}", str(k)) for k in range(40)] + [("big", str(k)) for k in range(40)]
    chunks = _chunks(jobs, _chunk_size(len(jobs), 2))
    flat = sorted(i for chunk in chunks for i in chunk)
    assert flat == list(range(len(jobs)))
    for code in {c for c, _ in jobs if c != "big"}:  # 8 answers each: never cut
        holders = [k for k, chunk in enumerate(chunks) if any(jobs[i][0] == code for i in chunk)]
        assert len(holders) == 1
    assert all(len(chunk) <= 64 for chunk in chunks)
