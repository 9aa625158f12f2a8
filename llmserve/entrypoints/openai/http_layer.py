"""The HTTP plumbing around the routes: OpenAI-shaped errors, API-key auth, body-size limit,
and /openapi.json saying so.

The middlewares are plain ASGI (not `BaseHTTPMiddleware`), so streamed responses pass
through untouched and a client's disconnect still reaches the route.
"""

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.config.engine import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
)
from llmserve.engine.async_engine import (
    EngineShutdown,
    EngineStepError,
    QueueFull,
    RequestTimeout,
)
from llmserve.entrypoints.openai.protocol import (
    AnthropicErrorResponse,
    BadRequest,
    ErrorResponse,
    OllamaErrorResponse,
    error_body,
)

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 405: "invalid_request_error",
                408: "timeout_error",
                413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error", 504: "timeout_error"}


ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None,
                   path: str = "") -> JSONResponse:
    """An error in OpenAI's shape, or Anthropic's for a request to `path` under
    /v1/messages."""
    type_ = _ERROR_TYPES.get(status, "server_error")
    return JSONResponse(shaped(path, error_body(message, type_, param, code), status),
                        status_code=status, headers=headers)


def error_shape(path: str) -> tuple[str, str]:
    """Whose error shape the route at `path` answers in, and its schema's name."""
    if path.startswith(ANTHROPIC_PREFIX):
        return "Anthropic's", "AnthropicErrorResponse"
    if path.startswith(OLLAMA_PREFIX):
        return "Ollama's", "OllamaErrorResponse"
    return "OpenAI's", "ErrorResponse"


def shaped(path: str, body: dict[str, Any], status: int) -> dict[str, Any]:
    """An OpenAI error body as the route at `path` answers: unchanged, in Anthropic's shape
    on its routes, in Ollama's (`{"error": message}`) on its."""
    if path.startswith(OLLAMA_PREFIX):
        return {"error": body["error"]["message"]}
    if not path.startswith(ANTHROPIC_PREFIX):
        return body
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                       "message": body["error"]["message"]}}


def exception_error(exc: Exception) -> tuple[int, dict[str, Any]]:
    """(status, OpenAI error body) that a route answers when its handler raised `exc`
    (`llmserve run-batch` writes the same for a batch line)."""
    param = code = None
    if isinstance(exc, BadRequest):
        status, message, param, code = exc.status, str(exc), exc.param, exc.code
        if param and param not in message:
            message = f"{param}: {message}"
    elif isinstance(exc, RequestValidationError | ValidationError):
        status = 400
        message, param = describe_validation_error(exc.errors())
    elif isinstance(exc, QueueFull):
        status, message, code = 429, str(exc), "rate_limit_exceeded"
    elif isinstance(exc, EngineShutdown):
        status, message = 503, str(exc)
    elif isinstance(exc, RequestTimeout):
        status, message, code = 504, str(exc), "request_timeout"
    elif isinstance(exc, EngineStepError):
        status, message = 500, str(exc)  # logged with its traceback by the engine
    else:
        status, message = 500, f"internal server error: {type(exc).__name__}: {exc}"
    return status, error_body(message, _ERROR_TYPES.get(status, "server_error"), param, code)


@dataclass(frozen=True, kw_only=True)
class EdgeSettings:
    """How long a client may take to send a request, how many may be open at once, and
    which Host names the server answers to (a server's and a router's alike)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    allowed_hosts: tuple[str, ...] = ()  # empty: any Host header


def edge_settings(args: Any) -> dict[str, Any]:
    """`EdgeSettings`' fields from the command line's network flags."""
    return {"header_timeout_s": args.header_timeout, "body_timeout_s": args.body_timeout,
            "max_connections": args.max_connections,
            "allowed_hosts": tuple(h for v in args.allowed_hosts or ()
                                   for h in v.split(",") if h)}


def install_middleware(app: FastAPI, settings: Any) -> None:
    """API key, CORS and the request-size cap, as `settings` (a server's or a router's:
    `api_key`, `open_paths`, `allowed_origins`, `max_request_bytes`) asks."""
    from fastapi.middleware.cors import CORSMiddleware

    if settings.api_key:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key,
                           open_paths=settings.open_paths)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes,
                       timeout_s=settings.body_timeout_s)
    app.add_middleware(OllamaBodyMiddleware)
    if settings.allowed_hosts:  # outermost: a foreign Host header gets nothing else
        app.add_middleware(HostCheckMiddleware, allowed_hosts=settings.allowed_hosts)


def uvicorn_config(app: ASGIApp, settings: Any, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` with the edge `settings` (a server's or a
    router's) asks: request headers complete within `header_timeout_s` of their first
    byte (`bounded_protocol`), and at most `max_connections` connections or requests at
    once (uvicorn answers 503 beyond)."""
    return uvicorn.Config(app, http=bounded_protocol(settings.header_timeout_s),
                          limit_concurrency=settings.max_connections, **options)


def bounded_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where installed, else h11, as its "auto") with a
    header timeout: a connection whose next request's headers are not complete within
    `header_timeout_s` of its first byte (or of the connection's start) is closed.
    uvicorn's own keep-alive timeout stops at the first byte, so a client sending its
    headers a byte at a time (slowloris) would otherwise hold the connection forever."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # httptools is optional
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class HeaderTimeoutProtocol(Base):
        _timer: asyncio.TimerHandle | None = None
        _timed_cycle: Any = None  # the request cycle current when the timer started

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._start_timer()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers() and (self._timer is None
                                             or self._timed_cycle is not self.cycle):
                self._start_timer()  # the first byte of a new request
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._timer is not None:
                self._timer.cancel()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _start_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timed_cycle = self.cycle
            self._timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._timer = None
            # no request's headers completed since the timer started (uvicorn makes a new
            # cycle for each request when its headers are complete)
            if self.cycle is self._timed_cycle and self._awaiting_headers() \
                    and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


def install_openapi(app: FastAPI, settings: Any) -> None:
    """/openapi.json as the routes answer: request bodies from the pydantic models, errors
    in OpenAI's shape (FastAPI would claim 422s in its own), and, where `settings.api_key`
    is set, the bearer key on every route but the open ones (/openapi.json itself is not
    one: SECURITY.md)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _openapi_schema(app, settings)
        return app.openapi_schema

    app.openapi = openapi


def _openapi_schema(app: FastAPI, settings: Any) -> dict[str, Any]:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = schema["components"]["schemas"]
    for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body
        schemas.pop(unused, None)
    for model in (ErrorResponse, AnthropicErrorResponse, OllamaErrorResponse):
        error_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error_schema.pop("$defs", {}), **{model.__name__: error_schema})
    if settings.api_key:
        schema["components"]["securitySchemes"] = {"apiKey": {"type": "http",
                                                              "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        shape, model = error_shape(path)
        error = {"content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model}"}}}}
        for operation in operations.values():
            responses = operation["responses"]
            responses.pop("422", None)
            responses["4XX"] = {"description": f"Refused: {shape} error shape", **error}
            responses["5XX"] = {"description": f"Failed: {shape} error shape", **error}
            if settings.api_key:
                operation["security"] = ([] if path in settings.open_paths
                                         else [{"apiKey": []}])
    return schema


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Every error leaves in OpenAI's shape: {"error": {message, type, param, code}}; on
    Anthropic's routes (/v1/messages...) in Anthropic's: {"type": "error", "error": {type,
    message}}."""

    def respond(request: Request, exc: Exception,
                headers: dict[str, str] | None = None) -> JSONResponse:
        status, body = exception_error(exc)
        return JSONResponse(shaped(request.url.path, body, status), status_code=status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(BadRequest)
    async def _bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(QueueFull)
    async def _queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        retry = max(exc.retry_after, retry_after_s)
        return respond(request, exc, {"Retry-After": str(retry)})

    @app.exception_handler(EngineShutdown)
    async def _shutdown(request: Request, exc: EngineShutdown) -> JSONResponse:
        return respond(request, exc, {"Retry-After": str(retry_after_s)})

    @app.exception_handler(EngineStepError)
    async def _step_failed(request: Request, exc: EngineStepError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(RequestTimeout)
    async def _timed_out(request: Request, exc: RequestTimeout) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers,
                              path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return respond(request, exc)


def describe_validation_error(errors: list[Any]) -> tuple[str, str | None]:
    """One line naming the field (as `messages[0].content`) and what is wrong with it.

    A value that fits no branch of a union (`prompt`: text, texts, token ids...) fails in
    every branch; of the first field's errors the one that says most is told: a value out
    of range over a wrong type, the deepest location over a shallower one."""
    if not errors:
        return "invalid request", None
    if errors[0].get("type") == "json_invalid":
        error = errors[0].get("ctx", {}).get("error", "")
        return f"invalid JSON in the request body: {error}", None
    located = [(_field_path(e.get("loc", ()), e.get("type") == "extra_forbidden"), e)
               for e in errors]
    root = located[0][0][:1]
    same_field = [(loc, e) for loc, e in located if loc[:1] == root]
    loc, error = max(same_field, key=lambda le: (not le[1].get("type", "").endswith("_type"),
                                                 len(le[0])))
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else part)
    if not loc:
        return f"the request body must be a JSON object: {error.get('msg')}", None
    if not param:  # a field named "" (an unknown key, refused): its name is ""
        return f'"": {error.get("msg")}', ""
    return f"{param}: {error.get('msg')}", param


def _field_path(loc: tuple[Any, ...], unknown_key: bool = False) -> list[str | int]:
    """A pydantic error location less "body" and the names pydantic gives union branches
    ("str", "list[int]", "constrained-str"); with `unknown_key` (a key refused as extra)
    its last part is the key as the request wrote it, kept whatever it holds (a fuzzed
    key with a "[" in it was taken for a branch name, and the 400 named no field)."""
    *path, last = loc or ("",)
    kept = [p for p in (loc if not unknown_key else path)
            if isinstance(p, int) or p != "body" and not any(c in p for c in "[]-")
            and p not in ("str", "int", "float", "bool")]
    return kept + [last] if unknown_key and loc else kept


class AuthMiddleware:
    """Require `Authorization: Bearer <api_key>` (or Anthropic's `x-api-key: <api_key>`)
    on every path but the open ones."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"
                or scope["path"] in self.open_paths):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        key = headers.get(b"x-api-key", b"")
        if (secrets.compare_digest(given, self.expected)
                or (key and secrets.compare_digest(key, self.expected_key))):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'"
                   if not (given or key) else "invalid API key")
        await error_response(401, message, code="invalid_api_key",
                             path=scope["path"])(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse bodies over `max_bytes` with 413, and stamp each request's arrival time.

    The body is read here (up to the limit) and replayed to the app; after it, `receive`
    passes through, so the app still hears of a client's disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s  # for the whole body to arrive (None: no limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["arrival_time"] = time.time()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(
                    receive(), None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                response = error_response(
                    408, f"the request body did not arrive within {self.timeout_s:g} s",
                    code="request_timeout", path=scope["path"], headers={"Connection": "close"})
                await response(scope, receive, send)
                return
            if message["type"] != "http.request":
                chunks.append(message)  # a disconnect: replay it as it came
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(message)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"the request body is larger than the server's limit "
                                  f"of {self.max_bytes} bytes", code="request_too_large",
                                  path=scope["path"])
        await response(scope, receive, send)


class OllamaBodyMiddleware:
    """Ollama reads every /api/ body as JSON whatever its Content-Type, and its documented
    examples (`curl URL/api/chat -d '{...}'`) send curl's form type: here such a body is
    read as the JSON it is too."""

    _FORM = b"application/x-www-form-urlencoded"

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(OLLAMA_PREFIX):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"
                       or not v.startswith(self._FORM)]
            if len(headers) != len(scope["headers"]):
                scope = {**scope, "headers": [*headers, (b"content-type",
                                                         b"application/json")]}
        await self.app(scope, receive, send)


class HostCheckMiddleware:
    """Answer only requests whose Host header names this server (`allowed_hosts`, as
    `--allowed-hosts` lists them; `*.example.com` matches its subdomains, `*` any): a web
    page that rebinds its own name to 127.0.0.1 (DNS rebinding) reaches a keyless
    loopback server with its own name in the Host header, and gets 400."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = tuple(h.lower() for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1").lower()
        name = host.rsplit(":", 1)[0] if host.rsplit(":", 1)[-1].isdigit() else host
        if any(allowed_host(name, pattern) for pattern in self.allowed):
            await self.app(scope, receive, send)
            return
        response = error_response(400, f"the Host header {host!r} is not one this server "
                                  "answers to (--allowed-hosts)", param="Host",
                                  code="invalid_host", path=scope.get("path", ""))
        await response(scope, receive, send)


def allowed_host(name: str, pattern: str) -> bool:
    """Whether a Host header's name (its port cut) matches an `--allowed-hosts` entry (an
    IPv6 address with or without its brackets)."""
    name, pattern = name.strip("[]"), pattern.strip("[]")
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return name == pattern[2:] or name.endswith(pattern[1:])
    return name == pattern


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
