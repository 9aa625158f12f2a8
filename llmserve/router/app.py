"""The router: one OpenAI-compatible endpoint in front of several llmserve replicas.

`build_router_app()` is the FastAPI app; `run_router()` serves it with uvicorn. Requests to
the model routes go to the replica the policy picks (prefix affinity and load by default)
and come back unchanged; /v1/models comes from the first replica that is up; /health is 200
only while every replica is up; /metrics joins the replicas' metrics and the router's own.
"""

import asyncio
import json
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from llmserve import __version__
from llmserve.entrypoints.openai.http_layer import (
    AuthMiddleware,
    BodyLimitMiddleware,
    error_response,
    install_error_handlers,
)
from llmserve.entrypoints.openai.protocol import error_body
from llmserve.entrypoints.openai.server import API_KEY_ENV, DEFAULT_MAX_REQUEST_BYTES
from llmserve.errors import LLMServeError
from llmserve.router.metrics import RouterMetrics
from llmserve.router.policy import (
    DEFAULT_PREFIX_CHARS,
    PrefixAffinityPolicy,
    ReplicaLoad,
    ReplicaPolicy,
)
from llmserve.router.proxy import ReplicaFailed, forward, replica_failed_response
from llmserve.router.replicas import HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S, HealthMonitor, Replica

logger = logging.getLogger(__name__)

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@dataclass(frozen=True)
class RouterSettings:
    """How the router faces the network and watches its replicas."""

    api_key: str | None = None  # checked here, and forwarded to the replicas
    metrics_require_auth: bool = False
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    health_interval_s: float = HEALTH_INTERVAL_S
    health_timeout_s: float = HEALTH_TIMEOUT_S
    shutdown_timeout_s: float = 30.0
    open_paths: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.prefix_chars < 1:
            raise ValueError(f"the routing prefix must be at least 1 character, got "
                             f"{self.prefix_chars} (--route-prefix-chars)")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("health_interval_s and health_timeout_s must be positive")
        paths = {"/health"} if self.metrics_require_auth else {"/health", "/metrics"}
        object.__setattr__(self, "open_paths", frozenset(paths))

    @property
    def auth_headers(self) -> dict[str, str]:
        """What the router sends with its own calls (health checks, metrics scrapes)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_router_app(replicas: list[Replica], settings: RouterSettings,
                     policy: ReplicaPolicy | None = None) -> FastAPI:
    """The router app; its lifespan checks every replica once, then every interval."""
    if not replicas:
        raise ValueError("the router needs at least one replica")
    router = _Router(replicas, settings, policy or PrefixAffinityPolicy(settings.prefix_chars))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with router.running():
            yield

    app = FastAPI(title="llmserve router", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, retry_after_s=1)
    _add_routes(app, router)
    if settings.api_key:
        app.add_middleware(AuthMiddleware, api_key=settings.api_key,
                           open_paths=settings.open_paths)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    return app


class _Router:
    """The router's state: replicas, policy, metrics, the HTTP client and health monitor."""

    def __init__(self, replicas: list[Replica], settings: RouterSettings,
                 policy: ReplicaPolicy) -> None:
        self.replicas = replicas
        self.settings = settings
        self.policy = policy
        self.metrics = RouterMetrics(len(replicas))
        self.client: httpx.AsyncClient | None = None
        self.monitor: HealthMonitor | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        # No read timeout: a long generation is not a failure; the health monitor is what
        # ends a request to a replica that stopped answering.
        timeout = httpx.Timeout(connect=self.settings.health_timeout_s, read=None,
                                write=None, pool=None)
        # keep-alive shorter than uvicorn's 5 s, so a pooled connection is never one the
        # replica is closing
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64,
                              keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            self.client = client
            self.monitor = HealthMonitor(self.replicas, client, self.settings.health_interval_s,
                                         self.settings.health_timeout_s,
                                         self.settings.auth_headers)
            await self.monitor.check_all()
            watching = asyncio.create_task(self.monitor.run())
            try:
                yield
            finally:
                watching.cancel()
                with suppress(asyncio.CancelledError):
                    await watching

    def up(self) -> list[Replica]:
        return [r for r in self.replicas if r.is_up]

    async def route(self, request: Request) -> Response:
        """Forward a model request to the replica the policy picks. A replica that refuses
        the connection is checked at once and the request goes to the next pick."""
        body = await request.body()
        parsed = _json_or_none(body)
        for _ in range(len(self.replicas)):
            up = self.up()
            if not up:
                return self.none_up()
            decision = self.policy.choose(request.url.path, parsed,
                                          [ReplicaLoad(r.index, r.in_flight) for r in up])
            replica = self.replicas[decision.replica]
            self.metrics.affinity.labels(result=decision.affinity).inc()
            try:
                return await self.send(replica, request, body)
            except ReplicaFailed as failure:
                await self.monitor.check(replica)
                if not failure.connect_failed or replica.is_up:
                    return replica_failed_response(failure)
        return self.none_up()

    async def send(self, replica: Replica, request: Request, body: bytes) -> Response:
        """Forward to this replica, counting the request in flight until it is over."""
        self.metrics.requests.labels(replica=str(replica.index)).inc()
        replica.in_flight += 1

        def done(failed: bool) -> None:
            replica.in_flight -= 1
            if failed:
                self.metrics.failures.labels(replica=str(replica.index)).inc()

        return await forward(self.client, replica, request, body, done)

    def none_up(self) -> Response:
        reasons = "; ".join(r.describe_down() for r in self.replicas)
        return error_response(503, f"no replica is up: {reasons}",
                              headers={"Retry-After": "1"})

    async def scrape(self, replica: Replica) -> str | None:
        try:
            response = await self.client.get(f"{replica.url}/metrics",
                                              headers=self.settings.auth_headers,
                                              timeout=self.settings.health_timeout_s)
        except httpx.TransportError:
            return None
        return response.text if response.status_code == 200 else None


def _add_routes(app: FastAPI, router: _Router) -> None:
    for path in ROUTED_PATHS:
        app.add_api_route(path, router.route, methods=["POST"])

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        for replica in router.up():
            try:
                return await router.send(replica, request, b"")
            except ReplicaFailed:
                await router.monitor.check(replica)
        return router.none_up()

    @app.get("/health")
    async def health() -> Response:
        down = [r for r in router.replicas if not r.is_up]
        if not down:
            return Response(status_code=200)
        message = "; ".join(r.describe_down() for r in down)
        body = error_body(message, "service_unavailable_error")
        return JSONResponse({"status": "unavailable", **body,
                             "down": [{"replica": r.index, "url": r.url, "reason": r.reason}
                                      for r in down]}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = await asyncio.gather(*(router.scrape(r) for r in router.replicas))
        by_index = {r.index: t for r, t in zip(router.replicas, texts, strict=True) if t}
        return Response(router.metrics.render(router.replicas, by_index),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # the replica answers it with a 400


# ---- `llmserve router`, and the router of `llmserve serve --data-parallel-size` -----------


def router_settings(args: Any) -> RouterSettings:
    """RouterSettings from the `serve`/`router` command-line flags."""
    return RouterSettings(
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        metrics_require_auth=args.metrics_require_auth,
        allowed_origins=tuple(o for v in args.allowed_origins or () for o in v.split(",") if o),
        max_request_bytes=args.max_request_bytes,
        prefix_chars=args.route_prefix_chars,
        shutdown_timeout_s=args.shutdown_timeout,
    )


def run_router(replicas: list[Replica], settings: RouterSettings, sock: socket.socket,
               banner: str, access_log: bool = False) -> None:
    """Serve the router on `sock` until SIGTERM/SIGINT; prints `banner` with the URL once
    it listens ("llmserve: {banner} at http://host:port/v1")."""
    import uvicorn

    app = build_router_app(replicas, settings)
    config = uvicorn.Config(app, log_config=None, access_log=access_log,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s))
    server = uvicorn.Server(config)
    # uvicorn re-raises the SIGTERM it caught once its graceful shutdown is done; this
    # handler absorbs it (as `llmserve serve` does), so the process goes on to stop cleanly.
    signal.signal(signal.SIGTERM, lambda *_: None)
    asyncio.run(_serve(server, sock, banner))


async def _serve(server: Any, sock: socket.socket, banner: str) -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"llmserve: {banner} at http://{host}:{port}/v1", flush=True)
    await task
    if not server.started:
        raise LLMServeError("the router failed to start (see the log above)")
