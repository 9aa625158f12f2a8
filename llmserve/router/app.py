"""The router: one OpenAI-compatible endpoint in front of several llmserve servers.

`build_router_app()` fronts data-parallel replicas: requests to the model routes go to the
replica the policy picks (prefix affinity and load by default) and come back unchanged;
/v1/models comes from the first replica that is up. `build_disaggregated_app()` fronts a
prefill and a decode server (`disaggregated`). Either way /health is 200 only while every
backend is up, /metrics joins the backends' metrics and the router's own, and
`run_router()` serves the app with uvicorn. The chat page at / is served here as on a server.
"""

import asyncio
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from llmserve import __version__
from llmserve.entrypoints.openai.http_layer import (
    edge_settings,
    install_error_handlers,
    install_middleware,
    uvicorn_config,
)
from llmserve.entrypoints.openai.protocol import error_body
from llmserve.entrypoints.openai.server import API_KEY_ENV, serve_announced
from llmserve.entrypoints.openai.web_ui import add_web_ui_routes
from llmserve.router.base import Router, RouterSettings, down_response, json_or_none
from llmserve.router.disaggregated import DisaggregatedRouter
from llmserve.router.metrics import DataParallelMetrics
from llmserve.router.policy import PrefixAffinityPolicy, ReplicaLoad, ReplicaPolicy
from llmserve.router.proxy import ReplicaFailed, replica_failed_response
from llmserve.router.replicas import Replica

logger = logging.getLogger(__name__)

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                "/v1/messages/count_tokens", "/tokenize", "/detokenize")


def build_router_app(replicas: list[Replica], settings: RouterSettings,
                     policy: ReplicaPolicy | None = None) -> FastAPI:
    """The data-parallel router's app; its lifespan checks every replica once, then every
    interval."""
    policy = policy or PrefixAffinityPolicy(settings.prefix_chars)
    return build_app(_DataParallelRouter(replicas, settings, policy))


def build_disaggregated_app(prefill_url: str, decode_url: str,
                            settings: RouterSettings) -> FastAPI:
    """The app of a router in front of one prefill server and one decode server."""
    return build_app(DisaggregatedRouter(prefill_url, decode_url, settings))


def build_app(router: Router) -> FastAPI:
    """The HTTP server around a router of any mode."""
    settings = router.settings

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with router.running():
            yield

    app = FastAPI(title="llmserve router", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, retry_after_s=1)
    _add_routes(app, router)
    add_web_ui_routes(app)
    install_middleware(app, settings)
    return app


class _DataParallelRouter(Router):
    """Replicas of one model; the policy picks one per request."""

    metrics: DataParallelMetrics

    def __init__(self, replicas: list[Replica], settings: RouterSettings,
                 policy: ReplicaPolicy) -> None:
        if not replicas:
            raise ValueError("the router needs at least one backend")
        super().__init__(replicas, settings, DataParallelMetrics(len(replicas)))
        self.policy = policy

    async def route(self, request: Request) -> Response:
        """Forward a model request to the replica the policy picks. A replica that refuses
        the connection is checked at once and the request goes to the next pick."""
        body = await request.body()
        parsed = json_or_none(body)
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

    async def models(self, request: Request) -> Response:
        for replica in self.up():
            try:
                return await self.send(replica, request, b"")
            except ReplicaFailed:
                await self.monitor.check(replica)
        return self.none_up()

    def none_up(self) -> Response:
        reasons = "; ".join(r.describe_down() for r in self.replicas)
        return down_response(f"no replica is up: {reasons}")


def _add_routes(app: FastAPI, router: Router) -> None:
    for path in ROUTED_PATHS:
        app.add_api_route(path, router.route, methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])

    @app.get("/health")
    async def health() -> Response:
        down = [r for r in router.replicas if not r.is_up]
        if not down:
            return Response(status_code=200)
        message = "; ".join(r.describe_down() for r in down)
        body = error_body(message, "service_unavailable_error")
        return JSONResponse({"status": "unavailable", **body,
                             "down": [{**r.identity(), "url": r.url, "reason": r.reason}
                                      for r in down]}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = await asyncio.gather(*(router.scrape(r) for r in router.replicas))
        by_label = {r.label: t for r, t in zip(router.replicas, texts, strict=True) if t}
        return Response(router.metrics.render(router.replicas, by_label),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


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
        **edge_settings(args),
    )


def run_router(app: FastAPI, settings: RouterSettings, sock: socket.socket, banner: str,
               access_log: bool = False) -> None:
    """Serve the router `app` on `sock` until SIGTERM/SIGINT; prints `banner` with the URL
    once it listens ("llmserve: {banner} at http://host:port/v1")."""
    import uvicorn

    config = uvicorn_config(app, settings, log_config=None, access_log=access_log,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s))
    server = uvicorn.Server(config)
    # uvicorn re-raises the SIGTERM it caught once its graceful shutdown is done; this
    # handler absorbs it (as `llmserve serve` does), so the process goes on to stop cleanly.
    signal.signal(signal.SIGTERM, lambda *_: None)
    asyncio.run(serve_announced(server, sock, banner, "router"))
