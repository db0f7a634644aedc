"""The self-play loop end to end on the tiny model: population and baseline runs, evolution, ratings, resume.

The engine is the real ``LocalEngine`` (real adapters, real REINFORCE++ updates, real evolution on adapter
tensors); only the *text* of completions is scripted, because these tests need deterministic proposals and
answers of known correctness. A random tiny model writes no valid programs. The sandbox is real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from scripted_runs import ScriptedEngine, adapter_weights, run_config, scripted_build

from openrlhf_populora.selfplay.runner import run

pytestmark = pytest.mark.slow


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "time" and not k.startswith("time/")}


class _RecordingBar:
    """Stands in for tqdm to record what the progress bar shows."""

    descriptions: list[str] = []

    def __init__(self, *args, **kwargs):
        pass

    def set_description(self, text):
        _RecordingBar.descriptions.append(text)

    def update(self, n):
        pass

    def set_postfix(self, values):
        pass

    def close(self):
        pass


def test_population_run_end_to_end(tmp_path, monkeypatch):
    import openrlhf_populora.selfplay.runner as runner

    monkeypatch.setattr(runner, "tqdm", _RecordingBar)
    ScriptedEngine.trained.clear()
    run_dir = tmp_path / "pop"
    config = run_config(run_dir)
    assert run(config, scripted_build, progress=False) == 0

    # the progress bar names each phase of each step, in order
    phases = [d.removeprefix("self-play [").removesuffix("]") for d in _RecordingBar.descriptions]
    order = ["match", "propose", "check", "solve", "verify", "train", "evolve", "probe"]
    assert phases == order * 2
    # every trajectory carries its whitening group: member/role/task type, of the member in that adapter slot
    groups = {t.group for t in ScriptedEngine.trained}
    assert groups and all(len(g.split("/")) == 3 for g in groups)
    assert {g.split("/")[1] for g in groups} == {"propose", "solve"}
    assert {g.split("/")[2] for g in groups} <= set(config.populora.task_types)
    assert all(t.group.split("/")[0][0] == t.adapter[0] for t in ScriptedEngine.trained)  # t* teach, s* solve

    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    first = records[0]
    assert 0 < first["train/validity"] < 1  # the script writes some invalid proposals
    assert 0 < first["train/solve_rate"] < 1
    assert first["train/format_rate"] == 1.0
    for tt in config.populora.task_types:
        assert first[f"train/{tt}/solve_rate"] is not None
    assert any(k.startswith("matrix/t") for k in first)
    assert first["coverage/overall"] > 0 and first["complexity/ast_nodes"] > 0
    assert first["train/grad_norm"] > 0  # adapters really trained
    # the learning diagnostics: every living member, in its role, each step; the mean over members
    for record in records:
        sizes = {tuple(k.split("/")[1:3]): v for k, v in record.items() if k.endswith("/all/update_size")}
        kls = {tuple(k.split("/")[1:3]): v for k, v in record.items() if k.endswith("/all/probe_kl")}
        assert sizes.keys() == kls.keys()
        assert sorted(role for _, role in sizes) == ["student"] * 2 + ["teacher"] * 2  # each living member once
        assert all(v >= 0 for v in [*sizes.values(), *kls.values()])
        assert record["learning/update_size"] > 0 and record["time/probe"] > 0

    # ratings moved away from the prior, and evolution at step k=1 replaced members with children; the last step
    # (2) made none: they would never have trained
    population = json.loads((run_dir / "population.json").read_text())["members"]
    children = [m for m in population if m["operator"] != "init"]
    assert children and all(m["birth_step"] == 1 and m["parents"] for m in children)
    retired = [m for m in population if m["retired_step"] == 1]
    assert len(retired) == len(children)
    # the members replaced at step 1 played step 1: its record keeps what they did (it dropped them, once)
    for member in retired:
        role = "teacher" if member["role"] == "teacher" else "student"
        assert first[f"member/{member['id']}/{role}/all/{'validity' if role == 'teacher' else 'solve_rate'}"] \
            is not None, member["id"]
    assert not any(k.startswith(f"member/{m['id']}/{r}/all/{n}") for m in children
                   for r, n in (("teacher", "validity"), ("student", "solve_rate")) for k in first)
    mus = [v for k, v in records[-1].items() if k.startswith("rating/") and k.endswith("/mu")]
    assert any(abs(mu - 25.0) > 1e-6 for mu in mus)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["kind"] for e in events} == {"seeding", "evolution"}

    # every living member's adapter loads with PEFT, and problems were archived with verdicts
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from openrlhf_populora.models.embedded import resolve_model

    alive = [m for m in population if m["retired_step"] is None]
    assert sorted(p.name for p in (run_dir / "adapters").iterdir()) == sorted(m["id"] for m in alive)
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"))
    PeftModel.from_pretrained(base, str(run_dir / "adapters" / alive[0]["id"]))
    problems = [json.loads(line) for line in (run_dir / "problems.jsonl").read_text().splitlines()]
    assert {p["step"] for p in problems} == {1, 2} and any(p["valid"] for p in problems)


def test_baseline_run_end_to_end(tmp_path):
    run_dir = tmp_path / "baseline"
    config = run_config(run_dir, mode="baseline", teacher_reward="learnability")
    assert run(config, scripted_build, progress=False) == 0
    records = _records(run_dir)
    assert len(records) == 2 and records[0]["train/validity"] > 0
    assert not any(k.startswith("rating/") or k.startswith("matrix/") for k in records[0])
    population = json.loads((run_dir / "population.json").read_text())["members"]
    assert [m["id"] for m in population] == ["b0"]  # no evolution for the single agent
    assert (run_dir / "adapters" / "b0" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_the_learning_probe_reads_a_hub_id_models_base_from_the_hf_cache(tmp_path, monkeypatch):
    """``--actor.model_name_or_path org/name`` (a hub id, as lib.sh's default names the 7B model) reaches the
    learning probe, which reads the base weights' norms from the model's files: here from an HF cache under
    ``HF_HOME``, offline. The same model as ``tiny``, so the update sizes equal a ``tiny`` run's. Catches: the
    probe refusing hub ids (every cluster run died after seeding and one step)."""
    from hf_cache import cache_model
    from huggingface_hub import constants

    from openrlhf_populora.models.embedded import resolve_model

    home = tmp_path / "hf"
    cache_model(home, "org/tiny-coder", Path(resolve_model("tiny")))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))  # what HF_HOME gives at import
    sizes = []
    for name, model in (("hub", "org/tiny-coder"), ("tiny", "tiny")):
        config = run_config(tmp_path / name, mode="baseline", total_steps=1)
        config.actor.model_name_or_path = model
        assert run(config, scripted_build, progress=False) == 0
        sizes.append({k: v for k, v in _records(tmp_path / name)[-1].items() if k.endswith("/update_size")})
    assert sizes[0] and sizes[0] == sizes[1] and all(v > 0 for v in sizes[0].values())


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    def config_for(run_dir, steps):  # an event at step 3: the second leg retires members the first exported
        config = run_config(run_dir, total_steps=steps)
        config.populora.evolution.evolve_every = 3
        return config

    # the first leg ends at step 2, where no event is due: a run's last step never evolves, so a leg ending at
    # an evolution step would skip the event that the uninterrupted run makes there
    straight = tmp_path / "straight"
    config = config_for(straight, 4)
    assert run(config, scripted_build, progress=False) == 0

    resumed = tmp_path / "resumed"
    first_leg = config_for(resumed, 2)
    assert run(first_leg, scripted_build, progress=False) == 0
    second_leg = config_for(resumed, 4)
    second_leg.ckpt.load_enable = True
    assert run(second_leg, scripted_build, progress=False) == 0

    a, b = _records(straight), _records(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert _comparable(x) == pytest.approx(_comparable(y), rel=1e-6, abs=1e-9)
    # the run directory holds the living members' adapters only, also after a resume (a member retired in the
    # second leg had been exported by the first)
    assert sorted(p.name for p in (resumed / "adapters").iterdir()) == sorted(
        p.name for p in (straight / "adapters").iterdir())
    for member in json.loads((straight / "population.json").read_text())["members"]:
        if member["retired_step"] is None:
            sa = adapter_weights(straight, member["id"])
            sb = adapter_weights(resumed, member["id"])
            assert sa.keys() == sb.keys()
            assert all(torch.allclose(sa[k], sb[k], atol=1e-6) for k in sa)
