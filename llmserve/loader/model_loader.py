"""Build a ready model and its tokenizer from a model spec (catalog name, .gguf, HF folder)."""

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.config import ModelConfig
from llmserve.loader.catalog import ModelSource, resolve_model
from llmserve.loader.gguf import load_gguf
from llmserve.loader.hf import load_hf_folder
from llmserve.models.registry import model_class
from llmserve.quantization import quantize_model
from llmserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    config: ModelConfig
    source: ModelSource
    quantization: str | None = None  # what the linear layers actually run ("int8"; None: float)


def load_model(
    spec: str | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
) -> LoadedModel:
    """Resolve `spec`, read weights and tokenizer, and return the model in eval mode.

    `quantization` (e.g. "int8") repacks the linear layers after loading; None is exact;
    "auto" means int8 for a quantized checkpoint on the CPU (as llama.cpp keeps a GGUF's
    quantization), exact float otherwise.
    """
    start = time.perf_counter()
    source = resolve_model(spec)
    if source.kind == "gguf":
        weights = load_gguf(source.path, dtype)
        tokenizer = Tokenizer.from_gguf_metadata(weights.metadata)
    else:
        weights = load_hf_folder(source.path, dtype)
        tokenizer = Tokenizer.from_hf_folder(source.path)
    with torch.device(device):
        model = model_class(weights.config)(weights.config)
    model.to(dtype=dtype)
    model.load_weights(weights.tensors)
    weights.tensors.clear()  # the model holds the only copy now: lower peak memory
    if quantization == "auto":
        on_cpu = torch.device(device).type == "cpu"
        quantization = "int8" if weights.quantized and on_cpu else None
    quantize_model(model, quantization)
    if hasattr(model, "enable_native_layers"):
        model.enable_native_layers()
    model.eval()
    logger.info("loaded %s (%s, %s weights) in %.1fs", source.name, source.kind,
                quantization or str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return LoadedModel(model, tokenizer, weights.config, source, quantization)
