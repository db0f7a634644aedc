"""launch/ray_job_follow.py against a real one-node Ray cluster: the launch scripts' exit status is the job's.

``ray job submit`` can return 0 while its job still runs (its log stream ends early, ray-project/ray#51601), and
returns 0 for a stopped job; slurm_populora.sbatch stops Ray when the launcher returns. These tests hold the
follower to the job's final status and its whole log.
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
import time
import uuid

import pytest
from paths import ROOT
from ray_nodes import local_cluster, node_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FOLLOW = ROOT / "launch" / "ray_job_follow.py"
LINES = "import time\nfor i in range(12):\n    print(f'line {i}', flush=True)\n    time.sleep(0.5)\n"
EXPECTED = [f"line {i}" for i in range(12)]  # the job's own lines; Ray adds its own before them


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray.dashboard")
    with local_cluster(nodes=1, gpus=0, cpus=2) as addresses:
        yield addresses


def _submit(cluster, code: str) -> tuple[object, str]:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(cluster["dashboard"])
    job_id = f"follow-test-{uuid.uuid4().hex[:8]}"
    client.submit_job(entrypoint=shlex.join([sys.executable, "-c", code]), submission_id=job_id)
    return client, job_id


def _follow(cluster, job_id: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(FOLLOW), cluster["dashboard"], job_id], env=node_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_job_that_succeeds_exits_0_with_every_line_once(cluster):
    # Catches: exiting before the job's last lines (ray-project/ray#48701), or printing a line twice
    _, job_id = _submit(cluster, LINES)
    done = _follow(cluster, job_id)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err
    assert [line for line in out.splitlines() if line.startswith("line ")] == EXPECTED, out
    assert f"launch: job {job_id} SUCCEEDED" in err


def test_a_job_that_fails_exits_1(cluster):
    # Catches: the follower's own success standing for the job's
    _, job_id = _submit(cluster, "print('about to fail', flush=True)\nraise SystemExit(3)")
    done = _follow(cluster, job_id)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 1 and "about to fail" in out
    assert f"launch: job {job_id} FAILED" in err


def test_a_stopped_job_exits_1(cluster):
    # `ray job submit` exits 0 for a job stopped with `ray job stop`. Catches: the same here (a batch script
    # would report a run that never finished as done)
    client, job_id = _submit(cluster, "import time\nprint('started', flush=True)\ntime.sleep(300)")
    done = _follow(cluster, job_id)
    deadline = time.monotonic() + 120
    while str(client.get_job_status(job_id).value) != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.5)
    client.stop_job(job_id)
    out, err = done.communicate(timeout=300)
    assert done.returncode == 1, (out, err)
    assert f"launch: job {job_id} STOPPED" in err


def test_when_the_stream_ends_early_it_polls_to_the_end(cluster, capsys):
    # What runs after Ray's log stream ended while the job was still running: here the stream had shown the logs
    # up to the job's first line. Catches: returning while the job runs (the bug this script exists for), or
    # printing again what the stream showed
    follow = _module()
    client, job_id = _submit(cluster, LINES)
    deadline = time.monotonic() + 120
    while "line 0\n" not in (logs := client.get_job_logs(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    printed = logs.index("line 0\n") + len("line 0\n")
    assert not client.get_job_status(job_id).is_terminal()  # the job runs on past the stream's end
    status = follow.wait(client, job_id, printed=printed, poll_s=0.5)
    assert status.value == "SUCCEEDED"
    assert capsys.readouterr().out.splitlines() == EXPECTED[1:]


def _module():
    spec = importlib.util.spec_from_file_location("ray_job_follow", FOLLOW)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stream_that_breaks_is_followed_by_polling(cluster, capsys, monkeypatch):
    # Ray 2.55's log stream raises on an abnormal close (code 1006) instead of ending. Catches: the follower
    # dying with it (exit 1 while the job runs: under sbatch, Ray stopped beneath the job). The break is
    # simulated after the stream's first chunk; the job, the cluster and the polling are real.
    from ray.job_submission import JobSubmissionClient

    follow = _module()
    real_tail = JobSubmissionClient.tail_job_logs

    async def breaking_tail(self, job_id):
        async for lines in real_tail(self, job_id):
            yield lines
            raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")

    monkeypatch.setattr(JobSubmissionClient, "tail_job_logs", breaking_tail)
    _, job_id = _submit(cluster, LINES)
    assert follow.follow(cluster["dashboard"], job_id, poll_s=0.5) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.out.splitlines() if line.startswith("line ")] == EXPECTED
    assert "log stream broke" in captured.err and f"launch: job {job_id} SUCCEEDED" in captured.err


def test_a_job_that_does_not_exist_is_unknown_not_failed(cluster):
    # Catches: a wrong id (or a vanished dashboard) reported as a failed job (exit 1), or a traceback
    done = _follow(cluster, "no-such-job-0000")
    out, err = done.communicate(timeout=300)
    assert done.returncode == 3, (out, err)
    assert "cannot watch job no-such-job-0000" in err and "Traceback" not in err
