"""The Ray launch's own settings: CPU-mode defaults, the run directory's checkpoint folder, the package's model
names, the self-play Config built from upstream's namespace, logical GPUs, and per-adapter training stats."""

from __future__ import annotations

import pytest

pytest.importorskip("openrlhf")

from openrlhf_populora.build import ray as launch  # noqa: E402
from openrlhf_populora.build.ray import config_from_args  # noqa: E402
from openrlhf_populora.engines.ray import cluster  # noqa: E402

BASE = ["--actor.model_name_or_path", "/models/tiny", "--vllm.num_engines", "1", "--ds.lora.rank", "8"]


def test_without_cuda_the_launch_defaults_to_what_runs_on_cpu_and_flags_still_win(monkeypatch):
    monkeypatch.setattr(cluster, "cuda_available", lambda: False)
    args = launch.parse_launch_args(BASE)
    assert args.ds.attn_implementation == "sdpa" and args.ds.param_dtype == "fp32"
    args = launch.parse_launch_args(BASE + ["--ds.attn_implementation", "eager", "--ds.param_dtype", "bf16"])
    assert args.ds.attn_implementation == "eager" and args.ds.param_dtype == "bf16"
    monkeypatch.setattr(cluster, "cuda_available", lambda: True)
    args = launch.parse_launch_args(BASE)
    assert args.ds.attn_implementation == "flash_attention_2" and args.ds.param_dtype == "bf16"  # upstream's


def test_checkpoints_go_to_the_run_directory_unless_a_path_is_given(tmp_path):
    args = launch.parse_launch_args(BASE + ["--ckpt.output_dir", str(tmp_path / "run")])
    assert args.ckpt.path == str(tmp_path / "run" / "checkpoints")
    args = launch.parse_launch_args(BASE + ["--ckpt.output_dir", str(tmp_path), "--ckpt.path", "/shared/ck"])
    assert args.ckpt.path == "/shared/ck"
    assert config_from_args(args).checkpoint_dir.as_posix() == "/shared/ck"


def test_package_model_names_resolve_to_local_folders_and_paths_pass_through(tmp_path, monkeypatch):
    monkeypatch.setenv("POPULORA_CACHE_DIR", str(tmp_path))
    args = launch.parse_launch_args(["--actor.model_name_or_path", "tiny", *BASE[2:]])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.actor.model_name_or_path)
    assert config.hidden_size // config.num_attention_heads >= 32  # a head size vLLM's CPU attention serves
    hub_id = "Qwen/Qwen2.5-Coder-7B-Instruct"  # on a cluster upstream loads hub ids itself; left alone
    assert launch.parse_launch_args(["--actor.model_name_or_path", hub_id, *BASE[2:]]).actor.model_name_or_path \
        == hub_id


def test_the_loop_config_takes_the_shared_leaves_of_upstream_args(tmp_path):
    args = launch.parse_launch_args(BASE + [
        "--rollout.temperature", "0.7", "--rollout.max_new_tokens", "99", "--train.seed", "5",
        "--ckpt.output_dir", str(tmp_path), "--populora.num_teachers", "3", "--populora.evolution.evolve_every", "4",
        "--logger.tensorboard_dir", str(tmp_path / "tb")])
    config = config_from_args(args)
    assert (config.rollout.temperature, config.rollout.max_new_tokens, config.train.seed) == (0.7, 99, 5)
    assert config.populora.num_teachers == 3 and config.populora.evolution.evolve_every == 4
    assert config.populora.engine == "ray" and config.logger.tensorboard_dir == str(tmp_path / "tb")
    # the learning probe reads the base weights and the LoRA scaling: the run's model and LoRA shape, not defaults
    assert config.actor.model_name_or_path == "/models/tiny" and config.ds.lora.rank == 8
    assert config_from_args(launch.parse_launch_args(BASE + ["--ds.lora.alpha", "32"])).ds.lora.alpha == 32
    assert config.ckpt.save_steps == -1  # upstream turns -1 into inf
    # W&B follows upstream's rule: on only with --logger.wandb.key (its project has a default)
    assert not config.logger.wandb.project
    keyed = config_from_args(launch.parse_launch_args(BASE + ["--logger.wandb.key", "k"]))
    assert keyed.logger.wandb.project == "openrlhf_train_ppo" and keyed.logger.wandb.key == "k"


@pytest.mark.parametrize("flags,gpus", [
    (["--actor.num_gpus_per_node", "4", "--vllm.num_engines", "2"], 6),
    (["--actor.num_gpus_per_node", "4", "--vllm.num_engines", "4", "--train.colocate_all"], 4),
    (["--actor.num_gpus_per_node", "2", "--vllm.num_engines", "1", "--algo.kl.init_coef", "0.01",
      "--ref.num_gpus_per_node", "2"], 5),
    (["--actor.num_gpus_per_node", "2", "--vllm.num_engines", "1", "--algo.kl.init_coef", "0.01",
      "--ref.num_gpus_per_node", "2", "--train.colocate_actor_ref"], 3),
])
def test_logical_gpus_cover_upstream_placement(flags, gpus):
    args = launch.parse_launch_args(["--actor.model_name_or_path", "/m", "--ds.lora.rank", "8", *flags])
    assert cluster.logical_gpus_needed(args) == gpus


def test_per_adapter_stats_nest_the_actor_status_and_share_batch_scalars():
    from openrlhf_populora.engines.ray.trainer import per_adapter_stats

    status = {"populora/t0/loss": 0.5, "populora/t0/optimizer_steps": 2, "populora/s1/loss": 0.1,
              "populora/x9/loss": 3.0, "policy_loss": 0.3, "actor_lr": 1e-5, "note": "text"}
    per = per_adapter_stats(status, ["t0", "s1"])
    assert per == {"t0": {"loss": 0.5, "optimizer_steps": 2.0, "lr": 1e-5}, "s1": {"loss": 0.1, "lr": 1e-5}}
    assert per_adapter_stats({"policy_loss": 0.3}, ["t0"]) == {"t0": {"loss": 0.3}}  # batch-level fallback

