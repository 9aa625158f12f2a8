"""A tiny stand-in for an llmserve server: OpenAI-shaped answers that name the replica.

What it does is scripted by the prompt (or the last message's content):
"error..." -> 400 in OpenAI's error shape; "busy..." -> 429 with Retry-After: 7;
"hang..." -> never answers; "slow..." streamed -> a chunk every 50 ms for a minute;
anything else -> the text "<name>" (streamed: three chunks "<name> ", then [DONE]).

Run in a thread (`serve_in_thread(FakeBackend(...).app)`), or as a process of its own
(`python -m tests.router.fake_backend NAME`, which prints "port N" once it listens).
"""

import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


def free_socket() -> socket.socket:
    """A socket on a free port of 127.0.0.1, bound (uvicorn listens on it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class FakeBackend:
    """The app, and what a test steers or inspects: health, requests seen, prefix hits."""

    def __init__(self, name: str, prefix_hits: int = 0) -> None:
        self.name = name
        self.healthy = True
        self.open_streams = 0
        self.seen: list[tuple[str, dict[str, str]]] = []  # (path, headers) of each request
        self.bodies: list[dict[str, Any]] = []  # the JSON body of each ({} if none)
        self.on_hold: Callable[[], None] | None = None  # called when a "hang" request arrives
        self.registry = CollectorRegistry()
        Counter("llmserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                registry=self.registry).inc(prefix_hits)
        Counter("llmserve_request_success", "Finished requests by finish reason.",
                ["finished_reason"], registry=self.registry).labels("stop").inc(2)
        Histogram("llmserve_time_to_first_token_seconds", "TTFT.", buckets=(0.1, 1.0),
                  registry=self.registry).observe(0.5)
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = await self._record(request)
            prompt = body.get("prompt")  # a batch or token ids: answered as any other prompt
            return await self._answer(body, prompt if isinstance(prompt, str) else "",
                                      "text_completion")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            body = await self._record(request)
            return await self._answer(body, body["messages"][-1]["content"], "chat.completion")

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            body = await self._record(request)
            return {"count": 2, "tokens": [1, 2], "max_model_len": 512, "by": self.name,
                    "prompt": body.get("prompt")}

        @app.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            await self._record(request)
            return {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0,
                                                "owned_by": self.name}]}

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type="text/plain")

        return app

    async def _record(self, request: Request) -> dict[str, Any]:
        self.seen.append((request.url.path, dict(request.headers)))
        raw = await request.body()
        body = json.loads(raw) if raw else {}
        self.bodies.append(body)
        return body

    async def _answer(self, body: dict[str, Any], prompt: str, kind: str) -> Response:
        if prompt.startswith("error"):
            return JSONResponse({"error": {"message": "max_tokens: must be at least 1",
                                           "type": "invalid_request_error",
                                           "param": "max_tokens", "code": None}},
                                status_code=400)
        if prompt.startswith("busy"):
            return JSONResponse({"error": {"message": "the queue is full",
                                           "type": "rate_limit_error", "param": None,
                                           "code": "rate_limit_exceeded"}},
                                status_code=429, headers={"Retry-After": "7"})
        if prompt.startswith("hang"):
            if self.on_hold is not None:
                self.on_hold()
            await asyncio.sleep(3600)
        if body.get("stream"):
            return StreamingResponse(self._events(kind, slow=prompt.startswith("slow")),
                                     media_type="text/event-stream")
        return JSONResponse(self._completion(kind))

    def _completion(self, kind: str) -> dict[str, Any]:
        if kind == "chat.completion":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.name},
                      "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": self.name, "finish_reason": "stop", "logprobs": None}
        return {"id": "fake-1", "object": kind, "created": 0, "model": "fake",
                "choices": [choice]}

    async def _events(self, kind: str, slow: bool) -> AsyncIterator[str]:
        self.open_streams += 1
        try:
            for event in self._chunks(kind, slow):
                yield event
                if slow:
                    await asyncio.sleep(0.05)
        finally:
            self.open_streams -= 1  # also when the client went away
        yield "data: [DONE]\n\n"

    def _chunks(self, kind: str, slow: bool) -> Iterator[str]:
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
        for i in range(1200 if slow else 3):
            if chunk_kind == "chat.completion.chunk":
                choice = {"index": 0, "delta": {"content": f"{self.name} "},
                          "finish_reason": None}
            else:
                choice = {"index": 0, "text": f"{self.name} ", "finish_reason": None,
                          "logprobs": None}
            chunk = {"id": f"fake-{i}", "object": chunk_kind, "created": 0, "model": "fake",
                     "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n"


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Serve `app` on a free port of 127.0.0.1 in a thread; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False,
                                           timeout_graceful_shutdown=1))
    sock = free_socket()
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)


def main() -> None:
    backend = FakeBackend(sys.argv[1], prefix_hits=int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    backend.on_hold = lambda: print("holding", flush=True)  # a test waits for this line
    sock = free_socket()
    print(f"port {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(backend.app, log_config=None, access_log=False)).run(
        sockets=[sock])


if __name__ == "__main__":
    main()
