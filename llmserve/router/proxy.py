"""Forward one HTTP request to one replica and pass its answer back unchanged.

Status codes, bodies and error bodies pass through as the replica sent them; an event
stream passes through event by event. What the replica cannot say itself becomes an
OpenAI-shaped 503: it refused the connection, dropped it, or was marked down while the
request was in flight (for a stream already started: an SSE error event, then the end). An
Ollama stream (newline-delimited JSON) passes through line by line likewise, a failure
ending it with an `{"error": ...}` line.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response

from llmserve.entrypoints.openai.http_layer import error_response
from llmserve.entrypoints.openai.protocol import error_body
from llmserve.entrypoints.openai.serving_base import (
    NDJSONResponse,
    SSEResponse,
    client_gone,
)
from llmserve.router.replicas import Replica
from llmserve.router.upstream import UpstreamResponse, exchange

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # as the server answers a client that went away
# Hop-by-hop headers, and what the client's HTTP library sets for the replica itself.
# accept-encoding stays behind so the replica's bytes are never compressed in between.
_REQUEST_HEADERS_DROPPED = frozenset({
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
    "trailer", "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding",
    "x-llmserve-load-seconds"})  # the router's own word to the backend (serving_ollama)
_RESPONSE_HEADERS_KEPT = ("content-type", "retry-after", "www-authenticate")


class ReplicaFailed(Exception):
    """The replica went down (or dropped the connection) before it answered."""

    def __init__(self, replica: Replica, why: str, connect_failed: bool = False) -> None:
        super().__init__(f"{replica.name} is down: {why}")
        self.replica = replica
        self.connect_failed = connect_failed  # True: the request never reached the replica


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _REQUEST_HEADERS_DROPPED}


async def forward(replica: Replica, request: Request, body: bytes,
                  on_done: Callable[[bool], None],
                  extra_headers: Mapping[str, str] | None = None) -> Response:
    """The replica's answer to `request` (whose body was read: `body`) as a response.

    `on_done(failed)` runs once the exchange is over: at once for a whole response or a
    failure, when the event stream ends for a stream; `failed`: the replica failed it.
    Raises `ReplicaFailed`; a client that goes away first gets 499 (and the replica sees
    the connection close: it aborts).
    """
    query = request.url.query
    target = f"{request.url.path}?{query}" if query else request.url.path
    try:
        try:
            headers = {**forwarded_headers(request.headers), **(extra_headers or {})}
            upstream = await _from_replica(replica, request, exchange(
                replica.url, request.method, target, headers, body))
        except BaseException as e:
            on_done(isinstance(e, ReplicaFailed))
            raise
        stream = _stream_kind(upstream)
        if stream is not None:
            return stream.response(_relay_events(upstream, replica, on_done, stream))
        failed = True
        try:
            content = await _from_replica(replica, request, upstream.aread())
            failed = False
        finally:
            await upstream.aclose()
            on_done(failed)
    except _ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    headers = {k: upstream.headers[k] for k in _RESPONSE_HEADERS_KEPT if k in upstream.headers}
    return Response(content, status_code=upstream.status_code, headers=headers)


def replica_failed_response(failure: ReplicaFailed, path: str = "") -> Response:
    """The 503 for a request its backend failed, in the shape of the route at `path`."""
    return error_response(503, str(failure), headers={"Retry-After": "1"}, path=path)


class _ClientGone(Exception):
    pass


async def _from_replica(replica: Replica, request: Request | None, work: Awaitable[T]) -> T:
    """Await `work` (an exchange with the replica), unless the replica is marked down first
    or the client goes away first; a failed connection is a `ReplicaFailed` too."""
    try:
        return await _unless_down(replica, request, work)
    except httpx.ConnectError as e:
        raise ReplicaFailed(replica, f"cannot connect ({e})", connect_failed=True) from None
    except httpx.TransportError as e:
        raise ReplicaFailed(replica, f"the connection failed ({type(e).__name__}: {e})"
                            ) from None


async def _unless_down(replica: Replica, request: Request | None, work: Awaitable[T]) -> T:
    """Await `work`, unless the replica is marked down first (`ReplicaFailed`) or the
    client goes away first (`_ClientGone`); either way `work` is cancelled."""
    task = asyncio.ensure_future(work)
    watchers = {asyncio.ensure_future(replica.down.wait())}
    if request is not None:
        watchers.add(asyncio.ensure_future(client_gone(request)))
    try:
        done, _ = await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        for watcher in watchers:
            watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # unwound before the stream is closed
    if replica.down.is_set():
        raise ReplicaFailed(replica, replica.reason)
    raise _ClientGone


class _Stream:
    """A streamed answer's framing: what separates its items, and the item a failure ends
    it with."""

    def __init__(self, response: type[SSEResponse], separator: bytes,
                 error: Callable[[str], bytes]) -> None:
        self.response = response
        self.separator = separator
        self.error = error


def _error_event(message: str) -> bytes:
    body: dict[str, Any] = error_body(message, "service_unavailable_error", code=503)
    return f"data: {json.dumps(body)}\n\n".encode()


def _error_line(message: str) -> bytes:
    return (json.dumps({"error": message}) + "\n").encode()


_EVENT_STREAM = _Stream(SSEResponse, b"\n\n", _error_event)
_NDJSON_STREAM = _Stream(NDJSONResponse, b"\n", _error_line)


def _stream_kind(response: UpstreamResponse) -> _Stream | None:
    if response.status_code != 200:
        return None
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        return _EVENT_STREAM
    if content_type.startswith("application/x-ndjson"):
        return _NDJSON_STREAM
    return None


async def _relay_events(upstream: UpstreamResponse, replica: Replica,
                        on_done: Callable[[bool], None], stream: _Stream
                        ) -> AsyncIterator[bytes]:
    """The replica's events (or lines), each whole (one cut off by a failure is dropped),
    then an error item if the replica fails mid-stream.

    One watcher for the whole stream cancels the relay if the replica is marked down (not
    a task per chunk: a token's event is relayed with no more than a read and a send)."""
    relay = asyncio.current_task()
    went_down = False

    def on_down(watch: asyncio.Future) -> None:
        nonlocal went_down
        if not watch.cancelled() and relay is not None:
            went_down = True
            relay.cancel()

    watcher = asyncio.ensure_future(replica.down.wait())
    watcher.add_done_callback(on_down)
    pending, failed = b"", False
    try:
        try:
            async for chunk in upstream.aiter_raw():
                *events, pending = (pending + chunk).split(stream.separator)
                if events:  # every whole event of the chunk in one send
                    yield stream.separator.join(events) + stream.separator
        except asyncio.CancelledError:
            if not went_down:
                raise  # the client went away (or the server stops)
            relay.uncancel()
            failed = True
            yield stream.error(str(ReplicaFailed(replica, replica.reason)))
            return
        except httpx.TransportError as e:
            failed = True
            yield stream.error(str(ReplicaFailed(
                replica, f"the connection failed ({type(e).__name__}: {e})")))
            return
        if pending.strip():
            yield pending
    finally:
        watcher.remove_done_callback(on_down)
        watcher.cancel()
        on_done(failed)
        await upstream.aclose()
