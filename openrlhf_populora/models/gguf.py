"""GGUF file -> plain Hugging Face model directory (safetensors), with the fixes a chat model needs.

transformers' GGUF loader (with the ``gguf`` package) dequantises every tensor to fp32. What it gets
wrong, or leaves out, for the models shipped here, and is fixed before saving:

- EOS is the chat turn's end ``<|im_end|>`` (GGUF tokenizers come out with ``<|endoftext|>`` or
  ``<|im_start|>``), PAD is a distinct token (``<|endoftext|>``), and the generation config stops on EOS;
- ``clean_up_tokenization_spaces=False``: decoded code keeps its exact spacing (``x . y`` stays);
- ``model_max_length`` is the model's number of positions;
- the GGUF's own chat template is kept; a ChatML template is set only where the GGUF has none.
"""

from __future__ import annotations

import logging
from pathlib import Path

from openrlhf_populora.models.tiny import CHAT_TEMPLATE

log = logging.getLogger(__name__)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write the fixed HF directory of ``gguf`` into ``out`` (an existing, empty directory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    log.info("reading the tokenizer from %s", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    log.info("dequantising the weights to fp32")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 local_files_only=True)
    vocab = tokenizer.get_vocab()
    for token in (EOS_TOKEN, PAD_TOKEN):
        if token not in vocab:
            raise ValueError(f"{gguf.name}: its tokenizer has no {token!r} token; only ChatML models are supported")
    tokenizer.eos_token, tokenizer.pad_token = EOS_TOKEN, PAD_TOKEN
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.model_max_length = model.config.max_position_embeddings
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    eos_id, pad_id = vocab[EOS_TOKEN], vocab[PAD_TOKEN]
    model.config.eos_token_id, model.config.pad_token_id = eos_id, pad_id
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id, eos_token_id=eos_id,
                                               pad_token_id=pad_id)
    log.info("writing safetensors into %s", out.parent)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
