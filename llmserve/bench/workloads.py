"""Benchmark prompts with exact token counts: random, shared-prefix, or read from JSONL.

Prompts are text (every OpenAI-compatible server takes text), built from random token ids of
the *server's* tokenizer: decoded, re-encoded, and trimmed or topped up until the text
encodes to exactly the length asked for. The tokenizer is the server's own `/tokenize` and
`/detokenize` when it has them (llmserve, vLLM), else a local one (`--tokenizer-model`).
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from llmserve.errors import LLMServeError

# Ids below this are special tokens and single bytes in common vocabularies; text made of
# them re-tokenizes badly, so prompts draw from above it.
_LOWEST_ID = 256
_MAX_FIT_ROUNDS = 16


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


class PromptTokenizer(Protocol):
    """What the workloads need of a tokenizer; encode adds special tokens as servers do."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LocalTokenizer:
    """A model's tokenizer loaded here (llmserve.tokenizer.Tokenizer)."""

    def __init__(self, model: str) -> None:
        from llmserve.loader.catalog import resolve_model
        from llmserve.tokenizer import Tokenizer

        source = resolve_model(model)
        path = source.path
        self._tok = (Tokenizer.from_gguf(path) if source.kind == "gguf"
                     else Tokenizer.from_hf_folder(path))
        self.vocab_size = self._tok.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class ServerTokenizer:
    """A server's `POST /tokenize` and `/detokenize` (llmserve's and vLLM's shape)."""

    def __init__(self, client: httpx.Client, model: str) -> None:
        self._client = client
        self._model = model
        self.vocab_size = self._probe_vocab_size()

    @classmethod
    def available(cls, client: httpx.Client, model: str) -> bool:
        try:
            response = client.post("/tokenize", json={"model": model, "prompt": "hi"})
        except httpx.TransportError as e:
            raise LLMServeError(f"cannot reach {client.base_url}: {e}") from None
        return response.status_code == 200 and "tokens" in response.json()

    def encode(self, text: str) -> list[int]:
        response = self._client.post("/tokenize", json={"model": self._model, "prompt": text})
        response.raise_for_status()
        return response.json()["tokens"]

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids).json()["prompt"]

    def _decode(self, ids: list[int]) -> httpx.Response:
        return self._client.post("/detokenize", json={"model": self._model, "tokens": ids})

    def _probe_vocab_size(self) -> int:
        """The smallest id /detokenize refuses, found by doubling then bisecting."""
        high = 1024
        while self._decode([high]).status_code == 200:
            high *= 2
            if high > 2**24:
                raise LLMServeError("/detokenize accepts every token id; cannot find the vocab")
        low = high // 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self._decode([mid]).status_code == 200 else (low, mid)
        return high


def exact_length_text(tokenizer: PromptTokenizer, rng: random.Random, length: int) -> str:
    """Text of random tokens that `tokenizer` encodes to exactly `length` tokens."""
    high = tokenizer.vocab_size
    ids = [rng.randrange(_LOWEST_ID, high) for _ in range(length)]
    for _ in range(_MAX_FIT_ROUNDS):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text)
        if len(encoded) == length:
            return text
        if len(encoded) > length:
            ids = encoded[:length]
        else:
            ids = encoded + [rng.randrange(_LOWEST_ID, high) for _ in range(length - len(encoded))]
    raise LLMServeError(f"could not build a prompt of exactly {length} tokens")


def random_workload(tokenizer: PromptTokenizer, num_prompts: int, input_len: int,
                    output_len: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(exact_length_text(tokenizer, rng, input_len), input_len, output_len)
            for _ in range(num_prompts)]


def shared_prefix_workload(tokenizer: PromptTokenizer, num_prompts: int, prefix_len: int,
                           input_len: int, output_len: int,
                           seed: int = 0) -> list[BenchRequest]:
    """One common prefix of `prefix_len` tokens, then `input_len` tokens of each question."""
    rng = random.Random(seed)
    prefix = exact_length_text(tokenizer, rng, prefix_len)
    requests = []
    for _ in range(num_prompts):
        prompt = prefix + "\n" + exact_length_text(tokenizer, rng, input_len)
        requests.append(BenchRequest(prompt, len(tokenizer.encode(prompt)), output_len))
    return requests


def jsonl_workload(path: Path, tokenizer: PromptTokenizer, num_prompts: int,
                   output_len: int) -> list[BenchRequest]:
    """Lines `{"prompt": str, "output_len"?: int}`; the first `num_prompts` of them."""
    requests = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LLMServeError(f"cannot read {path}: {e.strerror or e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LLMServeError(f"{path}:{number}: expected {{\"prompt\": ...}}") from None
        wanted = int(item.get("output_len", output_len))
        requests.append(BenchRequest(prompt, len(tokenizer.encode(prompt)), wanted))
        if len(requests) == num_prompts:
            break
    if not requests:
        raise LLMServeError(f"{path} holds no prompts")
    return requests
