"""A resume (--ckpt.load_enable) continues the run its directory holds: a configuration that changes what the run
computes is refused with the differing keys named, and config.yaml is never overwritten silently."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from paths import ROOT

from openrlhf_populora.config import (
    MAY_CHANGE_ON_RESUME_HELP,
    build_parser,
    config_from_dict,
    parse_config,
    resume_conflicts,
)
from openrlhf_populora.selfplay.checkpoint import save_checkpoint
from openrlhf_populora.selfplay.runner import RunDirError, check_run_dir, claim_run_dir

PRESETS = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))


def _config(run_dir: Path, *flags: str):
    return parse_config(["--config", "configs/laptop.yaml", "--ckpt.output_dir", str(run_dir), *flags])


def _run_with_a_checkpoint(tmp_path: Path, *flags: str) -> Path:
    """A run directory as a run leaves it: its config.yaml, a step in metrics.jsonl, a checkpoint."""
    run_dir = tmp_path / "run"
    config = _config(run_dir, *flags)
    claim_run_dir(config).close()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    save_checkpoint(config.checkpoint_dir, 1, lambda d: (d / "state").write_text("x"))
    return run_dir


def _written(run_dir: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(run_dir.glob("config*.yaml"))}


def test_a_resume_that_changes_the_run_is_refused_naming_each_key(tmp_path):
    """Catches: a resume with another seed or population accepted (and config.yaml overwritten with it)."""
    run_dir = _run_with_a_checkpoint(tmp_path)
    before = _written(run_dir)
    changed = _config(run_dir, "--ckpt.load_enable", "--train.seed", "1", "--populora.num_students", "3",
                      "--populora.sandbox.timeout_s", "2")
    with pytest.raises(RunDirError) as err:
        claim_run_dir(changed)
    message = str(err.value)
    assert "differs from the run's" in message and "in 3 key(s)" in message
    for key in ("train.seed: 42 -> 1", "populora.num_students: 2 -> 3", "populora.sandbox.timeout_s: 5.0 -> 2.0"):
        assert key in message
    assert _written(run_dir) == before  # nothing written


def test_the_cli_refuses_it_with_exit_2_before_loading_anything(tmp_path, capsys, monkeypatch):
    from openrlhf_populora.cli import train
    from openrlhf_populora.models import embedded

    run_dir = _run_with_a_checkpoint(tmp_path)
    monkeypatch.setattr(embedded, "resolve_model", lambda *a, **k: pytest.fail("got past the run-directory check"))
    assert train.main(["--config", "configs/laptop.yaml", "--ckpt.output_dir", str(run_dir), "--ckpt.load_enable",
                       "--actor.adam.lr", "3e-5"]) == 2
    preset_lr = _config(run_dir).actor.adam.lr  # the preset's rate, whatever it is (not 3e-5)
    assert preset_lr != 3e-5
    assert f"actor.adam.lr: {preset_lr} -> 3e-05" in capsys.readouterr().err


def test_keys_that_may_change_are_accepted_and_the_old_config_is_kept(tmp_path, caplog):
    """Catches: refusing a longer run, other logging or another checkpoint cadence; and overwriting config.yaml
    without keeping the previous one or saying so."""
    run_dir = _run_with_a_checkpoint(tmp_path)
    before = (run_dir / "config.yaml").read_text()
    resumed = _config(run_dir, "--ckpt.load_enable", "--populora.total_steps", "8", "--ckpt.save_steps", "2",
                      "--ckpt.max_num", "5", "--ckpt.keep_every", "4", "--logger.logging_steps", "2",
                      "--logger.tensorboard_dir", str(tmp_path / "tb"), "--no-populora.report",
                      "--populora.sandbox.workers", "1")
    with caplog.at_level("WARNING"):
        claim_run_dir(resumed).close()
    kept = [p for p in run_dir.glob("config.*.yaml")]
    assert len(kept) == 1 and kept[0].read_text() == before
    assert config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text())).populora.total_steps == 8
    assert "populora.total_steps" in caplog.text and kept[0].name in caplog.text


def test_the_run_length_may_not_change_when_the_learning_rate_schedule_spans_it(tmp_path):
    """Catches: accepting another total_steps under a cosine schedule or a warm-up (the schedule would jump)."""
    run_dir = _run_with_a_checkpoint(tmp_path, "--actor.lr_scheduler", "cosine_with_min_lr")
    with pytest.raises(RunDirError, match=r"populora.total_steps: 4 -> 8 \(the learning-rate schedule spans the run\)"):
        check_run_dir(_config(run_dir, "--actor.lr_scheduler", "cosine_with_min_lr", "--ckpt.load_enable",
                              "--populora.total_steps", "8"))
    warm = _run_with_a_checkpoint(tmp_path / "warm", "--actor.lr_warmup_ratio", "0.1")
    with pytest.raises(RunDirError, match="populora.total_steps"):
        check_run_dir(_config(warm, "--actor.lr_warmup_ratio", "0.1", "--ckpt.load_enable",
                              "--populora.total_steps", "8"))


def test_an_unchanged_resume_keeps_no_copy(tmp_path):
    run_dir = _run_with_a_checkpoint(tmp_path)
    claim_run_dir(_config(run_dir, "--ckpt.load_enable")).close()
    assert list(_written(run_dir)) == ["config.yaml"]


def test_a_stopped_run_is_never_restarted_over_its_checkpoint(tmp_path):
    """A run stopped during its first step has a checkpoint (its seeded state) but no metrics yet: starting it
    again without --ckpt.load_enable is refused like any existing run."""
    run_dir = tmp_path / "run"
    config = _config(run_dir)
    claim_run_dir(config).close()
    save_checkpoint(config.checkpoint_dir, 0, lambda d: (d / "state").write_text("x"))
    with pytest.raises(RunDirError, match="already holds a run"):
        check_run_dir(_config(run_dir))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_resumes_against_its_own_config_yaml(preset, tmp_path):
    """Catches: a false refusal of an unchanged resume (a value that reads back from YAML as another type)."""
    config = parse_config(["--config", f"configs/{preset}.yaml", "--ckpt.output_dir", str(tmp_path)])
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict(), sort_keys=False)))
    assert resume_conflicts(again, config) == []


def test_help_says_what_a_resume_may_change():
    text = " ".join(build_parser().format_help().split())
    start = text.index("--ckpt.load_enable")
    help_text = text[start:text.index("--ckpt.max_num", start)]
    for item in MAY_CHANGE_ON_RESUME_HELP:
        assert " ".join(item.split()) in help_text
    assert "refused, naming the keys" in help_text
