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
from llmserve.quantization.kquant import (
    KQuantLinearMethod,
    RawBlocks,
    can_pack,
    kquant_embedding,
    kquant_head,
)

# "kquant": a K-quant file's linears on their own blocks (quantization/kquant.py), the
# others (a file's non-K-quant tensors) on this method
KQUANT_FALLBACK = "int8"
QUANTIZATION_METHODS: dict[str, type[LinearMethod]] = {
    "int8": Int8LinearMethod,
    "int4": Int4LinearMethod,
    "int4-a8": Int4A8LinearMethod,
}


def linear_method(name: str | None) -> LinearMethod:
    """A fresh method instance for one layer; `None` gives the exact float method."""
    if name is None:
        return LinearMethod()
    if name == "kquant":
        return QUANTIZATION_METHODS[KQUANT_FALLBACK]()
    try:
        return QUANTIZATION_METHODS[name]()
    except KeyError:
        raise ValueError(
            f"unknown quantization {name!r}; choose one of: {', '.join(QUANTIZATION_METHODS)}"
        ) from None


# the LM head (and a tied embedding) stays int8 under int4: its logits feed sampling
# directly, and GGUF files keep it at 8 bits or more (Q8_0, Q6_K)
QUANTIZED_HEADS: dict[str, Callable[[torch.Tensor], nn.Module]] = {
    "int8": int8_head, "int4": int8_head, "int4-a8": int8_head, "kquant": int8_head}


def quantize_model(model: nn.Module, name: str | None,
                   raw_parts: dict[str, list[RawBlocks]] | None = None) -> None:
    """Switch every `Linear` of a loaded model to method `name` and repack its weights.

    "kquant": each linear whose row blocks `raw_parts` holds (module name -> its parts'
    K-quant blocks, as the file stores them) runs on them; the others on KQUANT_FALLBACK.
    A model with tied embeddings gets a quantized LM head (`raw_parts["lm_head"]`: the
    embedding's blocks, for "kquant"), and its embedding lookup reads that same table (one
    row gathered and dequantized per token): no float copy remains. An untied embedding
    whose blocks `raw_parts["embed_tokens"]` holds reads its rows from them likewise.
    """
    if name is None:
        return
    linear_method(name)  # validates the name
    raw_parts = raw_parts if name == "kquant" else {}
    for module_name, module in model.named_modules():
        if isinstance(module, Linear):
            parts = (raw_parts or {}).get(module_name)
            module.method = (KQuantLinearMethod(parts) if parts and can_pack(parts)
                             else linear_method(name))
            module.method.process_weights_after_loading(module)
    embed = (raw_parts or {}).get("embed_tokens")
    if embed and can_pack(embed) and getattr(model, "lm_head", None) is not None:
        model.model.embed_tokens = kquant_embedding(embed)  # untied: its own table
    if getattr(model, "lm_head", False) is None and getattr(model, "holds_head", True):
        # (tied; a later pipeline stage holds neither)
        parts = (raw_parts or {}).get("lm_head")
        if parts and can_pack(parts):
            model.lm_head = kquant_head(parts)
        else:
            model.lm_head = QUANTIZED_HEADS[name](model.model.embed_tokens.weight.data)
        model.model.embed_tokens = model.lm_head.as_embedding()
