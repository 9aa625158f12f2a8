"""llmserve: an LLM inference engine and OpenAI-compatible server on PyTorch."""

from llmserve.llm import LLM
from llmserve.outputs import CompletionOutput, Logprob, RequestOutput
from llmserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
