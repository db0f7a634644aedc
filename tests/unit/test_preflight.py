"""The preflight (``openrlhf_populora/preflight.py``, ``cli/preflight.py``): each check on fake GPUs, filesystems,
clusters and locks, against numbers computed by hand (the shapes of the GPU review: Qwen2.5-Coder-7B, LoRA rank 16
on the seven projections, bf16, 8 engines a node), and each refusal naming the flag that fixes it.

Every test says in a comment how the check was broken to see it fail (``Broken:``); each such break was applied to
the module and the test seen failing, then reverted."""

from __future__ import annotations

import errno
import fcntl
import os
from types import SimpleNamespace

import pytest
from paths import ROOT

from openrlhf_populora import preflight as pf
from openrlhf_populora.dirlock import OWNER_FILE, lock_directory
from openrlhf_populora.launch_checks import SHM_RESERVE, DirRoom

# Qwen2.5-Coder-7B-Instruct's config.json (the keys the checks read)
QWEN_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
           "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064, "tie_word_embeddings": False}
SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# embeddings and head 2 x 152064 x 3584 = 1,089,994,752; a layer: q 3584 x 3584 + k, v 2 x 3584 x 512 + o 3584 x 3584
# + q/k/v biases 3584 + 2 x 512 + MLP 3 x 3584 x 18944 + 2 norms x 3584 = 233,057,792, x 28 = 6,525,618,176; final
# norm 3584 (Qwen2.5-7B's published count: 7.61B)
QWEN_7B_PARAMS = 7_615_616_512
ADAPTER_7B = 80_740_352  # bf16 bytes: 28 layers x 16 x (7168 + 4096 + 4096 + 7168 + 22528 + 22528 + 22528) x 2
GPU_80 = 80_000_000_000


def plan(**changes) -> pf.Plan:
    """4t4s on one node of 8 GPUs, as lib.sh and common.args launch it."""
    base = dict(model="Qwen/Qwen2.5-Coder-7B-Instruct", nodes=1, gpus_per_node=8, engines=8, tensor_parallel=1,
                colocate_all=True, bundles=8, adapters=8, lora_rank=16, lora_targets=SEVEN, param_bytes=2,
                zero_stage=2, adam_offload=False, vllm_memory_utilization=0.5, scoring_budget=8e9,
                micro_batch_size=8, max_len=4096, attn_implementation="flash_attention_2", run_dir="/ckpt/4t4s")
    return pf.Plan(**{**base, **changes})


def node(name: str = "gpu-a", **changes) -> pf.NodeReport:
    """A GPU node as the probe reports it: 8 H100s of 80 GB, CUDA torch, flash-attn, /dev/shm of 64 GB."""
    base = dict(node=name, gpus=8, cpus=64, model_path="/hf/snapshots/abc", model_config=QWEN_7B,
                torch="2.13.0", torch_cuda="13.0", nvidia_devices=8, cuda_devices=8, gpu_memory=GPU_80,
                gpu_name="NVIDIA H100", flash_attn={"flash_attn": "2.8.3"},
                adapter_rooms=(DirRoom("/dev/shm", 64_000_000_000, SHM_RESERVE), DirRoom("/tmp", 500_000_000_000)))
    return pf.NodeReport(**{**base, **changes})


# ------------------------------------------------------------------------------------------------ memory


def test_parameter_counts_by_hand_and_from_the_weight_headers(tmp_path):
    """Broken: the q/k/v biases left out of decoder_parameter_count (7,615,487,488: 28 x 4,608 short); a tied head
    counted twice; the header count adding a tensor's dimensions instead of multiplying them."""
    assert pf.decoder_parameter_count(QWEN_7B) == QWEN_7B_PARAMS
    from openrlhf_populora.models.tiny import build_tiny_model, save_tiny_model

    model, _ = build_tiny_model(seed=0)
    real = sum(p.numel() for p in model.parameters())  # a tied head counted once, as in the file
    save_tiny_model(tmp_path / "tiny")
    assert pf.safetensors_parameter_count(tmp_path / "tiny") == real
    config = model.config.to_dict()
    assert pf.decoder_parameter_count(config) == real
    assert pf.safetensors_parameter_count(tmp_path) is None  # no weight files there


def test_memory_per_gpu_adds_up_by_hand_and_fits_80_gb():
    """4t4s on 80 GB: base 7,615,616,512 x 2 = 15,231,233,024; 8 adapters x 40,370,176 = 322,961,408 trainable:
    bf16 weights 645,922,816 (replicated under ZeRO-2), gradients / 8 = 80,740,352, fp32 master + Adam 12 x / 8
    = 484,442,112; overhead 1.5e9; scoring: floor(8e9 / (152,064 x 6)) = 8,768 tokens, 2 rows of 4,096: 2 x 4,096
    x 152,064 x 6 = 7,474,249,728; vLLM 0.5 x 80e9 = 40e9; total 65,416,588,032. vLLM's share holds the bf16
    weights 15,231,233,024 + 8 LoRA slots x 80,740,352 = 645,922,816 + the KV of 4,096 tokens x (2 x 28 layers x 4
    heads x 128 x 2 bytes = 57,344) = 234,881,024. Broken: vLLM's share left out of the total (the check passes a
    40 GB card), or the adapters counted once instead of N times."""
    row = pf.check_memory(plan(), cpu=False, reports=[node()])
    assert row.status == pf.OK, row
    assert row.detail.startswith(
        "frozen base 15.23 GB + adapter weights 0.65 GB + adapter gradients 0.08 GB + fp32 master + Adam 0.48 GB + "
        "CUDA context, NCCL, reduce bucket 1.50 GB + scoring logits (peak) 7.47 GB + vLLM share 40.00 GB = "
        "65.42 GB of 80.00 GB (14.58 GB left; activations not counted)"), row.detail
    assert ("vLLM's share 40.00 GB (0.5 of the GPU) holds weights 15.23 GB + LoRA slots 0.65 GB + KV of one "
            "4096-token sequence 0.23 GB = 16.11 GB") in row.detail


def test_memory_refused_on_47_gb_naming_the_vllm_share_that_would_fit():
    """47 GB: 25,416,588,032 + 23.5e9 = 48.92 GB > 47 GB. The largest share the training side leaves:
    (47e9 - 25,416,588,032) / 47e9 = 0.4592 -> at most 0.45 (rounded down: 0.46 x 47e9 + 25,416,588,032 =
    47.04e9 would not fit). Broken: the share rounded to nearest (0.46); the smallest GPU not taken (the node of
    80 GB beside it hides it)."""
    row = pf.check_memory(plan(), cpu=False, reports=[node(gpu_memory=47_000_000_000), node("gpu-b")])
    assert row.status == pf.REFUSED and "48.92 GB of 47.00 GB (1.92 GB over" in row.detail, row
    assert "--vllm.gpu_memory_utilization at most 0.45," in row.fix and "--ds.zero_stage 3" in row.fix
    assert "--populora.scoring_memory_gb" in row.fix


def test_memory_boundary_is_inclusive():
    """Without a vLLM share (vLLM on GPUs of its own) the training side is 25,416,588,032 bytes: a GPU of exactly
    that fits, one byte less does not. Broken: ``memory.free > 0`` instead of ``memory.fits`` (total <= GPU)."""
    separate = plan(colocate_all=False, vllm_memory_utilization=0.9)
    assert pf.check_memory(separate, False, [node(gpu_memory=25_416_588_032)]).status == pf.OK
    short = pf.check_memory(separate, False, [node(gpu_memory=25_416_588_031)])
    assert short.status == pf.REFUSED and "--ds.zero_stage 3" in short.fix
    assert "--vllm.gpu_memory_utilization at most" not in short.fix  # vLLM does not share these GPUs


def test_memory_refused_when_vllm_share_cannot_hold_the_weights():
    """vLLM at 0.15 of 80 GB = 12 GB cannot hold 16,112,036,864 bytes (weights, slots, one sequence's KV): vLLM
    would stop at start ("no available memory for the cache blocks"). 16,112,036,864 / 80e9 = 0.2014 -> at least
    0.21 (rounded up). With tensor parallelism 2 the weights halve: 7,615,616,512 + 645,922,816 + 234,881,024 =
    8.50 GB fits 12 GB. Broken: the weights not divided by the tensor-parallel size; the minimum rounded down."""
    row = pf.check_memory(plan(vllm_memory_utilization=0.15), False, [node()])
    assert row.status == pf.REFUSED and "= 16.11 GB" in row.detail
    assert "vLLM: --vllm.gpu_memory_utilization at least 0.21" in row.fix, row.fix
    assert "--vllm.tensor_parallel_size" in row.fix and "--data.max_len" in row.fix
    split = pf.check_memory(plan(vllm_memory_utilization=0.15, tensor_parallel=2, engines=4), False, [node()])
    assert split.status == pf.OK and "weights 7.62 GB" in split.detail and "= 8.50 GB" in split.detail, split


def test_memory_skipped_with_the_reason():
    """Broken: the CPU workers' skip removed (the row then blames torch.cuda, not the CPU workers)."""
    cpu = pf.check_memory(plan(), cpu=True, reports=[node(cuda_devices=0, gpu_memory=None)])
    assert cpu.status == pf.SKIPPED and "CPUs" in cpu.detail
    unknown = pf.check_memory(plan(), cpu=False, reports=[node(gpu_memory=None)])
    assert unknown.status == pf.SKIPPED and "torch.cuda" in unknown.detail
    no_model = pf.check_memory(plan(), cpu=False, reports=[node(model_config=None, model_error="x")])
    assert no_model.status == pf.SKIPPED and "config.json" in no_model.detail


# ----------------------------------------------------------------------------------------- adapter files


def test_adapter_rooms_measure_where_the_engines_write():
    """The rollout actors' order: POPULORA_ADAPTER_DIR alone when set (measured on its nearest existing parent when
    the engine will create it), else /dev/shm keeping 1 GiB, then the temp dir. Broken: /dev/shm's reserve
    dropped; the explicit directory measured as missing (free None) instead of on its parent."""
    asked = []

    def usage(path):
        asked.append(path)
        return SimpleNamespace(free={"/dev/shm": 12_000_000_000, "/scratch": 900_000_000_000}.get(path, 7))

    rooms, explicit = pf.adapter_rooms({}, usage, writable=lambda p: True, tempdir="/scratch")
    assert not explicit and rooms == (DirRoom("/dev/shm", 12_000_000_000, SHM_RESERVE),
                                      DirRoom("/scratch", 900_000_000_000))
    missing = "/work/wt39p-never/adapters"
    rooms, explicit = pf.adapter_rooms({"POPULORA_ADAPTER_DIR": missing}, usage,
                                       writable=lambda p: os.path.exists(p), tempdir="/scratch")
    assert explicit and rooms == (DirRoom(missing, 7),) and asked[-1] == "/work"
    rooms, _ = pf.adapter_rooms({}, usage, writable=lambda p: p != "/dev/shm", tempdir="/scratch")
    assert rooms[0] == DirRoom("/dev/shm", None, SHM_RESERVE)  # missing or read-only: no room


def test_adapter_directory_room_for_8t8s_by_hand():
    """8t8s (N = 16) on 8 GPUs: 8 engines x 17 x 80,740,352 = 10,980,687,872 bytes a node. /dev/shm must hold that
    plus 1 GiB: 12,054,429,696 bytes free is enough, one byte less falls to the temp dir, and with a small temp dir
    it is refused naming POPULORA_ADAPTER_DIR. Broken: engines counted per cluster (16 on 2 nodes) instead of per
    node; /dev/shm's reserve ignored (12,054,429,695 would pass)."""
    eight = plan(adapters=16, nodes=2, engines=16, bundles=16)
    fits = [DirRoom("/dev/shm", 12_054_429_696, SHM_RESERVE), DirRoom("/tmp", 1_000_000_000)]
    row = pf.check_adapter_dir(eight, False, [node(adapter_rooms=tuple(fits)), node("gpu-b")])
    assert row.status == pf.OK and row.detail.startswith(
        "10.98 GB (8 engine(s) on this node x (16 adapters + 1 being replaced) x 80.74 MB) a node; gpu-a: /dev/shm"), row
    short = (DirRoom("/dev/shm", 12_054_429_695, SHM_RESERVE), DirRoom("/tmp", 1_000_000_000))
    row = pf.check_adapter_dir(eight, False, [node("gpu-a"), node("gpu-b", adapter_rooms=short)])
    assert row.status == pf.REFUSED and row.detail.startswith("gpu-b: no directory has room"), row
    assert "POPULORA_ADAPTER_DIR" in row.fix and "--shm-size" in row.fix
    to_disk = (DirRoom("/dev/shm", 12_054_429_695, SHM_RESERVE), DirRoom("/tmp", 11_000_000_000))
    row = pf.check_adapter_dir(eight, False, [node(adapter_rooms=to_disk)])
    assert row.status == pf.OK and "/tmp: 11.00 GB free" in row.detail


def test_adapter_directory_checks_every_node_in_the_engines_dtype():
    """The first node has room, the second not: refused naming the second. On CPU workers the engines write fp32,
    twice the bytes. Broken: only the first node checked; bf16 sizes on CPU."""
    explicit = (DirRoom("/local/adapters", 5_000_000_000),)
    row = pf.check_adapter_dir(plan(), False, [node(), node("gpu-b", adapter_rooms=explicit, adapter_dir_explicit=True)])
    # 4t4s: 8 engines x 9 x 80,740,352 = 5,813,305,344 bytes > 5 GB
    assert row.status == pf.REFUSED and "gpu-b: no directory has room" in row.detail and "5.81 GB" in row.detail
    assert row.fix.startswith("point POPULORA_ADAPTER_DIR")
    cpu = pf.check_adapter_dir(plan(), True, [node(adapter_rooms=(DirRoom("/dev/shm", 1 << 40, SHM_RESERVE),))])
    assert "11.63 GB (8 engine(s)" in cpu.detail and "x 0.16 GB)" in cpu.detail, cpu  # 161,480,704: 4 bytes a value


# -------------------------------------------------------------------------------------- tensor parallelism


def test_tensor_parallelism_must_fit_a_node():
    """NNODES=2 VLLM_TP=16 on nodes of 8: refused naming --vllm.tensor_parallel_size and VLLM_TP. On a known
    cluster whose nodes hold 2 GPUs each, a size of 4 (which divides the planned 8 a node) cannot sit on one node.
    Broken: the rule checked against all GPUs (16 % 16 == 0); the cluster's per-node GPUs not looked at."""
    row = pf.check_tensor_parallel(plan(nodes=2, tensor_parallel=16, engines=1, bundles=16))
    assert row.status == pf.REFUSED and "--vllm.tensor_parallel_size (VLLM_TP)" in row.fix and "1, 2, 4, 8" in row.fix
    assert pf.check_tensor_parallel(plan(tensor_parallel=4, engines=2)).status == pf.OK
    small = [node("a", gpus=2, cpus=8), node("b", gpus=2, cpus=8), node("c", gpus=2, cpus=8), node("d", gpus=2, cpus=8)]
    row = pf.check_tensor_parallel(plan(tensor_parallel=4, engines=2), small)
    assert row.status == pf.REFUSED and "no Ray node holds 4 GPUs" in row.detail and "(the largest: 2)" in row.detail
    assert pf.check_tensor_parallel(plan(tensor_parallel=2, engines=4), small).status == pf.OK


# ---------------------------------------------------------------------------------------- the run directory


def test_run_directory_lock_is_taken_and_released_and_a_made_directory_removed(tmp_path):
    """Broken: the directory made for the check (and its .lock) left behind: the next check, and the run, find a
    directory they did not make."""
    run = tmp_path / "runs" / "x"
    for _ in range(2):
        row = pf.check_run_dir(str(run))
        assert row.status == pf.OK and "with flock" in row.detail and "removed again" in row.detail, row
    assert not (tmp_path / "runs").exists()
    run.mkdir(parents=True)
    row = pf.check_run_dir(str(run))
    assert row.status == pf.OK and "removed" not in row.detail and list(run.iterdir()) == []


def test_run_directory_without_flock_uses_the_owner_file_and_removes_it(tmp_path, monkeypatch):
    """flock raising ENOSYS (Lustre without -o flock): the check passes through the owner-file lock, says so, and
    leaves no .lock.owner behind (a left one would refuse the run itself). Broken: the row saying flock whatever
    lock was taken."""
    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    run = tmp_path / "run"
    run.mkdir()
    row = pf.check_run_dir(str(run))
    assert row.status == pf.OK and "owner file" in row.detail and "no flock" in row.detail, row
    assert not (run / OWNER_FILE).exists()


def test_run_directory_held_or_holding_a_run_is_refused_naming_the_flag(tmp_path):
    """Another process's lock: refused naming --ckpt.output_dir. A run the flags would overwrite (the runner's
    check_run_dir raising): refused with its message and the flags. Broken: DirectoryBusy reported as ok; the
    existing-run check not called."""
    run = tmp_path / "run"
    run.mkdir()
    held = lock_directory(run)
    try:
        # flock is per open file: a second open of .lock in this process is refused as another process would be
        row = pf.check_run_dir(str(run))
    finally:
        held.close()
    assert row.status == pf.REFUSED and "locked by another process" in row.detail
    assert "--ckpt.output_dir (RUN_DIR)" in row.fix
    from openrlhf_populora.config import parse_config
    from openrlhf_populora.selfplay.runner import check_run_dir

    (run / "metrics.jsonl").write_text("{}\n")
    config = parse_config(["--actor.model_name_or_path", "tiny", "--ckpt.output_dir", str(run)])
    row = pf.check_run_dir(str(run), existing=lambda: check_run_dir(config))
    assert row.status == pf.REFUSED and "already holds a run" in row.detail and "--ckpt.load_enable" in row.fix


# -------------------------------------------------------------------------------------------- Ray resources


def test_ray_resources_hold_the_plans_bundles():
    """2 nodes x 8 GPUs, 64 CPUs: 16 bundles + the controller's CPU. Broken: ``held <= bundles`` (refuses an exact
    fit), the controller's CPU not counted."""
    two = plan(nodes=2, engines=16, bundles=16)
    row = pf.check_ray_resources(two, [node("a"), node("b")])
    assert row.status == pf.OK and "2 node(s) hold 16 bundle(s), 128 CPU(s)" in row.detail, row
    # one node of 8 GPUs and 8 CPUs: the 8 bundles take every CPU, the controller actor finds none
    row = pf.check_ray_resources(plan(), [node(cpus=8)])
    assert row.status == pf.REFUSED and "8 CPU(s) in all, 9 needed" in row.detail
    assert pf.check_ray_resources(plan(), [node(cpus=9)]).status == pf.OK


def test_ray_resources_refuse_slurm_nodes_with_one_cpu():
    """Slurm steps without --cpus-per-task: each Ray node has 8 GPUs and 1 CPU, so 2 bundles fit where 16 must.
    Broken: GPUs counted without the CPU each bundle takes."""
    row = pf.check_ray_resources(plan(nodes=2, engines=16, bundles=16), [node("a", cpus=1), node("b", cpus=1)])
    assert row.status == pf.REFUSED and "the nodes hold 2 bundle(s)" in row.detail
    assert "a has 8 GPUs but 1 CPU(s)" in row.detail and "wait forever" in row.detail
    assert "--cpus-per-task" in row.fix and "--actor.num_nodes" in row.fix and "GPUS_PER_NODE" in row.fix


def test_ray_resources_spread_over_smaller_nodes_and_skip_without_a_cluster():
    """The rehearsal's shape: the 1-node plan of 2 GPUs on two raylets of 1 GPU and 4 CPUs (upstream's PACK
    placement spreads the bundles). Broken: requiring a node of --actor.num_gpus_per_node GPUs."""
    rehearsal = plan(gpus_per_node=2, engines=2, bundles=2, adapters=2)
    assert pf.check_ray_resources(rehearsal, [node("a", gpus=1, cpus=4), node("b", gpus=1, cpus=4)]).status == pf.OK
    skipped = pf.check_ray_resources(rehearsal, None, "no Ray cluster running")
    assert skipped.status == pf.SKIPPED and skipped.detail == "no Ray cluster running"


def test_plan_counts_what_upstream_reserves(monkeypatch):
    """Plan.from_args takes the bundles from the launcher's own count (logical_gpus_needed): colocated, the
    engines share the actor's GPUs; apart, they add theirs. Broken: engines added under colocate_all."""
    def args(colocate: bool) -> SimpleNamespace:
        n = SimpleNamespace
        return n(actor=n(model_name_or_path="m", num_nodes=2, num_gpus_per_node=4),
                 vllm=n(num_engines=4, tensor_parallel_size=2, gpu_memory_utilization=0.5),
                 train=n(colocate_all=colocate, colocate_actor_ref=False), ref=n(num_nodes=1, num_gpus_per_node=8),
                 algo=n(kl=n(init_coef=0.0)), populora=n(adapter_names=["t0", "s0"], scoring_memory_gb=8.0),
                 ds=n(lora=n(target_modules="all-linear", rank=16), param_dtype="bf16", zero_stage=2,
                      adam_offload=False, attn_implementation="sdpa"),
                 rollout=n(micro_batch_size=8), data=n(max_len=4096), ckpt=n(output_dir="/r"))

    assert pf.Plan.from_args(args(True)).bundles == 8
    apart = pf.Plan.from_args(args(False))
    assert apart.bundles == 16 and apart.ranks == 8 and apart.adapters == 2 and apart.scoring_budget == 8e9


# ------------------------------------------------------------------------------------- CUDA and flash-attn


def test_cuda_refused_where_torch_cannot_use_the_nodes_gpus():
    """A node with NVIDIA devices and a CPU torch (the run would fall to CPU), a node where Ray counts more GPUs
    than CUDA sees. Broken: the per-node device count not compared with Ray's."""
    row = pf.check_cuda(False, "x", [node(), node("gpu-b", torch_cuda=None, cuda_devices=0)])
    assert row.status == pf.REFUSED and "gpu-b: torch 2.13.0 (a CPU build) sees no CUDA device, though /dev has 8" \
        in row.detail and "make install-gpu" in row.fix and "--populora.cluster_device cpu" in row.fix
    row = pf.check_cuda(False, "x", [node(cuda_devices=4)])
    assert row.status == pf.REFUSED and "Ray counts 8 GPUs, torch 2.13.0 (CUDA 13.0) sees 4" in row.detail
    ok = pf.check_cuda(False, "x", [node(), node("gpu-b")])
    assert ok.status == pf.OK and ok.detail == "2 GPU node(s): 8 x NVIDIA H100, torch 2.13.0 (CUDA 13.0)"
    cpu = pf.check_cuda(True, "no GPU node's torch sees a CUDA device: logical GPUs", [node(cuda_devices=0)])
    assert cpu.status == pf.SKIPPED and "logical GPUs" in cpu.detail


def test_flash_attn_checked_where_it_is_used():
    """Broken: flash-attn checked on CPU workers (the rehearsal's CPU cluster would be refused), or an import
    error on the second node missed."""
    broken = {"flash_attn": "error: ImportError: libcudart.so.13: cannot open shared object file"}
    row = pf.check_flash_attn(plan(), False, [node(), node("gpu-b", flash_attn=broken)])
    assert row.status == pf.REFUSED and "gpu-b: ImportError: libcudart.so.13" in row.detail
    assert "--ds.attn_implementation sdpa" in row.fix and "make install-gpu" in row.fix
    assert pf.check_flash_attn(plan(), False, [node()]).detail == "flash_attn 2.8.3 imports on 1 GPU node(s)"
    assert pf.check_flash_attn(plan(attn_implementation="sdpa"), False, [node()]).status == pf.SKIPPED
    cpu = pf.check_flash_attn(plan(attn_implementation="sdpa"), True, [node(cuda_devices=0, flash_attn={})])
    assert cpu.status == pf.SKIPPED and "CPUs" in cpu.detail


def test_the_cpu_decision():
    """Broken: any node's GPUs (Ray's logical ones included) taken for CUDA."""
    logical = [node(cuda_devices=0, torch_cuda=None, nvidia_devices=0)]
    assert pf.decide_cpu("auto", logical) == (True, "no GPU node's torch sees a CUDA device: logical GPUs")
    assert pf.decide_cpu("auto", [node()])[0] is False
    assert pf.decide_cpu("cuda", logical) == (False, "--populora.cluster_device cuda")
    assert pf.decide_cpu("cpu", [node()])[0] is True


# ---------------------------------------------------------------------------------------------- the model


def test_model_resolves_on_every_node_or_is_refused_naming_the_node():
    """Broken: only the first node's report read; a probe that never answered counted as resolved."""
    ok = pf.check_model(plan(), [node(), node("gpu-b")])
    assert ok.status == pf.OK and ok.detail == ("Qwen/Qwen2.5-Coder-7B-Instruct -> /hf/snapshots/abc on all 2 "
                                                "node(s)")
    missing = node("gpu-b", model_path=None, model_error="model 'Qwen/...' is not in the Hugging Face cache")
    row = pf.check_model(plan(), [node(), missing])
    assert row.status == pf.REFUSED and "gpu-b: model 'Qwen/...' is not in the Hugging Face cache" in row.detail
    assert "--actor.model_name_or_path (MODEL)" in row.fix and "HF_HOME" in row.fix
    silent = pf.check_model(plan(), [node(), pf.NodeReport("gpu-c", 8, 64, error="no answer in 300 s")])
    assert silent.status == pf.REFUSED and "gpu-c: no answer in 300 s" in silent.detail
    both = pf.check_model(plan(), [missing, pf.NodeReport("gpu-c", model_error=missing.model_error)])
    assert both.detail == "Qwen/Qwen2.5-Coder-7B-Instruct: gpu-b, gpu-c: model 'Qwen/...' is not in the Hugging " \
                          "Face cache"  # one line for the nodes that say the same


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """An HF home of the test's own holding the tiny model as ``org/tiny-coder``, offline."""
    from hf_cache import cache_model
    from huggingface_hub import constants

    from openrlhf_populora.models.tiny import save_tiny_model

    home = tmp_path / "hf"
    cache_model(home, "org/tiny-coder", save_tiny_model(tmp_path / "tiny-source"))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))  # what HF_HOME gives at import
    return home


def test_probe_resolves_a_hub_id_from_the_cache_offline(hf_home, tmp_path):
    """The probe a node runs: a hub id from its HF cache (config and parameter count read there), offline; a hub
    id not in the cache refused with resolve_model's reason. Broken: config.json read from the working directory
    instead of the snapshot."""
    found = pf.probe_model("org/tiny-coder")
    assert found["model_error"] is None and found["model_path"].startswith(str(hf_home / "hub"))
    assert found["model_config"]["hidden_size"] == 64
    assert found["base_params"] == pf.safetensors_parameter_count(tmp_path / "tiny-source")
    missing = pf.probe_model("org/absent")
    assert missing["model_path"] is None and "HF_HUB_OFFLINE" in missing["model_error"]
    assert "no such directory" in pf.probe_model(str(tmp_path / "nowhere"))["model_error"]


def test_probe_of_a_hub_id_online_reads_only_its_config(hf_home, monkeypatch, tmp_path):
    """Not in the cache, hub reachable: the model's page and config.json only, not its weights (every node would
    download 15 GB in the preflight). Broken: every hub id handed to resolve_model, which downloads the weights
    where the hub is reachable (the fake snapshot_download refuses that)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from openrlhf_populora.models import embedded

    monkeypatch.setattr(embedded, "hub_offline", lambda: False)
    config = tmp_path / "config.json"
    config.write_text('{"hidden_size": 3584}')
    monkeypatch.setattr(huggingface_hub, "model_info",
                        lambda name: SimpleNamespace(safetensors=SimpleNamespace(total=QWEN_7B_PARAMS)))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda name, filename: str(config))

    def cache_only(name, local_files_only=False, **kwargs):
        assert local_files_only, "the weights would be downloaded"
        raise LocalEntryNotFoundError("not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cache_only)
    found = pf.probe_model("Qwen/Qwen2.5-Coder-7B-Instruct")
    assert found["model_error"] is None and found["model_path"] is None
    assert found["base_params"] == QWEN_7B_PARAMS and found["model_config"] == {"hidden_size": 3584}
    assert "downloaded there at start" in found["model_note"]
    row = pf.check_model(plan(), [node(model_path=None, model_note=found["model_note"])])
    assert row.status == pf.OK and "gpu-a: not in this node's HF cache" in row.detail


# --------------------------------------------------------------------------------------- the table and CLI


def test_the_table_escapes_cells_and_counts():
    """Broken: a ``|`` in a detail splitting its row; the verdict saying nothing refused when a row is."""
    rows = [pf.Row("a", pf.OK, "x | y"), pf.Row("b", pf.REFUSED, "z\nw", "--flag")]
    assert pf.format_table(rows).splitlines() == [
        "| check | status | detail | fix |", "|---|---|---|---|", "| a | ok | x \\| y |  |",
        "| b | refused | z w | --flag |",
        "[populora] preflight: 1 ok, 0 skipped, 1 refused: refused: fix what the rows marked refused name, then "
        "launch again"]
    assert pf.refused(rows) == [rows[1]]


def test_local_gather_on_cuda_checks_this_machines_gpus(monkeypatch):
    """No cluster, CUDA here: upstream's train() starts Ray on this machine, so its GPUs and CPUs are the
    resources. No CUDA: the launcher's own local Ray, skipped. Broken: the local CUDA machine's resources skipped."""
    monkeypatch.setattr(pf, "probe_node", lambda model: {"cuda_devices": 2, "gpu_memory": GPU_80,
                                                         "model_path": "/m", "model_config": QWEN_7B})
    got = pf.gather(plan(bundles=8), "auto", None)
    assert not got.cpu and got.resources == got.reports and got.reports[0].gpus == 2
    assert pf.check_ray_resources(plan(bundles=8), got.resources).status == pf.REFUSED
    monkeypatch.setattr(pf, "probe_node", lambda model: {"cuda_devices": 0, "model_path": "/m"})
    got = pf.gather(plan(bundles=8), "auto", None)
    assert got.cpu and got.resources is None and got.reports[0].gpus == 8 and "logical GPU" in got.resources_why


@pytest.mark.slow
def test_cli_prints_one_table_and_refuses_with_status_2(tmp_path, monkeypatch, capsys):
    """The command on this machine (no cluster): the tiny model, the shipped cluster flags. Every check ok or
    skipped with a reason, exit 0; then a run in the directory without --ckpt.load_enable: exit 2, refused naming
    the flag. Broken: the exit status ignoring refusals; the runner's existing-run check not handed to the run
    directory's row."""
    from openrlhf_populora.cli import preflight as cli
    from openrlhf_populora.engines.ray import cluster

    monkeypatch.setattr(cluster, "cluster_address", lambda: None)  # never another session's Ray on this machine
    common = [line.split("#")[0].split() for line in
              (ROOT / "launch" / "presets" / "common.args").read_text().splitlines()]
    argv = ["--populora.engine", "ray", "--config", str(ROOT / "configs" / "1t1s.yaml"),
            *[t for line in common for t in line], "--actor.model_name_or_path", "tiny", "--vllm.num_engines", "1",
            "--actor.num_gpus_per_node", "1", "--ckpt.output_dir", str(tmp_path / "run")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| check ")]
    assert [r.split(" | ")[0][2:] for r in rows] == list(pf.CHECKS), out
    for row in rows:
        status, detail = row.split(" | ")[1:3]
        assert status == "ok" or (status == "skipped" and detail), row
    assert "attention runs as sdpa" in out and not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    assert cli.main(argv) == 2
    out = capsys.readouterr().out
    refused = [line for line in out.splitlines() if "| refused |" in line]
    assert len(refused) == 1 and refused[0].startswith(f"| {pf.RUN_DIR} |") and "--ckpt.load_enable" in refused[0]
