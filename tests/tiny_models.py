"""Tiny random checkpoints for the reference tests: random weights (norms and biases too)
saved as a Hugging Face folder with a byte-level tokenizer (every byte one of 256 tokens),
so that an engine can load it and `transformers` runs the same weights."""

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights drawn large enough that a mistake shows in the logits (norms around 1)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.dim() == 1 else 0.08)


def save_byte_tokenizer(folder: Path) -> None:
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")


def save_tiny(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """`model` randomised and saved to `folder` with the byte tokenizer; returns it in eval
    mode (the reference)."""
    randomize(model)
    model.save_pretrained(folder)
    save_byte_tokenizer(folder)
    return model.eval()
