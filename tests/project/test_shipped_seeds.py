"""The seed tasks shipped in configs/seeds are valid: re-checking each one in the sandbox reproduces it."""


from paths import ROOT

from openrlhf_populora.sandbox import Sandbox
from openrlhf_populora.tasks import TaskBuffers, check_proposals

SEEDS = ROOT / "configs" / "seeds" / "basic.jsonl"


def _as_proposal(task) -> str:
    if task.task_type == "code_f":
        blocks = "".join(f"```input\n{x}\n```\n" for x in task.inputs)
        return f"<answer>{blocks}```message\n{task.message}\n```</answer>"
    return f"<answer>\n```python\n{task.program}\n```\n```input\n{task.inputs[0]}\n```\n</answer>"


def test_shipped_seed_tasks_recheck_as_valid():
    buffers = TaskBuffers.load(SEEDS)
    assert all(buffers.size(t) > 0 for t in ("code_o", "code_i", "code_f"))
    with Sandbox(workers=2, timeout_s=5.0, memory_mb=256) as sandbox:
        for task_type in ("code_o", "code_i", "code_f"):
            tasks = buffers.tasks(task_type)
            programs = [t.program for t in tasks] if task_type == "code_f" else None
            checks = check_proposals(task_type, [_as_proposal(t) for t in tasks], sandbox, programs=programs)
            for task, check in zip(tasks, checks, strict=True):
                assert check.valid, (task.program, check.reason)
                assert check.task.outputs == task.outputs
