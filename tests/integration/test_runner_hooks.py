"""``RunHooks``: how a use of the runner (the retention study's children) departs from a plain run, through the
runner itself: its own start instead of the seeding, a hook once the loop holds its state (started or resumed), a
hook after every step whose values join that step's record, and a last step before ``populora.total_steps``.

The runs are the loop tests' (``test_selfplay_loop``: the real local engine on the tiny model, completions
scripted, the real sandbox), with evolution off.
"""

from __future__ import annotations

import json

import pytest
import scripted_runs

from openrlhf_populora.selfplay.checkpoint import checkpoint_step, latest_checkpoint
from openrlhf_populora.selfplay.runner import RunHooks, run

pytestmark = pytest.mark.slow


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_hooks_start_ready_on_step_and_last_step(tmp_path):
    # Catches (each seen failing when the runner was broken so): the start hook ignored (the runner seeds: a
    # "seeding" event) or its state not checkpointed (no step_000000); `ready` called on a fresh start only (no
    # call at step 1 of the resume) or before the resume has loaded its state (step 0 there); on_step's values
    # logged as a record of their own (two lines per step) or dropped; last_step ignored (a step 3 of 3).
    run_dir = tmp_path / "run"
    calls: list[tuple[str, int]] = []

    def start(loop):
        calls.append(("start", loop.step))
        loop.create_adapters()
        loop.seed_buffers()

    def on_step(loop, output):
        calls.append(("on_step", output.step))
        assert loop.step == output.step  # the step is complete
        return {"hook/step_twice": 2.0 * output.step}

    def hooks(last_step: int) -> RunHooks:
        return RunHooks(start=start, ready=lambda loop: calls.append(("ready", loop.step)), on_step=on_step,
                        last_step=last_step, meta={"mode": "hooked", "label": "h"})

    config = scripted_runs.run_config(run_dir, total_steps=3)
    config.populora.evolution.enabled = False
    config.ckpt.save_steps = 1
    assert run(config, scripted_runs.scripted_build, progress=False, hooks=hooks(1)) == 0
    assert calls == [("start", 0), ("ready", 0), ("on_step", 1)]
    assert checkpoint_step(latest_checkpoint(run_dir / "checkpoints")) == 1
    assert (run_dir / "checkpoints" / "step_000000").is_dir()  # the start's state, checkpointed by the runner
    assert not [e for e in _lines(run_dir / "events.jsonl") if e.get("kind") == "seeding"]

    calls.clear()
    config.ckpt.load_enable = True
    assert run(config, scripted_runs.scripted_build, progress=False, hooks=hooks(2)) == 0
    assert calls == [("ready", 1), ("on_step", 2)]  # resumed: no start, `ready` after the state is loaded
    records = _lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]  # one record per step, and none past last_step
    assert [r["hook/step_twice"] for r in records] == [2.0, 4.0]
    assert all("train/solve_rate" in r for r in records)  # in the step's own record
    meta = json.loads((run_dir / "run_meta.json").read_text())
    assert meta["mode"] == "hooked" and meta["label"] == "h" and len(meta["sessions"]) == 2
