"""The learning diagnostics (metrics/learning.py, selfplay/probe.py): exact values by hand, and the probe on the
real local engine with the tiny model.

Broken implementations each test catches are named in its docstring.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from openrlhf_populora.engines.base import BASE_ADAPTER, SamplingParams, Trajectory
from openrlhf_populora.metrics.learning import (
    base_weight_key,
    base_weight_norms,
    lowrank_fro_norm,
    probe_kl,
    update_size,
)

M1 = "base_model.model.model.layers.0.self_attn.q_proj"
M2 = "base_model.model.model.layers.0.self_attn.v_proj"


def _adapter() -> dict[str, torch.Tensor]:
    # B A = [[0, 2], [0, 0]] (norm 2) and [[0, 0], [3, 0]] (norm 3)
    return {f"{M1}.lora_A.weight": torch.tensor([[0.0, 2.0]]), f"{M1}.lora_B.weight": torch.tensor([[1.0], [0.0]]),
            f"{M2}.lora_A.weight": torch.tensor([[1.0, 0.0]]), f"{M2}.lora_B.weight": torch.tensor([[0.0], [3.0]])}


def test_lowrank_norm_equals_the_dense_product_norm():
    """Catches a Gram product taken the wrong way round or a missing square root."""
    gen = torch.Generator().manual_seed(0)
    b, a = torch.randn(7, 3, generator=gen, dtype=torch.float64), torch.randn(3, 5, generator=gen, dtype=torch.float64)
    assert lowrank_fro_norm(b, a) == pytest.approx(float(torch.linalg.norm(b @ a)), rel=1e-12)


def test_update_size_is_the_whole_update_over_the_whole_weight():
    """||s B A|| per module 4 and 6 at s = 2; ||W|| 3 and 4: sqrt(16 + 36) / sqrt(9 + 16) = sqrt(52) / 5.
    Catches a sum of per-module ratios (4/3 + 6/4), the scaling left out (sqrt(13)/5) or applied squared."""
    assert update_size(_adapter(), {M1: 3.0, M2: 4.0}, scaling=2.0) == pytest.approx(math.sqrt(52) / 5, rel=1e-12)


def test_a_fresh_adapter_has_moved_nowhere():
    fresh = {k: (torch.zeros_like(v) if "lora_B" in k else v) for k, v in _adapter().items()}
    assert update_size(fresh, {M1: 3.0, M2: 4.0}, scaling=2.0) == 0.0


def test_base_norms_come_from_the_adapted_weights_in_the_checkpoint(tmp_path):
    """Catches a wrong key mapping (the PEFT prefix kept, or '.weight' missing) and a silently skipped module."""
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.full((2, 2), 1.5),
               "model.layers.0.self_attn.k_proj.weight": torch.full((2, 2), 9.0)}, str(tmp_path / "model.safetensors"))
    assert base_weight_key(M1) == "model.layers.0.self_attn.q_proj.weight"
    assert base_weight_norms(tmp_path, [M1]) == {M1: pytest.approx(3.0)}
    with pytest.raises(KeyError, match="v_proj"):
        base_weight_norms(tmp_path, [M1, M2])


def test_probe_kl_averages_the_k3_estimate_per_token_over_responses():
    """log r = -1 and -2 on the first response's tokens: (e^-1 - 1 + 1 + e^-2 - 1 + 2) / 2 = 0.751607; 0 on the
    second: 0.375804. Catches the plain log-ratio (0.75), r taken the other way round (2.553), a sum over tokens
    instead of a mean (0.751607) and a mean over all tokens pooled (0.501071)."""
    assert probe_kl([[-1.0, -1.0], [-0.5]], [[-2.0, -3.0], [-0.5]]) == pytest.approx(
        (math.exp(-1) + math.exp(-2) + 1) / 4, rel=1e-12)
    assert probe_kl([[-1.0]], [[-1.0]]) == 0.0
    with pytest.raises(ValueError):
        probe_kl([[-1.0]], [[-1.0, -2.0]])


@pytest.fixture(scope="module")
def engine():
    from scripted_loops import tiny_config

    from openrlhf_populora.build import local_engine_config
    from openrlhf_populora.engines.local import LocalEngine

    config = tiny_config()
    config.ds.lora.rank, config.ds.lora.alpha = 4, 8
    eng = LocalEngine(local_engine_config(config, dtype="fp32"))  # fp32: the dense check reads the same weights
    yield eng
    eng.close()


def test_the_probe_scores_base_responses_under_the_base_and_a_fresh_adapter_sits_at_zero(engine):
    """The base's log-probs through BASE_ADAPTER equal a fresh (B = 0) adapter's, so a fresh member's probe KL and
    update size are exactly 0; a moved adapter has both away from 0, and its update size equals the dense
    computation from the model's own weights. Catches the probe scored under the wrong adapter, the base's
    log-probs not stored with the probe, and base norms read from the wrong tensors."""
    from openrlhf_populora.models.embedded import resolve_model
    from openrlhf_populora.selfplay.probe import LearningMeter, build_probe

    engine.add_adapter("fresh")
    engine.add_adapter("moved")
    prompts = {"teacher": [engine.render_prompt("write f"), engine.render_prompt("write g")],
               "student": [engine.render_prompt("solve f")]}
    probe = build_probe(engine, prompts, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8, seed=3))
    items = probe.roles["teacher"] + probe.roles["student"]
    assert len(probe.roles["teacher"]) == 2 and len(probe.roles["student"]) == 1
    fresh = engine.token_log_probs([Trajectory("fresh", it.prompt_ids, it.response_ids, 0.0) for it in items])
    assert [it.base_log_probs for it in items] == fresh

    gen = torch.Generator().manual_seed(1)
    weights = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in engine.get_adapter("moved").items()}
    engine.set_adapter("moved", weights)
    meter = LearningMeter(engine, resolve_model("tiny"), scaling=8 / 4)
    out = meter.measure(probe, [("a", "fresh", ["teacher"]), ("b", "moved", ["teacher", "student"])])
    # 0 up to float32 rounding: the fresh adapter's rows are batched (and padded) with the moved one's here
    assert out[("a", "teacher")]["update_size"] == 0.0 and 0 <= out[("a", "teacher")]["probe_kl"] < 1e-9
    assert out[("b", "teacher")]["probe_kl"] > 1e-3 and out[("b", "student")]["probe_kl"] > 1e-3

    base = dict(engine.base.named_parameters())
    num = den = 0.0
    for key, a in weights.items():
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0]
            b = weights[f"{module}.lora_B.weight"]
            num += float(torch.linalg.norm(2.0 * b @ a)) ** 2
            name = module.removeprefix("base_model.model.") + ".base_layer.weight"
            den += float(torch.linalg.norm(base[next(n for n in base if n.endswith(name))])) ** 2
    assert out[("b", "teacher")]["update_size"] == pytest.approx(math.sqrt(num / den), rel=1e-5)
    assert out[("b", "student")]["update_size"] == out[("b", "teacher")]["update_size"]
    engine.remove_adapter("fresh")
    engine.remove_adapter("moved")


def test_token_log_probs_accepts_the_base_but_training_does_not(engine):
    with pytest.raises(KeyError):
        engine.train_step([Trajectory(BASE_ADAPTER, [1, 2], [3], 1.0)])
