"""Task buffers (dedup, newest-kept capacity, references, recency window, JSONL) and seeding."""

import random

import pytest
from task_answers import proposal

from openrlhf_populora.sandbox import Sandbox
from openrlhf_populora.tasks import Seeder, Task, TaskBuffers, TaskRules, zero_triplet


def make(k: int, step: int = 0, task_type: str = "code_o") -> Task:
    return Task(task_type, f"def f(x):\n    return x + {k}\n", ["1"], [str(1 + k)], proposer="t", step=step)


def test_dedup_per_type():
    buffers = TaskBuffers()
    assert buffers.add(make(1)) and not buffers.add(make(1))
    assert not buffers.add(Task.from_dict({**make(1).to_dict(), "proposer": "other", "step": 9}))
    assert buffers.add(make(1, task_type="code_i"))
    assert buffers.size("code_o") == 1 and buffers.size("code_i") == 1 and len(buffers) == 2
    assert buffers.sizes() == {"code_o": 1, "code_i": 1, "code_f": 0}
    assert make(1) in buffers and make(2) not in buffers
    assert buffers.extend([make(2), make(2), make(3)]) == 2
    with pytest.raises(TypeError):
        buffers.add({"task_type": "code_o"})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        buffers.size("code_x")


def test_capacity_keeps_the_newest():
    # AZR's truncate_datasets kept the OLDEST programs and silently dropped new ones (pitfall 6).
    buffers = TaskBuffers(capacity=3)
    for k in range(5):
        buffers.add(make(k, step=k))
    assert [t.step for t in buffers.tasks("code_o")] == [2, 3, 4]
    with pytest.raises(ValueError):
        TaskBuffers(capacity=0)


def test_references_are_k_distinct_from_own_type():
    buffers = TaskBuffers()
    buffers.extend(make(k) for k in range(10))
    buffers.add(make(99, task_type="code_i"))
    rng = random.Random(0)
    refs = buffers.references("code_o", 6, rng)
    assert len(refs) == 6 and len({r.key() for r in refs}) == 6 and all(r.task_type == "code_o" for r in refs)
    assert len(buffers.references("code_i", 6, rng)) == 1 and buffers.references("code_f", 6, rng) == []
    seen = {r.key() for _ in range(200) for r in buffers.references("code_o", 1, rng)}
    assert len(seen) == 10  # uniform over the whole buffer


def test_induction_program_comes_from_triplet_buffers():
    buffers = TaskBuffers()
    rng = random.Random(0)
    assert buffers.induction_program(rng) is None
    buffers.add(make(1, task_type="code_i"))
    buffers.add(make(2, task_type="code_o"))
    assert {buffers.induction_program(rng).task_type for _ in range(50)} == {"code_i", "code_o"}


def test_solver_batch_prefers_recent_then_fills():
    buffers = TaskBuffers()
    buffers.extend(make(k, step=k // 3) for k in range(12))  # steps 0..3, three tasks each
    rng = random.Random(1)
    batch = buffers.solver_batch("code_o", 4, step=3, rng=rng, window=0)
    assert len(batch) == 4 and sum(t.step == 3 for t in batch) == 3  # all 3 recent + 1 older
    batch = buffers.solver_batch("code_o", 5, step=3, rng=rng, window=1)
    assert all(t.step >= 2 for t in batch) and len({t.key() for t in batch}) == 5
    assert len(buffers.solver_batch("code_o", 50, step=3, rng=rng)) == 12
    assert buffers.solver_batch("code_f", 4, step=3, rng=rng) == []


def test_save_load_round_trip(tmp_path):
    buffers = TaskBuffers()
    buffers.extend([make(1), make(2, task_type="code_i"), zero_triplet()])
    path = tmp_path / "sub" / "tasks.jsonl"
    buffers.save(path)
    again = TaskBuffers.load(path)
    for task_type in ("code_o", "code_i", "code_f"):
        assert again.tasks(task_type) == buffers.tasks(task_type)
    path.write_text(path.read_text() + "\n{\"task_type\": \"code_o\"}\n")
    with pytest.raises(ValueError, match="tasks.jsonl:5"):
        TaskBuffers.load(path)


class ScriptedProposer:
    """Stands in for the base model: a deterministic completion per prompt kind (the checks are real)."""

    def __init__(self):
        self.k = 0

    def __call__(self, prompts):
        outs = []
        for prompt in prompts:
            self.k += 1
            if "design" in prompt.split("\n")[0]:  # induction proposer
                inputs = "".join(f"```input\n{i * self.k}\n```\n" for i in range(10))
                outs.append(f"<answer>{inputs}```message\nadds\n```</answer>")
            elif self.k % 3 == 0:
                outs.append("I do not know")  # invalid proposals are simply skipped
            else:
                outs.append(f"<answer>```python\ndef f(x):\n    return x * {self.k}\n```\n```input\n{self.k}\n```"
                            "</answer>")
        return outs


def test_seeder_fills_both_triplet_buffers_then_induction():
    buffers = TaskBuffers()
    seeder = Seeder(buffers, triplets=5, induction=3, rng=random.Random(0), references=2)
    assert buffers.size("code_o") == buffers.size("code_i") == 1  # the zero triplet
    model = ScriptedProposer()
    with Sandbox(workers=2, timeout_s=2.0, memory_mb=256) as sb:
        rounds = 0
        while not seeder.done:
            reqs = seeder.requests(4)
            assert reqs and all(r.task_type == ("code_f" if seeder.phase == "induction" else r.task_type)
                                for r in reqs)
            seeder.feed(reqs, model([r.prompt for r in reqs]), sb)
            rounds += 1
    assert seeder.complete and seeder.requests(4) == []
    assert buffers.size("code_o") == buffers.size("code_i") == 5 and buffers.size("code_f") == 3
    assert {t.key() for t in buffers.tasks("code_o")} == {t.retyped("code_o").key() for t in buffers.tasks("code_i")}
    assert all(t.proposer == "seed" and t.step == 0 for t in buffers.tasks("code_f"))
    assert rounds == seeder.rounds


def test_seeder_gives_up_after_max_rounds():
    buffers = TaskBuffers()
    seeder = Seeder(buffers, triplets=3, induction=0, max_rounds=2, rules=TaskRules())
    with Sandbox(workers=1, timeout_s=2.0, memory_mb=256) as sb:
        while not seeder.done:
            reqs = seeder.requests(2)
            seeder.feed(reqs, ["junk"] * len(reqs), sb)
    assert seeder.rounds == 2 and not seeder.complete
    assert [c.reason for c in seeder.last_checks] == ["no_program", "no_program"]
    with pytest.raises(ValueError):
        seeder.feed(seeder.requests(1) or [], ["x"], sb)


def test_capacity_one_is_allowed_and_keeps_the_newest():
    """Catches: a capacity check that rejects 1 (``capacity < 2``): the smallest valid buffer must work."""
    buffers = TaskBuffers(capacity=1)
    assert buffers.add(make(1)) and buffers.add(make(2))
    assert buffers.tasks("code_o") == [make(2)]


def test_solver_batch_with_proposers_draws_only_their_tasks_and_the_seeds():
    """Catches: a ``proposers`` filter that is dropped or broken (other members' tasks, or a crash)."""
    buffers = TaskBuffers()
    seeds = [Task("code_o", f"def f(x):\n    return x - {k}\n", ["1"], [str(1 - k)], proposer="seed", step=0)
             for k in range(2)]
    mine = [Task("code_o", f"def f(x):\n    return x * {k}\n", ["2"], [str(2 * k)], proposer="a", step=s)
            for k, s in ((3, 0), (4, 2))]
    theirs = [Task("code_o", f"def f(x):\n    return x ** {k}\n", ["2"], [str(2 ** k)], proposer="b", step=2)
              for k in range(2, 4)]
    buffers.extend(seeds + mine + theirs)
    batch = buffers.solver_batch("code_o", 10, step=2, rng=random.Random(0), proposers=["a"])
    assert sorted(t.key() for t in batch) == sorted(t.key() for t in seeds + mine)
    batch = buffers.solver_batch("code_o", 10, step=2, rng=random.Random(0), proposers=[])
    assert sorted(t.key() for t in batch) == sorted(t.key() for t in seeds + mine[:1])  # step 0 only


def test_save_creates_missing_parent_folders(tmp_path):
    """Catches: ``mkdir`` without ``parents=True`` (a run dir two levels deep that does not exist yet)."""
    buffers = TaskBuffers()
    buffers.add(make(1))
    path = tmp_path / "a" / "b" / "tasks.jsonl"
    buffers.save(path)
    assert TaskBuffers.load(path).tasks("code_o") == [make(1)]


@pytest.mark.parametrize("triplets,induction,ok", [(1, 0, True), (0, 0, False), (1, -1, False)])
def test_seeder_bounds(triplets, induction, ok):
    """Catches: a bound that rejects ``triplets=1`` (the zero triplet alone is then already complete)."""
    if not ok:
        with pytest.raises(ValueError):
            Seeder(TaskBuffers(), triplets=triplets, induction=induction)
        return
    seeder = Seeder(TaskBuffers(), triplets=triplets, induction=induction)
    assert seeder.complete and seeder.done and seeder.requests(4) == []


def test_seeder_requests_one_and_passes_its_rules_and_timeout():
    """Catches: ``requests(1)`` answering nothing (``batch_size < 2``), and triplet prompts built with the
    default rules (banned words) instead of the seeder's own."""
    rules = TaskRules(prompt_banned_words=("zebra", "yak"))
    seeder = Seeder(TaskBuffers(), triplets=2, induction=0, rules=rules, timeout_s=3.5)
    assert seeder.requests(0) == []
    (req,) = seeder.requests(1)
    assert req.task_type == "code_o" and req.program is None
    assert "- Do not use any of these words anywhere, not even in comments: zebra, yak.\n" in req.prompt
    assert "- It finishes within 3.5 seconds.\n" in req.prompt


def test_seeder_feed_counts_every_new_triplet_after_an_invalid_one():
    """Catches: ``feed`` stopping at the first invalid completion of a type (``break``), a count that starts at
    1, and a count that keeps only the last triplet's (``added =`` instead of ``+=``)."""
    from openrlhf_populora.tasks.buffers import SeedRequest

    seeder = Seeder(TaskBuffers(), triplets=5, induction=0)
    requests = [SeedRequest(t, "p") for t in ("code_o", "code_i", "code_o", "code_i")]
    completions = ["junk", proposal("def f(x):\n    return x + 7", "1"),
                   proposal("def f(x):\n    return x * 7", "2"), "junk"]
    with Sandbox(workers=1, timeout_s=2.0, memory_mb=256) as sb:
        assert seeder.feed(requests, completions, sb) == 2
    assert [c.reason for c in seeder.last_checks] == ["no_program", "ok", "ok", "no_program"]
    assert len(seeder.pool) == 3 and seeder.buffers.size("code_o") == seeder.buffers.size("code_i") == 3


def test_seeder_a_code_i_proposal_of_a_held_triplet_is_not_new():
    """Catches: ``_add_triplet`` keeping a code_i proposal as code_i in the pool: the pool (stored as code_o)
    then misses the duplicate, grows, and ``feed`` counts a triplet the buffers already hold."""
    from openrlhf_populora.tasks.buffers import SeedRequest

    seeder = Seeder(TaskBuffers(), triplets=3, induction=0)
    with Sandbox(workers=1, timeout_s=2.0, memory_mb=256) as sb:
        added = seeder.feed([SeedRequest("code_i", "p")], [proposal("def f(x):\n    return x", "'Hello world'")],
                            sb)
    assert seeder.last_checks[0].reason == "ok"
    assert added == 0 and seeder.pool == [zero_triplet("code_o")]
    assert seeder.buffers.sizes() == {"code_o": 1, "code_i": 1, "code_f": 0}
