"""The many-model server's HTTP app (`llmserve serve --models-dir`) around a
`multi_model.ModelRouter`: the model routes it routes, the listings (/v1/models, /models,
Ollama's /api/tags and /api/ps), loading and unloading by hand (/models/load,
/models/unload), Ollama's pull and delete, health, metrics and the chat page; and
`run_models_server`, the command's entry."""

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from llmserve import __version__
from llmserve.entrypoints.openai.http_layer import install_error_handlers, install_middleware
from llmserve.entrypoints.openai.protocol import BadRequest
from llmserve.entrypoints.openai.serving_base import NDJSONResponse, respond
from llmserve.entrypoints.openai.serving_ollama import (
    OLLAMA_API_VERSION,
    OllamaModelRequest,
    delete_from_catalog,
    keep_alive_seconds,
    ollama_name,
    pull_from_catalog,
)
from llmserve.entrypoints.openai.web_ui import add_web_ui_routes
from llmserve.router.multi_model import (
    MODEL_ROUTES,
    ROUTER_FLAGS,
    UNLOADED,
    ModelRouter,
    ModelServerSettings,
    json_object,
    without_flags,
)


def build_models_app(router: ModelRouter) -> FastAPI:
    """The many-model server's HTTP app."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with router.running():
            yield

    app = FastAPI(title="llmserve", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    install_error_handlers(app, retry_after_s=1)
    for path in MODEL_ROUTES:
        app.add_api_route(path, router.route, methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    app.add_api_route("/models", router.models, methods=["GET"])

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        return router.card(router.find(model_id))

    @app.post("/models/load")
    async def load(request: Request) -> dict[str, Any]:
        slot = router.find(_named(await request.body()))
        await router.acquire(slot)
        return {"success": True, "model": slot.name, "status": {"value": slot.state}}

    @app.post("/models/unload")
    async def unload(request: Request) -> dict[str, Any]:
        slot = router.find(_named(await request.body()))
        await router.unload(slot, "request")
        return {"success": True, "model": slot.name, "status": {"value": slot.state}}

    @app.get("/api/tags")
    async def ollama_tags() -> dict[str, Any]:
        return await router.tags()

    @app.get("/api/ps")
    async def ollama_ps() -> dict[str, Any]:
        return await router.ps()

    @app.get("/api/version")
    async def ollama_version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}

    @app.post("/api/pull")
    async def ollama_pull(body: OllamaModelRequest, request: Request) -> Response:
        work = pull_from_catalog(body, router.on_files_thread)
        return await respond(request, work, NDJSONResponse)

    @app.delete("/api/delete")
    async def ollama_delete(body: OllamaModelRequest) -> Response:
        name = body.named()
        slot = router.slots.get(ollama_name(name))
        if slot is not None and not slot.model.in_catalog:
            raise BadRequest(f"model '{name}' is a file under --models-dir: the server does "
                             "not delete its user's files", param="model", status=403)
        loaded = [s.model.path for s in router.slots.values() if s.state != UNLOADED]
        delete_from_catalog(body, loaded)
        router.refresh()
        return Response(status_code=200)

    @app.head("/")
    async def running() -> Response:
        return PlainTextResponse("llmserve is running")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)  # the server answers; each model loads on demand

    @app.get("/metrics")
    async def metrics() -> Response:
        loaded = [s.replica for s in router.slots.values() if s.replica is not None]
        texts = await asyncio.gather(*(router.scrape(r) for r in loaded))
        by_label = {r.label: t for r, t in zip(loaded, texts, strict=True) if t}
        router.metrics.loaded.set(len(loaded))
        return Response(router.metrics.render(loaded, by_label),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    add_web_ui_routes(app)
    install_middleware(app, router.settings)
    return app


def _named(body: bytes) -> str:
    parsed = json_object(body)
    name = parsed.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest("model is required", param="model")
    return name


def run_models_server(args: Any, argv: list[str]) -> int:
    """`llmserve serve --models-dir DIR`: serve every model under DIR (and the catalog's
    pulled ones) on the user's socket until SIGTERM; returns 0."""
    from llmserve.entrypoints.openai.server import listening_socket
    from llmserve.memory import parse_size
    from llmserve.router.app import router_settings, run_router

    settings = router_settings(args)
    models = ModelServerSettings(
        models_dir=Path(args.models_dir).expanduser(),
        server_argv=tuple(without_flags(argv, ROUTER_FLAGS)),
        max_loaded=args.max_loaded_models,
        memory_budget=parse_size(args.max_loaded_memory) if args.max_loaded_memory else None,
        keep_alive_s=keep_alive_seconds(args.keep_alive),
        pinned=tuple(args.pin or ()))
    router = ModelRouter(settings, models)
    sock = listening_socket(args.host, args.port)
    names = ", ".join(sorted(router.slots)) or "none yet"
    print(f"llmserve: {len(router.slots)} models on offer: {names}", file=sys.stderr,
          flush=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run_router(build_models_app(router), settings, sock,
               f"serving '{len(router.slots)} models of {models.models_dir}'",
               access_log=args.verbose)
    return 0
