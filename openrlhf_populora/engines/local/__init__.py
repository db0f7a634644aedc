"""The embedded engine: transformers + peft in one process (CPU or one GPU). See ``engine.py``."""

from openrlhf_populora.engines.local.config import DTYPES, LocalEngineConfig, resolve_dtype
from openrlhf_populora.engines.local.engine import LocalEngine
from openrlhf_populora.engines.local.sampling import sample_next_tokens
from openrlhf_populora.engines.local.state import STATE_FILE
from openrlhf_populora.engines.local.training import lr_factor, make_policy_loss, native_policy_loss

__all__ = [
    "DTYPES",
    "STATE_FILE",
    "LocalEngine",
    "LocalEngineConfig",
    "lr_factor",
    "make_policy_loss",
    "native_policy_loss",
    "resolve_dtype",
    "sample_next_tokens",
]
