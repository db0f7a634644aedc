"""The operator retention study (``studies/retention.py``, through ``cli.retention``) end to end, on a tiny-model
run made here.

The source run is a real ``runner.run`` of 2 teachers + 2 students on the tiny model, checkpointed after every
step, with scripted completions (``engines/scripted.py``: the text is scripted, the adapters, their training,
the checkpoints and the sandbox are real): teachers propose one of three valid programs or an invalid answer at
random, students are always right on ``x + 3``, never on ``x * 2``, and on even samples otherwise, so every
group's rewards vary and every member trains. The study then takes teachers t0 and t1 at steps 1 and 2, makes
children with ``gaussian`` (M1), ``svd_mean`` (X1) and ``copy_parent``, and retrains each for 2 steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from task_answers import scripted_output_answer

from openrlhf_populora.analysis.retention import distance_key, logprob_key
from openrlhf_populora.build import local_engine_config
from openrlhf_populora.cli import report, retention
from openrlhf_populora.config import Config
from openrlhf_populora.engines.local.state import read_state
from openrlhf_populora.engines.scripted import scripted_engine
from openrlhf_populora.selfplay.runner import claim_run_dir, run

PROGRAMS = [("def f(x):\n    return x + 3", "4"), ("def f(x):\n    return x * 2", "5"),
            ("def f(x):\n    return x - 1", "9")]


def policy(adapter: str, prompt: str, sample: int, rng) -> str:
    if "Write a new Python function" in prompt:  # the compact proposer prompt (code_o)
        choice = rng.randrange(len(PROGRAMS) + 1)
        if choice == len(PROGRAMS):
            return "<think>hmm</think><answer>I do not know</answer>"
        program, arguments = PROGRAMS[choice]
        return f"<think>p</think><answer>\n```python\n{program}\n```\n```input\n{arguments}\n```\n</answer>"
    return scripted_output_answer(prompt, sample)


Scripted = scripted_engine(policy)


def scripted_factory(config: Config):
    """What build.build_engine builds, with scripted completions."""
    return Scripted(local_engine_config(config))


def source_config(run_dir: Path, **lora) -> Config:
    config = Config()
    config.actor.model_name_or_path = "tiny"
    config.actor.adam.lr = 1e-2
    config.ds.lora.rank = lora.get("rank", 2)
    config.rollout.max_new_tokens = 16
    config.ckpt.output_dir = str(run_dir)
    config.ckpt.save_steps, config.ckpt.max_num = 1, 10
    p = config.populora
    p.task_types = ["code_o"]
    p.num_teachers, p.num_students, p.total_steps = 2, 2, 2
    p.proposals_per_teacher, p.solver_tasks, p.solver_samples, p.references = 4, 2, 2, 1
    p.seed_file = "configs/seeds/basic.jsonl"
    p.prompts = "compact"  # short prompts: the tiny model's tokens are bytes
    p.evolution.enabled = False
    p.report = False
    config.validate()
    return config


STUDY = ["--snapshots", "1", "2", "--parents", "t0", "t1", "--operators", "M1", "svd_mean", "--steps", "2",
         "--probe-samples", "3", "--smooth", "1", "--at", "1", "2", "--quiet"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """The source run and the study on it: (run dir, study dir, the study's stdout)."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("retention")
    run_dir = root / "run"
    config = source_config(run_dir)
    with claim_run_dir(config):  # writes config.yaml, as cli.train does
        assert run(config, scripted_factory, progress=False) == 0
    out = root / "study"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = retention.main(["--run", str(run_dir), *STUDY, "--out", str(out)], engine_factory=scripted_factory)
    assert status == 0
    return run_dir, out, stdout.getvalue()


def records(child: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (child / "metrics.jsonl").read_text().splitlines():
        obj = json.loads(line)
        out.setdefault(obj["step"], {}).update(obj)
    return out


def same(a, b) -> bool:
    """Bit-identical nested states (tensors compared with torch.equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def child_path(out: Path, step: int, operator: str) -> Path:
    return out / "children" / f"step_{step:06d}" / operator


def probe(out: Path, step: int) -> dict:
    return json.loads((out / "snapshots" / f"step_{step:06d}" / "probe.json").read_text())


def test_the_study_writes_the_grid_and_the_table(study):
    """Catches: a study that skips an operator or a snapshot, draws nothing, or a table whose reference is
    not copy_parent (copy_parent's own fraction is then not 1)."""
    _, out, stdout = study
    for name in ("retention_grid.png", "retention_grid_teacher_reward.png", "retention_measures.png",
                 "retention.md", "retention.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    table = json.loads((out / "retention.json").read_text())
    assert table["role"] == "teacher" and table["metric"] == "validity" and table["at"] == [1, 2]
    rows = {(r["operator"], r["snapshot"]): r for r in table["rows"]}
    assert set(rows) == {(op, s) for op in ("copy_parent", "gaussian", "svd_mean") for s in (1, 2)}
    assert all(r["finished"] and r["steps_done"] == 2 for r in rows.values())
    assert [r["code"] for r in table["summary"]] == ["copy_parent", "M1", "X1"]
    for s in (1, 2):
        copy = rows[("copy_parent", s)]
        assert copy["recovery_step"] == 1 and copy["delta_distance"]["start"] == 0.0
        assert all(f in (1.0, None) for f in copy["fraction_of_copy"].values())
        assert copy["logprob_vs_parent_start"] == 0.0
    assert "| gaussian | M1 | 1 |" in (out / "retention.md").read_text()
    assert "| svd_mean | X1 | 2 |" in stdout  # the table is printed too
    # the parent's curve (grey in the grid) comes from the source run's metrics.jsonl
    parents = json.loads((out / "parents.json").read_text())["parents"]
    assert [p["member"] for p in parents] == ["t0", "t1"]
    assert [x for x, _ in parents[0]["series"]["validity"]] == [1, 2]


def test_copy_parent_starts_as_its_parent_and_every_other_child_does_not(study):
    """Catches: a copy that is not exact (a distance computed through rounding, a re-factored copy, the wrong
    slot or member), a mutation or crossover that is silently a copy, and a log-prob measure that does not
    score under the child."""
    run_dir, out, _ = study
    for s in (1, 2):
        reference = probe(out, s)["parents"][0]
        assert len(reference["samples"]) == 3 and reference["member"] == "t0"
        start = records(child_path(out, s, "copy_parent"))[s]
        assert start[distance_key(0)] == 0.0  # exactly
        assert start[logprob_key(0)] == reference["logprob"]  # exactly the parent's own log-prob
        assert start[distance_key(1)] > 0  # t1 is another adapter
        parent = read_state(run_dir / "checkpoints" / f"step_{s:06d}" / "engine")["weights"]["t0"]
        final = read_state(child_path(out, s, "copy_parent") / "checkpoints" / f"step_{s + 2:06d}" / "engine")
        assert len(final["adapters"]) == 2 and final["adapters"][0] == "t0"  # the child's slot and the opponent's
        for operator in ("gaussian", "svd_mean"):
            begin = records(child_path(out, s, operator))[s]
            assert begin[distance_key(0)] > 0, operator
            assert begin[logprob_key(0)] != reference["logprob"], operator
        assert records(child_path(out, s, "svd_mean"))[s][distance_key(1)] > 0
        # after retraining, copy_parent's child has left its parent
        end = records(child_path(out, s, "copy_parent"))[s + 2]
        assert end[distance_key(0)] > 0
        assert any(not torch.equal(v, final["weights"]["t0"][k]) for k, v in parent.items())


def test_the_opponent_stays_frozen_and_the_child_plays_it(study):
    """Catches: an opponent that trains (its adapter or Adam state moves), a child that never trains, and a
    retraining that runs the whole population instead of the child against one opponent."""
    run_dir, out, _ = study
    for s in (1, 2):
        for operator in ("copy_parent", "gaussian", "svd_mean"):
            child = child_path(out, s, operator)
            info = json.loads((child / "child.json").read_text())
            opponent = info["opponent"]["slot"]
            assert info["opponent"]["role"] == "student" and info["slot"] == "t0"
            snapshot = read_state(run_dir / "checkpoints" / f"step_{s:06d}" / "engine")
            final = read_state(child / "checkpoints" / f"step_{s + 2:06d}" / "engine")
            assert final["updates"] == snapshot["updates"] + 2  # the schedule went on from the checkpoint's position
            for key, value in snapshot["weights"][opponent].items():
                assert torch.equal(value, final["weights"][opponent][key]), (operator, key)
            assert same(final["optimizers"][opponent], snapshot["optimizers"][opponent])  # no Adam step either
            assert final["optimizers"]["t0"]["state"]  # the child took Adam steps
            recs = records(child)
            assert sorted(recs) == [s, s + 1, s + 2]
            for t in (s + 1, s + 2):
                assert recs[t]["member/child/teacher/all/validity"] is not None
                assert recs[t][f"member/{info['opponent']['id']}/student/all/solve_rate"] is not None
                assert recs[t]["population/num_teachers"] == 1.0 and recs[t]["population/num_students"] == 1.0
            assert (child / "adapters" / "child" / "adapter_config.json").is_file() and (child / "DONE").is_file()


def test_a_rerun_skips_finished_children(study, capsys):
    """Catches: a resume that retrains (or even loads a model for) children already done."""
    run_dir, out, _ = study
    before = {p: p.stat().st_mtime_ns for p in out.glob("children/*/*/metrics.jsonl")}

    def no_engine(config):
        raise AssertionError("every child is finished: no engine should be built")

    assert retention.main(["--run", str(run_dir), *STUDY, "--out", str(out)], engine_factory=no_engine) == 0
    stdout = capsys.readouterr().out
    assert stdout.count("finished, skipped") == 6
    assert {p: p.stat().st_mtime_ns for p in out.glob("children/*/*/metrics.jsonl")} == before


def test_report_draws_the_study(study, tmp_path):
    """Catches: a report option that is not wired, or that needs the study's own output files."""
    _, out, _ = study
    assert report.main(["--retention", str(out), "--out", str(tmp_path / "figs")]) == 0
    for name in ("retention_grid.png", "retention_measures.png", "retention.md", "retention.json"):
        assert (tmp_path / "figs" / name).is_file(), name
    assert report.main(["--retention", str(tmp_path), "--out", str(tmp_path / "x")]) == 2  # not a study


def _incompatible_copy(run_dir: Path, target: Path) -> Path:
    """The source run with every adapter cut to rank 1 (and its config saying so): a run of another rank."""
    import yaml

    shutil.copytree(run_dir, target)
    config = yaml.safe_load((target / "config.yaml").read_text())
    config["ds"]["lora"]["rank"] = 1
    (target / "config.yaml").write_text(yaml.safe_dump(config))
    for state_dir in target.glob("checkpoints/step_*/engine"):
        state = read_state(state_dir)
        state["lora"]["rank"] = 1
        for weights in state["weights"].values():
            for key, value in weights.items():
                weights[key] = value[:1] if "lora_A" in key else value[:, :1]
        torch.save(state, state_dir / "engine_state.pt")
    return target


def test_bad_input_is_one_line_and_exit_status_2(study, tmp_path, capsys):
    """Catches: each bad input reaching the engine (a traceback, another status) or writing into --out."""
    run_dir, out, _ = study
    other = _incompatible_copy(run_dir, tmp_path / "rank1")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run_dir / "config.yaml", bare / "config.yaml")
    base = ["--run", str(run_dir), "--steps", "2", "--quiet"]
    cases = {
        "no checkpoint at step 7": [*base, "--snapshots", "7", "--parents", "t0"],
        "incompatible parents": [*base, "--snapshots", "1", "--parents", "t0", f"{other}:t1"],
        "unknown evolution operator": [*base, "--snapshots", "1", "--parents", "t0", "--operators", "M9"],
        "needs two parents": [*base, "--snapshots", "1", "--parents", "t0", "--operators", "X1"],
        "has no checkpoints": ["--run", str(bare), "--snapshots", "1", "--parents", "t0"],
        "play one role": [*base, "--snapshots", "1", "--parents", "t0", "s0"],
        "no member 't9'": [*base, "--snapshots", "1", "--parents", "t9"],
        "not a living student": [*base, "--snapshots", "1", "--parents", "t0", "--opponent", "t1"],
        "one member (mutations) or two": [*base, "--snapshots", "1", "--parents", "t0", "t1", "s1"],
    }
    for i, (message, argv) in enumerate(cases.items()):
        target = tmp_path / f"out{i}"
        status = retention.main([*argv, "--out", str(target)], engine_factory=_no_engine)
        err = capsys.readouterr().err
        assert status == 2, (message, err)
        assert message in err and err.startswith("error: ") and err.count("\n") == 1, (message, err)
        assert not target.exists(), message
    # the study directory refuses a different study (here: another --steps)
    status = retention.main(["--run", str(run_dir), *STUDY, "--out", str(out), "--steps", "3"],
                            engine_factory=_no_engine)
    err = capsys.readouterr().err
    assert status == 2 and "holds a study with steps 2" in err and err.count("\n") == 1


def _specialist_copy(run_dir: Path, target: Path) -> Path:
    """The source run with t1's adapter doubled in every checkpoint: another run, with a t1 of its own."""
    shutil.copytree(run_dir, target)
    for state_dir in target.glob("checkpoints/step_*/engine"):
        state = read_state(state_dir)
        state["weights"]["t1"] = {k: 2 * v for k, v in state["weights"]["t1"].items()}
        torch.save(state, state_dir / "engine_state.pt")
    return target


def test_a_second_parent_from_another_run(study, tmp_path, capsys):
    """Catches: OTHER_RUN_DIR:MEMBER read from --run instead of the other run (the distances to the second
    parent then come out as to --run's t1), and a second parent left out of the crossover."""
    from openrlhf_populora.analysis.retention import delta_distance

    run_dir, _, _ = study
    other = _specialist_copy(run_dir, tmp_path / "specialist")
    out = tmp_path / "study"
    argv = ["--run", str(run_dir), "--snapshots", "2", "--parents", "t0", f"{other}:t1", "--operators", "X1",
            "--steps", "1", "--probe-samples", "2", "--quiet", "--out", str(out)]
    assert retention.main(argv, engine_factory=scripted_factory) == 0
    t0 = read_state(run_dir / "checkpoints" / "step_000002" / "engine")["weights"]["t0"]
    theirs = read_state(other / "checkpoints" / "step_000002" / "engine")["weights"]["t1"]
    ours = read_state(run_dir / "checkpoints" / "step_000002" / "engine")["weights"]["t1"]
    start = records(child_path(out, 2, "copy_parent"))[2]
    assert start[distance_key(1)] == pytest.approx(delta_distance(t0, theirs), rel=1e-9)
    assert start[distance_key(1)] != pytest.approx(delta_distance(t0, ours), rel=1e-3)
    assert probe(out, 2)["parents"][1]["run"] == str(other.resolve())
    child = json.loads((child_path(out, 2, "svd_mean") / "child.json").read_text())
    assert [p["label"] for p in child["parents"]] == ["t0", f"{other}:t1"]
    assert records(child_path(out, 2, "svd_mean"))[2][distance_key(1)] > 0


def test_list_shows_each_checkpoints_members(study, capsys):
    run_dir, _, _ = study
    assert retention.main(["--run", str(run_dir), "--list"]) == 0
    stdout = capsys.readouterr().out
    assert "step 1: t0 (teacher" in stdout and "step 2: t0 (teacher" in stdout and "s1 (student" in stdout


def _no_engine(config):
    raise AssertionError("bad input must be refused before an engine is built")



@pytest.mark.slow
def test_an_interrupted_child_resumes_exactly(study, tmp_path, monkeypatch, capsys):
    """Catches: a half-done child that restarts from scratch, repeats or loses records, or resumes from a
    state other than its last step's (its records then differ from an uninterrupted child's)."""
    from openrlhf_populora.selfplay.loop import SelfPlay

    run_dir, out, _ = study
    argv = ["--run", str(run_dir), "--snapshots", "1", "--parents", "t0", "t1", "--operators", "svd_mean",
            "--steps", "2", "--probe-samples", "3", "--smooth", "1", "--at", "1", "2", "--quiet",
            "--out", str(tmp_path / "resumed")]
    real_step = SelfPlay.run_step
    calls = {"n": 0}

    def interrupt_at_the_fourth_step(self):
        calls["n"] += 1
        if calls["n"] == 4:  # copy_parent's 2 steps, then svd_mean's first; its second is interrupted
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(SelfPlay, "run_step", interrupt_at_the_fourth_step)
    assert retention.main(argv, engine_factory=scripted_factory) == 130
    half = child_path(tmp_path / "resumed", 1, "svd_mean")
    assert sorted(records(half)) == [1, 2] and not (half / "DONE").exists()
    monkeypatch.setattr(SelfPlay, "run_step", real_step)
    assert retention.main(argv, engine_factory=scripted_factory) == 0
    assert "svd_mean: resuming at step 2" in capsys.readouterr().out

    def comparable(recs):
        return {s: {k: v for k, v in r.items() if k != "time" and not k.startswith("time/")} for s, r in recs.items()}

    straight = comparable(records(child_path(out, 1, "svd_mean")))
    resumed = comparable(records(half))
    assert sorted(resumed) == [1, 2, 3]
    for s in straight:
        assert resumed[s] == pytest.approx(straight[s], rel=1e-6, abs=1e-9), s


# --- the table's intervals and recovery (pure functions: no study to run) -----------------------------------------

def test_recovery_needs_the_child_to_stay_within_tolerance():
    """Catches: "recovers at" as the first step that touches the tolerance (here step 1, before it falls back)."""
    from openrlhf_populora.analysis.retention import recovery_step

    reference = [None, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert recovery_step([None, 0.95, 0.5, 0.95, 1.0, 0.92], reference, 0.1) == 3
    assert recovery_step([None, 0.95, 0.95, 0.95, 0.95, 0.5], reference, 0.1) is None  # fell back at the end
    assert recovery_step([None, 0.95, None, 0.5, 0.95, 0.95], reference, 0.1) == 4
    assert recovery_step([None, 1.0, 1.0], [None, 1.0, 1.0], 0.0) == 1


def test_a_step_is_resampled_from_its_own_answers():
    """Catches: no answer-level resampling (a zero-width interval) or the wrong number of answers: 16 answers at a
    rate of 0.5 give Binomial(16, 0.5) / 16, whose 2.5% and 97.5% quantiles are 4/16 and 12/16."""
    import numpy as np

    from openrlhf_populora.analysis.retention import percentile_interval, resampled_curves

    draws = resampled_curves([None, 0.5, 0.5], 16, 1, np.random.default_rng(0), bootstraps=4000)
    assert np.isnan(draws[:, 0]).all()
    assert percentile_interval(draws[:, 1]) == [0.25, 0.75]
    assert resampled_curves([0.5], None, 1, np.random.default_rng(0)) is None  # no count: no interval


def test_the_mean_over_snapshots_resamples_the_snapshots():
    """Catches: averaging the snapshots' draws without resampling the snapshots: two snapshots at 0.5 and 1.5
    then give [1, 1]; resampled, a draw may take either one twice."""
    import numpy as np

    from openrlhf_populora.analysis.retention import percentile_interval, snapshot_mean_draws

    draws = snapshot_mean_draws([np.full(2000, 0.5), np.full(2000, 1.5)], np.random.default_rng(1))
    assert set(np.unique(draws)) == {0.5, 1.0, 1.5}
    assert percentile_interval(draws) == [0.5, 1.5]


def test_the_table_shows_the_seeds_and_the_intervals():
    from openrlhf_populora.analysis.retention import format_markdown

    row = {"operator": "gaussian", "code": "M1", "snapshot": 10, "finished": True, "steps_done": 8, "seed": 42,
           "values": {"solve_rate": {"8": 0.1}}, "fraction_of_copy": {"8": 0.8},
           "fraction_of_copy_ci": {"8": [0.4, 1.6]}, "recovery_step": None,
           "delta_distance": {"start": 0.07, "end": 0.9}, "logprob_vs_parent_start": -0.01,
           "logprob_vs_copy_end": 0.0}
    table = {"role": "student", "metric": "solve_rate", "at": [8], "tolerance": 0.1, "smooth": 5, "steps": 8,
             "reference": "copy_parent", "seeds": [42], "bootstraps": 1000, "rows": [row],
             "summary": [{"operator": "gaussian", "code": "M1", "snapshots": [10], "mean_fraction_of_copy": {"8": 0.8},
                          "mean_fraction_of_copy_ci": {"8": [0.4, 1.6]}, "recovery_steps": [None]}]}
    text = format_markdown(table)
    assert "**Seeds: 1** (42)" in text and "| 0.1 | 0.8 [0.4, 1.6] | – |" in text and "| 0.8 [0.4, 1.6] | – |" in text
