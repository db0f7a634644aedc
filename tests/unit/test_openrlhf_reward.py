"""OpenRLHF's reward file: scores, bad labels, never raising (hypothesis fuzz), loading the way upstream loads it,
many threads at once, no worker outliving its process, fork."""

import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paths import ROOT
from task_answers import answer_block

from openrlhf_populora import openrlhf_reward as reward_file
from openrlhf_populora.openrlhf_reward import reward_func, score_completions
from openrlhf_populora.sandbox import Sandbox
from openrlhf_populora.tasks import Task, solver_prompt


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2, timeout_s=2.0, memory_mb=256) as sb:
        yield sb


TASK = Task("code_o", "def f(x):\n    return [x] * 2\n", ["'a'"], ["['a', 'a']"])
PROMPT = "<|user|>predict<|assistant|>"


def test_reward_func_scores_a_student_completion(sandbox, monkeypatch):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    right = PROMPT + "<think>x</think><answer>```output\n['a', 'a']\n```</answer><|end|>"
    wrong = PROMPT + "<answer>```output\n['a']\n```</answer>"
    out = reward_func([right], [PROMPT], [TASK.to_json()])
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert isinstance(out["rewards"], torch.Tensor) and out["rewards"].shape == (1,)
    assert torch.tensor([out["rewards"]]).shape == (1,)  # what OpenRLHF does with it
    assert out["rewards"].tolist() == [1.0] and out["scores"].tolist() == [1.0]
    out = reward_func([wrong, "junk", right], [PROMPT] * 3, [TASK.to_json()] * 2 + [json.dumps({"task": TASK.to_dict()})])
    assert out["rewards"].tolist() == [-0.5, -1.0, 1.0] and out["scores"].tolist() == [0.0, 0.0, 1.0]
    assert out["extra_logs"]["reward_errors"] == 0.0 and all(isinstance(v, float) for v in out["extra_logs"].values())


def test_reward_func_prompt_answer_example_is_not_the_answer(sandbox, monkeypatch):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    prompt = "example: <answer>```output\n['a', 'a']\n```</answer> now you:"
    out = reward_func([prompt + " no idea"], [prompt], [TASK.to_json()])
    assert out["rewards"].tolist() == [-1.0]


def test_prompt_found_by_its_tail_when_decoding_changed_its_start(sandbox, monkeypatch):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    prompt = "Example: <answer>```output\n['a', 'a']\n```</answer>\n" + "Now predict the output of f('a')." * 3
    query = "<bos>" + prompt.replace("Example", "EXAMPLE") + " I do not know."
    out = reward_func([query], [prompt], [TASK.to_json()])
    assert out["rewards"].tolist() == [-1.0]  # the prompt's example answer is not taken as the answer


def test_bad_labels_score_zero_and_are_counted(sandbox):
    out = score_completions(["a", "b", "c"], ["", "", ""], ["not json", json.dumps({"task_type": "code_o"}), None],
                            sandbox=sandbox)
    assert out["rewards"] == [0.0, 0.0, 0.0] and out["extra_logs"]["reward_errors"] == 3.0


def test_eval_mode_gives_accuracy(sandbox, monkeypatch):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    monkeypatch.setenv("POPULORA_REWARD_MODE", "eval")
    out = reward_func(["junk", "<answer>```output\n['a', 'a']\n```</answer>"], ["", ""], [TASK.to_json()] * 2)
    assert out["rewards"].tolist() == [0.0, 1.0]


def test_sandbox_failure_does_not_raise(monkeypatch):
    class Broken:
        def run(self, jobs):
            raise RuntimeError("sandbox down")

    monkeypatch.setattr(reward_file, "_SANDBOX", Broken())
    out = reward_func(["<answer>```input\n'a'\n```</answer>"], [""], [TASK.retyped("code_i").to_json()])
    assert out["rewards"].tolist() == [0.0] and out["extra_logs"]["reward_errors"] == 1.0


labels = st.one_of(st.text(max_size=50), st.just(TASK.to_json()), st.just(TASK.retyped("code_i").to_json()),
                   st.none(), st.integers(), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
completions = st.one_of(
    st.text(max_size=300),
    st.builds(lambda v: f"<answer>```output\n{v}\n```</answer>", st.text(max_size=60)),
    st.builds(lambda v: f"<answer>```input\n{v}\n```</answer>", st.text(max_size=60)),
    st.sampled_from(["<answer>", "</answer>", "```output\n['a', 'a']\n```", "```input\n'a'\n```"]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(st.tuples(completions, st.one_of(st.text(max_size=20), st.none()), labels), max_size=4))
def test_reward_func_never_raises(sandbox, monkeypatch, data):
    monkeypatch.setattr(reward_file, "_SANDBOX", sandbox)
    queries = [q for q, _, _ in data]
    out = reward_func(queries, [p for _, p, _ in data], [lab for _, _, lab in data])
    assert out["rewards"].shape == (len(data),) and out["scores"].shape == (len(data),)
    assert all(r in (1.0, -0.5, -1.0, 0.0) for r in out["rewards"].tolist())


@settings(max_examples=15, deadline=None)
@given(queries=st.one_of(st.none(), st.text(max_size=10), st.lists(st.none(), max_size=3)),
       prompts=st.one_of(st.none(), st.integers()), labels=st.one_of(st.none(), st.lists(st.integers(), max_size=3)))
def test_reward_func_never_raises_on_wrong_types(queries, prompts, labels):
    out = reward_func(queries, prompts, labels)
    assert set(out) == {"rewards", "scores", "extra_logs"}


def test_reward_file_loads_the_way_openrlhf_loads_it(sandbox, monkeypatch):
    """OpenRLHF 0.11.2 (utils/agent.py) loads --reward.remote_url *.py via spec_from_file_location without
    registering the module in sys.modules."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reward_func", reward_file.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_SANDBOX", sandbox)
    out = module.reward_func([PROMPT + "<answer>```output\n['a', 'a']\n```</answer>"], [PROMPT], [TASK.to_json()])
    assert out["rewards"].tolist() == [1.0]


# ---------------------------------------------------------------- concurrency, process lifetime, fork

SEED_TASKS = [Task.from_dict(json.loads(line)) for line in (ROOT / "configs/seeds/basic.jsonl").read_text().splitlines()
              if line.strip()]
SANDBOX_ENV = {"POPULORA_SANDBOX_WORKERS": "2", "POPULORA_SANDBOX_TIMEOUT_S": "5", "POPULORA_SANDBOX_MEMORY_MB": "256"}


def seed_samples() -> list[tuple[str, str, str, float]]:
    """(query, prompt, label, expected reward): every seed task answered right and wrong."""
    samples = []
    for task in SEED_TASKS:
        prompt = solver_prompt(task)
        for correct in (True, False):
            query = f"{prompt}<think>checking</think>\n<answer>\n{answer_block(task, correct)}\n</answer>"
            samples.append((query, prompt, task.to_json(), 1.0 if correct else -0.5))
    return samples


def _is_running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited process its parent has not reaped yet)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def _still_running(pids, wait_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while True:
        running = [pid for pid in pids if _is_running(pid)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


@pytest.fixture()
def fresh_process_sandbox(monkeypatch):
    """The reward file with no sandbox yet in this process; records every Sandbox it creates, closes them after."""
    import openrlhf_populora.sandbox as sandbox_pkg

    created = []

    class CountingSandbox(Sandbox):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(self)

    for name, value in SANDBOX_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("POPULORA_REWARD_MODE", raising=False)
    reward_file.close_sandbox()
    monkeypatch.setattr(reward_file, "_SANDBOX", None)
    monkeypatch.setattr(sandbox_pkg, "Sandbox", CountingSandbox)
    yield created
    reward_file.close_sandbox()
    for sb in created:
        sb.close()


def test_concurrent_calls_score_exactly_as_one_thread_with_one_sandbox(fresh_process_sandbox):
    """Upstream calls reward_func per sample from many threads at once, threads that come and go. Catches: a
    sandbox created without a lock (or per call): more than one; a sandbox whose workers belong to a caller
    thread: they die with it (PR_SET_PDEATHSIG), killing the batches of other calls in flight (a right answer
    then scores -0.5) and restarting workers; any shared state that mixes up concurrent calls' answers."""
    created = fresh_process_sandbox
    samples = seed_samples()
    assert len(samples) == 56 and {s[3] for s in samples} == {1.0, -0.5}
    got: dict[int, tuple] = {}

    def call(i: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        query, prompt, label, _ = samples[i]
        out = reward_func([query], [prompt], [label])
        got[i] = (out["rewards"].tolist(), out["scores"].tolist(), out["extra_logs"])

    # two waves of fresh threads (the first wave's threads have all exited when the second starts)
    for wave in (range(0, 28), range(28, 56)):
        barrier = threading.Barrier(len(wave))
        threads = [threading.Thread(target=call, args=(i, barrier)) for i in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
    assert sorted(got) == list(range(56))

    # the same calls, one at a time, in this thread; then all at once as one batch
    alone = {}
    for i, (query, prompt, label, _) in enumerate(samples):
        out = reward_func([query], [prompt], [label])
        alone[i] = (out["rewards"].tolist(), out["scores"].tolist(), out["extra_logs"])
    batch = reward_func([s[0] for s in samples], [s[1] for s in samples], [s[2] for s in samples])

    assert got == alone
    assert [got[i][0][0] for i in range(56)] == [s[3] for s in samples]
    assert batch["rewards"].tolist() == [s[3] for s in samples]
    assert batch["scores"].tolist() == [1.0 if s[3] == 1.0 else 0.0 for s in samples]
    assert all(got[i][2]["reward_errors"] == 0.0 for i in range(56))
    assert len(created) == 1
    stats = created[0].stats()
    assert stats["worker_restarts"] == 0 and stats.get("status_killed", 0) == 0
    assert reward_file.sandbox_stats()["worker_restarts"] == 0


LOAD_AS_UPSTREAM = r'''
import asyncio, importlib.util, json, os, sys

import psutil

def children(pid):
    return sorted(p.pid for p in psutil.Process(pid).children())

def descendants(pid):
    return sorted(p.pid for p in psutil.Process(pid).children(recursive=True))

def running(pids):
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive

spec = importlib.util.spec_from_file_location("reward_func", sys.argv[1])  # as OpenRLHF 0.11.2 loads it
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
query, prompt, label = json.loads(sys.argv[2])

def score():  # as upstream calls it: asyncio.to_thread, from an event loop (whose executor thread then ends)
    out = asyncio.run(asyncio.to_thread(module.reward_func, [query], [prompt], [label]))
    return out["rewards"].tolist()
'''

SCORE_AND_EXIT = LOAD_AS_UPSTREAM + r'''
first = score()
workers = children(os.getpid())  # the sandbox's worker processes (bwrap, or the fork server itself)
pids = descendants(os.getpid())  # and everything under them
running_after_first = running(workers)
second = score()
print(json.dumps({"rewards": first + second, "workers": workers, "pids": pids,
                  "running_after_first": running_after_first, "running_after_second": running(workers),
                  "all_pids": sorted(set(pids) | set(descendants(os.getpid())))}), flush=True)
'''

FORK_CHILD = LOAD_AS_UPSTREAM + r'''
first = score()
parent_pids = children(os.getpid())
read_end, write_end = os.pipe()
child = os.fork()
if child == 0:
    os.close(read_end)
    rewards = score()
    mine = children(os.getpid())
    os.write(write_end, json.dumps({"rewards": rewards, "pids": mine, "running": running(mine)}).encode())
    os.close(write_end)
    sys.exit(0)  # a normal exit: atexit handlers and finalizers run in the child
os.close(write_end)
with os.fdopen(read_end) as fh:
    child_report = json.loads(fh.read())
_, status = os.waitpid(child, 0)
parent_running_after_child = running(parent_pids)
again = score()
print(json.dumps({"parent_rewards": first + again, "parent_pids": parent_pids, "child": child_report,
                  "child_status": status, "parent_running_after_child": parent_running_after_child,
                  "child_running_after_exit": running(child_report["pids"])}), flush=True)
'''


def _run_script(script: str, tmp_path) -> dict:
    task = SEED_TASKS[12]  # a code_i task: needs the sandbox
    assert task.task_type == "code_i"
    prompt = solver_prompt(task)
    sample = [f"{prompt}<answer>\n{answer_block(task, True)}\n</answer>", prompt, task.to_json()]
    env = {**os.environ, **SANDBOX_ENV, "OMP_NUM_THREADS": "1"}
    env.pop("POPULORA_REWARD_MODE", None)
    proc = subprocess.run([sys.executable, "-c", script, reward_file.__file__, json.dumps(sample)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loaded_as_upstream_loads_it_no_worker_outlives_the_process(tmp_path):
    """A process that loads the file by path (spec_from_file_location), scores from asyncio.to_thread as upstream
    does, and exits. Catches: workers tied to the calling thread (they die when the loop's executor thread ends,
    so the second call restarts them); workers that outlive the process (not closed at exit, not dying with it)."""
    report = _run_script(SCORE_AND_EXIT, tmp_path)
    assert report["rewards"] == [1.0, 1.0]
    workers = report["workers"]
    assert len(workers) == 2  # POPULORA_SANDBOX_WORKERS: the sandbox's worker processes ...
    assert report["running_after_first"] == workers  # ... outlive the thread that made the call ...
    assert report["running_after_second"] == workers  # ... and serve the next call, from another thread
    assert set(workers) < set(report["all_pids"])
    assert _still_running(report["all_pids"]) == []  # ... and none of them, nor anything under them, outlives it


def test_forked_child_gets_its_own_sandbox_and_leaves_the_parents_alone(tmp_path):
    """A process scores, forks; the child scores and exits normally; the parent scores again. Catches: a child
    that reuses the parent's sandbox (the same workers, through pipes both processes share); a child that closes
    the parent's sandbox, or lets its inherited finalizer kill the parent's workers when it exits."""
    report = _run_script(FORK_CHILD, tmp_path)
    child = report["child"]
    assert report["child_status"] == 0
    assert child["rewards"] == [1.0] and report["parent_rewards"] == [1.0, 1.0]
    parent_pids, child_pids = report["parent_pids"], child["pids"]
    assert len(parent_pids) == 2 and len(child_pids) == 2  # POPULORA_SANDBOX_WORKERS each
    assert not set(parent_pids) & set(child_pids)  # the child started workers of its own
    assert child["running"] == child_pids
    assert report["child_running_after_exit"] == []  # closed when the child exited
    assert report["parent_running_after_child"] == parent_pids  # the parent's workers survived the child's exit
    assert _still_running(parent_pids + child_pids) == []
