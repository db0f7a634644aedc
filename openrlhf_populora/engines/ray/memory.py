"""GPU memory arithmetic of the Ray engine (pure: no torch, no Ray, no GPU).

**A scoring forward's logits.** Experience making (the old log-probs of every micro-batch) and the log-prob
probes (the learning probe, the sync proof) run upstream's ``Actor.forward`` without gradient. It holds the
logits of every position of every row, ``rows x tokens x vocab`` values (``tokens``: the padded width): the
model's bf16 logits, and while they are still referenced upstream's fp32 copy of them
(``output["logits"].to(torch.float32)`` in ``openrlhf/models/actor.py``), 2 + 4 = :data:`LOGIT_BYTES` bytes a
value. With Qwen2.5's 152,064-entry vocabulary, 8 rows of 3,000 tokens take 21.9 GB.

**Row chunks.** The Ray engine splits every scoring call into chunks of rows whose logits stay within a budget,
``--populora.scoring_memory_gb`` (1 GB = 1e9 bytes):

    rows x tokens x vocab x 6 <= scoring_memory_gb x 1e9

that is, at most :func:`scoring_tokens` = floor(budget / (vocab x 6)) tokens (rows x padded width) a forward,
and :func:`rows_per_forward` rows of a given width. One row is never split: a row longer than the budget allows
is scored alone, and :func:`scoring_peak` counts it.

**The budget per GPU.** :func:`gpu_memory_plan` adds what one GPU holds at the scoring peak: the frozen base,
the N adapters with their gradients and Adam states as ZeRO partitions them, a fixed overhead, vLLM's share when
its engines are colocated, and the scoring peak, against the GPU's memory. It is for a preflight, before anything
starts; the numbers are estimates from shapes (the ZeRO paper's mixed-precision accounting), not measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

GB = 10**9
LOGIT_BYTES = 6  # per logit value in a scoring forward: bf16 logits (2) plus upstream's fp32 copy (4)
ADAM_STATE_BYTES = 8  # fp32 momentum and variance per trainable parameter
MASTER_BYTES = 4  # the fp32 master copy ZeRO keeps of each trainable parameter trained in bf16/fp16
# CUDA context, NCCL buffers (about 0.5 GB together) and one ZeRO reduce bucket (DeepSpeed's default 5e8
# elements, 1 GB in bf16): an estimate
OVERHEAD_BYTES = 1_500_000_000
# the seven projections of a Llama/Qwen2 decoder layer: (input features, output features) from the HF config
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def logit_bytes(rows: int, tokens: int, vocab: int) -> int:
    """Bytes of a scoring forward's logits: ``rows x tokens x vocab x`` :data:`LOGIT_BYTES`."""
    return int(rows) * int(tokens) * int(vocab) * LOGIT_BYTES


def scoring_tokens(budget_bytes: float, vocab: int) -> int:
    """The most tokens (rows x padded width) one scoring forward may hold within ``budget_bytes`` of logits:
    floor(budget / (vocab x 6)). At least 1."""
    if not budget_bytes > 0:
        raise ValueError(f"the scoring budget must be > 0 bytes, got {budget_bytes} (--populora.scoring_memory_gb)")
    if int(vocab) < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    return max(1, int(budget_bytes // (int(vocab) * LOGIT_BYTES)))


def rows_per_forward(width: int, max_tokens: int, limit: int | None = None) -> int:
    """How many rows padded to ``width`` tokens one forward of at most ``max_tokens`` tokens may take: at least 1
    (a row is never split), at most ``limit``."""
    rows = max(1, int(max_tokens) // max(1, int(width)))
    return rows if limit is None else max(1, min(rows, int(limit)))


def row_chunks(lengths: Sequence[int], max_rows: int, max_tokens: int | None = None) -> list[range]:
    """Consecutive chunks of rows, in order, as index ranges: each holds at most ``max_rows`` rows and, padded to
    its longest row, at most ``max_tokens`` tokens (``None``: no token bound). Greedy: a chunk takes the next row
    while both bounds hold; a row alone is always a chunk, whatever its length. Without a token bound (or one
    that never binds) the chunks are the fixed slices of ``max_rows``."""
    if int(max_rows) < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    chunks: list[range] = []
    start, widest = 0, 0
    for i, length in enumerate(lengths):
        wider = max(widest, int(length))
        rows = i - start + 1
        if rows > 1 and (rows > max_rows or (max_tokens is not None and rows * wider > max_tokens)):
            chunks.append(range(start, i))
            start, wider = i, int(length)
        widest = wider
    if len(lengths) > start:
        chunks.append(range(start, len(lengths)))
    return chunks


def scoring_peak(micro_batch_size: int, max_len: int, vocab: int, budget_bytes: float) -> int:
    """Bytes of the largest scoring forward the Ray engine runs: rows of ``max_len`` tokens (``--data.max_len``),
    as many as the budget allows, at most ``micro_batch_size`` (``--rollout.micro_batch_size``), at least one."""
    rows = rows_per_forward(max_len, scoring_tokens(budget_bytes, vocab), limit=micro_batch_size)
    return logit_bytes(rows, max_len, vocab)


def lora_parameter_count(config: Mapping, rank: int, target_modules: Sequence[str] | str) -> int:
    """Parameters of one LoRA adapter of ``rank`` on a Llama/Qwen2-style decoder described by its HF ``config``
    (``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, optionally
    ``num_key_value_heads`` and ``head_dim``): ``rank x (in + out)`` per targeted projection per layer.
    ``target_modules``: projection names (:data:`PROJECTIONS`) or ``"all-linear"`` (all seven)."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    targets = list(PROJECTIONS) if target_modules in ("all-linear", ["all-linear"]) else list(target_modules)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"--ds.lora.target_modules: no shape known for {unknown}; known: {', '.join(PROJECTIONS)}")
    per_layer = sum(int(rank) * (shapes[t][0] + shapes[t][1]) for t in dict.fromkeys(targets))
    return per_layer * int(config["num_hidden_layers"])


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes one GPU holds at the scoring peak, by part, and the GPU's memory (:func:`gpu_memory_plan`)."""

    gpu: int
    base: int  # the frozen base weights (this rank's partition under ZeRO-3)
    adapters: int  # the N adapters' weights in the training dtype
    gradients: int  # their gradients (partitioned from ZeRO-2 on)
    optimizer: int  # fp32 master and Adam moments (partitioned from ZeRO-1 on; 0 with --ds.adam_offload)
    overhead: int  # CUDA context, NCCL, a reduce bucket (OVERHEAD_BYTES)
    scoring: int  # the largest scoring forward's logits
    vllm: int  # vLLM's share when its engines share the GPU (gpu_memory_utilization x the GPU)

    @property
    def total(self) -> int:
        return self.base + self.adapters + self.gradients + self.optimizer + self.overhead + self.scoring + self.vllm

    @property
    def free(self) -> int:
        """What is left (negative: over by that much)."""
        return self.gpu - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu

    def parts(self) -> list[tuple[str, int]]:
        """``(part, bytes)`` rows for a table, then the total and the GPU."""
        return [("frozen base", self.base), ("adapter weights", self.adapters), ("adapter gradients", self.gradients),
                ("fp32 master + Adam", self.optimizer), ("CUDA context, NCCL, reduce bucket", self.overhead),
                ("scoring logits (peak)", self.scoring), ("vLLM share", self.vllm), ("total", self.total),
                ("GPU", self.gpu)]


def gpu_memory_plan(*, gpu_bytes: int, base_params: int, adapter_params: int, adapters: int, ranks: int,
                    zero_stage: int, param_bytes: int = 2, adam_offload: bool = False,
                    vllm_gpu_memory_utilization: float = 0.0, scoring_bytes: int = 0,
                    overhead_bytes: int = OVERHEAD_BYTES) -> MemoryPlan:
    """What one training GPU holds at the scoring peak (estimates from shapes).

    - ``base_params`` frozen parameters x ``param_bytes`` (2: bf16); divided over ``ranks`` under ZeRO-3;
    - ``adapters x adapter_params`` trainable parameters (:func:`lora_parameter_count`), each with, in the ZeRO
      paper's mixed-precision accounting: weights and gradients of ``param_bytes`` each, an fp32 master
      (:data:`MASTER_BYTES`, none when training in fp32) and Adam's two fp32 moments (:data:`ADAM_STATE_BYTES`).
      ZeRO-1 divides the master and moments over ``ranks``, ZeRO-2 the gradients too, ZeRO-3 the weights too;
      ``adam_offload`` keeps master and moments on the host;
    - ``overhead_bytes`` (:data:`OVERHEAD_BYTES`);
    - ``scoring_bytes``: the largest scoring forward's logits (:func:`scoring_peak`);
    - ``vllm_gpu_memory_utilization x gpu_bytes``: what colocated vLLM engines take at start-up
      (``--vllm.gpu_memory_utilization`` with ``--train.colocate_all``; 0 when vLLM has GPUs of its own).

    Not counted: training's activations and the adapter snapshot of a training window (training and scoring do
    not overlap), the allocator's fragmentation.
    """
    if int(zero_stage) not in (0, 1, 2, 3):
        raise ValueError(f"--ds.zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if int(ranks) < 1 or int(adapters) < 1:
        raise ValueError(f"ranks and adapters must be >= 1, got {ranks} and {adapters}")
    if not 0.0 <= float(vllm_gpu_memory_utilization) < 1.0:
        raise ValueError(f"--vllm.gpu_memory_utilization must be in [0, 1), got {vllm_gpu_memory_utilization}")
    stage, ranks = int(zero_stage), int(ranks)
    trainable = int(adapters) * int(adapter_params)

    def share(total: int, partitioned: bool) -> int:
        return -(-total // ranks) if partitioned else total  # a rank's partition, rounded up

    optimizer_bytes = (MASTER_BYTES if param_bytes < 4 else 0) + ADAM_STATE_BYTES
    return MemoryPlan(
        gpu=int(gpu_bytes),
        base=share(int(base_params) * param_bytes, stage == 3),
        adapters=share(trainable * param_bytes, stage == 3),
        gradients=share(trainable * param_bytes, stage >= 2),
        optimizer=0 if adam_offload else share(trainable * optimizer_bytes, stage >= 1),
        overhead=int(overhead_bytes),
        scoring=int(scoring_bytes),
        vllm=int(float(vllm_gpu_memory_utilization) * int(gpu_bytes)),
    )
