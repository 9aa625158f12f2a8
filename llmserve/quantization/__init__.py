"""Quantization methods for linear layers, picked by name from a registry.

`None` (the default) is the exact path: float weights, `F.linear`. Other methods replace
how a `Linear` stores its weight and computes its product, without the model changing.
"""

from collections.abc import Callable

import torch
from torch import nn

from llmserve.layers.linear import Linear, LinearMethod
from llmserve.quantization.int4 import Int4A8LinearMethod, Int4LinearMethod
from llmserve.quantization.int8 import Int8LinearMethod, int8_head

QUANTIZATION_METHODS: dict[str, type[LinearMethod]] = {
    "int8": Int8LinearMethod,
    "int4": Int4LinearMethod,
    "int4-a8": Int4A8LinearMethod,
}


def linear_method(name: str | None) -> LinearMethod:
    """A fresh method instance for one layer; `None` gives the exact float method."""
    if name is None:
        return LinearMethod()
    try:
        return QUANTIZATION_METHODS[name]()
    except KeyError:
        raise ValueError(
            f"unknown quantization {name!r}; choose one of: {', '.join(QUANTIZATION_METHODS)}"
        ) from None


# the LM head (and a tied embedding) stays int8 under int4: its logits feed sampling
# directly, and GGUF files keep it at 8 bits or more (Q8_0, Q6_K)
QUANTIZED_HEADS: dict[str, Callable[[torch.Tensor], nn.Module]] = {
    "int8": int8_head, "int4": int8_head, "int4-a8": int8_head}


def quantize_model(model: nn.Module, name: str | None) -> None:
    """Switch every `Linear` of a loaded model to method `name` and repack its weights.

    A model with tied embeddings gets a quantized LM head, and its embedding lookup reads
    that same int8 table (one row gathered and scaled per token): no float copy remains.
    """
    if name is None:
        return
    linear_method(name)  # validates the name
    for module in model.modules():
        if isinstance(module, Linear):
            module.method = linear_method(name)
            module.method.process_weights_after_loading(module)
    if getattr(model, "lm_head", False) is None:
        model.lm_head = QUANTIZED_HEADS[name](model.model.embed_tokens.weight.data)
        model.model.embed_tokens = model.lm_head.as_embedding()
