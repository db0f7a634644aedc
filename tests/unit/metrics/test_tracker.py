"""Tracker: JSONL round trip, crash tolerance, resume truncation, TensorBoard and W&B (offline); key schema."""

import json
import math

import numpy as np
import pytest

from openrlhf_populora.analysis.runs import load_run
from openrlhf_populora.metrics import keys
from openrlhf_populora.metrics.tracker import Tracker, progress_postfix


def test_round_trip(tmp_path):
    with Tracker(tmp_path, meta={"label": "pop", "mode": "population"}) as tracker:
        for step in range(1, 4):
            tracker.log(step, {"train/solve_rate": step / 10, keys.member_key("s0", "student", "solve_rate"): 0.5,
                               keys.rating_key("t0", "teacher"): np.float32(25.5), "coverage/overall": np.int64(1),
                               "train/kl": float("nan"), "note": "hello"})
        tracker.log_problems(2, [{"teacher": "t0", "program": "def f(x):\n    return x", "valid": True,
                                  "inputs": ["1"], "score": np.float64(0.25), "bad": float("inf")}])
        tracker.log_event(3, {"kind": "evolution", "replaced": "t1", "child": "t2", "parents": ("t0",),
                              "operator": "M1"})
    lines = (tmp_path / keys.METRICS_FILE).read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])
    assert first["step"] == 1 and first["train/kl"] is None and first["note"] == "hello"
    assert first["rating/teacher/t0/mu"] == 25.5 and first["coverage/overall"] == 1
    run = load_run(tmp_path)
    assert run.label == "pop" and run.mode == "population" and not run.is_baseline
    xs, ys = run.series("train/solve_rate")
    assert xs.tolist() == [1, 2, 3] and ys == pytest.approx([0.1, 0.2, 0.3])
    assert len(run.series("train/kl")[0]) == 0  # NaN was stored as null: missing, not a value
    assert run.member_series("student", "solve_rate")["s0"][1].tolist() == [0.5] * 3
    (problem,) = run.problems()
    assert problem["step"] == 2 and problem["score"] == 0.25 and problem["bad"] is None
    (event,) = run.evolution_events()
    assert event["step"] == 3 and event["parents"] == ["t0"] and "time" in event
    meta = json.loads((tmp_path / keys.META_FILE).read_text())
    assert meta["schema"] == keys.SCHEMA_VERSION


def test_bad_input_is_rejected(tmp_path):
    tracker = Tracker(tmp_path)
    with pytest.raises(ValueError, match="step"):
        tracker.log(-1, {})
    with pytest.raises(ValueError, match="step"):
        tracker.log(1.5, {})
    with pytest.raises(TypeError, match="train/x"):
        tracker.log(1, {"train/x": [1, 2]})
    with pytest.raises(ValueError, match="reserved"):
        tracker.log(1, {"step": 3})
    with pytest.raises(TypeError, match="mapping"):
        tracker.log_problems(1, ["not a dict"])
    tracker.close()
    with pytest.raises(RuntimeError, match="closed"):
        tracker.log(2, {})


def test_appending_after_a_crash_mid_line(tmp_path):
    (tmp_path / keys.METRICS_FILE).write_text('{"step": 1, "train/solve_rate": 0.1}\n{"step": 2, "train/so')
    with Tracker(tmp_path) as tracker:
        tracker.log(2, {"train/solve_rate": 0.2})
    run = load_run(tmp_path)
    assert run.series("train/solve_rate")[1].tolist() == [0.1, 0.2]
    assert any("line 2" in w for w in run.warnings)


def test_truncate_after_for_resume(tmp_path):
    with Tracker(tmp_path) as tracker:
        for step in range(1, 6):
            tracker.log(step, {"train/solve_rate": step})
            tracker.log_problems(step, [{"program": "x = 1"}])
            tracker.log_event(step, {"kind": "note"})
    with open(tmp_path / keys.METRICS_FILE, "a") as f:
        f.write('{"step": 6, "trunc')
    with Tracker(tmp_path) as tracker:
        dropped = tracker.truncate_after(3)
        tracker.log(4, {"train/solve_rate": 40})
    assert dropped == {keys.METRICS_FILE: 3, keys.PROBLEMS_FILE: 2, keys.EVENTS_FILE: 2}
    run = load_run(tmp_path)
    assert run.series("train/solve_rate")[1].tolist() == [1, 2, 3, 40]
    assert [p["step"] for p in run.problems()] == [1, 2, 3]
    assert not run.warnings


def test_truncate_after_forgets_one_kind_of_event_at_the_resumed_step(tmp_path):
    """A catch-up resume drops the evolution events an interrupted try logged at the checkpoint's step, and only
    those. Catches: a filter that ignores the kind (the step-3 note goes too), ignores the step (step 2's
    evolution goes too), or is not applied (step 3's evolution stays)."""
    with Tracker(tmp_path) as tracker:
        for step in range(1, 5):
            tracker.log_event(step, {"kind": "evolution", "child": f"c{step}"})
            tracker.log_event(step, {"kind": "note"})
    with Tracker(tmp_path) as tracker:
        dropped = tracker.truncate_after(3, forget_events="evolution")
    assert dropped[keys.EVENTS_FILE] == 3  # step 4's two events and step 3's evolution
    assert [(e["step"], e["kind"]) for e in load_run(tmp_path).events] == [
        (1, "evolution"), (1, "note"), (2, "evolution"), (2, "note"), (3, "note")]


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    with Tracker(tmp_path / "run", tensorboard_dir=tmp_path / "tb") as tracker:
        tracker.log(1, {"train/solve_rate": 0.25, "eval/humaneval/pass@1": 0.5, "note": "text", "x": None})
        tracker.log(2, {"train/solve_rate": 0.75})
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    seen = {}
    for event in LegacyEventFileLoader(str(path)).Load():
        for value in event.summary.value:
            seen[(event.step, value.tag)] = value.simple_value
    assert seen == {(1, "train/solve_rate"): 0.25, (1, "eval/humaneval/pass@1"): 0.5, (2, "train/solve_rate"): 0.75}


def test_logging_steps_thin_tensorboard_but_not_the_jsonl(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    with Tracker(tmp_path / "run", tensorboard_dir=tmp_path / "tb", logging_steps=2) as tracker:
        for step in range(1, 6):
            tracker.log(step, {"train/solve_rate": step / 10})
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    steps = [event.step for event in LegacyEventFileLoader(str(path)).Load() if event.summary.value]
    assert steps == [2, 4]
    assert len((tmp_path / "run" / keys.METRICS_FILE).read_text().splitlines()) == 5
    with pytest.raises(ValueError, match="logging_steps"):
        Tracker(tmp_path / "other", logging_steps=0)


@pytest.mark.slow
def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with Tracker(tmp_path, wandb={"project": "populora-test", "mode": "offline", "run_name": "unit",
                                  "org": None, "config": {"a": 1}}) as tracker:
        tracker.log(1, {"train/solve_rate": 0.5, "note": "skipped by W&B"})
        tracker.log(2, {"train/solve_rate": 0.6})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))
    assert len((tmp_path / keys.METRICS_FILE).read_text().splitlines()) == 2


def test_progress_postfix():
    assert progress_postfix({"train/solve_rate": 0.5, "coverage/overall": 0.01234}) == {
        "solve": "0.50", "valid": "-", "cover": "0.0123"}


def test_key_builders_and_parsers():
    assert keys.train_key("solve_rate") == "train/solve_rate"
    assert keys.train_key("validity", "code_o") == "train/code_o/validity"
    assert keys.complexity_key("loc", "code_f") == "complexity/code_f/loc"
    assert keys.coverage_key("overall") == "coverage/overall"
    assert keys.matrix_key("t0", "s1") == "matrix/t0/s1/solve_rate"
    assert keys.parse_matrix_key("matrix/t0/s1/solve_rate") == ("t0", "s1")
    assert keys.parse_rating_key(keys.rating_key("s2", "student", "sigma")) == ("student", "s2", "sigma")
    parsed = keys.parse_member_key(keys.member_key("b0", "teacher", "ast_depth", "code_i"))
    assert parsed == keys.MemberKey("b0", "teacher", "code_i", "ast_depth")
    assert keys.parse_member_key("train/solve_rate") is None
    assert keys.eval_key("humaneval") == "eval/humaneval/pass@1"
    assert keys.eval_key("mbpp", member_id="s0") == "eval/member/s0/mbpp/pass@1"
    assert keys.time_key("generate_solve") == "time/generate_solve"
    with pytest.raises(ValueError, match="unknown train metric"):
        keys.train_key("solve-rate")
    with pytest.raises(ValueError, match="member_id"):
        keys.member_key("t/0", "teacher", "validity")
    with pytest.raises(ValueError, match="role"):
        keys.member_key("b0", "both", "validity")
    assert math.isfinite(len(keys.TRAIN_METRICS))
