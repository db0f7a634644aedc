"""A tiny random causal LM with a byte-level tokenizer, built entirely in code (no files, no hub).

Used by tests, CI and smoke runs: a Qwen2 architecture (hidden 64, 2 layers, eager attention, about
140 K parameters) whose vocabulary is the 256 bytes plus three ChatML special tokens. Every string
round-trips exactly through the tokenizer (byte-level), so parsing code sees what the model produced.
The weights are a pure function of ``seed``: the same seed gives bit-identical models.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"

# ChatML, as Qwen2 and SmolLM2 use it; ``add_generation_prompt`` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: ids 0..255 are the bytes (GPT-2's byte-to-unicode alphabet),
    then ``<|endoftext|>`` (pad, 256), ``<|im_start|>`` (257) and ``<|im_end|>`` (eos, 258)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _unicode_to_byte()[ch])
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD_TOKEN, BOS_TOKEN, EOS_TOKEN])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's reversible byte -> printable unicode map, inverted (char -> byte value)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


VLLM_HEADS = 1  # head_dim 64: vLLM's CPU attention takes head sizes 32, 64, 80, ... and rejects the default 16


def tiny_config(vocab_size: int, heads: int | None = None) -> Qwen2Config:
    """Qwen2, hidden 64, 2 layers, 4 query heads / 2 KV heads (``heads``: that many of each instead), MLP 256,
    tied embeddings, eager attention."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=heads or 4,
        num_key_value_heads=heads or 2,
        max_position_embeddings=8192,  # byte-level tokens: AZR prompts run to ~4k
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 3,
        initializer_range=0.2,
    )
    config._attn_implementation = "eager"
    return config


def build_tiny_model(seed: int = 0, heads: int | None = None) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """The tiny random model (eval mode, fp32, CPU) and its tokenizer; deterministic under ``seed``.
    ``heads=VLLM_HEADS`` gives the variant vLLM's CPU build serves (same tokenizer, same init scheme).

    ``initializer_range`` is 0.2 (not 0.02) so the random model's next-token distributions are far
    from uniform: greedy decoding then varies with the prompt and with LoRA weights, which tests need.
    """
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(len(tokenizer), heads)
    assert tokenizer.eos_token_id == config.eos_token_id and tokenizer.pad_token_id == config.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )
    model.eval()
    return model, tokenizer


def save_tiny_model(path: str | Path, seed: int = 0, heads: int | None = None) -> Path:
    """Write the tiny model as a local HF directory (``config.json``, safetensors, tokenizer files)
    that ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load offline."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_tiny_model(seed, heads)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
