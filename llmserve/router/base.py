"""What every router mode shares: its backends and their health monitor, the HTTP client,
the metrics, and sending one request to one backend.

A mode (data-parallel replicas in `app`, prefill/decode in `disaggregated`) is a `Router`
that says where model requests go (`route`) and which backend answers /v1/models
(`models`); the app around it (`app.build_app`) is the same for every mode.
"""

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from llmserve.entrypoints.openai.http_layer import EdgeSettings, error_response
from llmserve.entrypoints.openai.server import DEFAULT_MAX_REQUEST_BYTES
from llmserve.entrypoints.openai.web_ui import PAGE_PATHS
from llmserve.router.metrics import RouterMetrics
from llmserve.router.policy import DEFAULT_PREFIX_CHARS
from llmserve.router.proxy import ReplicaFailed, forward, replica_failed_response
from llmserve.router.replicas import HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S, HealthMonitor, Replica


@dataclass(frozen=True)
class RouterSettings(EdgeSettings):
    """How the router faces the network and watches its backends."""

    api_key: str | None = None  # checked here, and forwarded to the backends
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
        object.__setattr__(self, "open_paths", frozenset(paths) | PAGE_PATHS)

    @property
    def auth_headers(self) -> dict[str, str]:
        """What the router sends with its own calls (health checks, metrics scrapes)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class Router(ABC):
    """The router's state: backends, settings, metrics, the HTTP client and health monitor
    (the last two exist while `running()`)."""

    def __init__(self, replicas: list[Replica], settings: RouterSettings,
                 metrics: RouterMetrics) -> None:
        self.replicas = replicas
        self.settings = settings
        self.metrics = metrics
        self.client: httpx.AsyncClient | None = None
        self.monitor: HealthMonitor | None = None

    @abstractmethod
    async def route(self, request: Request) -> Response:
        """The answer to a POST to a model route (completions, chat, tokenize, detokenize)."""

    @abstractmethod
    async def models(self, request: Request) -> Response:
        """The answer to GET /v1/models."""

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        # No read timeout: a long generation is not a failure; the health monitor is what
        # ends a request to a backend that stopped answering.
        timeout = httpx.Timeout(connect=self.settings.health_timeout_s, read=None,
                                write=None, pool=None)
        # keep-alive shorter than uvicorn's 5 s, so a pooled connection is never one the
        # backend is closing
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

    async def send(self, replica: Replica, request: Request, body: bytes,
                   extra_headers: dict[str, str] | None = None) -> Response:
        """Forward to this backend (with `extra_headers` beside the client's), counting the
        request in flight until it is over. Raises `ReplicaFailed`."""
        self.metrics.requests.labels(replica.label).inc()
        replica.in_flight += 1

        def done(failed: bool) -> None:
            replica.in_flight -= 1
            if failed:
                self.metrics.failures.labels(replica.label).inc()

        return await forward(replica, request, body, done, extra_headers)

    async def send_or_503(self, replica: Replica, request: Request, body: bytes) -> Response:
        """`send`, but a backend that is down, or fails the request, makes a 503 (and a
        failure has the backend checked at once)."""
        if not replica.is_up:
            return down_response(replica.describe_down())
        try:
            return await self.send(replica, request, body)
        except ReplicaFailed as failure:
            await self.monitor.check(replica)
            return replica_failed_response(failure)

    async def scrape(self, replica: Replica) -> str | None:
        try:
            response = await self.client.get(f"{replica.url}/metrics",
                                              headers=self.settings.auth_headers,
                                              timeout=self.settings.health_timeout_s)
        except httpx.TransportError:
            return None
        return response.text if response.status_code == 200 else None


def down_response(message: str) -> Response:
    """A 503 for a request no backend can take now."""
    return error_response(503, message, headers={"Retry-After": "1"})


def json_or_none(body: bytes) -> Any:
    """The request body as JSON, or None if it is not (the backend answers it with a 400)."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
