"""Gated MLP activations on fused [gate | up] rows (native SwiGLU where it runs, not under
`torch.compile`)."""

import torch
import torch.nn.functional as F

from llmserve.kernels import native_for, ptr


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> silu(gate) * up, (T, I)."""
    lib = native_for(gate_up) if gate_up.dim() == 2 and not torch.compiler.is_compiling() else None
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
