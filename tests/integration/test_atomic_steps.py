"""A step is atomic: a signal or an exception anywhere in a run leaves it at a whole step, and the resumed run
equals an uninterrupted one bit for bit (metrics, problems, events, population, buffers and every adapter).

The runs are the loop tests' (``test_selfplay_loop``: the real local engine on the tiny model, completions
scripted, the real sandbox): 2 teachers + 2 students, all three task types, seeding from the (scripted) base
model, evolution at step 1 of 2. A signal is a real ``os.kill`` of this process, sent from inside a phase of
step 1 (or of the seeding) after that phase has changed the run's state; an exception is raised at the same
places.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import scripted_runs
import torch
from paths import ROOT

from openrlhf_populora.selfplay import loop as loop_module
from openrlhf_populora.selfplay.checkpoint import checkpoint_step, latest_checkpoint
from openrlhf_populora.selfplay.runner import RunDirError, RunFailed, check_run_dir, run

pytestmark = pytest.mark.slow

# where a signal or an exception lands: a method that has just changed the run's state when it returns
POINTS = {
    "seeding": (loop_module.SelfPlay, "seed_buffers"),  # the buffers are filled
    "propose": (loop_module.SelfPlay, "_measure_programs"),  # valid proposals are in the buffers and the archive
    "solve": (loop_module.SelfPlay, "_plan_attempts"),  # the students' tasks are chosen
    "train": (scripted_runs.ScriptedEngine, "train_step"),  # every adapter and its Adam state took the update
    "rate": (loop_module.SelfPlay, "_rate"),  # the ratings took the step's games
    "evolve": (scripted_runs.ScriptedEngine, "set_adapter"),  # a child is in its slot, the population not yet told
}


def _config(run_dir: Path, total_steps: int = 2, **ckpt):
    config = scripted_runs.run_config(run_dir, total_steps=total_steps)
    config.populora.evolution.evolve_every = 1
    for key, value in ckpt.items():
        setattr(config.ckpt, key, value)
    return config


def _resumed(config):
    config.ckpt.load_enable = True
    check_run_dir(config)  # the directory accepts the resume (a run with steps and no checkpoint would not)
    return config


def _lines(path: Path, drop=("time", "seconds")) -> list[dict]:
    if not path.exists():
        return []
    return [{k: v for k, v in json.loads(line).items() if k not in drop and not k.startswith("time/")}
            for line in path.read_text().splitlines()]


def _outcome(run_dir: Path) -> dict:
    """Everything a finished run leaves, minus wall-clock times."""
    members = json.loads((run_dir / "population.json").read_text())["members"]
    adapters = {m["id"]: scripted_runs.adapter_weights(run_dir, m["id"]) for m in members if m["retired_step"] is None}
    return {"metrics": _lines(run_dir / "metrics.jsonl"), "problems": _lines(run_dir / "problems.jsonl"),
            "events": _lines(run_dir / "events.jsonl"), "population": members,
            "buffers": (run_dir / "buffers.jsonl").read_text(), "adapters": adapters}


def _assert_same_run(straight: dict, resumed: dict) -> None:
    assert [r["step"] for r in resumed["metrics"]] == [r["step"] for r in straight["metrics"]]
    for key in ("metrics", "problems", "events", "population", "buffers"):
        assert resumed[key] == straight[key], key  # exact: no tolerance
    assert resumed["adapters"].keys() == straight["adapters"].keys()
    for member, tensors in straight["adapters"].items():
        assert tensors.keys() == resumed["adapters"][member].keys()
        for name, tensor in tensors.items():
            assert torch.equal(tensor, resumed["adapters"][member][name]), (member, name)


@pytest.fixture(autouse=True)
def sigint_as_in_a_terminal():
    """Ctrl-C as a terminal delivers it: a test process started in the background by a non-interactive shell
    inherits SIGINT ignored, which the runner rightly leaves ignored (so these tests would see no signal)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert run(_config(run_dir), scripted_runs.scripted_build, progress=False) == 0
    outcome = _outcome(run_dir)
    assert any(e.get("kind") == "evolution" and e["step"] == 1 for e in outcome["events"])  # evolve has work
    return outcome


def _inject(monkeypatch, point: str, action, calls: int = 1) -> dict:
    """Run ``action()`` right after the ``calls``-th return of the method at ``point`` during step 1 (or seeding);
    returns a record of whether it fired."""
    owner, name = POINTS[point]
    real = getattr(owner, name)
    state = {"calls": 0, "fired": False}

    def wrapper(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        step = getattr(self, "step", None)
        if not state["fired"] and (step is None or step == 0):
            state["calls"] += 1
            if state["calls"] == calls:
                state["fired"] = True
                action()
        return result

    monkeypatch.setattr(owner, name, wrapper)
    return state


def _kill(signum):
    return lambda: os.kill(os.getpid(), signum)


@pytest.mark.parametrize("point,signum", [pytest.param(p, s, id=f"{p}-{s.name}") for p, s in
                                          [(point, signal.SIGTERM) for point in POINTS] + [("train", signal.SIGINT)]])
def test_a_signal_in_any_phase_finishes_the_step_checkpoints_it_and_stops(straight, tmp_path, monkeypatch, point,
                                                                          signum):
    """Catches: the old SIGTERM handler (KeyboardInterrupt mid-step, then a checkpoint of the half-applied state
    under the previous step number, which the resume replays), and a signal that does not stop the run."""
    run_dir = tmp_path / "run"
    fired = _inject(monkeypatch, point, _kill(signum))
    assert run(_config(run_dir), scripted_runs.scripted_build, progress=False) == 130
    assert fired["fired"]
    stopped_at = 0 if point == "seeding" else 1  # the step in progress (or the seeding) finished, then stopped
    assert checkpoint_step(latest_checkpoint(run_dir / "checkpoints")) == stopped_at
    assert [r["step"] for r in _lines(run_dir / "metrics.jsonl")] == list(range(1, stopped_at + 1))
    monkeypatch.undo()
    assert run(_resumed(_config(run_dir)), scripted_runs.scripted_build, progress=False) == 0
    _assert_same_run(straight, _outcome(run_dir))


@pytest.mark.parametrize("point", list(POINTS))
def test_an_exception_in_any_phase_leaves_the_last_whole_step_and_resumes_exactly(straight, tmp_path, monkeypatch,
                                                                                  point):
    """Catches: an exception that loses the run (no checkpoint: the resume is refused), a checkpoint of the
    half-applied state on the way out (the resume then differs), and a multi-line or missing report."""
    run_dir = tmp_path / "run"

    def crash():
        raise RuntimeError("CUDA out of memory (simulated)\nsecond line of the message")

    fired = _inject(monkeypatch, point, crash)
    with pytest.raises(RunFailed) as failure:
        run(_config(run_dir), scripted_runs.scripted_build, progress=False)
    assert fired["fired"]
    message = str(failure.value)
    assert "\n" not in message and isinstance(failure.value.__cause__, RuntimeError)
    where = "the run failed in seeding" if point == "seeding" else "step 1 failed in "
    assert where in message and "RuntimeError: CUDA out of memory (simulated);" in message
    assert "traceback in" in message and "second line" in (run_dir / "error.log").read_text()
    if point == "seeding":  # nothing to go back to: the same command starts afresh
        assert latest_checkpoint(run_dir / "checkpoints") is None and "starts it afresh" in message
        check_run_dir(_config(run_dir))
        config = _config(run_dir)
    else:
        assert checkpoint_step(latest_checkpoint(run_dir / "checkpoints")) == 0
        assert "the run stays at step 0" in message and "--ckpt.load_enable" in message
        config = _resumed(_config(run_dir))
    monkeypatch.undo()
    assert run(config, scripted_runs.scripted_build, progress=False) == 0
    _assert_same_run(straight, _outcome(run_dir))


def test_a_second_signal_stops_at_once_without_saving_the_half_applied_step(straight, tmp_path, monkeypatch):
    """Catches: saving the live state when a second Ctrl-C aborts mid-step (it holds step 1's update under
    step 0, and the resume would apply it twice)."""
    run_dir = tmp_path / "run"

    def twice():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    fired = _inject(monkeypatch, "train", twice)
    assert run(_config(run_dir), scripted_runs.scripted_build, progress=False) == 130
    assert fired["fired"]
    assert checkpoint_step(latest_checkpoint(run_dir / "checkpoints")) == 0
    assert not (run_dir / "metrics.jsonl").exists()
    monkeypatch.undo()
    assert run(_resumed(_config(run_dir)), scripted_runs.scripted_build, progress=False) == 0
    _assert_same_run(straight, _outcome(run_dir))


def test_an_interrupt_after_training_then_resume_matches_the_straight_run(tmp_path, monkeypatch):
    """The review's reproduction: a KeyboardInterrupt (what the old SIGTERM handler raised) right after step 2's
    training, then a resume. Before, the runner checkpointed the half-applied step 2 as step 1 and the resume
    trained it again (gradient norms 0.548 vs 0.364, adapters off by 2.1e-3). Catches that."""
    def config_for(run_dir):
        config = scripted_runs.run_config(run_dir, total_steps=3)
        config.populora.evolution.evolve_every = 100  # no evolution: isolate the effect
        config.ckpt.save_steps = 1
        return config

    straight = tmp_path / "straight"
    assert run(config_for(straight), scripted_runs.scripted_build, progress=False) == 0
    resumed = tmp_path / "resumed"
    real_rate = loop_module.SelfPlay._rate

    def rate_then_interrupt(self, t, matchups, proposals):
        games = real_rate(self, t, matchups, proposals)
        if t == 2:
            raise KeyboardInterrupt
        return games

    monkeypatch.setattr(loop_module.SelfPlay, "_rate", rate_then_interrupt)
    assert run(config_for(resumed), scripted_runs.scripted_build, progress=False) == 130
    assert checkpoint_step(latest_checkpoint(resumed / "checkpoints")) == 1  # step 2 was never saved
    monkeypatch.undo()
    assert run(_resumed(config_for(resumed)), scripted_runs.scripted_build, progress=False) == 0
    _assert_same_run(_outcome(straight), _outcome(resumed))


@pytest.mark.parametrize("save_steps,back_to", [(1, 1), (-1, 0)])
def test_a_crash_at_the_last_step_keeps_the_run(tmp_path, monkeypatch, save_steps, back_to):
    """The review's other reproduction: an exception at the last step used to leave no checkpoint, no exported
    adapters, and a directory that refused --ckpt.load_enable. Now the run goes back to its last checkpoint
    (the previous step with a checkpoint every step, the seeded state without periodic checkpoints) and resumes
    to the straight run's result. Catches: no checkpoint of the seeded state, no periodic checkpoint."""
    def config_for(run_dir):
        config = scripted_runs.run_config(run_dir, total_steps=2)
        config.populora.evolution.evolve_every = 100
        config.ckpt.save_steps = save_steps
        return config

    straight = tmp_path / "straight"
    assert run(config_for(straight), scripted_runs.scripted_build, progress=False) == 0
    crashed = tmp_path / "crashed"
    real = loop_module.SelfPlay.run_step

    def crash_at_the_last_step(self):
        if self.step == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(self)

    monkeypatch.setattr(loop_module.SelfPlay, "run_step", crash_at_the_last_step)
    with pytest.raises(RunFailed, match=f"step 2 failed .* the run stays at step {back_to} "):
        run(config_for(crashed), scripted_runs.scripted_build, progress=False)
    assert checkpoint_step(latest_checkpoint(crashed / "checkpoints")) == back_to
    with pytest.raises(RunDirError, match="already holds a run"):  # without the flag: refused, not overwritten
        check_run_dir(config_for(crashed))
    monkeypatch.undo()
    assert run(_resumed(config_for(crashed)), scripted_runs.scripted_build, progress=False) == 0
    _assert_same_run(_outcome(straight), _outcome(crashed))


def _step_one_differences(straight: dict, extended: dict) -> set[str]:
    """The keys of the step-1 metrics record that differ between two runs."""
    a, b = straight["metrics"][0], extended["metrics"][0]
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


@pytest.mark.parametrize("crash", [False, True], ids=["straight-on", "crash-after-the-deferred-evolution"])
def test_a_run_extended_past_its_last_step_makes_that_steps_evolution(straight, tmp_path, monkeypatch, crash):
    """A 1-step run does not evolve at step 1 (its last: a child would be exported untrained); resumed with
    --populora.total_steps 2 it makes that evolution first, so it ends as the 2-step run (``straight``, evolution
    at step 1) does: the same events, population, buffers, adapters and step-2 metrics, exactly. Only step 1's
    record differs: it describes the members alive before the evolution (the replaced ones, not their children). With ``crash``, step 2 raises after the deferred evolution was logged: the
    checkpoint still holds step 1 unevolved, and the next resume drops the logged events before evolving again.

    Catches: a resume that never makes the skipped evolution (the children are missing); the pending flag not
    saved in the checkpoint (the same); events of an interrupted catch-up kept beside the redone ones (two
    evolution events per child); an evolution made at the last step itself (the 1-step run would have events)."""
    run_dir = tmp_path / "run"
    assert run(_config(run_dir, total_steps=1), scripted_runs.scripted_build, progress=False) == 0
    short = _outcome(run_dir)
    assert not [e for e in short["events"] if e.get("kind") == "evolution"]
    assert json.loads((latest_checkpoint(run_dir / "checkpoints") / "loop.json").read_text()) == \
        {"step": 1, "evolution_pending": True}
    if crash:
        real = loop_module.SelfPlay.run_step

        def crash_after_evolving(self):
            assert [e["kind"] for e in _lines(run_dir / "events.jsonl")].count("evolution") == 2
            raise RuntimeError("preempted (simulated)")

        monkeypatch.setattr(loop_module.SelfPlay, "run_step", crash_after_evolving)
        with pytest.raises(RunFailed, match="step 2 failed .* the run stays at step 1 "):
            run(_resumed(_config(run_dir, total_steps=2)), scripted_runs.scripted_build, progress=False)
        monkeypatch.setattr(loop_module.SelfPlay, "run_step", real)
    assert run(_resumed(_config(run_dir, total_steps=2)), scripted_runs.scripted_build, progress=False) == 0
    extended = _outcome(run_dir)
    for key in ("problems", "events", "population", "buffers"):
        assert extended[key] == straight[key], key
    assert extended["adapters"].keys() == straight["adapters"].keys()
    for member, tensors in straight["adapters"].items():
        for name, tensor in tensors.items():
            assert torch.equal(tensor, extended["adapters"][member][name]), (member, name)
    assert extended["metrics"][1] == straight["metrics"][1]
    assert extended["metrics"][0] == short["metrics"][0]  # step 1 as the 1-step run logged it
    # step 1's record: the straight run logged it after evolving (the children, no replaced members), the extended
    # run before; every other member's metrics and ratings are the same
    changed = {e[k] for e in straight["events"] if e.get("kind") == "evolution" for k in ("replaced", "child")}
    assert len(changed) == 4  # one teacher and one student replaced, and their children
    differing = _step_one_differences(straight, extended)
    assert {k for k in differing if k.split("/")[0] in ("member", "rating") and not {k.split("/")[1],
            k.split("/")[2]} & changed} == set()
    assert {k for k in differing if k.split("/")[0] not in ("member", "rating")} <= {"learning/update_size",
                                                                                     "learning/probe_kl"}


def test_run_meta_records_each_start_and_resume_with_its_code_and_machine(tmp_path):
    # a 1-step run extended to 2 steps: two sessions, from step 0 (new) and from step 1 (resumed), each naming
    # the commit, the packages and the CPU. Catches: no record (a run stitched from several commits or machines
    # looks like one), a resume that overwrites the first record instead of adding one, the wrong step.
    import subprocess

    run_dir = tmp_path / "run"
    assert run(_config(run_dir, total_steps=1), scripted_runs.scripted_build, progress=False) == 0
    assert run(_resumed(_config(run_dir, total_steps=2)), scripted_runs.scripted_build, progress=False) == 0
    sessions = json.loads((run_dir / "run_meta.json").read_text())["sessions"]
    assert [(s["from_step"], s["resumed"]) for s in sessions] == [(0, False), (1, True)]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    for session in sessions:
        if head.returncode == 0:  # a git checkout (CI's clone is one)
            assert session["commit"] == head.stdout.strip() and isinstance(session["dirty"], bool)
        assert session["packages"]["torch"] == torch.__version__
        assert session["cpu"] and session["torch_threads"] == torch.get_num_threads()
        assert session["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    # resuming the finished run trains nothing and records nothing (catches: a third session, from step 2, for a
    # start that did no work, as a driver script that resumes every run would add to finished runs)
    meta = (run_dir / "run_meta.json").read_text()
    assert run(_resumed(_config(run_dir, total_steps=2)), scripted_runs.scripted_build, progress=False) == 0
    assert (run_dir / "run_meta.json").read_text() == meta
