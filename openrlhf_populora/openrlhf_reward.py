"""OpenRLHF's reward file for PopuLoRA's code tasks: ``--reward.remote_url <this file>``.

OpenRLHF 0.11.2 loads a ``--reward.remote_url`` that ends in ``.py`` with ``spec_from_file_location`` (without
registering it in ``sys.modules``) and calls ``reward_func(queries, prompts, labels)`` per sample, in a
thread. A label is a task as JSON (the format of ``configs/seeds/*.jsonl``, or ``{"task": {...}}``); the
completion is verified in this process's sandbox and scored with ``rewards.student_reward``. An exception
there leaves the sample's reward None and drops the rewards of its whole micro-batch, so ``reward_func`` never
raises: a label that is not a task, or a sandbox failure, scores 0.0 and counts in
``extra_logs["reward_errors"]``.

Environment knobs: ``POPULORA_REWARD_MODE=train|eval`` (shaped AZR rewards, or 1/0 accuracy),
``POPULORA_SANDBOX_WORKERS`` (2), ``POPULORA_SANDBOX_TIMEOUT_S`` (5), ``POPULORA_SANDBOX_MEMORY_MB`` (512).
"""

# No ``from __future__ import annotations`` here: OpenRLHF loads this file with spec_from_file_location
# without registering it in sys.modules, and @dataclass with string annotations would then fail.
import json
import os
import threading

from openrlhf_populora.rewards import RewardConfig, student_reward

_SANDBOX = None
_SANDBOX_LOCK = threading.Lock()


def _shared_sandbox():
    global _SANDBOX
    with _SANDBOX_LOCK:
        if _SANDBOX is None:
            from openrlhf_populora.sandbox import Sandbox

            _SANDBOX = Sandbox(workers=int(os.environ.get("POPULORA_SANDBOX_WORKERS", "2")),
                               timeout_s=float(os.environ.get("POPULORA_SANDBOX_TIMEOUT_S", "5")),
                               memory_mb=int(os.environ.get("POPULORA_SANDBOX_MEMORY_MB", "512")))
        return _SANDBOX


def _task_from_label(label):
    from openrlhf_populora.tasks import Task

    data = json.loads(label) if isinstance(label, (str, bytes)) else label
    if isinstance(data, dict) and "task" in data and "program" not in data:
        data = data["task"]
    return Task.from_dict(data)


def _response_of(query, prompt) -> str:
    """The completion inside ``query`` (= decoded prompt + response): the text after the prompt, else after
    the prompt's last 64 characters (decoding may change the prompt's start), else the whole query."""
    if not isinstance(query, str):
        return ""
    if isinstance(prompt, str) and prompt.strip():
        at = query.find(prompt)
        if at >= 0:
            return query[at + len(prompt):]
        tail = prompt.rstrip()[-64:]
        at = query.rfind(tail)
        if at >= 0:
            return query[at + len(tail):]
    return query


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
