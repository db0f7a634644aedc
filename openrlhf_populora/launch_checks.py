"""Checks of a cluster launch against the machines it runs on, as pure functions of numbers (GPU counts, sizes,
free bytes): what the launch refuses at once, and what a preflight prints as one table (one :class:`Check` a
row). Nothing here touches a filesystem, a GPU or Ray; callers measure and pass the numbers in.

- :func:`tensor_parallel_fits`: a vLLM engine's tensor-parallel workers must sit on one node. Each worker reads
  the adapter files itself (vLLM's LoRA worker manager loads ``lora_path`` in every worker), and the files are
  written on the rollout actor's own node, so an engine split across nodes cannot load them.
- :func:`adapter_dir_need` and :func:`choose_adapter_dir`: every engine writes every adapter to its node's
  adapter directory (``/dev/shm`` by default): engines on the node x (N adapters + the new version of the one
  being replaced) x one adapter's bytes. :func:`lora_adapter_bytes` gives that size from a model's config.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

GB = 1000**3
MB = 1000**2

# /dev/shm also holds Ray's object store and NCCL's buffers: adapter files go there only with this much left over
SHM_RESERVE = 1 << 30
SHM = "/dev/shm"
ADAPTER_DIR_ENV = "POPULORA_ADAPTER_DIR"  # names the one directory for adapter payloads (default: /dev/shm, else temp)


@dataclass(frozen=True)
class Check:
    """One row of a preflight: what was checked, whether it passed, the numbers behind it, and (when it failed)
    the setting or flag that fixes it."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def message(self) -> str:
        """The failure as one sentence for an error: detail, then the fix."""
        return f"{self.detail}; {self.fix}" if self.fix else self.detail


def tensor_parallel_fits(gpus_per_node: int, tensor_parallel_size: int) -> Check:
    """Whether each vLLM engine's ``tensor_parallel_size`` GPUs fit on one node of ``gpus_per_node`` GPUs (the
    engines take consecutive GPUs, so the size must divide a node's GPUs)."""
    ok = tensor_parallel_size >= 1 and gpus_per_node % tensor_parallel_size == 0
    detail = f"vLLM tensor parallelism {tensor_parallel_size} over nodes of {gpus_per_node} GPUs"
    if ok:
        return Check("tensor parallelism fits a node", True, detail)
    return Check("tensor parallelism fits a node", False,
                 f"an engine's {tensor_parallel_size} GPUs would span nodes of {gpus_per_node}, and its workers on the "
                 "other node cannot read the adapter files (written on the engine's own node)",
                 f"use a tensor-parallel size that divides the GPUs per node (here one of "
                 f"{', '.join(str(d) for d in _divisors(gpus_per_node))})")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else [1]


def engines_per_node(num_engines: int, tensor_parallel_size: int, gpus_per_node: int) -> int:
    """The most vLLM engines one node holds: as many as its GPUs take (``gpus_per_node // tensor_parallel_size``),
    no more than there are engines."""
    return max(1, min(num_engines, gpus_per_node // max(1, tensor_parallel_size)))


def adapter_dir_need(engines_on_node: int, adapters: int, adapter_bytes: int) -> int:
    """Bytes one node's adapter directory holds at its fullest: each engine keeps one version of each of its
    ``adapters``, plus, during an upload, the new version of the one being replaced (added before the old one
    is removed)."""
    return engines_on_node * (adapters + 1) * adapter_bytes


def need_detail(engines_on_node: int, adapters: int, adapter_bytes: int) -> str:
    """How :func:`adapter_dir_need` counted, for messages."""
    need = adapter_dir_need(engines_on_node, adapters, adapter_bytes)
    return (f"{_size(need)} ({engines_on_node} engine(s) on this node x ({adapters} adapters + 1 being replaced) x "
            f"{_size(adapter_bytes)})")


def _size(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / MB:.2f} MB"


def adapter_dir_places(environ: Mapping[str, str], tempdir: str) -> tuple[tuple[tuple[str, int], ...], bool]:
    """Where a node's vLLM engines write their adapter files, in order of preference, each as (path, bytes to
    keep free): ``$POPULORA_ADAPTER_DIR`` alone when set, else tmpfs (``/dev/shm``, keeping :data:`SHM_RESERVE`),
    then ``tempdir`` (node-local disk). Also whether the directory was named. The rollout actors choose from
    these (``engines/ray/vllm_rollout.adapter_root``) and the preflight measures them (``preflight.adapter_rooms``)."""
    explicit = environ.get(ADAPTER_DIR_ENV)
    if explicit:
        return ((explicit, 0),), True
    return ((SHM, SHM_RESERVE), (tempdir, 0)), False


@dataclass(frozen=True)
class DirRoom:
    """A place adapter files could go: ``free`` bytes (None: missing or not writable), of which ``reserve`` must
    stay free for others (``/dev/shm``: :data:`SHM_RESERVE`)."""

    path: str
    free: int | None
    reserve: int = 0

    def room(self) -> int:
        return -1 if self.free is None else self.free - self.reserve

    def describe(self) -> str:
        if self.free is None:
            return f"{self.path}: missing or not writable"
        kept = f", {_size(self.reserve)} of it kept for Ray and NCCL" if self.reserve else ""
        return f"{self.path}: {_size(self.free)} free{kept}"


def choose_adapter_dir(need: int, candidates: Sequence[DirRoom], explicit: bool = False,
                       explain: str = "") -> tuple[str | None, Check]:
    """The first of ``candidates`` (in order of preference) with room for ``need`` bytes, and the check that says
    so; ``(None, failed check)`` when none has room. ``explicit``: the candidates are the one directory the user
    named (``POPULORA_ADAPTER_DIR``), so the fix names another. ``explain``: how ``need`` was counted."""
    counted = f"{_size(need)}" + (f" = {explain}" if explain else "")
    for candidate in candidates:
        if candidate.room() >= need:
            return candidate.path, Check("adapter directory has room", True,
                                         f"{candidate.path} for {counted}: {candidate.describe()}")
    places = "; ".join(c.describe() for c in candidates) or "no directory"
    fix = ("point POPULORA_ADAPTER_DIR at a node-local directory with room" if explicit else
           "set POPULORA_ADAPTER_DIR to a node-local directory with room (a local disk), or give the node or "
           "container a larger /dev/shm (docker --shm-size)")
    return None, Check("adapter directory has room", False,
                       f"no directory has room for the adapter files: they need {counted}; {places}", fix)


# LoRA target module -> (input, output) features, from a Llama/Qwen2-style config
def _module_shapes(config: Mapping) -> dict[str, tuple[int, int]]:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    intermediate = int(config["intermediate_size"])
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}


def lora_adapter_bytes(config: Mapping, rank: int, target_modules: str | Iterable[str], dtype_bytes: int) -> int:
    """One LoRA adapter's tensor bytes for a Llama/Qwen2-style model ``config`` (its ``config.json`` as a dict):
    A (rank x in) and B (out x rank) on each target module of every layer, ``dtype_bytes`` each (2 for bf16).
    ``target_modules``: module names, or ``"all-linear"`` (the seven projections). Raises ``ValueError`` for a
    module this function does not know."""
    shapes = _module_shapes(config)
    names = list(shapes) if isinstance(target_modules, str) and target_modules == "all-linear" else (
        [target_modules] if isinstance(target_modules, str) else list(target_modules))
    unknown = [name for name in names if name not in shapes]
    if unknown:
        raise ValueError(f"lora_adapter_bytes knows the modules {sorted(shapes)}, not {unknown}")
    per_layer = sum(rank * (shapes[name][0] + shapes[name][1]) for name in names)
    return per_layer * int(config["num_hidden_layers"]) * dtype_bytes
