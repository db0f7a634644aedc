"""OpenRLHF's reward file for PopuLoRA's code tasks: ``--reward.remote_url <this file>``.

OpenRLHF 0.11.2 loads a ``--reward.remote_url`` that ends in ``.py`` with ``spec_from_file_location`` (without
registering it in ``sys.modules``) and calls ``reward_func(queries, prompts, labels)`` once per sample, each call
in a thread of its event loop's executor (``asyncio.to_thread``), inside every vLLM actor process. A label is a
task as JSON (the format of ``configs/seeds/*.jsonl``, or ``{"task": {...}}``); the completion is verified in this
process's sandbox and scored with ``rewards.student_reward``. An exception there leaves the sample's reward None
and drops the rewards of its whole micro-batch, so ``reward_func`` never raises: a label that is not a task, or a
sandbox failure, scores 0.0 and counts in ``extra_logs["reward_errors"]``.

The sandbox, under upstream's concurrency:

- one per process (per loaded copy of this file), created lazily by the first call that needs one; concurrent
  calls share it (its batches run one at a time; each call's answers are one batch);
- created, and its batches run, on one long-lived daemon thread of this module, never on a caller's thread: a
  sandbox worker is killed when the thread that started it exits (PR_SET_PDEATHSIG), and caller threads come
  and go, which would kill the workers under another call's batch and score its answers as wrong;
- closed at interpreter exit (``atexit``): no worker process outlives this process;
- never shared across ``fork`` (checked by pid): a child process starts a sandbox of its own on its first call
  and forgets the parent's without touching it (closing it, or letting its finalizer run at the child's exit,
  would kill the parent's workers).

``close_sandbox()`` closes it by hand (the next call starts a new one); ``sandbox_stats()`` reads its counters.

Environment knobs: ``POPULORA_REWARD_MODE=train|eval`` (shaped AZR rewards, or 1/0 accuracy),
``POPULORA_SANDBOX_WORKERS`` (2), ``POPULORA_SANDBOX_TIMEOUT_S`` (5), ``POPULORA_SANDBOX_MEMORY_MB`` (512).
"""

# No ``from __future__ import annotations`` here: OpenRLHF loads this file with spec_from_file_location
# without registering it in sys.modules, and @dataclass with string annotations would then fail.
import atexit
import json
import os
import queue
import re
import threading
from concurrent import futures

from openrlhf_populora.rewards import RewardConfig, student_reward

_SANDBOX = None  # a sandbox to use instead of this process's own (tests set it); None: the process's own
_RUNNER = None  # this process's sandbox thread, which owns its sandbox
_OWNER_PID = os.getpid()  # the process that _RUNNER belongs to
_STATE_LOCK = threading.Lock()
_EXIT_HOOK = False  # close_sandbox registered with atexit


def _new_sandbox():
    from openrlhf_populora.sandbox import Sandbox

    return Sandbox(workers=int(os.environ.get("POPULORA_SANDBOX_WORKERS", "2")),
                   timeout_s=float(os.environ.get("POPULORA_SANDBOX_TIMEOUT_S", "5")),
                   memory_mb=int(os.environ.get("POPULORA_SANDBOX_MEMORY_MB", "512")))


class _Runner:
    """A daemon thread that owns this process's sandbox: creates it on first use, runs every batch of it (for
    any caller thread, one at a time) and closes it. Its workers live as long as this thread."""

    def __init__(self):
        self.sandbox = None
        self.closed = False
        self._inbox = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="populora-reward-sandbox", daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            item = self._inbox.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # handed back to the caller
                future.set_exception(err)

    def call(self, fn, *args):
        """``fn(*args)`` on this thread: its result, or its exception raised in the caller."""
        future = futures.Future()
        self._inbox.put((future, fn, args))
        while not futures.wait([future], timeout=1.0).done:
            if not self.thread.is_alive():  # stopped (closed, or the interpreter is exiting)
                raise RuntimeError("the reward file's sandbox thread has stopped")
        return future.result()

    # the three below run on this thread only

    def run_jobs(self, jobs, sandbox=None):
        if sandbox is not None:
            return sandbox.run(jobs)
        if self.closed:
            raise RuntimeError("the reward file's sandbox is closed")
        if self.sandbox is None:
            self.sandbox = _new_sandbox()
        return self.sandbox.run(jobs)

    def stats(self):
        return dict(self.sandbox.stats()) if self.sandbox is not None else {}

    def close(self):
        self.closed = True
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            sandbox.close()

    def stop(self):
        self._inbox.put(None)


def _forget_parent_state():
    """In a forked child: drop the parent's sandbox thread and sandbox without touching them. Disarming the
    sandbox's finalizer matters: run at the child's exit, it would kill the PARENT's worker processes."""
    global _RUNNER, _STATE_LOCK, _OWNER_PID
    inherited, _RUNNER = _RUNNER, None
    finalizer = getattr(getattr(inherited, "sandbox", None), "_finalizer", None)
    if finalizer is not None:
        try:
            finalizer.detach()
        except Exception:  # pragma: no cover - weakref.finalize.detach does not raise
            pass
    _STATE_LOCK = threading.Lock()  # the parent may have held it at the fork
    _OWNER_PID = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_state)


def _runner():
    """This process's sandbox thread, started on first use (a forked child starts its own)."""
    global _RUNNER, _EXIT_HOOK
    if _OWNER_PID != os.getpid():  # a fork the at-fork hook did not see
        _forget_parent_state()
    with _STATE_LOCK:
        if _RUNNER is None or not _RUNNER.thread.is_alive():
            _RUNNER = _Runner()
        if not _EXIT_HOOK:
            atexit.register(close_sandbox)
            _EXIT_HOOK = True
        return _RUNNER


class _ProcessSandbox:
    """What ``verify_answers`` gets: ``run(jobs)`` on this process's sandbox (or ``_SANDBOX`` when set), always
    on the sandbox thread."""

    def run(self, jobs):
        runner = _runner()
        return runner.call(runner.run_jobs, jobs, _SANDBOX)


def _shared_sandbox():
    """This process's sandbox, as a ``run(jobs)`` handle that any thread may use."""
    return _ProcessSandbox()


def close_sandbox():
    """Close this process's sandbox (its workers and everything they started) and stop its thread; registered
    with ``atexit``. The next call starts new ones. A sandbox inherited through ``fork`` is the parent's and is
    left alone. Never raises."""
    global _RUNNER
    if _OWNER_PID != os.getpid():
        _forget_parent_state()
        return
    with _STATE_LOCK:
        runner, _RUNNER = _RUNNER, None
        if runner is None:
            return
        try:
            if runner.thread.is_alive() and threading.current_thread() is not runner.thread:
                runner.call(runner.close)  # after the batch in flight, if any
            else:
                runner.close()
        except Exception:
            pass
        runner.stop()


def sandbox_stats() -> dict:
    """This process's sandbox counters (``Sandbox.stats()``: executions, worker_restarts, ...); {} before the
    first call that needed it. Never raises."""
    runner = _RUNNER
    try:
        if runner is None or _OWNER_PID != os.getpid() or runner.sandbox is None:
            return {}
        return dict(runner.sandbox.stats())
    except Exception:
        return {}


def _task_from_label(label):
    from openrlhf_populora.tasks import Task

    data = json.loads(label) if isinstance(label, (str, bytes)) else label
    if isinstance(data, dict) and "task" in data and "program" not in data:
        data = data["task"]
    return Task.from_dict(data)


# special tokens at the end of a decoded response: upstream decodes with skip_special_tokens=False and vLLM keeps
# the EOS token (Qwen's <|im_end|>, <|endoftext|>; Llama's </s>), which PopuLoRA's engines never show the grader
_SPECIAL_AT_END = re.compile(r"(?:<\|[^|<>\s]{1,40}\|>|</s>)\Z")


def _strip_trailing_special(text: str) -> str:
    """``text`` without the special tokens (and whitespace) that end it; linear in its length (a regex over the
    whole run of them backtracks quadratically on a long whitespace tail)."""
    stripped, found = text.rstrip(), False
    while (match := _SPECIAL_AT_END.search(stripped)) is not None:
        stripped, found = stripped[:match.start()].rstrip(), True
    return stripped if found else text  # no special token: the text as it was, whitespace and all


def _response_of(query, prompt) -> str:
    """The completion inside ``query`` (= decoded prompt + response): the text after the prompt, else after
    the prompt's last 64 characters (decoding may change the prompt's start), else the whole query; without
    the special tokens that end it (the EOS token), as PopuLoRA's own engines decode it."""
    if not isinstance(query, str):
        return ""
    response = query
    if isinstance(prompt, str) and prompt.strip():
        at = query.find(prompt)
        if at >= 0:
            response = query[at + len(prompt):]
        else:
            tail = prompt.rstrip()[-64:]
            at = query.rfind(tail)
            if at >= 0:
                response = query[at + len(tail):]
    return _strip_trailing_special(response)


def _as_tensor(values: list[float]):
    """OpenRLHF wants a tensor (``torch.tensor([t])`` of a 1-element tensor keeps shape [1]; of a list it
    would be [1, 1]). torch is imported here only, lazily; without torch a list is returned."""
    try:
        import torch
    except Exception:  # pragma: no cover - torch is installed wherever OpenRLHF runs
        return list(values)
    return torch.tensor(values, dtype=torch.float32)


def score_completions(queries, prompts, labels, *, sandbox=None, cfg=None) -> dict:
    """``reward_func`` with plain lists: {"rewards", "scores" (1/0 correctness), "extra_logs"}. Never raises."""
    n = len(queries) if isinstance(queries, (list, tuple)) else 0
    cfg = cfg or (RewardConfig.evaluation() if os.environ.get("POPULORA_REWARD_MODE") == "eval"
                  else RewardConfig())
    rewards, scores = [0.0] * n, [0.0] * n
    logs = {"format_ok": 0.0, "correct": 0.0, "reward_errors": 0.0}
    try:
        from openrlhf_populora.tasks import Verdict, verify_answers

        prompts = list(prompts) if isinstance(prompts, (list, tuple)) else []
        labels = list(labels) if isinstance(labels, (list, tuple)) else []
        tasks, responses, where, errors = [], [], [], 0
        for i in range(n):
            try:
                task = _task_from_label(labels[i])
            except Exception:
                errors += 1
                continue
            tasks.append(task)
            responses.append(_response_of(queries[i], prompts[i] if i < len(prompts) else ""))
            where.append(i)
        verdicts: list = []
        if tasks:
            try:
                verdicts = verify_answers(tasks, responses, sandbox or _shared_sandbox())
            except Exception:
                errors += len(tasks)
                verdicts, where = [], []
        for i, verdict in zip(where, verdicts, strict=True):
            if not isinstance(verdict, Verdict):
                continue
            rewards[i] = student_reward(verdict, cfg)
            scores[i] = 1.0 if verdict.correct else 0.0
            logs["format_ok"] += verdict.format_ok / max(n, 1)
            logs["correct"] += verdict.correct / max(n, 1)
        logs["reward_errors"] = float(errors)
    except Exception:
        logs["reward_errors"] = float(n)
    return {"rewards": rewards, "scores": scores, "extra_logs": logs}


def reward_func(queries, prompts, labels, **kwargs):
    """OpenRLHF reward file entry point: label = a task as JSON (or ``{"task": {...}}``).

    Returns ``{"rewards": Tensor[n], "scores": Tensor[n], "extra_logs": {name: float}}``; a label that is
    not a task, or a sandbox failure, scores 0.0 and counts in ``extra_logs["reward_errors"]``.
    """
    try:
        out = score_completions(queries, prompts, labels)
        return {"rewards": _as_tensor(out["rewards"]), "scores": _as_tensor(out["scores"]),
                "extra_logs": out["extra_logs"]}
    except Exception:  # pragma: no cover - score_completions already never raises
        return {"rewards": _as_tensor([0.0]), "scores": _as_tensor([0.0]), "extra_logs": {"reward_errors": 1.0}}
