"""Gated MLP activations on fused [gate | up] rows (native SwiGLU where it runs, not under
`torch.compile`)."""

import torch
import torch.nn.functional as F

from llmserve.kernels import native_for, ptr


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> silu(gate) * up, (T, I)."""
    out = _native(gate_up, "silu_and_mul")
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> gelu_tanh(gate) * up, (T, I) (Gemma's GeGLU)."""
    out = _native(gate_up, "gelu_tanh_and_mul")
    if out is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
    return out


def _native(gate_up: torch.Tensor, kernel: str) -> torch.Tensor | None:
    """The native kernel's result (the one the decoder stack calls), or None where it does
    not run (another device or dtype, under `torch.compile`)."""
    lib = native_for(gate_up) if gate_up.dim() == 2 and not torch.compiler.is_compiling() else None
    if lib is None:
        return None
    t, width = gate_up.shape
    out = gate_up.new_empty(t, width // 2)
    getattr(lib, kernel)(ptr(gate_up), t, width // 2, ptr(out))
    return out
