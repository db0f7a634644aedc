"""The tiny random model and its byte-level tokenizer."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from openrlhf_populora.models.tiny import EOS_TOKEN, PAD_TOKEN, build_tiny_model, save_tiny_model


def test_tiny_model_is_small_and_deterministic_under_its_seed():
    (m0, _), (m0_again, _), (m1, _) = build_tiny_model(0), build_tiny_model(0), build_tiny_model(1)
    n_params = sum(p.numel() for p in m0.parameters())
    assert 100_000 < n_params < 200_000
    assert m0.config.num_hidden_layers == 2 and m0.config.hidden_size == 64
    s0, s0b, s1 = m0.state_dict(), m0_again.state_dict(), m1.state_dict()
    assert all(torch.equal(s0[k], s0b[k]) for k in s0)
    assert not all(torch.equal(s0[k], s1[k]) for k in s0)


def test_building_does_not_touch_the_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    build_tiny_model(3)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_round_trips_any_text_and_has_chat_tokens():
    _, tok = build_tiny_model(0)
    text = "def f(x):\n\treturn x  +  1  # héllo ✓ \x00"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode()) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN and tok.eos_token_id != tok.pad_token_id
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.eos_token_id in ids
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"


def test_saved_tiny_model_loads_with_auto_classes_and_matches(tmp_path):
    save_tiny_model(tmp_path, seed=4)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, attn_implementation="eager")
    model.eval()
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    reference, ref_tok = build_tiny_model(4)
    ids = torch.tensor([tok("hello world", add_special_tokens=False)["input_ids"]])
    assert ids.tolist() == [ref_tok("hello world", add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert tok.eos_token_id == model.generation_config.eos_token_id == model.config.eos_token_id
    assert tok.pad_token_id == model.config.pad_token_id
    assert tok.chat_template == ref_tok.chat_template
