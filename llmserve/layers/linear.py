"""Linear layers whose weight layout and matmul are chosen by a `LinearMethod` (float, or a
quantized or packed format that replaces it per layer), and the packed LM head."""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.embedding import PackedEmbedding


class LinearMethod:
    """How a linear layer stores its weight and computes `x @ W.T (+ b)`.

    The unquantized method is the exact path; quantized methods (int8/int4 weight-only)
    replace it per layer without the model code changing.
    """

    def create_weights(self, layer: "Linear") -> None:
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features), requires_grad=False
        )

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Repack the loaded float weight (quantize it, ...); the float method keeps it."""

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class PackedLinearMethod(LinearMethod):
    """A method that keeps only a packed form of the loaded float weight.

    Subclasses name `pack` (float weight -> packed object with `tensors()`, which become
    the layer's buffers) and `compute` (x, packed, bias -> y).
    """

    pack: Callable[[torch.Tensor], Any]
    compute: Callable[..., torch.Tensor]

    def process_weights_after_loading(self, layer: "Linear") -> None:
        self.weight = type(self).pack(layer.weight.data)
        for name, tensor in self.weight.tensors().items():
            layer.register_buffer(name, tensor)
        layer.weight = None  # the float copy is no longer needed

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return type(self).compute(x, self.weight, layer.bias)


class PackedHead(nn.Module):
    """The LM head (or a tied embedding) in a packed form, for `compute_logits`; a tied
    embedding then reads its rows from the same table (`as_embedding`): one copy."""

    def __init__(self, weight: Any, linear: Callable[[torch.Tensor, Any], torch.Tensor]
                 ) -> None:
        super().__init__()
        self.weight = weight
        self._linear = linear
        for name, tensor in weight.tensors().items():
            self.register_buffer(name, tensor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.weight).float()

    def as_embedding(self) -> "PackedEmbedding":
        return PackedEmbedding(self.weight)


class Linear(nn.Module):
    """`y = x W^T + b` whose weight layout and matmul are chosen by a `LinearMethod`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.method = method or LinearMethod()
        self.method.create_weights(self)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)
