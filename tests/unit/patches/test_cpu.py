"""CPU patches for OpenRLHF 0.11.2's training path: each applies and reverts, keeps upstream's behaviour
when CUDA is present, and with them OpenRLHF's real ``DeepspeedStrategy`` sets up on gloo and prepares an
``Actor`` (one process, world size 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from openrlhf_populora.patches import openrlhf_0_11_2 as pinned
from openrlhf_populora.patches.openrlhf_0_11_2 import cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches are for CUDA-less machines")


@pytest.fixture()
def patched():
    pinned.apply(cpu.cpu_patches())
    yield
    pinned.revert()


def test_every_patch_applies_and_reverts():
    patches = cpu.cpu_patches()
    originals = {p.target: pinned.lookup(p.target) for p in patches}
    assert len(originals) == len(patches), "targets are distinct"
    pinned.apply(patches)
    try:
        for p in patches:
            assert pinned.lookup(p.target) is p.replacement, p.target
        pinned.apply(patches)  # idempotent: the recorded originals stay the real ones
    finally:
        pinned.revert()
    for target, original in originals.items():
        assert pinned.lookup(target) is original, target


def test_patched_modules_see_cpu_for_cuda_and_torch_is_untouched(patched):
    from openrlhf.trainer.ppo_utils import replay_buffer
    from openrlhf.trainer.ray import ppo_actor

    assert ppo_actor.torch.cuda.current_device() == "cpu"
    ppo_actor.torch.cuda.synchronize()  # a no-op instead of "Torch not compiled with CUDA"
    assert ppo_actor.torch.Tensor is torch.Tensor and ppo_actor.torch.tensor([1]).tolist() == [1]
    assert replay_buffer.NaiveReplayBuffer(2).target_device == torch.device("cpu")
    assert replay_buffer.torch.device("cuda:0") == torch.device("cuda:0")  # only the cpu spelling is mapped
    with pytest.raises((RuntimeError, AssertionError, AttributeError)):
        torch.cuda.current_device()  # the real torch still has no CUDA


def test_the_torch_views_pickle_by_reference():
    import pickle

    import cloudpickle

    for view in (cpu.CPU_TORCH, cpu.CPU_TORCH_REPLAY_BUFFER):
        assert pickle.loads(pickle.dumps(view)) is view
        assert cloudpickle.loads(cloudpickle.dumps(view)) is view


def test_replacements_defer_to_upstream_when_cuda_is_available(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 7)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    assert cpu.CPU_TORCH.cuda.current_device() == 7
    assert cpu.CPU_TORCH.cuda.synchronize is torch.cuda.synchronize
    cpu.barrier_and_cuda_sync()
    assert calls == ["barrier", "sync"]
    seen = {}
    monkeypatch.setattr("torch.distributed.device_mesh.init_device_mesh",
                        lambda device, *a, **k: seen.setdefault("device", device))
    cpu.init_device_mesh_any_device("cuda", (1,))
    assert seen["device"] == "cuda"


def test_flash_attn_shim_gives_the_imported_names_and_raises_when_called(monkeypatch):
    for key in [k for k in sys.modules if k == "flash_attn" or k.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, key)
    real = True
    try:
        import flash_attn  # noqa: F401
    except Exception:
        real = False
    for key in [k for k in sys.modules if k == "flash_attn" or k.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, key)
    assert cpu.install_flash_attn_shim() is (not real)
    if real:
        return
    from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input  # noqa: F401
    from flash_attn.utils.distributed import all_gather

    with pytest.raises(RuntimeError, match="flash_attn is not installed"):
        all_gather(torch.zeros(1))
    with pytest.raises(ImportError):  # models/utils.py falls back to torch's cross-entropy on ImportError
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # noqa: F401
    assert cpu.install_flash_attn_shim() is True  # idempotent


STRATEGY_SCRIPT = textwrap.dedent('''
    import os, socket, sys
    from types import SimpleNamespace as ns

    import torch
    import torch.distributed as dist

    from openrlhf_populora.patches import openrlhf_0_11_2 as pinned
    from openrlhf_populora.patches.openrlhf_0_11_2 import cpu

    model_dir, zero_stage, apply = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "patched"
    cpu.install_flash_attn_shim()  # both ways: upstream imports flash_attn at module level
    if apply:
        pinned.apply(cpu.cpu_patches())
    import deepspeed
    from openrlhf.models import Actor
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # what Ray's BaseDistributedActor sets for a world of one (upstream then calls set_device on LOCAL_RANK)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    args = ns(local_rank=-1,  # the fields DeepspeedStrategy reads (upstream's flag defaults)
              ds=ns(param_dtype="bf16", zero_stage=zero_stage, adam_offload=False, zpg=1, use_universal_ckpt=False,
                    grad_accum_dtype=None, overlap_comm=False, deepcompile=False, tensor_parallel_size=1,
                    ring_attn_size=1),
              train=ns(dynamic_batch_enable=False))
    strategy = DeepspeedStrategy(seed=1, max_norm=1.0, micro_train_batch_size=1, train_batch_size=2,
                                 zero_stage=zero_stage, args=args)
    strategy.setup_distributed()
    assert dist.get_backend() == "gloo" and strategy.world_size == 1
    assert strategy.ds_device_mesh.device_type == "cpu" and strategy.accumulated_gradient == 2
    assert strategy.all_reduce({"x": 3.0})["x"] == 3.0
    assert strategy.all_reduce(torch.tensor([2.0]), op="sum").tolist() == [2.0]
    assert strategy.all_gather(torch.tensor([1.0])).tolist() == [1.0]

    actor = Actor(model_dir, attn_implementation="eager", param_dtype="bf16", lora_rank=4, lora_alpha=8,
                  target_modules="all-linear", ds_config=strategy.get_ds_train_config())
    cfg = dict(optim="adam", adam=dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
               lr_scheduler="constant", max_norm=1.0, scheduler_steps=4)
    actor, optim, scheduler = strategy.prepare((actor, cfg))
    assert isinstance(actor.model, deepspeed.DeepSpeedEngine) and actor.model.zero_optimization_stage() == zero_stage
    seq = torch.randint(0, 250, (2, 10))
    log_probs = actor(seq, torch.ones(2, 4, dtype=torch.bool), attention_mask=torch.ones_like(seq))
    assert log_probs.shape == (2, 4) and torch.isfinite(log_probs).all()
    print("prepared:", type(optim).__name__, type(getattr(optim, "optimizer", None)).__name__)
''')


def run_strategy(model_dir: str, zero_stage: int, patches: str) -> subprocess.CompletedProcess:
    """The strategy in a fresh interpreter: torch.distributed and DeepSpeed's group caches are process-global, and
    another test module's process group (initialised, or destroyed under DeepSpeed's cached clone of it) must not
    decide whether this one passes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", STRATEGY_SCRIPT, model_dir, str(zero_stage), patches], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_real_deepspeed_strategy_sets_up_on_gloo_and_prepares_an_actor(tiny_model_dir, zero_stage):
    # catches: a CPU patch that stops applying (a device mesh on "cuda", set_device on a CUDA-less torch, NCCL)
    done = run_strategy(tiny_model_dir, zero_stage, "patched")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "prepared:" in done.stdout


@pytest.mark.slow
def test_without_the_patches_upstreams_strategy_cannot_set_up_here(tiny_model_dir):
    # the control for the test above: it fails for want of the patches, not of something it never exercises
    done = run_strategy(tiny_model_dir, 2, "unpatched")
    assert done.returncode != 0 and "prepared:" not in done.stdout
    assert "in setup_distributed" in done.stderr and "torch.cuda.set_device" in done.stderr, done.stderr[-3000:]


def test_fp32_is_a_param_dtype_on_cpu_and_upstream_values_are_unchanged(patched):
    from openrlhf.utils import utils

    assert utils.convert_to_torch_dtype("fp32") is torch.float32
    assert utils.convert_to_torch_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="Invalid param_dtype"):
        utils.convert_to_torch_dtype("fp8")
