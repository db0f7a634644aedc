"""Follow a submitted Ray job to its end: print its logs, wait for a final status, exit 0 only if it succeeded.

    python3 launch/ray_job_follow.py RAY_ADDRESS SUBMISSION_ID

``ray job submit`` without ``--no-wait`` tails the job's logs and exits when the tail ends. The tail can end
while the job is still RUNNING (ray-project/ray#51601, #60665: the log websocket closes, seen here on a loaded
2-core machine), and ``ray job submit`` then exits 0. A batch script that stops Ray when the launcher returns
(``slurm_populora.sbatch``) would kill the job. Its last lines can also be missing (ray-project/ray#48701).

So lib.sh submits with ``--no-wait`` and runs this: stream the logs; if the stream ends or breaks (Ray 2.55
raises on an abnormal close) before the job does, poll the job's status and logs every ``POLL_S`` seconds until
it is SUCCEEDED, FAILED or STOPPED, printing what the stream had not; then print whatever the stream missed at
the end. A dashboard that does not answer is retried for ``PATIENCE_S`` seconds before giving up. Exit 0 if the
job SUCCEEDED, 1 if it FAILED or was STOPPED, 3 if the job could not be watched (no such job, or the dashboard
gone for ``PATIENCE_S``: its state is unknown, not failed), 130 on Ctrl-C (the job keeps running: ``ray job
stop SUBMISSION_ID`` stops it).

Needs only Ray's job SDK (``ray[default]``), in the Python that runs the ``ray`` command.
"""

from __future__ import annotations

import asyncio
import sys
import time

from ray.job_submission import JobStatus, JobSubmissionClient

POLL_S = 10.0
PATIENCE_S = 600.0  # how long an unanswering dashboard is retried
UNOBSERVABLE = 3  # the exit status when the job's state cannot be known


class Unobservable(Exception):
    """The job's state cannot be read (no such job, or the dashboard did not answer for ``PATIENCE_S``)."""


def ask(call, what: str, patience_s: float = PATIENCE_S, poll_s: float = POLL_S):
    """``call()``, retried every ``poll_s`` seconds while the dashboard does not answer (a connection error, a
    timeout, a 5xx), for at most ``patience_s``; a job the dashboard does not know raises ``Unobservable``."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - requests, aiohttp and Ray's own errors alike
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if "does not exist" in text or "404" in text:
                raise Unobservable(f"{what}: {text}") from None
            if time.monotonic() >= deadline:
                raise Unobservable(f"{what}: the dashboard did not answer for {patience_s:g} s ({text})") from None
            print(f"launch: {what}: {text}; retrying in {poll_s:g} s", file=sys.stderr, flush=True)
            time.sleep(poll_s)


def stream(client: JobSubmissionClient, job_id: str) -> int:
    """Print the job's logs as they come until Ray's stream ends; return how many characters were printed."""
    printed = 0

    async def tail() -> None:
        nonlocal printed
        async for lines in client.tail_job_logs(job_id):
            print(lines, end="", flush=True)
            printed += len(lines)

    try:
        asyncio.run(tail())
    except Exception as err:  # noqa: BLE001 - Ray 2.55 raises on an abnormal close: polling takes over
        print(f"\nlaunch: Ray's log stream broke ({type(err).__name__}: {err})", file=sys.stderr, flush=True)
    return printed


def wait(client: JobSubmissionClient, job_id: str, printed: int, poll_s: float = POLL_S) -> JobStatus:
    """Until the job's status is final, every ``poll_s`` seconds print the logs past the first ``printed``
    characters; then print the rest and return the final status."""
    while True:
        status = ask(lambda: client.get_job_status(job_id), f"status of {job_id}", poll_s=poll_s)
        logs = ask(lambda: client.get_job_logs(job_id), f"logs of {job_id}", poll_s=poll_s)  # after: complete
        print(logs[printed:], end="", flush=True)
        printed = max(printed, len(logs))
        if status.is_terminal():
            return status
        time.sleep(poll_s)


def follow(address: str, job_id: str, poll_s: float = POLL_S) -> int:
    """Stream, then wait; return the exit status (0 SUCCEEDED, 1 FAILED or STOPPED)."""
    client = ask(lambda: JobSubmissionClient(address), f"the dashboard at {address}", poll_s=poll_s)
    ask(lambda: client.get_job_status(job_id), f"job {job_id}", poll_s=poll_s)  # known, before streaming it
    printed = stream(client, job_id)
    if not ask(lambda: client.get_job_status(job_id), f"status of {job_id}", poll_s=poll_s).is_terminal():
        print(f"\nlaunch: Ray's log stream ended while job {job_id} runs (ray-project/ray#51601); polling its "
              f"status and logs every {poll_s:g} s until it ends", file=sys.stderr, flush=True)
    status = wait(client, job_id, printed, poll_s)
    message = ask(lambda: client.get_job_info(job_id), f"info of {job_id}", poll_s=poll_s).message
    print(f"launch: job {job_id} {status.value}" + (f": {message}" if message else ""), file=sys.stderr, flush=True)
    return 0 if status == JobStatus.SUCCEEDED else 1


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    address, job_id = argv
    try:
        return follow(address, job_id)
    except Unobservable as err:
        print(f"launch: cannot watch job {job_id} ({err}); its state is unknown: ray job status --address="
              f"{address} {job_id}", file=sys.stderr)
        return UNOBSERVABLE
    except KeyboardInterrupt:
        print(f"\nlaunch: stopped following; job {job_id} keeps running (ray job stop --address={address} "
              f"{job_id} stops it; ray job logs --address={address} --follow {job_id} follows it)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
