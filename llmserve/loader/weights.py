"""What a loader returns: the model config, its weights under canonical names, file metadata.

Canonical weight names are Hugging Face Llama names (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight`), whatever the file
format; `lm_head.weight` is absent when the embeddings are tied.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmserve.config import ModelConfig
from llmserve.errors import ModelNotFoundError

# (config, canonical tensor name) -> (rows, columns) to read; None: the whole dimension
WeightSlices = Callable[[ModelConfig, str], tuple[slice | None, slice | None]]


@dataclass
class LoadedWeights:
    """A model's config and its dense weights, keyed by canonical (HF Llama) names.

    `metadata` is format-specific: the GGUF key/value metadata (tokenizer, chat template)
    for a GGUF file, the parsed `config.json` for a Hugging Face folder.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)
    # the kernels that keep the file's quantization ("int4" for GGUF Q4_*, "int8" for other
    # quantized files), None for float weights
    quantization: str | None = None


def require_path(path: str | Path, *, is_dir: bool) -> Path:
    """Return `path` as a Path, or raise ModelNotFoundError if it is not a file/folder."""
    path = Path(path)
    exists = path.is_dir() if is_dir else path.is_file()
    if not exists:
        kind = "folder" if is_dir else "file"
        raise ModelNotFoundError(f"model {kind} not found: {path}")
    return path


def drop_tied_head(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """With tied embeddings the head *is* the embedding: keep one copy, under its name."""
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
