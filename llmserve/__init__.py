"""llmserve: an LLM inference engine and OpenAI-compatible server on PyTorch."""

import os
from typing import TYPE_CHECKING

# OpenMP worker threads spin while waiting for work by default; on a machine with as few
# cores as threads, any other busy process (the HTTP server, a tokenizer, a benchmark
# client) then makes every parallel region wait for a descheduled spinner, and decode slows
# by 10x (measured: 1.4 vs 15 tok/s at batch 1 with a second process busy). Passive waiting
# costs little when the machine is quiet. It must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# numpy's OpenBLAS starts a pool of threads that poll for work; llmserve never uses numpy for
# compute, and on a small machine those threads take cycles from the kernels.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

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
