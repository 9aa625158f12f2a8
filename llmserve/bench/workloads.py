"""Benchmark prompts with exact token counts: random, shared-prefix, or read from JSONL.

Prompts are text (every OpenAI-compatible server takes text), built from random token ids of
the *server's* tokenizer: decoded, re-encoded, and trimmed or topped up until the text
encodes to exactly the length asked for. The tokenizer is the model's own, loaded here, when
the model is a catalog name or a local file (or `--tokenizer-model`), else the server's
`/tokenize` and `/detokenize` (llmserve's, vLLM's or llama.cpp's shape).

A sweep gives every concurrency level prompts of its own seed: random token ids share no
prefix, so no level is flattered by the prefix cache an earlier level filled. The
shared-prefix workload is the explicit way to measure that cache.
"""

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from llmserve.errors import LLMServeError

logger = logging.getLogger(__name__)

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

    @staticmethod
    def can_load(model: str) -> bool:
        """Whether `model` names a catalog model or a local .gguf file or model folder."""
        from llmserve.loader.catalog import CATALOG

        return model in CATALOG or Path(model).expanduser().exists()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class ServerTokenizer:
    """A server's `POST /tokenize` and `/detokenize`, in either shape servers use.

    vLLM and llmserve: `{"prompt": text}` -> `{"tokens": [...]}`, `{"tokens": [...]}` ->
    `{"prompt": text}`. llama.cpp's llama-server: `{"content": text, "add_special": true}`
    -> `{"tokens": [...]}`, `{"tokens": [...]}` -> `{"content": text}` (it answers a body
    without "content" with no tokens, which is how the shapes are told apart).
    """

    _TEXT_KEYS = ("prompt", "content")

    def __init__(self, client: httpx.Client, model: str, text_key: str = "prompt") -> None:
        self._client = client
        self._model = model
        self._text_key = text_key
        self.vocab_size = self._vocab_size_from_models() or self._probe_vocab_size()

    @classmethod
    def probe(cls, client: httpx.Client, model: str) -> "ServerTokenizer | None":
        """The server's tokenizer if its /tokenize answers in a known shape, else None."""
        for key in cls._TEXT_KEYS:
            try:
                response = client.post("/tokenize", json=cls._tokenize_body(model, key, "hi"))
            except httpx.TransportError as e:
                raise LLMServeError(f"cannot reach {client.base_url}: {e}") from None
            if response.status_code == 200 and _json_tokens(response):
                return cls(client, model, key)
        return None

    @staticmethod
    def _tokenize_body(model: str, key: str, text: str) -> dict[str, object]:
        if key == "content":
            return {"content": text, "add_special": True}
        return {"model": model, "prompt": text}

    def encode(self, text: str) -> list[int]:
        response = self._post("/tokenize", self._tokenize_body(self._model, self._text_key, text))
        tokens = _json_tokens(response)
        if response.status_code != 200 or tokens is None:
            raise LLMServeError(f"/tokenize answered HTTP {response.status_code}: "
                                f"{response.text[:200]}")
        return tokens

    def decode(self, ids: list[int]) -> str:
        response = self._decode(ids)
        body = _json(response)
        text = next((body[k] for k in self._TEXT_KEYS if isinstance(body.get(k), str)), None)
        if response.status_code != 200 or text is None:
            raise LLMServeError(f"/detokenize answered HTTP {response.status_code}: "
                                f"{response.text[:200]}")
        return text

    def _post(self, path: str, body: dict[str, object]) -> httpx.Response:
        try:
            return self._client.post(path, json=body)
        except httpx.HTTPError as e:
            raise LLMServeError(f"{path} on {self._client.base_url} failed: {e}") from None

    def _decode(self, ids: list[int]) -> httpx.Response:
        return self._post("/detokenize", {"model": self._model, "tokens": ids})

    def _vocab_size_from_models(self) -> int | None:
        """llama.cpp lists `meta.n_vocab` under /v1/models; others do not."""
        try:
            data = _json(self._client.get("/v1/models")).get("data") or [{}]
            size = (data[0].get("meta") or {}).get("n_vocab")
        except (httpx.HTTPError, AttributeError, TypeError):
            return None
        return size if isinstance(size, int) and size > 0 else None

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


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _json_tokens(response: httpx.Response) -> list[int] | None:
    """The non-empty list of integer ids in a /tokenize answer, else None."""
    tokens = _json(response).get("tokens")
    if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
        return tokens
    return None


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
                   output_len: int, offset: int = 0) -> list[BenchRequest]:
    """Lines `{"prompt": str, "output_len"?: int}`: `num_prompts` of them from prompt number
    `offset` on, wrapping around at the end of the file (with a warning: prompts repeat)."""
    items = read_jsonl_prompts(path)
    start = offset % len(items)
    picked = (items[start:] + items[:start])[:num_prompts]
    if offset + len(picked) > len(items):
        logger.warning("%s holds %d prompts; prompts from %d on repeat earlier ones (prefix "
                       "caches will favour them)", path, len(items), offset)
    return [BenchRequest(prompt, len(tokenizer.encode(prompt)),
                         output_len if wanted is None else wanted)
            for prompt, wanted in picked]


def read_jsonl_prompts(path: Path) -> list[tuple[str, int | None]]:
    """Every (prompt, output_len or None) of a JSONL file, blank lines skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise LLMServeError(f"cannot read {path}: {e.strerror or e}") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
            wanted = int(item["output_len"]) if "output_len" in item else None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise LLMServeError(f"{path}:{number}: expected {{\"prompt\": ...}}") from None
        if not isinstance(prompt, str):
            raise LLMServeError(f"{path}:{number}: \"prompt\" must be a string")
        items.append((prompt, wanted))
    if not items:
        raise LLMServeError(f"{path} holds no prompts")
    return items
