"""RMSNorm, with the native one-pass kernel where it runs (not under `torch.compile`:
there inductor fuses the torch ops into a kernel of its own)."""

import torch
from torch import nn

from llmserve.kernels import native_for, ptr


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype before the weight (as HF Llama)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_native = x.dim() == 2 and not torch.compiler.is_compiling()
        lib = native_for(x, self.weight) if use_native else None
        if lib is not None:  # one pass instead of seven ops
            out = torch.empty_like(x)
            lib.rms_norm(ptr(x), x.shape[0], x.shape[1], ptr(self.weight), self.eps, ptr(out))
            return out
        return self._torch_forward(x)

    def heads_(self, qkv: torch.Tensor, first: int, num_heads: int, head_dim: int) -> bool:
        """Normalise heads [first, first + num_heads) of fused qkv rows (T, C) in place, each
        head as a row (Qwen3's q and k norms), with the native kernel (the decoder stack's:
        the same bits); False (nothing done) where it cannot run."""
        lib = None if torch.compiler.is_compiling() else native_for(qkv, self.weight)
        if lib is None or qkv.dim() != 2:
            return False
        lib.rms_norm_heads(qkv.data_ptr() + 4 * first * head_dim, qkv.shape[0],
                           qkv.shape[1], num_heads, head_dim, ptr(self.weight),
                           self.eps)
        return True

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
