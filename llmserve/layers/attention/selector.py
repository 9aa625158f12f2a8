"""Which attention backend runs on a device: by name, or the fastest there ("auto")."""

import torch

from llmserve.config.engine import ATTENTION_BACKEND_CHOICES
from llmserve.kernels import native
from llmserve.layers.attention.backend import AttentionBackend, TorchBackend
from llmserve.layers.attention.flex import flex_backend
from llmserve.layers.attention.native import NativeCPUBackend


def reads_only_written_slots(device: torch.device, name: str = "auto") -> bool:
    """Whether the backend for `device` never reads a cache slot before writing it (the
    native kernel reads keys < each query's position)."""
    return attention_backend(device, name).reads_only_written_slots


def attention_backend(device: torch.device, name: str = "auto") -> AttentionBackend:
    """The backend `name` for `device`; "auto" is the fastest there: the native kernels on
    the CPU when they build, flex_attention on CUDA, else the plain torch one."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"attention_backend must be one of "
                         f"{', '.join(ATTENTION_BACKEND_CHOICES)}, "
                         f"not {name!r}")
    device = torch.device(device)
    if name == "native" or (name == "auto" and device.type == "cpu" and native() is not None):
        if device.type != "cpu":
            raise ValueError("attention_backend native runs on the CPU only")
        return NativeCPUBackend()
    if name == "flex" or (name == "auto" and device.type == "cuda" and _has_flex_attention()):
        if not _has_flex_attention():
            raise ValueError("attention_backend flex needs torch.nn.attention.flex_attention")
        return flex_backend(device)
    return TorchBackend()


def _has_flex_attention() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True
