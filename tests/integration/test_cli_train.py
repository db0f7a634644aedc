"""The train CLI's flags and presets: OpenRLHF-style dotted names, clear errors, exit status 2."""

from pathlib import Path

import pytest
from paths import ROOT

from openrlhf_populora.cli.train import main
from openrlhf_populora.config import Config, build_parser, load_yaml, parse_config

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_all_presets_exist_and_parse():
    names = {p.stem for p in CONFIGS}
    assert {"laptop", "laptop-smollm2", "1t1s", "4t4s", "8t8s", "baseline"} <= names
    for path in CONFIGS:
        config = parse_config(["--config", str(path)])
        assert config.populora.total_steps > 0


def test_preset_values_and_flag_precedence():
    config = parse_config(["--config", "configs/4t4s.yaml", "--populora.num_students", "3",
                           "--actor.adam.lr", "2e-6", "--ds.lora.target_modules", "q_proj", "v_proj",
                           "--ckpt.load_enable"])
    assert config.populora.num_teachers == 4 and config.populora.num_students == 3
    assert config.actor.adam.lr == 2e-6 and config.ds.lora.target_modules == ["q_proj", "v_proj"]
    assert config.ckpt.load_enable is True
    assert parse_config(["--config", "configs/baseline.yaml"]).populora.mode == "baseline"


def test_openrlhf_flag_names_are_accepted():
    flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    for name in ["--actor.model_name_or_path", "--ds.lora.rank", "--ds.lora.alpha", "--ds.lora.target_modules",
                 "--ds.lora.dropout", "--rollout.temperature", "--rollout.top_p", "--rollout.max_new_tokens",
                 "--actor.adam.lr", "--actor.max_norm", "--train.seed", "--ckpt.path", "--ckpt.save_steps",
                 "--ckpt.load_enable", "--ckpt.output_dir", "--logger.tensorboard_dir", "--logger.wandb.project",
                 "--populora.num_teachers", "--populora.evolution.evolve_every", "--populora.reward.wrong"]:
        assert name in flags, name


@pytest.mark.parametrize("argv, message", [
    (["--populora.num_teacher", "2"], "did you mean --populora.num_teachers"),
    (["--actor.adam.learning_rate", "1e-5"], "did you mean --actor.adam.lr"),
    (["--populora.total_steps", "0"], "--populora.total_steps must be > 0"),
    (["--populora.total_steps", "two"], "invalid int value"),
    (["--populora.matchmaking", "elo"], "invalid choice"),
    (["--populora.task_types", "code_x"], "unknown task type 'code_x'"),
    (["--populora.evolution.evolve_every", "-1"], "evolve_every must be > 0"),
    (["--populora.evolution.operators", "{nope: 1}"], "nope"),
    (["--config", "configs/missing.yaml"], "config file not found"),
    (["--actor.eps_clip_low_high", "0.2", "1.5"], "both bounds must be in (0, 1)"),
    # values that used to pass the parser and fail later, inside the run
    (["--populora.buffer_capacity", "0"], "--populora.buffer_capacity must be > 0"),
    (["--populora.references", "-1"], "--populora.references must be >= 0"),
    (["--populora.seed_tasks", "0"], "--populora.seed_tasks must be > 0"),
    (["--ds.lora.dropout", "1.0"], "--ds.lora.dropout must be in [0, 1)"),
    (["--train.max_epochs", "0"], "--train.max_epochs must be > 0"),
    (["--logger.logging_steps", "0"], "--logger.logging_steps must be > 0"),
    (["--populora.evolution.params.ties_density", "0"], "evolution.params.ties_density must be in (0, 1]"),
    # malformed YAML in a mapping flag: argparse's message, not a YAML traceback
    (["--populora.evolution.operators", "{bad:"], "not valid YAML"),
    (["--populora.evolution.operators", "[1, 2]"], "expected a YAML mapping"),
    (["--populora.evolution.operators", "{M1: 1, gaussian: 1}"], "names 'gaussian' twice"),
    # a population in which nothing can evolve, with evolution on
    (["--populora.num_teachers", "1", "--populora.num_students", "1"], "--populora.evolution.enabled false"),
    (["--populora.baseline_for", "4t4s"], "it needs --populora.mode baseline"),
    (["--populora.mode", "baseline", "--populora.baseline_for", "9t9s"], "no preset '9t9s'"),
    (["--populora.mode", "baseline", "--populora.baseline_for", "baseline"], "is not a population preset"),
])
def test_bad_flags_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--ckpt.output_dir", "/nonexistent/never-created"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not Path("/nonexistent/never-created").exists()  # rejected before anything was written


def test_asymmetric_clip_reaches_the_engine():
    from openrlhf_populora.build import build_engine

    symmetric = build_engine(parse_config(["--actor.model_name_or_path", "tiny", "--actor.eps_clip", "0.1"]))
    assert (symmetric.config.eps_clip_low, symmetric.config.eps_clip_high) == (0.1, 0.1)
    engine = build_engine(parse_config(["--actor.model_name_or_path", "tiny",
                                        "--actor.eps_clip_low_high", "0.2", "0.28"]))
    assert (engine.config.eps_clip_low, engine.config.eps_clip_high) == (0.2, 0.28)


def test_unknown_yaml_key_suggests_the_closest(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("populora:\n  num_teacherz: 3\n")
    with pytest.raises(ValueError, match="did you mean populora.num_teachers"):
        load_yaml(bad)
    bad.write_text("populora:\n  num_teachers: many\n")
    with pytest.raises(ValueError, match="populora.num_teachers: cannot use 'many'"):
        load_yaml(bad)


def test_existing_run_is_never_overwritten(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["--actor.model_name_or_path", "tiny", "--ckpt.output_dir", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_resuming_a_run_without_a_checkpoint_is_refused(tmp_path, capsys):
    """Starting over inside it would append a second step 1 to its metrics.jsonl."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["--actor.model_name_or_path", "tiny", "--ckpt.output_dir", str(tmp_path),
                 "--ckpt.load_enable"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_resume_flag_on_a_new_directory_starts_a_run():
    """A preemptible job's command line always asks to resume; its first start has nothing to resume."""
    from openrlhf_populora.selfplay.runner import check_run_dir

    check_run_dir(parse_config(["--ckpt.output_dir", "/nonexistent/new-run", "--ckpt.load_enable"]))


def test_an_unknown_lora_target_is_exit_2_before_the_run_directory_is_touched(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["--actor.model_name_or_path", "tiny", "--ds.lora.target_modules", "qproj",
                 "--ckpt.output_dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "['qproj'] match no module" in err and "q_proj" in err and not run_dir.exists()


@pytest.mark.parametrize("population", ["1t1s", "4t4s", "8t8s", "laptop", "signature"])
def test_the_baseline_is_matched_per_adapter_to_its_population(population):
    """Every setting that sets a member's compute and update equals the population preset's; the population's
    shape does not come along. (configs/baseline.yaml used to propose 64 tasks a step against 16 per 4t4s
    teacher.)"""
    pop = parse_config(["--config", f"configs/{population}.yaml"])
    base = parse_config(["--config", "configs/baseline.yaml", "--populora.baseline_for", population,
                         "--ckpt.output_dir", "runs/b"])
    assert base.populora.mode == "baseline" and base.populora.baseline_for == population
    for section in ("actor", "ds", "rollout", "train"):
        assert getattr(base, section) == getattr(pop, section), section
    for name in ("task_types", "total_steps", "proposals_per_teacher", "solver_tasks", "solver_samples",
                 "references", "seed_tasks", "seed_max_rounds", "seed_file", "prompts", "chat_template",
                 "reward", "skip_zero_advantage", "recency_window", "buffer_capacity"):
        assert getattr(base.populora, name) == getattr(pop.populora, name), name
    assert base.ckpt.output_dir == "runs/b" and base.populora.teacher_reward_mode() == "learnability"
    assert pop.populora.teacher_reward_mode() == "failure_rate"
    assert parse_config(["--config", "configs/baseline.yaml"]).populora.baseline_for == "4t4s"


def test_the_1t1s_preset_does_not_promise_evolution():
    config = parse_config(["--config", "configs/1t1s.yaml"])
    assert config.populora.evolution.enabled is False


def test_config_round_trips_through_its_dict():
    from openrlhf_populora.config import config_from_dict

    config = parse_config(["--config", "configs/laptop.yaml"])
    assert config_from_dict(config.to_dict()) == config
    assert Config() == config_from_dict(Config().to_dict())


def test_two_runs_never_write_into_one_directory(tmp_path):
    import fcntl

    with open(tmp_path / ".lock", "w") as held:  # a run in progress holds this lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as exc:
            main(["--actor.model_name_or_path", "tiny", "--ckpt.output_dir", str(tmp_path)])
    assert "another run is writing" in str(exc.value)
    assert not (tmp_path / "config.yaml").exists()


def test_a_missing_model_is_exit_2_before_the_run_directory_is_touched(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["--actor.model_name_or_path", str(tmp_path / "nowhere"), "--ckpt.output_dir", str(run_dir)]) == 2
    assert "--actor.model_name_or_path" in capsys.readouterr().err and not run_dir.exists()
