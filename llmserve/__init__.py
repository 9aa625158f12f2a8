"""llmserve: an LLM inference engine and OpenAI-compatible server on PyTorch."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

if TYPE_CHECKING:
    from llmserve.llm import LLM
    from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
    from llmserve.sampling_params import SamplingParams

_LAZY = {
    "LLM": "llmserve.llm",
    "SamplingParams": "llmserve.sampling_params",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
    "Logprob": "llmserve.outputs",
}


def __getattr__(name: str):
    """Import on first use, so `llmserve --help` does not pay for importing torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
