"""``--populora.engine ray``: upstream's parser and validation, the --populora.* group, the refusals, and a runpy
launch of upstream's own ``train()`` that receives the plugin's classes."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("openrlhf")

from openrlhf_populora.patches import openrlhf_0_11_2 as patches  # noqa: E402
from openrlhf_populora.patches.openrlhf_0_11_2 import lock  # noqa: E402

from openrlhf_populora.build import ray as launch  # noqa: E402
from openrlhf_populora.cli import ray_launch  # noqa: E402
from openrlhf_populora.config import PopuLoRAConfig, iter_fields  # noqa: E402
from openrlhf_populora.config import build_parser as local_parser  # noqa: E402

BASE = ["--actor.model_name_or_path", "/models/tiny", "--vllm.num_engines", "2", "--ds.lora.rank", "8"]


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    assert patches.applied() == []
    yield
    patches.revert()


def _exit_message(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        launch.parse_launch_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# the parser


def test_upstream_parser_is_captured_with_all_167_flags():
    parser = launch.upstream_parser()
    assert len(lock.flag_snapshot(parser)) == 167
    assert parser is not launch.upstream_parser()  # each call a fresh copy: callers may modify it
    args = parser.parse_args(["--ds.lora.rank", "4", "--train.colocate_all"])
    assert getattr(args, "ds.lora.rank") == 4 and getattr(args, "train.colocate_all") is True


def test_launch_parser_is_a_superset_of_upstream_with_identical_defaults():
    ours = lock.flag_snapshot(launch.build_parser())
    live = lock.flag_snapshot(launch.upstream_parser())
    stored = patches.load_lock()["flags"]
    assert live == stored  # the installed upstream is the one snapshotted
    for reference in (live, stored):
        assert len(reference) == 167
        missing = sorted(set(reference) - set(ours))
        assert not missing, f"upstream flags missing from the launch parser: {missing}"
        for flag, entry in reference.items():
            expected = dict(entry)
            if entry["dest"] in launch.PLUGIN_DEFAULTS:  # the documented plugin defaults, nothing else
                expected["default"] = lock.json_safe(launch.PLUGIN_DEFAULTS[entry["dest"]])
            assert ours[flag] == expected, flag
    assert {f for f in ours if f not in live} == {"--config"} | {f"--{name}" for name, _, _ in
                                                                 iter_fields(PopuLoRAConfig, "populora.")}


def test_help_lists_upstream_and_populora_flags():
    text = launch.build_parser().format_help()
    assert "--vllm.num_engines" in text and "--populora.num_teachers" in text and "PopuLoRA" in text


def test_populora_flags_are_the_local_engines_flags():
    ours = {a.dest: a for a in launch.build_parser()._actions}
    local = {a.dest: a for a in local_parser()._actions}
    names = [name for name, _, _ in iter_fields(PopuLoRAConfig, "populora.")]
    assert len(names) > 30
    for name in names:
        a, b = ours[name], local[name]
        assert (a.option_strings, a.type, a.choices, a.nargs, a.help, a.default) == \
               (b.option_strings, b.type, b.choices, b.nargs, b.help, b.default), name
    assert "ray" in ours["populora.engine"].choices


def test_populora_values_parse_into_a_nested_namespace():
    args = launch.parse_launch_args(BASE + [
        "--populora.num_teachers", "3", "--populora.num_students", "1", "--populora.task_types", "code_o", "code_f",
        "--populora.evolution.evolve_every", "5", "--no-populora.skip_zero_advantage",
        "--populora.evolution.operators", "{gaussian: 1.0, ties: 0.5}", "--populora.sandbox.timeout_s", "2.5",
        "--populora.matchmaking", "round_robin",
    ])
    p = args.populora
    assert (p.num_teachers, p.num_students, p.task_types) == (3, 1, ["code_o", "code_f"])
    assert p.evolution.evolve_every == 5 and p.evolution.operators == {"gaussian": 1.0, "ties": 0.5}
    assert p.skip_zero_advantage is False and p.sandbox.timeout_s == 2.5 and p.matchmaking == "round_robin"
    assert p.engine == "ray" and p.total_steps == PopuLoRAConfig().total_steps  # unset: the dataclass default
    assert p.adapter_names == ["t0", "t1", "t2", "s0"]
    assert isinstance(p.evolution, SimpleNamespace) and isinstance(p.sandbox, SimpleNamespace)
    assert args.ds.lora.rank == 8 and args.vllm.num_engines == 2  # upstream's hierarchized namespace
    assert not hasattr(args, "config") and not hasattr(args, launch.CONFIG_DEST)
    baseline = launch.parse_launch_args(BASE + ["--populora.mode", "baseline"])
    assert baseline.populora.adapter_names == ["b0"]


def test_plugin_defaults_apply_only_when_the_flag_is_not_given():
    args = launch.parse_launch_args(BASE)
    assert args.algo.advantage.estimator == "reinforce" and args.algo.kl.init_coef == 0.0
    assert args.reward.remote_url == launch.REWARD_SENTINEL
    args = launch.parse_launch_args(BASE + ["--algo.advantage.estimator", "reinforce_baseline",
                                            "--algo.kl.init_coef", "0.001"])
    assert args.algo.advantage.estimator == "reinforce_baseline" and args.algo.kl.init_coef == 0.001
    assert launch.parse_launch_args(BASE).actor.adam.lr == 1e-6  # every other default stays upstream's


def test_all_linear_flag_becomes_peft_s_string_shorthand():
    args = launch.parse_launch_args(BASE + ["--ds.lora.target_modules", "all-linear"])
    assert args.ds.lora.target_modules == "all-linear"
    args = launch.parse_launch_args(BASE + ["--ds.lora.target_modules", "q_proj", "v_proj"])
    assert args.ds.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("targets, served", [
    (["q_proj", "v_proj"], ["qkv_proj"]),
    (["all-linear"], ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]),
    ([], ["o_proj", "qkv_proj"]),  # Config's default: q_proj k_proj v_proj o_proj
])
def test_the_rollout_engines_serve_the_trained_layers_only(monkeypatch, targets, served):
    # catches: a launch whose rollout actors start vLLM without lora_target_modules, or with other layers than
    # --ds.lora.target_modules trains
    from openrlhf_populora.engines.ray import vllm_rollout

    monkeypatch.setattr(vllm_rollout, "MultiLoRARolloutActor", vllm_rollout.MultiLoRARolloutActor)
    monkeypatch.setenv(vllm_rollout.CONFIG_ENV, "")
    argv = BASE + (["--ds.lora.target_modules", *targets] if targets else [])
    swaps = {p.target: p.replacement for p in launch.launch_swaps(launch.parse_launch_args(argv))}
    actor = swaps["openrlhf.trainer.ray.vllm_engine:RolloutRayActor"].__ray_actor_class__
    for cpu in (True, False):
        assert actor.multilora.engine_kwargs(cpu=cpu)["lora_target_modules"] == served


def test_a_yaml_preset_gives_populora_defaults_and_flags_win(tmp_path, capsys):
    preset = tmp_path / "p.yaml"
    preset.write_text("actor: {adam: {lr: 3.0e-6}}\npopulora: {num_teachers: 3, total_steps: 9, "
                      "evolution: {evolve_every: 2}}\n")
    args = launch.parse_launch_args(BASE + ["--config", str(preset), "--populora.total_steps", "11"])
    assert (args.populora.num_teachers, args.populora.total_steps, args.populora.evolution.evolve_every) == (3, 11, 2)
    assert args.actor.adam.lr == 3e-6  # the whole preset reaches upstream's flags, as on the local engine
    assert launch.parse_launch_args(BASE + ["--config", str(preset), "--actor.adam.lr", "5e-6"]).actor.adam.lr == 5e-6
    # without a preset, the algorithm's defaults are the plugin's Config's, not upstream's
    plain = launch.parse_launch_args(BASE)
    assert (plain.actor.lr_scheduler, plain.actor.lr_warmup_ratio) == ("constant_with_warmup", 0.0)
    assert plain.ds.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    preset.write_text("actor: {micro_batch_size: 3}\nrollout: {max_new_tokens: 77}\nlogger: {wandb: {mode: offline}}\n")
    args = launch.parse_launch_args(BASE + ["--config", str(preset)])
    assert (args.train.micro_batch_size, args.rollout.max_new_tokens) == (3, 77)
    assert "no use for these preset settings: logger.wandb.mode" in capsys.readouterr().err
    shipped = launch.parse_launch_args(BASE + ["--config", "configs/4t4s.yaml"])
    assert shipped.populora.num_teachers == 4 and shipped.populora.adapter_names[-1] == "s3"


@pytest.mark.parametrize("argv, message", [
    (["--populora.num_teachrs", "3"], "--populora.num_teachrs -> did you mean --populora.num_teachers?"),
    (["--populora.evolution.evolv_every", "3"], "did you mean --populora.evolution.evolve_every?"),
    (["--actor.adam.lrr", "1e-5"], "did you mean --actor.adam.lr?"),
    (["--populora.total_steps", "two"], "invalid int value: 'two'"),
    (["--populora.matchmaking", "elo"], "invalid choice: 'elo'"),
    (["--populora.total_steps", "0"], "--populora.total_steps must be > 0"),
    (["--populora.task_types", "code_x"], "unknown task type 'code_x'"),
    (["--populora.engine", "local"], "this launcher runs the ray engine"),
    (["--algo.advantage.estimator", "ppo"], "invalid choice: 'ppo'"),  # upstream's own choices
    (["--config", "configs/nope.yaml"], "config file not found"),
])
def test_bad_flags_exit_2_with_a_clear_message(capsys, argv, message):
    assert message in _exit_message(capsys, BASE + argv)


@pytest.mark.parametrize("argv, message", [
    (["--train.async_enable"], "--train.async_enable is not supported"),
    (["--ds.packing_samples"], "--ds.packing_samples"),
    (["--train.dynamic_batch_enable"], "implied by --train.dynamic_batch_enable"),
    (["--ds.ring_attn_size", "2"], "--ds.ring_attn_size > 1"),
    (["--algo.advantage.estimator", "gae"], "needs a critic per adapter"),
    (["--vllm.num_engines", "0"], "generation is vLLM-only"),
    (["--ds.lora.rank", "0"], "--ds.lora.rank must be > 0"),
    (["--train.agent_func_path", "/x/agent.py"], "--train.agent_func_path is not supported"),
    # flags upstream reads and the plugin's controller does not: refused, naming the flag that does the job
    (["--rollout.n_samples_per_prompt", "8"], "use --populora.solver_samples"),
    (["--rollout.batch_size", "64"], "use --populora.proposals_per_teacher"),
    (["--train.num_episodes", "3"], "use --populora.total_steps"),
    (["--data.apply_chat_template"], "use --populora.chat_template"),
    (["--algo.dynamic_filtering_enable"], "use --populora.skip_zero_advantage"),
    (["--data.prompt_dataset", "/d/prompts.jsonl"], "the teachers write the tasks"),
    (["--eval.dataset", "/d/eval.jsonl", "--eval.steps", "5"], "--eval.steps is not read"),
    (["--reward.remote_url", "http://rm:5000"], "rewards come from the sandboxed verifier"),
    # vLLM serves LoRA on named Qwen2/Llama layers only: anything else is refused before Ray starts
    (["--ds.lora.target_modules", "q_proj", "lm_head"], "--ds.lora.target_modules lm_head: the vLLM engine serves"),
    (["--ds.lora.target_modules", ".*proj"], "--ds.lora.target_modules .*proj: the vLLM engine serves"),
])
def test_unsupported_upstream_settings_are_refused(capsys, argv, message):
    err = _exit_message(capsys, BASE + argv)
    assert "the PopuLoRA Ray engine cannot run this" in err and message in err


def test_missing_vllm_engines_is_refused(capsys):
    err = _exit_message(capsys, ["--actor.model_name_or_path", "/m", "--ds.lora.rank", "8"])
    assert "--vllm.num_engines must be >= 1" in err


# ---------------------------------------------------------------------------------------------------------
# the class swaps


class StandIn:
    """Stands in for a Ray actor class: records ``.options(...)`` and ``.remote(...)``; handles answer
    ``get_max_steps`` and ``fit``."""

    def __init__(self, name: str) -> None:
        self.name, self.created, self.options_seen, self.called = name, [], [], []

    def options(self, **kwargs):
        self.options_seen.append(kwargs)
        return self

    def remote(self, *args, **kwargs):
        self.created.append((args, kwargs))

        def method(name, result):
            return SimpleNamespace(remote=lambda *a, **k: self.called.append(name) or result)

        return SimpleNamespace(get_max_steps=method("get_max_steps", 7), fit=method("fit", None))


class RecordingGroup:
    """Stands in for upstream's ``RayActorGroup`` (which would start real Ray actors on GPUs)."""

    made: list = []

    def __init__(self, num_nodes, num_gpus_per_node, ray_actor_type, pg=None, num_gpus_per_actor=1, **kwargs):
        self.actor_type, self.pg, self.gpus = ray_actor_type, pg, (num_nodes, num_gpus_per_node, num_gpus_per_actor)
        self.init_args, self.saved = None, False
        RecordingGroup.made.append(self)

    def async_init_model_from_pretrained(self, *args):
        self.init_args = args
        return []

    def async_save_model(self):
        self.saved = True
        return []


@pytest.fixture()
def stand_ins():
    return {target: StandIn(target.rsplit(":", 1)[1]) for target, _, _ in launch.SWAPS}


@pytest.fixture()
def fake_cluster(monkeypatch, stand_ins):
    """Only what cannot run here is faked: Ray's cluster calls (remote/get are identities, placement groups are
    records) and the actor groups. Upstream's validation, ``train()`` and ``create_vllm_engines`` run for real."""
    import ray
    from openrlhf.trainer.ray import launcher, vllm_engine

    made_pgs = []

    def placement_group(bundles, strategy="PACK"):
        made_pgs.append(bundles)
        return SimpleNamespace(bundles=bundles, ready=lambda: None)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get", lambda refs, **kwargs: refs)
    monkeypatch.setattr(sys.modules["ray.util.placement_group"], "placement_group", placement_group)
    monkeypatch.setattr(vllm_engine, "placement_group", placement_group)
    monkeypatch.setattr(vllm_engine, "PlacementGroupSchedulingStrategy", lambda **kwargs: kwargs)
    monkeypatch.setattr(launcher, "RayActorGroup", RecordingGroup)
    real_plugin_patches = launch.plugin_patches
    # the launch passes its configured rollout actor; the stand-ins replace all three classes here
    monkeypatch.setattr(launch, "plugin_patches", lambda replacements=None: real_plugin_patches(stand_ins))
    from openrlhf_populora.engines.ray.vllm_rollout import CONFIG_ENV

    monkeypatch.setenv(CONFIG_ENV, "")  # configure_multilora exports the config; restored afterwards
    RecordingGroup.made = []
    return SimpleNamespace(placement_groups=made_pgs)


def test_plugin_patches_take_stand_ins_and_reject_unknown_targets(stand_ins):
    swaps = launch.plugin_patches(stand_ins)
    assert [(p.target, p.replacement) for p in swaps] == list(stand_ins.items())
    with pytest.raises(KeyError, match="not a swap target"):
        launch.plugin_patches({"openrlhf.trainer.ppo_trainer:BasePPOTrainer": object()})


def test_the_real_replacements_subclass_the_classes_they_replace():
    try:
        swaps = launch.plugin_patches()
    except ImportError as err:  # written in parallel: skip until all three modules import
        pytest.skip(f"a replacement module does not import yet: {err}")
    for patch in swaps:
        original = patches.lookup(patch.target).__ray_actor_class__
        replacement = patch.replacement
        assert hasattr(replacement, "remote"), f"{patch.target}: the replacement must be a Ray actor class"
        assert issubclass(replacement.__ray_actor_class__, original), patch.target


def test_runpy_launch_runs_upstream_train_with_the_swapped_classes(fake_cluster, stand_ins, capsys):
    originals = {target: patches.lookup(target) for target in stand_ins}
    argv = BASE + ["--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2", "--train.colocate_all",
                   "--vllm.enforce_eager", "--populora.num_teachers", "2", "--populora.num_students", "2"]
    assert ray_launch.main(argv) == 0

    trainer = stand_ins["openrlhf.trainer.ppo_trainer:PPOTrainer"]
    policy = stand_ins["openrlhf.trainer.ray.ppo_actor:PolicyModelActor"]
    rollout = stand_ins["openrlhf.trainer.ray.vllm_engine:RolloutRayActor"]
    # upstream's placement: one colocated group of actor GPUs, handed to the vLLM engines too
    assert fake_cluster.placement_groups == [[{"GPU": 1, "CPU": 1}] * 2]
    # create_vllm_engines (upstream's, unmodified) built our rollout actor, once per engine
    assert len(rollout.created) == 2
    engine_kwargs = rollout.created[0][1]
    assert engine_kwargs["model"] == "/models/tiny" and engine_kwargs["enforce_eager"] is True
    assert engine_kwargs["remote_rm_url"] == [launch.REWARD_SENTINEL]  # after upstream's comma split
    assert engine_kwargs["num_gpus"] == 0.2  # colocated
    # only the policy group: no reference (KL 0), no reward model (remote_url set), no critic (reinforce)
    (group,) = RecordingGroup.made
    assert group.actor_type is policy and group.gpus == (1, 2, 0.2)
    # our controller, built by upstream's train() with upstream's arguments
    ((trainer_args, trainer_kwargs),) = trainer.created
    pretrain, strategy, actor_group, critic, reward, ref, engines = trainer_args
    assert pretrain == "/models/tiny" and actor_group is group and (critic, reward, ref) == (None, None, None)
    assert len(engines) == 2 and trainer_kwargs["do_sample"] is True
    args = strategy.args
    assert args.populora.adapter_names == ["t0", "t1", "s0", "s1"] and args.populora.engine == "ray"
    assert args.actor.eps_clip_low_high == (0.2, 0.2)  # upstream's validation ran on our namespace
    assert trainer.called == ["get_max_steps", "fit"]
    # the rollout actors know how many engines share a node's adapter directory (2 on this 2-GPU node)
    from openrlhf_populora.engines.ray.vllm_rollout import CONFIG_ENV

    assert json.loads(os.environ[CONFIG_ENV])["engines_per_node"] == 2
    assert group.init_args == (strategy, "/models/tiny", 7, engines) and group.saved
    # and everything is put back
    assert patches.applied() == []
    assert {target: patches.lookup(target) for target in stand_ins} == originals


def test_upstream_validation_errors_exit_2_and_revert_the_swaps(fake_cluster, stand_ins, capsys):
    originals = {target: patches.lookup(target) for target in stand_ins}
    assert ray_launch.main(BASE + ["--algo.advantage.estimator", "rloo"]) == 2
    assert "rloo requires n_samples_per_prompt > 1" in capsys.readouterr().err
    assert RecordingGroup.made == [] and patches.applied() == []
    assert {target: patches.lookup(target) for target in stand_ins} == originals


def test_an_existing_run_is_refused_before_anything_starts(fake_cluster, stand_ins, tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert ray_launch.main(BASE + ["--ckpt.output_dir", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert RecordingGroup.made == [] and patches.applied() == []
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"  # nothing lost


def test_failures_inside_train_propagate_and_revert_the_swaps(fake_cluster, stand_ins):
    originals = {target: patches.lookup(target) for target in stand_ins}
    with pytest.raises(AssertionError, match="must be equal to"):  # colocated: 2 GPUs vs 3 engines
        ray_launch.main(BASE[:3] + ["3", "--ds.lora.rank", "8", "--actor.num_gpus_per_node", "2",
                                "--train.colocate_all"])
    assert patches.applied() == []
    assert {target: patches.lookup(target) for target in stand_ins} == originals


def test_version_mismatch_stops_the_launch(monkeypatch, capsys):
    monkeypatch.setattr(patches, "installed_version", lambda: "0.11.3")
    assert ray_launch.main(BASE) == 1
    assert "pip install --no-deps openrlhf==0.11.2" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# the train CLI hands ray runs to the launcher


@pytest.mark.parametrize("argv", [["--populora.engine", "ray", "--x.y", "1"], ["--populora.engine=ray"]])
def test_train_cli_hands_the_whole_argv_to_the_ray_launcher(monkeypatch, argv):
    from openrlhf_populora.cli import train

    seen = []
    monkeypatch.setattr(ray_launch, "main", lambda a: seen.append(a) or 0)
    assert train.main(argv) == 0
    assert seen == [argv]


def test_train_cli_follows_a_preset_that_selects_ray(monkeypatch, tmp_path):
    from openrlhf_populora.cli import train

    preset = tmp_path / "ray.yaml"
    preset.write_text("populora: {engine: ray, num_teachers: 3}\n")
    seen = []
    monkeypatch.setattr(ray_launch, "main", lambda a: seen.append(a) or 0)
    assert train.main(["--config", str(preset)]) == 0 and seen == [["--config", str(preset)]]
    assert train._selects_ray(["--config", str(preset), "--populora.engine", "local"]) is False
    assert train._selects_ray(["--config", "configs/4t4s.yaml"]) is False


_ENV_PROBE = """
import json, os
from types import SimpleNamespace as N
import ray
from openrlhf_populora.engines.ray import cluster

args = N(actor=N(num_nodes=1, num_gpus_per_node=1), vllm=N(num_engines=0, tensor_parallel_size=1),
         ref=N(num_nodes=1, num_gpus_per_node=1), algo=N(kl=N(init_coef=0.0)),
         train=N(colocate_all=False, colocate_actor_ref=False))
assert cluster.connect(args, requested="cpu").initialized

@ray.remote(num_cpus=1)
def worker_env():
    return {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}

print("ENV=" + json.dumps(ray.get(worker_env.remote())))
ray.shutdown()
"""


@pytest.mark.slow
def test_the_launching_shells_environment_reaches_the_cpu_workers():
    """A real local Ray started by the launch in CPU mode: a key the user exports (a larger vLLM KV cache) reaches
    the workers, the CPU defaults fill in the rest. Catches: the CPU defaults overriding the user's value (they
    did: VLLM_CPU_KVCACHE_SPACE=3 arrived as 1), or not reaching the workers at all."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "3"
    done = subprocess.run([sys.executable, "-c", _ENV_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("ENV="))
    assert json.loads(line[4:]) == {"VLLM_CPU_KVCACHE_SPACE": "3", "OMP_NUM_THREADS": "1",
                                    "TOKENIZERS_PARALLELISM": "false"}


_READY_PROBE = """
import time
import ray
from openrlhf_populora.patches.openrlhf_0_11_2.cpu import install_flash_attn_shim

install_flash_attn_shim()  # OpenRLHF's modules import flash_attn, which a CPU machine has not
from openrlhf_populora.engines.ray.policy_actor import wait_for_engines

ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")

@ray.remote(num_cpus=1)
class SlowEngine:
    def __init__(self, seconds):
        time.sleep(seconds)
        self.started = time.time()

    def started_at(self):
        return self.started

engines = [SlowEngine.remote(s) for s in (1.0, 3.0)]
wait_for_engines(engines)
returned = time.time()
print("LATE=" + str(max(ray.get([e.started_at.remote() for e in engines])) - returned))
wait_for_engines([])
wait_for_engines(None)
ray.shutdown()
"""


@pytest.mark.slow
def test_the_policy_waits_until_every_vllm_engine_has_started():
    """Upstream's train() loads the policy while the vLLM engines are still starting; colocated, vLLM would count
    DeepSpeed's memory as its own. ``wait_for_engines`` (called first in the policy actor's set-up) returns only
    after the slowest engine's __init__ ended. Catches: no wait (returns ~3 s before the slow engine is up)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", _READY_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    late = float(next(ln for ln in done.stdout.splitlines() if ln.startswith("LATE="))[5:])
    assert late <= 0.0  # the slow engine had started before wait_for_engines returned
