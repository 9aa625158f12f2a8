"""llmserve: an LLM inference engine and OpenAI-compatible server on PyTorch."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "Logprob", "PoolingRequestOutput", "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "ScoringRequestOutput", "LoRARequest"]

if TYPE_CHECKING:
    from llmserve.llm import LLM
    from llmserve.lora_request import LoRARequest
    from llmserve.outputs import (
        ClassificationRequestOutput,
        CompletionOutput,
        EmbeddingRequestOutput,
        Logprob,
        PoolingRequestOutput,
        RequestOutput,
        ScoringRequestOutput,
    )
    from llmserve.pooling_params import PoolingParams
    from llmserve.sampling_params import SamplingParams

_LAZY = {
    "LLM": "llmserve.llm",
    "SamplingParams": "llmserve.sampling_params",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
    "Logprob": "llmserve.outputs",
    "PoolingParams": "llmserve.pooling_params",
    "PoolingRequestOutput": "llmserve.outputs",
    "EmbeddingRequestOutput": "llmserve.outputs",
    "ClassificationRequestOutput": "llmserve.outputs",
    "ScoringRequestOutput": "llmserve.outputs",
    "LoRARequest": "llmserve.lora_request",
}


def __getattr__(name: str):
    """Import on first use, so `llmserve --help` does not pay for importing torch."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
