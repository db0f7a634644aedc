"""Reading a run directory's members and checking adapters, with clear errors on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from openrlhf_populora.eval.members import (
    adapter_digest,
    check_adapters,
    load_run_members,
    select_members,
)
from openrlhf_populora.population.members import Population


def fake_adapter(path: Path, r: int = 8, base: str = "/models/base", weights: bytes = b"w") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "r": r, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"], "base_model_name_or_path": base,
        "peft_type": "LORA",
    }))
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def fake_run(root: Path, n_teachers: int = 2, n_students: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump({"actor": {"model_name_or_path": "/models/base"}}))
    population = Population.create(n_teachers, n_students)
    for i, member in enumerate(population.alive()):
        member.rating = {"mu": 25.0 + i, "sigma": 1.0, "conservative": 22.0 + i}
        fake_adapter(root / "adapters" / member.id, weights=member.id.encode())
    population.save(root / "population.json")
    return root


def test_load_run_members(tmp_path):
    run = load_run_members(fake_run(tmp_path / "run"))
    assert run.base_model == "/models/base"
    assert [(m.name, m.role) for m in run.members] == [("t0", "teacher"), ("t1", "teacher"),
                                                      ("s0", "student"), ("s1", "student")]
    assert run.members[2].adapter_dir == tmp_path / "run" / "adapters" / "s0"
    assert run.members[3].rating == 28.0  # mu, the score selection ranks by (conservative: 25)
    assert all(m.untrained is None for m in run.members)  # no metrics.jsonl: cannot tell, so trained


def test_retired_members_are_skipped(tmp_path):
    root = fake_run(tmp_path / "run")
    data = json.loads((root / "population.json").read_text())
    data["members"][0]["retired_step"] = 3
    (root / "population.json").write_text(json.dumps(data))
    assert [m.name for m in load_run_members(root).members] == ["t1", "s0", "s1"]


def test_without_population_json_every_adapter_is_a_member(tmp_path):
    root = fake_run(tmp_path / "run")
    (root / "population.json").unlink()
    assert [m.name for m in load_run_members(root).members] == ["s0", "s1", "t0", "t1"]


def test_select_members(tmp_path):
    members = load_run_members(fake_run(tmp_path / "run")).members
    assert [m.name for m in select_members(members, "all")] == ["t0", "t1", "s0", "s1"]
    assert [m.name for m in select_members(members, "students")] == ["s0", "s1"]
    assert [m.name for m in select_members(members, "teachers")] == ["t0", "t1"]
    assert [m.name for m in select_members(members, "best")] == ["s1"]  # highest mu
    assert [m.name for m in select_members(members, "s1, t0")] == ["s1", "t0"]
    with pytest.raises(ValueError, match=r"unknown member\(s\) \['x9'\]; the run has t0, t1, s0, s1"):
        select_members(members, "s0,x9")


def with_training_log(root: Path) -> Path:
    """A 2-step run: t1 was replaced at step 2 by t2 (in slot t1); t0 and s0 trained at step 1, t1 at step 2,
    s1 never (its rewards never varied, say), and t2, born at step 2, the last, never."""
    data = json.loads((root / "population.json").read_text())
    data["members"][1]["retired_step"] = 2
    data["members"].append({**data["members"][1], "id": "t2", "birth_step": 2, "retired_step": None,
                            "parents": ["t0"], "operator": "gaussian"})
    (root / "population.json").write_text(json.dumps(data))
    fake_adapter(root / "adapters" / "t2", weights=b"t2")
    steps = [{"step": 1, "member/t0/teacher/all/policy_loss": 0.1, "member/s0/student/all/grad_norm": 0.5,
              "member/s1/student/all/solve_rate": 0.5},
             {"step": 2, "member/t1/teacher/all/policy_loss": 0.2, "member/t1/teacher/all/grad_norm": 0.3,
              "member/t2/teacher/all/coverage": 0.1}]
    (root / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return root


def test_untrained_members_are_named_with_the_reason(tmp_path):
    # catches: training looked up by adapter slot (t2 lives in t1's slot, which trained under t1's id), any metric
    # counted as an update (s1's solve rate, t2's coverage), and a last-step birth read as "no update since"
    run = load_run_members(with_training_log(fake_run(tmp_path / "run")))
    assert {m.name: m.untrained for m in run.members} == {
        "t0": None, "s0": None, "s1": "no update since its birth at step 0",
        "t2": "born at step 2, the run's last step"}


def test_a_damaged_training_log_is_an_error_naming_the_line(tmp_path):
    # catches: a reader that skips a damaged line, so members whose updates were logged there look untrained
    root = with_training_log(fake_run(tmp_path / "run"))
    lines = (root / "metrics.jsonl").read_text().splitlines()
    (root / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:25] + "\n")  # step 2 cut in the middle
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2: not valid JSON\. Fix: repair or remove that line"):
        load_run_members(root)


def test_best_is_never_an_untrained_member(tmp_path):
    # catches: --members best picking the highest mu among all solvers, s1 (mu 28) that never trained
    members = load_run_members(with_training_log(fake_run(tmp_path / "run"))).members
    assert [m.name for m in select_members(members, "best")] == ["s0"]


def test_run_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist. Fix: pass --run"):
        load_run_members(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.yaml not found"):
        load_run_members(empty)
    (empty / "config.yaml").write_text(yaml.safe_dump({"actor": {"model_name_or_path": "/m"}}))
    with pytest.raises(ValueError, match=r"has no adapters \(expected .*adapter_config.json.*Fix: train first"):
        load_run_members(empty)
    root = fake_run(tmp_path / "run")
    (root / "adapters" / "s1" / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match=r"member 's1' of .*population.json has no adapter: expected .*s1"):
        load_run_members(root)


def test_check_adapters_accepts_a_consistent_population(tmp_path):
    members = load_run_members(fake_run(tmp_path / "run")).members
    assert check_adapters(members, "/models/base") == {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def test_check_adapters_rank_mismatch(tmp_path):
    root = fake_run(tmp_path / "run")
    fake_adapter(root / "adapters" / "s1", r=16)
    with pytest.raises(ValueError, match=r"s1/adapter_config.json: adapter 's1' has .*'r': 16.* but 't0' has .*'r': 8"):
        check_adapters(load_run_members(root).members, "/models/base")


def test_check_adapters_base_model_mismatch(tmp_path):
    root = fake_run(tmp_path / "run")
    fake_adapter(root / "adapters" / "t1", base="/models/other")
    with pytest.raises(ValueError, match=r"trained on base model '/models/other'.* Fix: pass --base-model /models/other"):
        check_adapters(load_run_members(root).members, "/models/base")


def test_check_adapters_missing_weights(tmp_path):
    root = fake_run(tmp_path / "run")
    (root / "adapters" / "s0" / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors not found"):
        check_adapters(load_run_members(root).members, "/models/base")


def test_adapter_digest_changes_with_the_weights(tmp_path):
    a = fake_adapter(tmp_path / "a", weights=b"one")
    b = fake_adapter(tmp_path / "b", weights=b"two")
    assert adapter_digest(a) != adapter_digest(b) and len(adapter_digest(a)) == 64
    assert adapter_digest(None) == "base"
