"""Shared layers of decoder models: linear (pluggable weight method), RMSNorm, rotary, embedding."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels import native_for, ptr


def _tracing() -> bool:
    """Under `torch.compile` the native helpers (ctypes) give way to torch ops, which
    inductor fuses into kernels of its own."""
    return torch.compiler.is_compiling()


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


class PackedEmbedding(nn.Module):
    """Token embedding read from a packed head's table (`embedding_rows`: float rows)."""

    def __init__(self, weight: Any) -> None:
        super().__init__()
        self.table = weight

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.table.embedding_rows(token_ids)  # (T, hidden)


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


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype before the weight (as HF Llama)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib = native_for(x, self.weight) if x.dim() == 2 and not _tracing() else None
        if lib is not None:  # one pass instead of seven ops
            out = torch.empty_like(x)
            lib.llmserve_rms_norm(ptr(x), x.shape[0], x.shape[1], ptr(self.weight), self.eps,
                                  ptr(out))
            return out
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency-dependent rope scaling: long wavelengths slowed by `factor`."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_ctx / low_freq_factor
    high_freq_wavelen = old_ctx / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half layout) with a precomputed cos/sin table."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (base**exponents)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        if kind == "linear":
            positions = positions / scaling["factor"]
        freqs = torch.outer(positions, inv_freq)  # (max_position, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_position, head_dim)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> "RotaryPositions":
        """The rotation for one step's tokens, shared by all layers."""
        return RotaryPositions(positions, self.cos_cache, self.sin_cache, dtype)


@dataclass
class RotaryPositions:
    """Rotary tables at one step's positions (T,); cos/sin looked up once, when first used."""

    positions: torch.Tensor
    cos_cache: torch.Tensor  # (max_position, head_dim)
    sin_cache: torch.Tensor
    dtype: torch.dtype

    _cos_sin: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False)

    @property
    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each (T, 1, head_dim) in the compute dtype, looked up when first used (the
        native in-place rotation never needs them). Not a `cached_property`: its lock would
        break a `torch.compile` graph. Kept as (T, head_dim): a compiled decoder layer that
        takes them as inputs sees no size-1 dimension to make symbolic."""
        if self._cos_sin is None:
            self.look_up()
        cos, sin = self._cos_sin
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def look_up(self) -> None:
        cos = self.cos_cache[self.positions].to(self.dtype)
        sin = self.sin_cache[self.positions].to(self.dtype)
        self._cos_sin = (cos, sin)

    def rotate_qkv_(self, qkv: torch.Tensor, num_rotated_heads: int, head_dim: int) -> bool:
        """Rotate the first `num_rotated_heads` heads (q, then k) of fused qkv rows (T, C)
        in place with the native kernel; False (nothing done) where it cannot run."""
        lib = None if _tracing() else native_for(qkv, self.cos_cache)
        if lib is None or qkv.dim() != 2 or self.positions.dtype != torch.long:
            return False
        lib.llmserve_rotary_inplace(
            ptr(qkv), qkv.shape[0], qkv.shape[1], num_rotated_heads, head_dim,
            ptr(self.positions), ptr(self.cos_cache), ptr(self.sin_cache))
        return True


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, rope: RotaryPositions
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (T, num_heads, head_dim), k: (T, num_kv_heads, head_dim) rotated by position."""
    cos, sin = rope.cos_sin
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Embedding(nn.Module):
    """Token embedding; its weight doubles as the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> silu(gate) * up, (T, I)."""
    lib = native_for(gate_up) if gate_up.dim() == 2 and not _tracing() else None
    if lib is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    t, width = gate_up.shape
    out = gate_up.new_empty(t, width // 2)
    lib.llmserve_silu_and_mul(ptr(gate_up), t, width // 2, ptr(out))
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> gelu_tanh(gate) * up, (T, I) (Gemma's GeGLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
