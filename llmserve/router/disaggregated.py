"""Disaggregated prefill/decode: one prefill server and one decode server behind the router.

A generation request that can be split makes two hops, tied by a fresh `transfer_id`:

1. to the prefill server, the body asking for one token, not streamed, with
   `kv_transfer_params: {"do_remote_decode": true, "transfer_id": ...}`: it computes the
   prompt's KV cache and holds it for the decode server. An answer other than 200 goes back
   to the client as it is, and the decode server never sees the request;
2. to the decode server, the client's body with `kv_transfer_params: {"transfer_id": ...}`:
   it pulls that KV cache and generates; its answer (a stream too) is the client's.

A request that cannot be split (several choices, beams, logprobs, echo, a batch of prompts:
what the one-token prefill hop does not carry over) goes to the decode server unchanged,
which is a whole engine and computes the prompt itself; so do /tokenize, /detokenize and
/v1/models. The two hops go through the proxy's `forward` (via `Router.send`), as a
data-parallel router's requests do, so errors, streams, failures and clients leaving are
handled there once.
"""

import json
import logging
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from llmserve.router.base import Router, RouterSettings, down_response, json_or_none
from llmserve.router.metrics import DisaggregatedMetrics
from llmserve.router.replicas import Replica

logger = logging.getLogger(__name__)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


class DisaggregatedRouter(Router):
    """Generation requests split into a prefill hop and a decode hop; the rest to decode."""

    metrics: DisaggregatedMetrics

    def __init__(self, prefill_url: str, decode_url: str, settings: RouterSettings) -> None:
        self.prefill = Replica(0, prefill_url, role="prefill")
        self.decode = Replica(1, decode_url, role="decode")
        super().__init__([self.prefill, self.decode], settings, DisaggregatedMetrics())

    async def route(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        if path not in (COMPLETIONS, CHAT):
            return await self.send_or_503(self.decode, request, body)
        parsed = json_or_none(body)
        why = direct_reason(path, parsed)
        if why is not None:
            logger.debug("%s goes to the decode server directly: %s", path, why)
            self.metrics.split.labels(path="direct").inc()
            return await self.send_or_503(self.decode, request, body)
        self.metrics.split.labels(path="split").inc()
        return await self.split(request, parsed)

    async def split(self, request: Request, body: dict[str, Any]) -> Response:
        """The prefill hop, then, if the prefill server answered 200, the decode hop."""
        if not self.decode.is_up:  # a prefill nobody would decode is wasted work
            return down_response(self.decode.describe_down())
        transfer_id = uuid.uuid4().hex
        start = time.perf_counter()
        prefilled = await self.send_or_503(self.prefill, request,
                                           _encode(prefill_body(body, transfer_id)))
        if prefilled.status_code != 200:
            return prefilled  # its error (or a 503 for a prefill server that is down)
        self.metrics.prefill_seconds.observe(time.perf_counter() - start)
        return await self.send_or_503(self.decode, request,
                                      _encode(decode_body(body, transfer_id)))

    async def models(self, request: Request) -> Response:
        return await self.send_or_503(self.decode, request, b"")


def direct_reason(path: str, body: Any) -> str | None:
    """Why a request to `path` (completions or chat) with JSON `body` cannot be split into a
    prefill hop and a decode hop; None if it can."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    for name in ("n", "best_of"):
        if not _absent_or_one(body.get(name)):
            return f"{name} is {body[name]!r}, not 1"
    if body.get("use_beam_search"):
        return "it uses beam search"
    if body.get("echo"):
        return "it echoes the prompt"
    if body.get("prompt_logprobs") is not None:
        return "it asks for prompt logprobs"
    if path == CHAT:
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            return "it asks for logprobs"
        return None
    if body.get("logprobs") is not None:
        return "it asks for logprobs"
    if not _single_prompt(body.get("prompt")):
        return "the prompt is not a single prompt"
    return None


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """What the prefill server gets: `body` asking for one token, whole (not streamed), and
    keeping the prompt's KV cache for the decode server under `transfer_id`."""
    prefill = {k: v for k, v in body.items() if k != "stream_options"}
    prefill.update(max_tokens=1, stream=False,
                   kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
    if "max_completion_tokens" in body:  # chat: it wins over max_tokens
        prefill["max_completion_tokens"] = 1
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int | float) and not isinstance(min_tokens, bool):
        prefill["min_tokens"] = min(min_tokens, 1)
    return prefill


def decode_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """What the decode server gets: the client's `body`, and where its KV cache waits."""
    return {**body, "kv_transfer_params": {"transfer_id": transfer_id}}


def _absent_or_one(value: Any) -> bool:
    return value is None or (value == 1 and not isinstance(value, bool))


def _single_prompt(prompt: Any) -> bool:
    """A string, a list of token ids, or a batch of exactly one of either."""
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list):
        return False
    return len(prompt) == 1 or all(isinstance(t, int) for t in prompt)


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()
