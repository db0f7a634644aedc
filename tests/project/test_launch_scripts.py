"""launch/: every script and preset builds a command that the real parser (upstream + --populora.*) and upstream's
own validation accept; the documented stock OpenRLHF commands parse with upstream's parser alone."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openrlhf")

from openrlhf_populora.patches import openrlhf_0_11_2 as patches  # noqa: E402
from paths import ROOT

from openrlhf_populora.build import ray as launch  # noqa: E402

LAUNCH = ROOT / "launch"
SCRIPTS = ["ray_job_1node.sh", "ray_job_multinode.sh", "slurm_populora.sbatch"]
PRESETS = ["1t1s", "4t4s", "8t8s", "baseline"]
ENTRY = ["python3", "-m", "openrlhf_populora.cli.train", "--populora.engine", "ray"]


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    yield
    patches.revert()


def dry_run(script: str, extra: list[str] = (), **env) -> list[str]:
    """The command a script would run, one token per line (DRY_RUN=1), run from the repository root."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_ADDRESS"))}
    environment.update({"DRY_RUN": "1", **env})
    out = subprocess.run(["bash", str(LAUNCH / script), *extra], cwd=ROOT, env=environment, capture_output=True,
                         text=True, timeout=30, check=True)
    return out.stdout.splitlines()


def plugin_argv(tokens: list[str]) -> list[str]:
    assert tokens[:3] == ["ray", "job", "submit"]
    start = tokens.index("--")
    assert tokens[start + 1:start + 1 + len(ENTRY)] == ENTRY
    return tokens[start + 1 + len(ENTRY) - 2:]  # keep --populora.engine ray: the launcher sees the whole argv


class _ReachedTrain(Exception):  # noqa: N818 - a signal: upstream's validation passed and train() started
    pass


def upstream_validation_accepts(args, monkeypatch) -> None:
    """Run train_ppo_ray's __main__ (its validation) on ``args`` and stop as train() starts: its first statement
    asks ``ray.is_initialized()``."""
    import ray

    def reached():
        raise _ReachedTrain

    monkeypatch.setattr(ray, "is_initialized", reached)
    with pytest.raises(_ReachedTrain):
        launch.run_upstream(args, [])
    assert patches.applied() == []


def test_scripts_are_valid_bash():
    for script in [*SCRIPTS, "lib.sh"]:
        subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True, timeout=30)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_script_and_preset_parses_and_passes_upstream_validation(script, preset, monkeypatch):
    env = {"PRESET": preset, "RUN_DIR": f"/ckpt/{preset}"}
    if script != "ray_job_1node.sh":
        env["NNODES" if script == "ray_job_multinode.sh" else "SLURM_JOB_NUM_NODES"] = "3"
    argv = plugin_argv(dry_run(script, **env))
    args = launch.parse_launch_args(argv)  # exits 2 on any unknown flag or bad value
    nodes = 1 if script == "ray_job_1node.sh" else 3
    gpus = nodes * 8
    assert (args.actor.num_nodes, args.actor.num_gpus_per_node) == (nodes, 8)
    assert args.train.colocate_all and args.vllm.num_engines * args.vllm.tensor_parallel_size == gpus
    assert args.vllm.enforce_eager and args.actor.model_name_or_path == "Qwen/Qwen2.5-Coder-7B-Instruct"
    assert (args.ds.lora.rank, args.ds.lora.alpha) == (16, 32) and len(args.ds.lora.target_modules) == 7
    assert args.actor.adam.lr == 1e-5 and args.algo.kl.init_coef == 0  # lr: the YAML preset's
    assert args.algo.advantage.estimator == "reinforce"
    assert args.ckpt.output_dir == f"/ckpt/{preset}"
    expected_mode = "baseline" if preset == "baseline" else "population"
    assert args.populora.mode == expected_mode and args.populora.engine == "ray"
    upstream_validation_accepts(args, monkeypatch)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_gives_both_engines_one_algorithm(preset):
    """The launch script's command and the local engine read the same YAML: every algorithm knob (learning rate
    and schedule, clip, LoRA, sampling, seed, epochs) and every --populora.* value agree. (The launch presets used
    to say lr 1e-5 with a cosine schedule and 3% warm-up where the YAML said 1e-6, constant.)"""
    from openrlhf_populora.config import iter_fields, parse_config

    args = launch.parse_launch_args(plugin_argv(dry_run("ray_job_1node.sh", PRESET=preset)))
    local = parse_config(["--config", str(ROOT / "configs" / f"{preset}.yaml")])
    for leaf, dest in launch.ALGORITHM_LEAVES.items():
        if dest == "train.micro_batch_size":
            continue  # memory, not the algorithm: the cluster's common.args sets it (each adapter's loss is
            # normalised over its whole step whatever the micro-batch)
        expected = launch.upstream_value(leaf, launch._lookup(local, leaf))
        assert launch._lookup(args, dest) == expected, leaf
    for name, _field, _tp in iter_fields(type(local.populora), "populora."):
        if name != "populora.engine":
            assert launch._lookup(args, name) == launch._lookup(local, name), name
    if preset != "baseline":
        teachers = int(preset[0])
        assert args.populora.adapter_names == [f"t{i}" for i in range(teachers)] + [f"s{i}" for i in range(teachers)]
    assert args.actor.lr_scheduler == "constant_with_warmup" and args.actor.lr_warmup_ratio == 0.0


def test_extra_flags_and_environment_override_the_preset():
    tokens = dry_run("ray_job_1node.sh", ["--populora.total_steps", "3"], PRESET="1t1s", MODEL="/m/coder",
                     GPUS_PER_NODE="4", VLLM_TP="2")
    args = launch.parse_launch_args(plugin_argv(tokens))
    assert args.populora.total_steps == 3 and args.actor.model_name_or_path == "/m/coder"
    assert (args.actor.num_gpus_per_node, args.vllm.num_engines, args.vllm.tensor_parallel_size) == (4, 2, 2)


def test_an_unknown_preset_fails_clearly():
    out = subprocess.run(["bash", str(LAUNCH / "ray_job_1node.sh")], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "DRY_RUN": "1", "PRESET": "9t9s"}, timeout=30)
    assert out.returncode == 2 and "no such preset file" in out.stderr


def test_a_python_that_cannot_follow_the_job_is_refused_before_submitting(tmp_path):
    # lib.sh follows the job with ray_job_follow.py (Ray's job SDK). Catches: submitting first and failing to
    # follow after (a job running with nobody waiting for it; under sbatch, Ray stopped beneath it). The `ray`
    # here only records that it was called; the python3 is the system's, which has no Ray.
    if subprocess.run(["/usr/bin/python3", "-c", "import ray"], capture_output=True).returncode == 0:
        pytest.skip("the system python3 has Ray")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to("/usr/bin/python3")
    called = tmp_path / "ray-called"
    (bin_dir / "ray").write_text(f"#!/bin/sh\ntouch {called}\n")
    (bin_dir / "ray").chmod(0o755)
    out = subprocess.run(["bash", str(LAUNCH / "ray_job_1node.sh")], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PRESET": "1t1s"}, timeout=30)
    assert out.returncode == 2 and "cannot import ray.job_submission" in out.stderr, out.stderr
    assert not called.exists()


def test_every_preset_file_line_is_one_flag():
    for path in sorted((LAUNCH / "presets").glob("*.args")):
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            assert not line or (line.startswith("--") and line.count("--") == 1), f"{path.name}: {line!r}"


def stock_commands() -> list[list[str]]:
    """The ``openrlhf.cli.train_ppo_ray`` commands of launch/README.md, as argv lists after the module name."""
    text = (LAUNCH / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        if "openrlhf.cli.train_ppo_ray" in block:
            tokens = shlex.split(block.replace("\\\n", " "))
            commands.append(tokens[tokens.index("openrlhf.cli.train_ppo_ray") + 1:])
    return commands


def test_stock_openrlhf_commands_parse_with_upstream_alone(monkeypatch):
    commands = stock_commands()
    assert len(commands) == 2
    for argv in commands:
        assert not any(token.startswith("--populora") for token in argv)
        flat = launch.upstream_parser().parse_args(argv)  # SystemExit on any flag upstream does not know
        assert getattr(flat, "ds.lora.rank") == 0  # full fine-tune: stock LoRA cannot sync to vLLM
        assert getattr(flat, "algo.advantage.estimator") in ("reinforce", "reinforce_baseline")
        assert getattr(flat, "actor.num_gpus_per_node") == getattr(flat, "vllm.num_engines")
        upstream_validation_accepts(flat, monkeypatch)


def test_a_relative_run_dir_is_made_absolute_where_the_script_runs(tmp_path):
    """Ray's workers on each node run in their own directory: a relative RUN_DIR (the default) would put the
    run's files, each rank's checkpoint shards and the controller's run directory in different places."""
    tokens = dry_run("ray_job_multinode.sh", PRESET="4t4s", RUN_DIR="runs/x")
    args = launch.parse_launch_args(plugin_argv(tokens))
    assert args.ckpt.output_dir == str(ROOT / "runs" / "x")  # dry_run runs the script from the repository root
    assert args.ckpt.path == str(ROOT / "runs" / "x" / "checkpoints")
    assert args.logger.tensorboard_dir == str(ROOT / "runs" / "x" / "tensorboard")
    default = subprocess.run(["bash", str(LAUNCH / "ray_job_1node.sh")], cwd=tmp_path, capture_output=True,
                             text=True, env={**os.environ, "DRY_RUN": "1", "PRESET": "1t1s"}, timeout=30, check=True)
    assert f"{tmp_path}/runs/populora-1t1s" in default.stdout.splitlines()
    # and the launcher resolves whatever path it is given in the driver's directory
    direct = launch.parse_launch_args(["--actor.model_name_or_path", "/m", "--vllm.num_engines", "1",
                                       "--ds.lora.rank", "8", "--ckpt.output_dir", "rel/run"])
    assert direct.ckpt.output_dir == os.path.abspath("rel/run") and os.path.isabs(direct.ckpt.path)


@pytest.mark.parametrize(("flags", "says"), [
    (["--vllm.enable_sleep", "--train.colocate_all"], "--vllm.enable_sleep is not supported"),
    (["--ds.enable_sleep"], "--ds.enable_sleep is not supported"),
    (["--algo.advantage.is_correction_level", "token"], "--algo.advantage.is_correction_level is not supported"),
    (["--ds.tensor_parallel_size", "2"], "--ds.tensor_parallel_size > 1"),
    (["--ds.zero_stage", "3", "--ds.adam_offload"], "--ds.adam_offload is not supported with --ds.zero_stage 3"),
    (["--ckpt.save_hf"], "--ckpt.save_hf is not read"),
])
def test_flags_the_engine_cannot_run_are_refused_at_launch_saying_why(flags, says, capsys):
    """Each was accepted and then hung or crashed mid-run (sleep modes: engines never woken, fp32 fragments
    dropped; IS correction: no rollout log-probs; AutoTP: ranks taken for data-parallel ones; ZeRO-3 with Adam
    offload: refused only inside the first update) or did nothing (--ckpt.save_hf)."""
    base = ["--actor.model_name_or_path", "/m", "--vllm.num_engines", "1", "--ds.lora.rank", "8"]
    with pytest.raises(SystemExit) as exit_:
        launch.parse_launch_args(base + flags)
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    launch.parse_launch_args(base + ["--ds.zero_stage", "2", "--ds.adam_offload"])  # ZeRO-2 offload is fine


def test_the_launchers_ray_init_merges_with_the_jobs_runtime_env():
    """Inside ``ray job submit`` Ray merges the job's runtime env with the driver's ``ray.init`` one and refuses a
    key set on both sides (the first real launch failed so: upstream's train() asks for TOKENIZERS_PARALLELISM,
    which lib.sh's default RUNTIME_ENV sets). The launcher leaves the job's keys out of its own."""
    import json

    from ray.runtime_env.runtime_env import _merge_runtime_env

    from openrlhf_populora.engines.ray import cluster

    tokens = dry_run("ray_job_1node.sh", PRESET="1t1s")
    job = json.loads(next(t for t in tokens if t.startswith("--runtime-env-json=")).split("=", 1)[1])
    assert "TOKENIZERS_PARALLELISM" in job["env_vars"]  # the default a user gets
    upstream = {"env_vars": dict(cluster.UPSTREAM_ENV_DEFAULTS)}
    assert _merge_runtime_env(job, upstream) is None  # what upstream's own ray.init would hit
    for env_vars, extra in [(cluster.UPSTREAM_ENV_DEFAULTS, None),
                            ({**cluster.UPSTREAM_ENV_DEFAULTS, **cluster.CPU_WORKER_ENV},
                             {"worker_process_setup_hook": cluster.WORKER_SETUP_HOOK})]:
        ours = cluster.driver_runtime_env(dict(env_vars), extra, job=job)
        merged = _merge_runtime_env(job, ours)
        assert merged is not None
        assert merged["env_vars"]["TOKENIZERS_PARALLELISM"] == job["env_vars"]["TOKENIZERS_PARALLELISM"]
    hooked = {"worker_process_setup_hook": "user.hook", "env_vars": {}}
    assert _merge_runtime_env(hooked, cluster.driver_runtime_env({}, {"worker_process_setup_hook": "x"},
                                                                 job=hooked)) is not None


@pytest.mark.parametrize(("script", "nodes"), [("ray_job_multinode.sh", "NNODES"),
                                               ("slurm_populora.sbatch", "SLURM_JOB_NUM_NODES")])
def test_tensor_parallelism_that_would_span_nodes_is_refused_at_once(script, nodes):
    """Each tensor-parallel worker of a vLLM engine reads the adapter files itself, from its own node's disk, so
    an engine split across nodes fails its first adapter upload (vLLM's LoRAAdapterNotFoundError). 2 nodes x 8
    GPUs with VLLM_TP=16 divides the 16 GPUs but not a node's 8. Catches: lib.sh checking all GPUs % VLLM_TP."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_ADDRESS"))}
    environment.update(DRY_RUN="1", PRESET="4t4s", VLLM_TP="16", **{nodes: "2"})
    out = subprocess.run(["bash", str(LAUNCH / script)], cwd=ROOT, env=environment, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "VLLM_TP=16 does not divide GPUS_PER_NODE=8" in out.stderr and out.stdout == ""
    # a tensor-parallel size that divides a node's GPUs is fine, on any number of nodes
    assert "--vllm.tensor_parallel_size" in dry_run(script, PRESET="4t4s", VLLM_TP="4", **{nodes: "2"})


def test_the_launcher_refuses_an_engine_split_across_nodes(capsys):
    """The same rule in the Python launch, for commands not built by lib.sh. Catches: no check there (the run
    starts and fails at the first adapter upload)."""
    topology = ["--actor.model_name_or_path", "/m", "--ds.lora.rank", "8", "--train.colocate_all",
                "--actor.num_nodes", "2", "--actor.num_gpus_per_node", "8"]
    with pytest.raises(SystemExit) as exit_:
        launch.parse_launch_args([*topology, "--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "16"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert "--vllm.tensor_parallel_size 16 does not divide --actor.num_gpus_per_node 8" in err, err
    args = launch.parse_launch_args([*topology, "--vllm.num_engines", "4", "--vllm.tensor_parallel_size", "4"])
    assert args.vllm.tensor_parallel_size == 4


def test_cpu_workers_get_sdpa_where_the_cluster_flags_name_flash_attention():
    """common.args names flash_attention_2 (right on GPUs); on CPU workers transformers refuses it at the first
    model load ("FlashAttention2 has been toggled on, but it cannot be used"), as a `ray job submit` of the shipped
    ray_job_1node.sh to a CPU Ray head did. Catches: the CPU decision not reaching the attention implementation."""
    argv = plugin_argv(dry_run("ray_job_1node.sh", PRESET="1t1s"))
    assert argv[argv.index("--ds.attn_implementation") + 1] == "flash_attention_2"
    assert launch.parse_launch_args(argv, cpu=True).ds.attn_implementation == "sdpa"
    assert launch.parse_launch_args(argv, cpu=False).ds.attn_implementation == "flash_attention_2"
    # an implementation that runs on CPU is kept
    eager = launch.parse_launch_args([*argv, "--ds.attn_implementation", "eager"], cpu=True)
    assert eager.ds.attn_implementation == "eager"


# stand-ins for Slurm, Ray and the network tools: each records its command line in $STUB_LOG
SLURM_STUBS = {
    # runs the step's command after its options, as Slurm would on the node named by -w
    "srun": 'echo "srun $*" >>"$STUB_LOG"\nwhile [[ $# -gt 0 && $1 == -* ]]; do\n'
            '  case $1 in -w|-n|-N|-c) shift 2 ;; *) shift ;; esac\ndone\nexec "$@"\n',
    "scontrol": 'echo "scontrol $*" >>"$STUB_LOG"\nprintf "gpu-a\\ngpu-b\\n"\n',
    "ray": 'echo "ray $*" >>"$STUB_LOG"\n',
    # the script's count of Ray nodes up (a heredoc on stdin: the `ray start`s so far), the job SDK check, the
    # job follower
    "python3": 'echo "python3 $*" >>"$STUB_LOG"\nif [[ $1 == - ]]; then grep -c "^ray start" "$STUB_LOG" || true; '
               'elif [[ $1 == *ray_job_follow.py ]]; then echo "launch: job $3 SUCCEEDED"; fi\n',
    # a Debian /etc/hosts maps the hostname to 127.0.1.1; docker0 comes first in `hostname -I`
    "hostname": 'echo "hostname $*" >>"$STUB_LOG"\ncase $1 in --ip-address) echo 127.0.1.1 ;; '
                '-I) echo "172.17.0.1 10.0.0.11 " ;; *) echo gpu-a ;; esac\n',
    "getent": 'echo "getent $*" >>"$STUB_LOG"\n[[ $2 == gpu-b ]] && echo "10.0.0.12       STREAM gpu-b"\n',
    # the route from the head to the other node goes out of ib0, whose address is 10.0.0.11
    "ip": 'echo "ip $*" >>"$STUB_LOG"\n[[ $* == *"route get 10.0.0.12"* ]] && '
          'echo "10.0.0.12 dev ib0 src 10.0.0.11 uid 0"\n',
}


def run_sbatch_with_stubs(tmp_path: Path, replace: dict[str, str] | None = None, **env: str
                          ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """slurm_populora.sbatch run as Slurm runs it on the first node of a 2-node allocation (the SLURM_* variables
    set), with the stand-ins (``replace``: other bodies for some) first on PATH. Returns the run and the recorded
    command lines."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in {**SLURM_STUBS, **(replace or {})}.items():
        (stubs / name).write_text("#!/usr/bin/env bash\n" + body)
        (stubs / name).chmod(0o755)
    log = tmp_path / "calls.log"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "HEAD_IP"))}
    environment.update(PATH=f"{stubs}:/usr/bin:/bin", STUB_LOG=str(log), PRESET="4t4s", RUN_DIR="/shared/run",
                       SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_JOB_NUM_NODES="2",
                       SLURM_CPUS_PER_TASK="64", SLURM_GPUS_PER_NODE="8", **env)
    out = subprocess.run(["bash", str(LAUNCH / "slurm_populora.sbatch")], cwd=tmp_path, env=environment,
                         capture_output=True, text=True, timeout=60)
    return out, log.read_text().splitlines() if log.exists() else []


def test_slurm_ray_steps_get_the_allocations_cpus_and_gpus_and_the_routed_head_address(tmp_path):
    """Since Slurm 22.05 srun does not inherit --cpus-per-task: a Ray step given none gets one CPU (the raylet, 8
    DeepSpeed ranks and 8 vLLM engines on it). And `hostname -I`'s first address can be docker0's. Catches: srun
    steps without --cpus-per-task/--gpus-per-node/--cpu-bind=none, `ray start` without --num-cpus/--num-gpus, and
    a head address that is not the one routing to the other node."""
    out, calls = run_sbatch_with_stubs(tmp_path)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    starts = [line for line in calls if line.startswith("srun ") and " ray start " in line]
    assert len(starts) == 2, calls  # the head and the second node
    for step in starts:
        for flag in ("--cpus-per-task=64", "--gpus-per-node=8", "--cpu-bind=none", "--num-cpus=64", "--num-gpus=8"):
            assert f" {flag} " in f"{step} ", (flag, step)
    head = next(line for line in calls if line.startswith("ray start --head"))
    assert "--node-ip-address=10.0.0.11" in head.split(), head
    worker = next(line for line in calls if line.startswith("ray start --address"))
    assert "--address=10.0.0.11:6379" in worker.split(), worker
    submits = [line for line in calls if line.startswith("ray job submit")]
    assert all("--address=http://10.0.0.11:8265" in submit.split() for submit in submits), submits
    # the preflight first, once the Ray nodes are up, then the run (test_the_preflight_runs_first_...)
    assert [submit.split(" -- ")[1].split()[2] for submit in submits] == [
        "openrlhf_populora.cli.preflight", "openrlhf_populora.cli.train"], submits
    assert calls.index(submits[0]) > max(calls.index(line) for line in starts)


def test_slurm_head_address_can_be_set_and_ray_start_args_come_last(tmp_path):
    """HEAD_IP wins over the lookup (for networks it cannot see), and RAY_START_ARGS come after the script's own
    flags, so a user's --num-cpus wins (Ray's CLI keeps an option's last value)."""
    out, calls = run_sbatch_with_stubs(tmp_path, HEAD_IP="192.168.5.5", RAY_START_ARGS="--num-cpus 48")
    assert out.returncode == 0, out.stderr[-3000:]
    head = next(line for line in calls if line.startswith("ray start --head"))
    assert "--node-ip-address=192.168.5.5" in head.split() and head.endswith("--num-cpus 48 --block"), head
    assert not any(line.startswith(("ip ", "getent ")) for line in calls)


def test_slurm_without_a_route_or_a_resolvable_head_address_asks_for_head_ip(tmp_path):
    """No route to the other node and a hostname that resolves to loopback: refused before Ray starts, naming
    HEAD_IP (not `hostname -I`'s first address, which may be docker0's)."""
    unreachable = 'echo "RTNETLINK answers: Network is unreachable" >&2\nexit 2\n'
    out, calls = run_sbatch_with_stubs(tmp_path, replace={"ip": unreachable})
    assert out.returncode == 2 and "set HEAD_IP" in out.stderr, (out.stdout, out.stderr)
    assert not any(line.startswith("ray ") for line in calls)


# `ray` and the job follower, recorded in $STUB_LOG; the follower fails the jobs named in $FAIL_JOBS
SUBMIT_STUBS = {
    "ray": 'echo "ray $*" >>"$STUB_LOG"\n',
    "python3": 'echo "python3 $*" >>"$STUB_LOG"\nif [[ $1 == *ray_job_follow.py ]]; then\n'
               '  if [[ " ${FAIL_JOBS:-} " == *" $3 "* ]]; then echo "launch: job $3 FAILED" >&2; exit 1; fi\n'
               '  echo "launch: job $3 SUCCEEDED" >&2\nfi\n',
}


def run_with_submit_stubs(tmp_path: Path, script: str, extra: list[str] = (), **env: str
                          ) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``script`` run for real (not DRY_RUN) with :data:`SUBMIT_STUBS` first on PATH: what it submits and follows."""
    stubs = tmp_path / "bin"
    stubs.mkdir(parents=True)
    for name, body in SUBMIT_STUBS.items():
        (stubs / name).write_text("#!/usr/bin/env bash\n" + body)
        (stubs / name).chmod(0o755)
    log = tmp_path / "calls.log"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "PREFLIGHT"))}
    environment.update(PATH=f"{stubs}:/usr/bin:/bin", STUB_LOG=str(log), PRESET="1t1s", RUN_DIR="/ckpt/run",
                       SUBMISSION_ID="job1", **env)
    out = subprocess.run(["bash", str(LAUNCH / script), *extra], cwd=tmp_path, env=environment, capture_output=True,
                         text=True, timeout=60)
    return out, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("script", ["ray_job_1node.sh", "ray_job_multinode.sh"])
def test_the_preflight_runs_first_with_the_runs_own_flags(tmp_path, script):
    """Before the run, its preflight (``cli.preflight``) is submitted as a job of its own with exactly the run's
    flags (the extra ones included) and the same runtime env, and followed to its end; only then is the run
    submitted. Catches: a preflight checking other flags than the run's, or the run submitted before (or without)
    its preflight's verdict."""
    out, calls = run_with_submit_stubs(tmp_path, script, ["--populora.total_steps", "3"])
    assert out.returncode == 0, (out.stdout, out.stderr)
    submits = [line for line in calls if line.startswith("ray job submit")]
    follows = [line for line in calls if "ray_job_follow.py" in line]
    assert len(submits) == 2 and len(follows) == 2, calls
    assert "--submission-id=job1-preflight" in submits[0].split() and "--submission-id=job1" in submits[1].split()
    assert follows[0].endswith(" job1-preflight") and follows[1].endswith(" job1")
    assert [calls.index(line) for line in (submits[0], follows[0], submits[1], follows[1])] == sorted(
        calls.index(line) for line in (submits[0], follows[0], submits[1], follows[1]))
    head_pre, preflight = submits[0].split(" -- python3 -m openrlhf_populora.cli.preflight ")
    head_run, run = submits[1].split(" -- python3 -m openrlhf_populora.cli.train ")
    assert preflight == run and run.startswith("--populora.engine ray ") and run.endswith("--populora.total_steps 3")
    assert head_pre.replace("job1-preflight", "job1") == head_run  # the same address and runtime env


def test_a_refusing_preflight_stops_the_launch_and_preflight_0_skips_it(tmp_path):
    """The preflight's job failing (it exits 2 on a refusal): the script stops with status 2, saying so, and
    submits nothing more. ``PREFLIGHT=0``: the run alone. Catches: the run submitted whatever the preflight said."""
    out, calls = run_with_submit_stubs(tmp_path / "refused", "ray_job_1node.sh", FAIL_JOBS="job1-preflight")
    assert out.returncode == 2 and "the preflight (job1-preflight) refused this launch" in out.stderr, out.stderr
    assert [line for line in calls if line.startswith("ray job submit")] == [calls[1]], calls  # only the preflight
    out, calls = run_with_submit_stubs(tmp_path / "skipped", "ray_job_1node.sh", PREFLIGHT="0")
    assert out.returncode == 0, out.stderr
    submits = [line for line in calls if line.startswith("ray job submit")]
    assert len(submits) == 1 and "openrlhf_populora.cli.train" in submits[0]


def run_stock_train_step(tmp_path: Path, before: str = "", after: str = "") -> tuple[subprocess.CompletedProcess, Path]:
    """``launch/stock_b2_cpu.sh`` with ``STEPS=train`` on a stand-in model directory, and a ``PY`` whose model
    resolution (the ``-c`` call) prints ``before``, runs the real resolution, then prints ``after``, and which
    records the trainer's argv (``cli.stock_ppo``) instead of training; other calls go to the real python.
    Returns the script's result and the file holding the recorded argv (absent if the trainer was not called)."""
    record = tmp_path / "stock_ppo.argv"
    py = tmp_path / "py"
    py.write_text(f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "openrlhf_populora.cli.stock_ppo" ]; then printf '%s\\n' "$@" > {record}; exit 0; fi
[ "$1" = "-c" ] || exec {sys.executable} "$@"
printf '%s' {shlex.quote(before)}
{sys.executable} "$@" || exit $?
printf '%s' {shlex.quote(after)}
""")
    py.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = subprocess.run(["bash", str(LAUNCH / "stock_b2_cpu.sh")], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PY": str(py), "OUT": str(tmp_path / "out"), "STEPS": "train",
                              "MODEL": str(model)}, timeout=120)
    return out, record


def test_the_stock_recipe_hands_the_trainer_the_model_directory_after_a_notice_on_stdout(tmp_path):
    """A model's first use converts it, and DeepSpeed's accelerator notice then lands on stdout before the
    resolved path (seen 2026-12-07: upstream was handed '[WARNING] ...\\n/root/.cache/...' as the model and
    refused it as a hub repo id). Catches: the recipe taking the resolver's whole stdout as the path."""
    out, record = run_stock_train_step(
        tmp_path, before="[WARNING] [real_accelerator.py:199:get_accelerator] Setting accelerator to CPU.\n")
    assert out.returncode == 0, out.stderr
    argv = record.read_text().splitlines()
    assert argv[argv.index("--actor.model_name_or_path") + 1] == str(tmp_path / "model")


def test_the_stock_recipe_refuses_a_model_that_resolves_to_no_model_directory(tmp_path):
    """The resolver's last line is not a model directory (here a notice printed after the path): the recipe stops
    with status 2, saying what it got, before the trainer starts. Catches: the trainer started on whatever the
    last line was (failing minutes later, inside Ray, on a hub id it cannot download)."""
    out, record = run_stock_train_step(tmp_path, after="a late notice\n")
    assert out.returncode == 2 and "resolved to 'a late notice', which is not a model directory" in out.stderr, \
        out.stderr
    assert not record.exists()
