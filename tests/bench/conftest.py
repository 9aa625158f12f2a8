"""A tiny random Llama for the engine-side benchmarks (quality, latency bookkeeping)."""

from pathlib import Path

import pytest
import torch
import transformers

from tests.tiny_models import save_byte_tokenizer

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    """A random Llama with a byte-level tokenizer: every byte is one of its 256 tokens."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(folder)
    save_byte_tokenizer(folder)
    return folder
