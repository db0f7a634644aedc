"""launch_checks: the launch's checks as pure functions of numbers, with hand-computed expectations (the sizes of
the GPU review: Qwen2.5-Coder-7B, LoRA rank 16 on seven projections, bf16, 8 engines a node)."""

from __future__ import annotations

import pytest

from openrlhf_populora.launch_checks import (
    GB,
    SHM_RESERVE,
    DirRoom,
    adapter_dir_need,
    adapter_dir_places,
    choose_adapter_dir,
    engines_per_node,
    lora_adapter_bytes,
    tensor_parallel_fits,
)

QWEN_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
           "num_hidden_layers": 28}
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_7B = 80_740_352  # 28 layers x 16 x (7168 + 4096 + 4096 + 7168 + 22528 + 22528 + 22528) x 2 bytes


def test_tensor_parallelism_must_divide_a_nodes_gpus():
    """Catches: the rule checked against all GPUs (2 x 8 = 16 is divisible by 16)."""
    assert tensor_parallel_fits(8, 1).ok and tensor_parallel_fits(8, 8).ok and tensor_parallel_fits(8, 4).ok
    split = tensor_parallel_fits(8, 16)
    assert not split.ok and "one of 1, 2, 4, 8" in split.fix
    assert not tensor_parallel_fits(8, 3).ok and not tensor_parallel_fits(8, 0).ok


def test_engines_per_node():
    assert engines_per_node(8, 1, 8) == 8  # one node of 8 GPUs, one engine per GPU
    assert engines_per_node(16, 1, 8) == 8  # two nodes: 8 on each
    assert engines_per_node(4, 2, 8) == 4
    assert engines_per_node(2, 1, 8) == 2  # fewer engines than GPUs
    assert engines_per_node(1, 16, 8) == 1


def test_lora_adapter_bytes_at_the_7b_shapes_and_on_a_real_model():
    """The review's 80.7 MB per bf16 rank-16 adapter of the 7B model, and the exact size of a real peft adapter of
    the tiny Qwen2 (grouped-query attention: k/v are narrower than q). Catches: a wrong shape for one module."""
    assert lora_adapter_bytes(QWEN_7B, 16, SEVEN, 2) == ADAPTER_7B
    assert lora_adapter_bytes(QWEN_7B, 16, "all-linear", 2) == ADAPTER_7B
    assert lora_adapter_bytes(QWEN_7B, 16, ["q_proj", "v_proj"], 2) == 28 * 16 * (7168 + 4096) * 2
    with pytest.raises(ValueError, match="lm_head"):
        lora_adapter_bytes(QWEN_7B, 16, ["lm_head"], 2)

    from peft import LoraConfig, get_peft_model

    from openrlhf_populora.models.tiny import build_tiny_model

    model, _ = build_tiny_model(seed=0)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN))
    real = sum(p.numel() * p.element_size() for n, p in peft.named_parameters() if "lora_" in n)
    assert lora_adapter_bytes(model.config.to_dict(), 4, SEVEN, 4) == real


def test_the_adapter_directory_needs_every_engines_every_adapter():
    """8t8s on one 8-GPU node: 8 engines x (16 adapters + 1 being replaced) x 80.7 MB = 10.98 GB, which a 10 GB
    /dev/shm (OpenRLHF's --shm-size=10g) does not hold: the files go to the temp dir's disk. Catches: one
    engine's need, or /dev/shm chosen by a fixed 1 GiB floor."""
    need = adapter_dir_need(8, 16, ADAPTER_7B)
    assert need == 8 * 17 * ADAPTER_7B == 10_980_687_872
    shm, disk = DirRoom("/dev/shm", 10 * 2**30, SHM_RESERVE), DirRoom("/tmp", 200 * GB)
    assert choose_adapter_dir(need, [shm, disk])[0] == "/tmp"
    big_shm = DirRoom("/dev/shm", need + SHM_RESERVE, SHM_RESERVE)
    assert choose_adapter_dir(need, [big_shm, disk])[0] == "/dev/shm"
    # /dev/shm keeps its reserve for Ray's object store and NCCL
    assert choose_adapter_dir(need, [DirRoom("/dev/shm", need + SHM_RESERVE - 1, SHM_RESERVE), disk])[0] == "/tmp"
    # 4t4s fits a 10 GB /dev/shm: 8 x 9 x 80.7 MB = 5.81 GB
    assert choose_adapter_dir(adapter_dir_need(8, 8, ADAPTER_7B), [shm, disk])[0] == "/dev/shm"


def test_no_room_anywhere_is_refused_naming_what_to_set():
    need = adapter_dir_need(8, 16, ADAPTER_7B)
    chosen, check = choose_adapter_dir(need, [DirRoom("/dev/shm", 64 * 2**20, SHM_RESERVE),
                                              DirRoom("/tmp", 5 * GB), DirRoom("/nope", None)], explain="8 x 17")
    assert chosen is None and not check.ok
    message = check.message()
    assert "10.98 GB = 8 x 17" in message and "/tmp: 5.00 GB free" in message and "/nope: missing" in message
    assert "POPULORA_ADAPTER_DIR" in message and "--shm-size" in message
    chosen, check = choose_adapter_dir(need, [DirRoom("/scratch/lora", GB)], explicit=True)
    assert chosen is None and "POPULORA_ADAPTER_DIR" in check.fix and "shm" not in check.fix


def test_adapter_files_go_to_the_named_directory_alone_else_tmpfs_then_the_temp_dir():
    """The one order the rollout actors choose from and the preflight measures. Catches: the temp dir tried
    before tmpfs, tmpfs's reserve dropped or charged to the temp dir, and a named directory with fallbacks
    after it (a run the user pointed at a disk writing to tmpfs anyway)."""
    assert adapter_dir_places({}, "/tmp") == ((("/dev/shm", SHM_RESERVE), ("/tmp", 0)), False)
    assert adapter_dir_places({"POPULORA_ADAPTER_DIR": "/scratch/a"}, "/tmp") == ((("/scratch/a", 0),), True)
    assert adapter_dir_places({"POPULORA_ADAPTER_DIR": ""}, "/tmp")[1] is False  # set but empty: the default
