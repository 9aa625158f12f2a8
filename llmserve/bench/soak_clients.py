"""`bench soak`'s clients: streamed requests of random lengths on both endpoints, a few
hung up on mid-stream, and the tally of what they saw (counts, latencies per window).
"""

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from llmserve.bench.serve import ENDPOINTS
from llmserve.bench.soak_report import latency_ms
from llmserve.bench.workloads import PromptTokenizer, exact_length_text
from llmserve.errors import LLMServeError


@dataclass(frozen=True)
class SoakRequest:
    endpoint: str  # a key of ENDPOINTS
    body: dict[str, Any]
    disconnect_after: int | None  # hang up after this many text chunks; None: read it all


@dataclass
class StreamRecord:
    """What the client saw of one request (perf_counter seconds)."""

    start: float
    first_token: float | None = None
    end: float = 0.0
    num_tokens: int = 0  # the usage chunk's completion_tokens, else text chunks
    outcome: str = "error"  # completed, disconnected or error
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.num_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.num_tokens - 1)

    @property
    def e2el(self) -> float:
        return self.end - self.start


@dataclass
class Tally:
    """Requests so far, and the completed ones since the last sample."""

    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # by message
    window: list[StreamRecord] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(
        default_factory=lambda: {"ttft_ms": [], "tpot_ms": [], "e2el_ms": []})

    def add(self, record: StreamRecord) -> None:
        self.outcomes[record.outcome] += 1
        if record.outcome == "error":
            self.errors[record.error[:160]] += 1
        if record.outcome != "completed":
            return
        self.window.append(record)
        for name, value in (("ttft_ms", record.ttft), ("tpot_ms", record.tpot),
                            ("e2el_ms", record.e2el)):
            if value is not None:
                self.latencies[name].append(value)

    def counts(self) -> dict[str, int]:
        return {"sent": self.sent, "completed": self.outcomes["completed"],
                "disconnected": self.outcomes["disconnected"],
                "errors": self.outcomes["error"]}

    def take_window(self) -> dict[str, Any]:
        records, self.window = self.window, []
        return {"completed": len(records),
                "output_tokens": sum(r.num_tokens for r in records),
                "ttft_ms": latency_ms([r.ttft for r in records if r.ttft is not None]),
                "tpot_ms": latency_ms([r.tpot for r in records if r.tpot is not None]),
                "e2el_ms": latency_ms([r.e2el for r in records])}


def plan_request(input_len: tuple[int, int], output_len: tuple[int, int],
                 disconnect_fraction: float, model: str, tokenizer: PromptTokenizer,
                 rng: random.Random) -> SoakRequest:
    """A request of random prompt and output lengths, exactly `output_len` tokens long
    (`min_tokens` and `ignore_eos`), on a random endpoint; maybe one to hang up on."""
    num_prompt, num_output = rng.randint(*input_len), rng.randint(*output_len)
    endpoint = rng.choice(tuple(ENDPOINTS))
    prompt = exact_length_text(tokenizer, rng, num_prompt)
    body: dict[str, Any] = {
        "model": model, "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0.0, "max_tokens": num_output, "min_tokens": num_output,
        "ignore_eos": True,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    disconnect_after = None
    if rng.random() < disconnect_fraction:
        disconnect_after = rng.randint(1, max(1, num_output - 1))
    return SoakRequest(endpoint, body, disconnect_after)


async def stream_once(client: httpx.AsyncClient, request: SoakRequest) -> StreamRecord:
    """Send one streamed request and read it (or hang up as planned)."""
    record = StreamRecord(start=time.perf_counter())
    num_chunks = 0
    try:
        async with client.stream("POST", ENDPOINTS[request.endpoint],
                                 json=request.body) as response:
            if response.status_code != 200:
                await response.aread()
                raise LLMServeError(f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    record.outcome = "completed"
                    break
                event = json.loads(data)
                if "error" in event:
                    raise LLMServeError(f"error event: {event['error'].get('message')}")
                if _has_text(event):
                    num_chunks += 1
                    if record.first_token is None:
                        record.first_token = time.perf_counter()
                    if num_chunks == request.disconnect_after:
                        record.outcome = "disconnected"  # leaving the block closes it
                        break
                usage = event.get("usage")
                if usage:
                    record.num_tokens = usage["completion_tokens"]
            else:
                raise LLMServeError("the stream ended without [DONE]")
        record.num_tokens = record.num_tokens or num_chunks
    except (httpx.HTTPError, LLMServeError, json.JSONDecodeError, KeyError) as e:
        record.outcome, record.error = "error", f"{type(e).__name__}: {e}"
    record.end = time.perf_counter()
    return record


def _has_text(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False
