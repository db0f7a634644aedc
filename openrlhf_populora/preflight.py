"""The preflight of a Ray launch: everything that would make the run fail (or hang) after it started, checked
before anything heavy starts, and printed as one table, a row a check (check | status | detail | fix).

``python -m openrlhf_populora.cli.preflight <the flags of cli.train --populora.engine ray>`` runs it by itself;
``launch/lib.sh`` runs it as a Ray job of its own before it submits the run. The checks:

- **the model resolves on every node**: a directory, or a hub id in each node's HF cache (or, where the hub is
  reachable, on the hub: then each node downloads it at start), as the ranks, the engines and the controller's
  learning probe will resolve it;
- **CUDA** and **flash-attn** importable on the GPU workers, when they are to be used (GPU workers on CUDA;
  ``--ds.attn_implementation flash_attention_*``); skipped, saying why, when the GPU workers are CPUs;
- **the memory per GPU**: :func:`~openrlhf_populora.engines.ray.memory.gpu_memory_plan` (the frozen base, the
  adapters' ZeRO states, the scoring peak, vLLM's share) against the smallest GPU torch sees, and vLLM's share
  against what vLLM must fit in it (weights, LoRA slots, the KV cache of one ``--data.max_len`` sequence);
- **the adapter directory** of every node has room for its engines x (N + 1) adapter files
  (:mod:`~openrlhf_populora.launch_checks`), measured where the engines will write them;
- **tensor parallelism fits a node**;
- **the run directory can be locked** (:mod:`~openrlhf_populora.dirlock`: taken and released; a directory made
  for the check is removed again), and holds no run that the flags would overwrite;
- **the Ray resources** hold the plan's placement groups: bundles of one GPU and one CPU (actor ranks, vLLM
  engines x tensor parallelism), and one CPU more for the controller.

The checks are pure functions of plain inputs (a :class:`Plan` from the parsed flags, one :class:`NodeReport` a
node, a lock function, a ``shutil.disk_usage``-like callable), so tests give them fake GPUs, filesystems and
clusters. What measures them: :func:`probe_node` (run on each node as a tiny Ray task: no GPU, a hundredth of a
CPU; in this process when no cluster is running) and :func:`gather`.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openrlhf_populora.dirlock import LOCK_FILE, DirectoryBusy, lock_directory
from openrlhf_populora.engines.ray.memory import gpu_memory_plan, lora_parameter_count, scoring_peak
from openrlhf_populora.launch_checks import (
    DirRoom,
    adapter_dir_need,
    adapter_dir_places,
    choose_adapter_dir,
    engines_per_node,
    lora_adapter_bytes,
    need_detail,
    tensor_parallel_fits,
)

OK, REFUSED, SKIPPED = "ok", "refused", "skipped"

MODEL = "model resolves on every node"
CUDA = "CUDA on the GPU workers"
FLASH_ATTN = "flash-attn on the GPU workers"
MEMORY = "memory per GPU"
ADAPTER_DIR = "adapter directory has room"
TENSOR_PARALLEL = "tensor parallelism fits a node"
RUN_DIR = "run directory can be locked"
RESOURCES = "Ray resources hold the plan"
CHECKS = (MODEL, CUDA, FLASH_ATTN, MEMORY, ADAPTER_DIR, TENSOR_PARALLEL, RUN_DIR, RESOURCES)

PROBE_CPUS = 0.01  # a node probe's CPU request: it schedules beside anything but a node whose CPUs are all held
PROBE_TIMEOUT_S = 300.0
# Ray empties CUDA_VISIBLE_DEVICES for a task that asks for no GPU; with this set to 0 it leaves it alone, so the
# probe sees the node's GPUs without holding one
NO_GPU_HIDING = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
VLLM_DTYPE_BYTES = 2  # upstream creates every engine in bfloat16 on GPUs


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


@dataclass(frozen=True)
class Row:
    """One line of the table: ``status`` is :data:`OK`, :data:`REFUSED` or :data:`SKIPPED`; ``fix`` names the
    flag or environment variable that fixes a refusal."""

    check: str
    status: str
    detail: str
    fix: str = ""


# ------------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Plan:
    """What the launch will ask for, from the parsed flags (:meth:`from_args`)."""

    model: str
    nodes: int  # --actor.num_nodes
    gpus_per_node: int  # --actor.num_gpus_per_node
    engines: int  # --vllm.num_engines
    tensor_parallel: int  # --vllm.tensor_parallel_size
    colocate_all: bool
    bundles: int  # GPUs (and CPUs) upstream's placement groups and actors reserve
    adapters: int  # N: the run's adapter slots
    lora_rank: int
    lora_targets: str | tuple[str, ...]
    param_bytes: int  # 2 (bf16) or 4 (fp32): --ds.param_dtype
    zero_stage: int
    adam_offload: bool
    vllm_memory_utilization: float
    scoring_budget: float  # bytes: --populora.scoring_memory_gb x 1e9
    micro_batch_size: int  # --rollout.micro_batch_size (the scoring forwards' rows)
    max_len: int  # --data.max_len
    attn_implementation: str
    run_dir: str

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return (f"{self.ranks} actor rank(s) ({self.nodes} node(s) x {self.gpus_per_node} GPU(s)), {self.engines} "
                f"vLLM engine(s) x tensor parallelism {self.tensor_parallel}"
                f"{', colocated' if self.colocate_all else ''}")

    @classmethod
    def from_args(cls, args: Any) -> Plan:
        """From the Ray launcher's hierarchized namespace (``build.ray.parse_launch_args``)."""
        from openrlhf_populora.engines.ray.cluster import logical_gpus_needed

        targets = args.ds.lora.target_modules
        return cls(
            model=str(args.actor.model_name_or_path), nodes=int(args.actor.num_nodes),
            gpus_per_node=int(args.actor.num_gpus_per_node), engines=int(args.vllm.num_engines or 0),
            tensor_parallel=int(args.vllm.tensor_parallel_size), colocate_all=bool(args.train.colocate_all),
            bundles=int(logical_gpus_needed(args)), adapters=len(args.populora.adapter_names),
            lora_rank=int(args.ds.lora.rank), lora_targets=targets if isinstance(targets, str) else tuple(targets),
            param_bytes=4 if args.ds.param_dtype == "fp32" else 2, zero_stage=int(args.ds.zero_stage),
            adam_offload=bool(args.ds.adam_offload),
            vllm_memory_utilization=float(args.vllm.gpu_memory_utilization),
            scoring_budget=float(args.populora.scoring_memory_gb) * 1e9,
            micro_batch_size=int(args.rollout.micro_batch_size), max_len=int(args.data.max_len),
            attn_implementation=str(args.ds.attn_implementation), run_dir=str(args.ckpt.output_dir))


# ------------------------------------------------------------------------------------------ what a node says


@dataclass(frozen=True)
class NodeReport:
    """What :func:`probe_node` found on one node, with the node's Ray resources (``gpus``, ``cpus``).
    ``error``: the probe did not answer (then nothing else is known)."""

    node: str
    gpus: float = 0
    cpus: float = 0
    error: str | None = None
    model_path: str | None = None
    model_error: str | None = None
    model_note: str = ""
    model_config: Mapping | None = None
    base_params: int | None = None
    torch: str | None = None
    torch_cuda: str | None = None  # torch.version.cuda: None for a CPU build
    nvidia_devices: int = 0  # /dev/nvidia<N> device files
    cuda_devices: int = 0  # what torch.cuda sees
    gpu_memory: int | None = None  # the smallest device's total memory, bytes
    gpu_name: str = ""
    cuda_error: str | None = None
    flash_attn: Mapping[str, str] = field(default_factory=dict)  # module -> version, or "error: ..."
    adapter_rooms: tuple[DirRoom, ...] = ()
    adapter_dir_explicit: bool = False

    @classmethod
    def from_probe(cls, node: str, probe: Mapping, gpus: float = 0, cpus: float = 0) -> NodeReport:
        rooms = tuple(DirRoom(r["path"], r["free"], r.get("reserve", 0)) for r in probe.get("adapter_rooms", ()))
        keys = set(cls.__dataclass_fields__) - {"node", "gpus", "cpus", "adapter_rooms"}
        return cls(node=node, gpus=gpus, cpus=cpus, adapter_rooms=rooms,
                   **{k: v for k, v in probe.items() if k in keys})


def safetensors_parameter_count(directory: str | os.PathLike) -> int | None:
    """The parameters of the ``*.safetensors`` files in ``directory``, from their headers (no weight is read):
    the sum of every tensor's element count. None without such files."""
    total, found = 0, False
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= int(dim)
                total += count
        found = True
    return total if found else None


def decoder_parameter_count(config: Mapping) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its HF ``config``: embeddings (and an untied head), per
    layer the four attention projections (q/k/v biases for ``qwen2`` or ``attention_bias``), the three MLP
    projections and two norms, and the final norm. For models without safetensors headers to count."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab, layers = int(config["vocab_size"]), int(config["num_hidden_layers"])
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = (q + 2 * kv) if (config.get("model_type") == "qwen2" or config.get("attention_bias")) else 0
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + bias + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * per_layer + hidden


def kv_bytes_per_token(config: Mapping, dtype_bytes: int = VLLM_DTYPE_BYTES) -> int:
    """vLLM's KV cache for one token: keys and values of every layer's KV heads."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()


def probe_model(name: str) -> dict[str, Any]:
    """Resolve ``name`` as the run will, without downloading weights: this package's models and directories
    through ``resolve_model``; a hub id from the HF cache, else (hub reachable) its hub page and ``config.json``
    only. Returns ``model_path`` or ``model_error``, a ``model_note``, the ``model_config`` and ``base_params``."""
    from openrlhf_populora.models.embedded import NOT_LOADED, hub_offline, is_builtin_model, resolve_model

    out: dict[str, Any] = {"model_path": None, "model_error": None, "model_note": "", "model_config": None,
                           "base_params": None}
    try:
        if is_builtin_model(name) or _looks_like_path(name):
            out["model_path"] = resolve_model(name)
        else:
            from huggingface_hub import hf_hub_download, model_info, snapshot_download
            from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

            try:
                out["model_path"] = snapshot_download(name, local_files_only=True, ignore_patterns=NOT_LOADED)
            except (LocalEntryNotFoundError, IncompleteSnapshotError):
                if hub_offline():
                    resolve_model(name)  # raises its own message: not in the cache, offline
                    raise
                info = model_info(name)  # on the hub, and readable with this node's token
                if info.safetensors is not None:
                    out["base_params"] = int(info.safetensors.total)
                out["model_config"] = json.loads(Path(hf_hub_download(name, "config.json")).read_text())
                out["model_note"] = "not in this node's HF cache: downloaded there at start"
                return out
    except Exception as err:  # noqa: BLE001 - whatever stops it is the row's detail
        out["model_error"] = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return out
    config = Path(out["model_path"]) / "config.json"
    try:
        out["model_config"] = json.loads(config.read_text())
        out["base_params"] = safetensors_parameter_count(out["model_path"])
    except (OSError, ValueError, struct.error) as err:
        out["model_note"] = f"cannot read its config.json or weight headers ({err})"
    return out


def probe_gpus() -> dict[str, Any]:
    """torch's view of this process's GPUs: version and CUDA build, the devices it sees and their smallest total
    memory, the NVIDIA device files in /dev, and (where it sees a device) whether flash-attn imports."""
    out: dict[str, Any] = {"nvidia_devices": len(glob.glob("/dev/nvidia[0-9]*")), "cuda_devices": 0}
    try:
        import torch
    except Exception as err:  # noqa: BLE001
        out["cuda_error"] = f"torch does not import: {err}"
        return out
    out.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    try:
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            out["cuda_devices"] = count
            out["gpu_memory"] = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
            out["gpu_name"] = torch.cuda.get_device_name(0)
    except Exception as err:  # noqa: BLE001
        out["cuda_error"] = f"{type(err).__name__}: {err}"
    if out["cuda_devices"]:
        flash: dict[str, str] = {}
        for module in ("flash_attn", "flash_attn_interface"):  # FlashAttention 2, and 3's
            try:
                imported = __import__(module)
                if module == "flash_attn":
                    from flash_attn import flash_attn_func  # noqa: F401 - loads the CUDA extension
                flash[module] = str(getattr(imported, "__version__", "installed"))
            except Exception as err:  # noqa: BLE001
                flash[module] = f"error: {type(err).__name__}: {err}"
        out["flash_attn"] = flash
    return out


def _writable_dir(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK)


def adapter_rooms(environ: Mapping[str, str] | None = None,
                  disk_usage: Callable[[str], Any] = shutil.disk_usage,
                  writable: Callable[[str], bool] = _writable_dir,
                  tempdir: str | None = None) -> tuple[tuple[DirRoom, ...], bool]:
    """Where this node's engines would write their adapter files (``launch_checks.adapter_dir_places``, the
    rollout actors' order of preference), with each place's free bytes; ``$POPULORA_ADAPTER_DIR``, made by the
    engine when missing, is measured on its nearest existing parent. Returns the places and whether the
    directory was named explicitly."""
    environ = os.environ if environ is None else environ

    def room(path: str, reserve: int = 0, create: bool = False) -> DirRoom:
        probe = path
        while create and not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        if not writable(probe):
            return DirRoom(path, None, reserve)
        return DirRoom(path, int(disk_usage(probe).free), reserve)

    places, explicit = adapter_dir_places(environ, tempdir or tempfile.gettempdir())
    return tuple(room(path, reserve, create=explicit) for path, reserve in places), explicit


def probe_node(model: str) -> dict[str, Any]:
    """Everything a node tells the preflight (run there as a Ray task, or in this process): the model, the GPUs,
    the adapter directory's room. JSON-able."""
    rooms, explicit = adapter_rooms()
    return {**probe_model(model), **probe_gpus(), "adapter_dir_explicit": explicit,
            "adapter_rooms": [{"path": r.path, "free": r.free, "reserve": r.reserve} for r in rooms]}


# ------------------------------------------------------------------------------------------------ the checks

MODEL_FIX = ("--actor.model_name_or_path (MODEL): a directory every node has, or a hub id in every node's HF cache "
             "(HF_HOME / HF_HUB_CACHE; fetch it with `hf download <id>`), or unset HF_HUB_OFFLINE where the hub is "
             "reachable")


def _by_message(problems: Sequence[tuple[str, str]]) -> list[str]:
    """``node: message`` lines, the nodes with the same message on one line (``a, b: message``)."""
    nodes: dict[str, list[str]] = {}
    for node, message in problems:
        nodes.setdefault(message, []).append(node)
    return [f"{', '.join(names)}: {message}" for message, names in nodes.items()]


def check_model(plan: Plan, reports: Sequence[NodeReport]) -> Row:
    """Every node resolves the model (a probe that did not answer counts as not)."""
    bad = _by_message([(r.node, r.error or r.model_error) for r in reports if r.error or r.model_error])
    if bad or not reports:
        return Row(MODEL, REFUSED, f"{plan.model}: " + ("; ".join(bad) or "no node answered"), MODEL_FIX)
    places = sorted({r.model_path or "the hub" for r in reports})
    where = (f"{places[0]} on all {len(reports)} node(s)" if len(places) == 1 else
             "; ".join(f"{r.node}: {r.model_path or 'the hub'}" for r in reports))
    notes = sorted({f"{r.node}: {r.model_note}" for r in reports if r.model_note})
    named = "" if places == [plan.model] else f"{plan.model} -> "
    return Row(MODEL, OK, f"{named}{where}" + (f" ({'; '.join(notes)})" if notes else ""))


def gpu_nodes(reports: Sequence[NodeReport]) -> list[NodeReport]:
    """The answering nodes that hold GPUs (where the ranks and engines run)."""
    return [r for r in reports if r.gpus > 0 and not r.error]


def decide_cpu(requested: str, reports: Sequence[NodeReport]) -> tuple[bool, str]:
    """Whether the GPU workers are CPUs, and why: ``--populora.cluster_device`` when it is cpu or cuda, else
    whether any GPU node's torch sees a CUDA device (the launcher asks a one-GPU task the same question)."""
    if requested in ("cpu", "cuda"):
        return requested == "cpu", f"--populora.cluster_device {requested}"
    if any(r.cuda_devices > 0 for r in gpu_nodes(reports)):
        return False, "torch sees CUDA devices on the GPU nodes"
    return True, "no GPU node's torch sees a CUDA device: logical GPUs"


def check_cuda(cpu: bool, why: str, reports: Sequence[NodeReport]) -> Row:
    """On CUDA, every GPU node's torch sees at least as many CUDA devices as Ray counts GPUs there."""
    if cpu:
        return Row(CUDA, SKIPPED, f"the GPU workers are CPUs ({why}): DeepSpeed on gloo, vLLM's CPU build")
    nodes = gpu_nodes(reports)
    problems = []
    for r in nodes:
        build = f"torch {r.torch} ({'CUDA ' + r.torch_cuda if r.torch_cuda else 'a CPU build'})"
        if r.cuda_devices == 0:
            files = f", though /dev has {r.nvidia_devices} NVIDIA device(s)" if r.nvidia_devices else ""
            problems.append(f"{r.node}: {build} sees no CUDA device{files}"
                            + (f" ({r.cuda_error})" if r.cuda_error else ""))
        elif r.cuda_devices < r.gpus:
            problems.append(f"{r.node}: Ray counts {r.gpus:g} GPUs, {build} sees {r.cuda_devices}")
    if problems or not nodes:
        return Row(CUDA, REFUSED, "; ".join(problems) or "no node with GPUs answered",
                   "install the GPU stack on every node (make install-gpu: torch for CUDA), start each node's Ray "
                   "with --num-gpus at most the GPUs CUDA sees, or run on CPUs with --populora.cluster_device cpu")
    kinds = sorted({f"{r.cuda_devices} x {r.gpu_name or 'GPU'}, torch {r.torch} (CUDA {r.torch_cuda})" for r in nodes})
    return Row(CUDA, OK, f"{len(nodes)} GPU node(s): {'; '.join(kinds)}")


def check_flash_attn(plan: Plan, cpu: bool, reports: Sequence[NodeReport]) -> Row:
    """With a flash-attn implementation on CUDA, its package imports on every GPU node."""
    attention = plan.attn_implementation
    if cpu:
        return Row(FLASH_ATTN, SKIPPED, f"the GPU workers are CPUs: attention runs as {attention} (flash-attn "
                                        "needs CUDA)")
    if not attention.startswith("flash_attention"):
        return Row(FLASH_ATTN, SKIPPED, f"--ds.attn_implementation {attention}: flash-attn is not used")
    module = "flash_attn_interface" if attention == "flash_attention_3" else "flash_attn"
    nodes = [r for r in gpu_nodes(reports) if r.cuda_devices]
    found = {r.node: r.flash_attn.get(module, "error: not checked") for r in nodes}
    bad = [f"{node}: {value[len('error: '):]}" for node, value in found.items() if value.startswith("error: ")]
    if bad or not nodes:
        return Row(FLASH_ATTN, REFUSED, f"--ds.attn_implementation {attention} needs {module}: "
                   + ("; ".join(bad) or "no CUDA node answered"),
                   f"install {module} on every node (make install-gpu builds flash-attn; FLASH_ATTN_WHEEL for a "
                   "wheel), or --ds.attn_implementation sdpa")
    versions = sorted(set(found.values()))
    return Row(FLASH_ATTN, OK, f"{module} {', '.join(versions)} imports on {len(nodes)} GPU node(s)")


def _model_facts(reports: Sequence[NodeReport]) -> tuple[Mapping | None, int | None]:
    for r in reports:
        if r.model_config and not r.error:
            return r.model_config, r.base_params or decoder_parameter_count(r.model_config)
    return None, None


def check_memory(plan: Plan, cpu: bool, reports: Sequence[NodeReport]) -> Row:
    """One training GPU at the scoring peak (:func:`gpu_memory_plan`) against the smallest GPU torch sees, and
    vLLM's share against its weights (over tensor parallelism), its LoRA slots (N adapters) and the KV cache of
    one ``--data.max_len`` sequence. Estimates from shapes."""
    if cpu:
        return Row(MEMORY, SKIPPED, "the GPU workers are CPUs: no GPU memory to budget")
    sizes = [r.gpu_memory for r in gpu_nodes(reports) if r.gpu_memory]
    if not sizes:
        return Row(MEMORY, SKIPPED, "torch.cuda gave no GPU memory size on any node")
    config, base_params = _model_facts(reports)
    if config is None:
        return Row(MEMORY, SKIPPED, "the model's config.json could not be read: nothing to size")
    try:
        adapter_params = lora_parameter_count(config, plan.lora_rank, plan.lora_targets)
        adapter_file = lora_adapter_bytes(config, plan.lora_rank, plan.lora_targets, VLLM_DTYPE_BYTES)
        kv_token = kv_bytes_per_token(config)
        vocab = int(config["vocab_size"])
    except (KeyError, ValueError) as err:
        return Row(MEMORY, SKIPPED, f"the model's shapes are not a Llama/Qwen2 decoder's: {err}")
    gpu = min(sizes)
    share = plan.vllm_memory_utilization if plan.colocate_all else 0.0
    memory = gpu_memory_plan(
        gpu_bytes=gpu, base_params=base_params, adapter_params=adapter_params, adapters=plan.adapters,
        ranks=plan.ranks, zero_stage=plan.zero_stage, param_bytes=plan.param_bytes, adam_offload=plan.adam_offload,
        vllm_gpu_memory_utilization=share,
        scoring_bytes=scoring_peak(plan.micro_batch_size, plan.max_len, vocab, plan.scoring_budget))
    parts = " + ".join(f"{name} {gb(size)}" for name, size in memory.parts()[:-2])
    training = (f"{parts} = {gb(memory.total)} of {gb(gpu)} ({gb(abs(memory.free))} "
                f"{'left' if memory.fits else 'over'}; activations not counted)")
    vllm_share = int(plan.vllm_memory_utilization * gpu)
    weights = -(-base_params * VLLM_DTYPE_BYTES // plan.tensor_parallel)
    slots, kv = plan.adapters * adapter_file, plan.max_len * kv_token
    vllm_need = weights + slots + kv
    vllm = (f"vLLM's share {gb(vllm_share)} ({plan.vllm_memory_utilization:g} of the GPU) holds weights "
            f"{gb(weights)} + LoRA slots {gb(slots)} + KV of one {plan.max_len}-token sequence {gb(kv)} = "
            f"{gb(vllm_need)}")
    detail = f"{training}; {vllm}"
    fixes = []
    if not memory.fits:
        room = (gpu - (memory.total - memory.vllm)) / gpu  # the largest vLLM share the training side leaves
        fixes.append("the training side: " + (f"--vllm.gpu_memory_utilization at most {_floor2(room)}, or "
                                              if share and room >= 0.01 else "") +
                     "a lower --populora.scoring_memory_gb, --ds.zero_stage 3 (the base partitioned over the ranks), "
                     "or a smaller model")
    if vllm_share < vllm_need:
        fixes.append(f"vLLM: --vllm.gpu_memory_utilization at least {_ceil2(vllm_need / gpu)}, a larger "
                     "--vllm.tensor_parallel_size, or a lower --data.max_len")
    if fixes:
        return Row(MEMORY, REFUSED, detail, "; ".join(fixes))
    return Row(MEMORY, OK, detail)


def _floor2(x: float) -> str:
    return f"{math.floor(x * 100 + 1e-9) / 100:.2f}"


def _ceil2(x: float) -> str:
    return f"{math.ceil(x * 100 - 1e-9) / 100:.2f}"


def check_adapter_dir(plan: Plan, cpu: bool, reports: Sequence[NodeReport]) -> Row:
    """Each GPU node's adapter directory has room for its engines x (N + 1) adapter files (in the engines' dtype:
    bf16 on GPUs, fp32 on CPUs), where the engines will choose it (:func:`adapter_rooms`)."""
    config, _ = _model_facts(reports)
    if config is None:
        return Row(ADAPTER_DIR, SKIPPED, "the model's config.json could not be read: nothing to size")
    try:
        size = lora_adapter_bytes(config, plan.lora_rank, plan.lora_targets, 4 if cpu else VLLM_DTYPE_BYTES)
    except (KeyError, ValueError) as err:
        return Row(ADAPTER_DIR, SKIPPED, f"the model's shapes are not a Llama/Qwen2 decoder's: {err}")
    per_node = engines_per_node(plan.engines, plan.tensor_parallel, plan.gpus_per_node)
    need = adapter_dir_need(per_node, plan.adapters, size)
    explain = need_detail(per_node, plan.adapters, size)
    nodes = gpu_nodes(reports)
    chosen, bad, fix = [], [], ""
    for r in nodes:
        path, check = choose_adapter_dir(need, r.adapter_rooms, explicit=r.adapter_dir_explicit, explain=explain)
        if path is None:
            bad.append(f"{r.node}: {check.detail}")
            fix = check.fix
        else:
            room = next(room for room in r.adapter_rooms if room.path == path)
            chosen.append(f"{r.node}: {room.describe()}")
    if bad or not nodes:
        return Row(ADAPTER_DIR, REFUSED, "; ".join(bad) or "no node with GPUs answered",
                   fix or "set POPULORA_ADAPTER_DIR to a node-local directory with room")
    return Row(ADAPTER_DIR, OK, f"{explain} a node; {'; '.join(chosen)}")


def check_tensor_parallel(plan: Plan, reports: Sequence[NodeReport] | None = None) -> Row:
    """An engine's tensor-parallel GPUs on one node: the size divides ``--actor.num_gpus_per_node``, and (on a
    known cluster) some node holds that many bundles."""
    fits = tensor_parallel_fits(plan.gpus_per_node, plan.tensor_parallel)
    if not fits.ok:
        return Row(TENSOR_PARALLEL, REFUSED, fits.detail, f"--vllm.tensor_parallel_size (VLLM_TP): {fits.fix}")
    if reports and plan.tensor_parallel > 1:
        largest = max(_bundles_on(r) for r in reports)
        if largest < plan.tensor_parallel:
            return Row(TENSOR_PARALLEL, REFUSED,
                       f"{fits.detail}, but no Ray node holds {plan.tensor_parallel} GPUs with a CPU each (the "
                       f"largest: {largest})",
                       "--vllm.tensor_parallel_size (VLLM_TP) at most a node's GPUs, or larger Ray nodes")
    return Row(TENSOR_PARALLEL, OK, f"{fits.detail}: each engine on one node")


def check_run_dir(run_dir: str, existing: Callable[[], None] | None = None,
                  lock: Callable[[str], Any] = lock_directory) -> Row:
    """``existing()`` raises ``ValueError`` (the runner's ``RunDirError``) for a run the flags would overwrite or
    cannot resume; then the directory's lock (``flock``, or the owner file where the filesystem has none) is
    taken and released at once. A directory (and a ``.lock`` file) made for the check is removed again."""
    fix = "--ckpt.output_dir (RUN_DIR): another directory, or --ckpt.load_enable to resume the run there"
    if existing is not None:
        try:
            existing()
        except ValueError as err:
            return Row(RUN_DIR, REFUSED, str(err), fix)
    path = Path(run_dir)
    created = [p for p in [path, *path.parents] if not p.exists()]
    had_lock_file = (path / LOCK_FILE).exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        held = lock(str(path))
    except DirectoryBusy as busy:
        _remove_made(path, created, had_lock_file=True)  # its .lock is the holder's
        return Row(RUN_DIR, REFUSED, f"{path}: {busy}",
                   "--ckpt.output_dir (RUN_DIR) another directory, or wait for the run writing there (a stale "
                   ".lock.owner left by a killed run: delete it)")
    except OSError as err:
        _remove_made(path, created, had_lock_file)
        return Row(RUN_DIR, REFUSED, f"{path}: cannot create or lock it ({err})",
                   "--ckpt.output_dir (RUN_DIR) on storage this user can write (every node's, for several nodes)")
    how = "flock" if getattr(held, "owner", None) is None else (
        "an owner file (.lock.owner: this filesystem has no flock; a run killed outright leaves it behind)")
    held.close()
    _remove_made(path, created, had_lock_file)
    return Row(RUN_DIR, OK, f"{path}: taken and released with {how}"
               + ("; made for the check and removed again" if created else ""))


def _remove_made(path: Path, created: Sequence[Path], had_lock_file: bool) -> None:
    if not had_lock_file:
        (path / LOCK_FILE).unlink(missing_ok=True)
    for folder in created:  # deepest first
        try:
            folder.rmdir()
        except OSError:
            break


def _bundles_on(report: NodeReport) -> int:
    """Upstream's bundles (1 GPU + 1 CPU each) a node can hold."""
    return int(min(report.gpus, report.cpus))


def check_ray_resources(plan: Plan, nodes: Sequence[NodeReport] | None, why: str = "") -> Row:
    """The alive nodes hold the plan's ``bundles`` of one GPU and one CPU (upstream's placement groups pack the
    actor ranks and the vLLM engines' GPUs into them; they wait forever for what is not there), and one CPU
    more, outside them, for the controller actor. ``nodes=None``: no cluster to check (``why``)."""
    if nodes is None:
        return Row(RESOURCES, SKIPPED, why)
    held = sum(_bundles_on(n) for n in nodes)
    cpus = sum(n.cpus for n in nodes)
    listed = "; ".join(f"{n.node}: {n.gpus:g} GPU(s), {n.cpus:g} CPU(s)" for n in nodes) or "no alive node"
    short = [f"{n.node} has {n.gpus:g} GPUs but {n.cpus:g} CPU(s)" for n in nodes if 0 < n.cpus < n.gpus]
    need = (f"{plan.describe()}: {plan.bundles} bundle(s) of 1 GPU + 1 CPU, and 1 CPU for the controller")
    problems = []
    if held < plan.bundles:
        problems.append(f"the nodes hold {held} bundle(s)" + (f" ({'; '.join(short)})" if short else ""))
    if cpus < plan.bundles + 1:
        problems.append(f"{cpus:g} CPU(s) in all, {plan.bundles + 1} needed")
    if problems:
        return Row(RESOURCES, REFUSED, f"{need}; {', '.join(problems)}: the placement groups would wait forever "
                                       f"({listed})",
                   "--actor.num_nodes / --actor.num_gpus_per_node (NNODES, GPUS_PER_NODE) to what the cluster has, "
                   "or Ray nodes with more: ray start --num-gpus/--num-cpus (Slurm: --cpus-per-task, RAY_START_ARGS)")
    return Row(RESOURCES, OK, f"{need}; {len(nodes)} node(s) hold {held} bundle(s), {cpus:g} CPU(s) ({listed})")


@dataclass
class Gathered:
    """What :func:`gather` measured: whether the GPU workers are CPUs (``cpu``, ``why``), one report a probed node,
    and the nodes for the Ray resources check (None: skipped, ``resources_why`` says why)."""

    cpu: bool
    why: str
    reports: list[NodeReport]
    resources: list[NodeReport] | None
    resources_why: str = ""
    address: str | None = None


def run_checks(plan: Plan, gathered: Gathered, existing: Callable[[], None] | None = None,
               lock: Callable[[str], Any] = lock_directory) -> list[Row]:
    """Every check, in the table's order (:data:`CHECKS`)."""
    cpu, reports = gathered.cpu, gathered.reports
    return [check_model(plan, reports), check_cuda(cpu, gathered.why, reports),
            check_flash_attn(plan, cpu, reports), check_memory(plan, cpu, reports),
            check_adapter_dir(plan, cpu, reports), check_tensor_parallel(plan, gathered.resources),
            check_run_dir(plan.run_dir, existing, lock),
            check_ray_resources(plan, gathered.resources, gathered.resources_why)]


def refused(rows: Sequence[Row]) -> list[Row]:
    return [row for row in rows if row.status == REFUSED]


def format_table(rows: Sequence[Row]) -> str:
    """The rows as one Markdown table (``|`` in a cell escaped), then a line counting them."""
    def cell(text: str) -> str:
        return " ".join(text.replace("|", "\\|").split())

    lines = ["| check | status | detail | fix |", "|---|---|---|---|"]
    lines += [f"| {cell(r.check)} | {r.status} | {cell(r.detail)} | {cell(r.fix)} |" for r in rows]
    counts = {status: sum(r.status == status for r in rows) for status in (OK, SKIPPED, REFUSED)}
    verdict = ("refused: fix what the rows marked refused name, then launch again" if counts[REFUSED] else
               "nothing refused")
    lines.append(f"[populora] preflight: {counts[OK]} ok, {counts[SKIPPED]} skipped, {counts[REFUSED]} refused: "
                 f"{verdict}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- measuring (Ray or here)


def _node_label(node: Mapping) -> str:
    return f"{node.get('NodeManagerAddress', '?')} ({str(node.get('NodeID', ''))[:8]})"


def probe_cluster(model: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[list[NodeReport], list[NodeReport]]:
    """Run :func:`probe_node` as a tiny Ray task on every alive node that has CPUs (pinned there, no GPU; Ray
    left from hiding the node's GPUs from it); returns the probed nodes' reports and every alive node's
    resources (for :func:`check_ray_resources`). A node that does not answer in ``timeout_s`` gets ``error``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    alive = [n for n in ray.nodes() if n.get("Alive")]
    every = [NodeReport(_node_label(n), gpus=float(n["Resources"].get("GPU", 0)),
                        cpus=float(n["Resources"].get("CPU", 0))) for n in alive]
    remote = ray.remote(probe_node)
    probed = [(n, report) for n, report in zip(alive, every, strict=True) if report.cpus >= PROBE_CPUS]
    refs = [remote.options(num_cpus=PROBE_CPUS, num_gpus=0, runtime_env={"env_vars": dict(NO_GPU_HIDING)},
                           scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(model)
            for n, _ in probed]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    reports = []
    for ref, (_, base) in zip(refs, probed, strict=True):
        if ref not in ready:
            ray.cancel(ref, force=True)
            reports.append(NodeReport(base.node, base.gpus, base.cpus,
                                      error=f"no answer in {timeout_s:g} s (are its CPUs all held by another job?)"))
            continue
        try:
            reports.append(NodeReport.from_probe(base.node, ray.get(ref), base.gpus, base.cpus))
        except Exception as err:  # noqa: BLE001
            reports.append(NodeReport(base.node, base.gpus, base.cpus, error=f"the probe failed: {err}"))
    return reports, every


def gather(plan: Plan, requested: str = "auto", address: str | None = None, timeout_s: float = PROBE_TIMEOUT_S,
           cuda_available: Callable[[], bool] | None = None) -> Gathered:
    """Measure the cluster the launch would join (``address``: a running Ray cluster, the launcher's
    ``cluster_address()``), or this machine when none runs. Joining, it connects, probes every node and
    disconnects; with none, it probes this process, and the launcher will start Ray itself."""
    if address is not None:
        import ray

        with warnings.catch_warnings():  # Ray's notice that it will stop hiding GPUs from tasks without any
            warnings.simplefilter("ignore", FutureWarning)
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        try:
            reports, every = probe_cluster(plan.model, timeout_s)
        finally:
            ray.shutdown()
        cpu, why = decide_cpu(requested, reports)
        return Gathered(cpu, why, reports, every, address=address)
    probe = probe_node(plan.model)
    sees_cuda = probe.get("cuda_devices", 0) > 0 if cuda_available is None else cuda_available()
    cpu = requested == "cpu" or (requested == "auto" and not sees_cuda)
    why = (f"--populora.cluster_device {requested}" if requested != "auto" else
           "no Ray cluster running and no CUDA here: the launcher starts a local Ray with logical GPUs" if cpu else
           "no Ray cluster running: upstream's train() starts Ray on this machine's GPUs")
    gpus = plan.bundles if cpu else probe.get("cuda_devices", 0)
    local = NodeReport.from_probe("this machine", probe, gpus=gpus, cpus=os.cpu_count() or 1)
    if cpu:
        return Gathered(cpu, why, [local], None,
                        f"no Ray cluster running: the launcher starts a local Ray with the plan's {plan.bundles} "
                        "logical GPU(s)")
    return Gathered(cpu, why, [local], [local])
