"""The OpenAI-compatible HTTP server: `build_app()` (FastAPI) and `run_server()` (uvicorn).

Routes: /v1/completions, /v1/chat/completions, /v1/responses (and /v1/responses/{id}),
/v1/messages (Anthropic's, with /v1/messages/count_tokens), the pooling runner's
/v1/embeddings, /classify, /v1/score and /rerank (serving_pooling.py), /v1/models, /v1/models/{id},
/tokenize, /detokenize, /tokenizer_info, /health, /metrics, /version, and the chat page at
/ (web_ui.py). Model work happens on the AsyncEngine's thread, tokenization on its small
executor; the event loop only moves bytes.
"""

import asyncio
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from llmserve import __version__
from llmserve.cpu_info import set_thread_policy
from llmserve.engine.async_engine import AsyncEngine
from llmserve.entrypoints.openai.http_layer import (
    EdgeSettings,
    edge_settings,
    install_error_handlers,
    install_middleware,
    install_openapi,
    uvicorn_config,
)
from llmserve.entrypoints.openai.media import MediaFetcher
from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    now,
)
from llmserve.entrypoints.openai.reasoning import resolve_parser
from llmserve.entrypoints.openai.serving_base import respond
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat
from llmserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmserve.entrypoints.openai.serving_lora import (
    LOAD_TIMEOUT_S,
    LoRARegistry,
    add_lora_routes,
    parse_lora_modules,
)
from llmserve.entrypoints.openai.serving_messages import (
    AnthropicServingMessages,
    CountTokensRequest,
    MessagesRequest,
)
from llmserve.entrypoints.openai.serving_ollama import OllamaServing, add_ollama_routes
from llmserve.entrypoints.openai.serving_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    OpenAIServingPooling,
    RerankRequest,
    ScoreRequest,
)
from llmserve.entrypoints.openai.serving_responses import (
    OpenAIServingResponses,
    ResponsesRequest,
)
from llmserve.entrypoints.openai.web_ui import PAGE_PATHS, add_web_ui_routes
from llmserve.errors import LLMServeError

API_KEY_ENV = "LLMSERVE_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# how /openapi.json describes a route that answers a stream when asked ("stream": true)
_STREAMED: dict[int | str, Any] = {
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings(EdgeSettings):
    """How the server faces the network (the engine's own settings live in EngineConfig)."""

    model_name: str
    api_key: str | None = None
    metrics_require_auth: bool = False
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    retry_after_s: int = 1
    shutdown_timeout_s: float = 30.0
    reasoning_parser: str | None = None  # reasoning.py's CHOICES ("auto": from the template)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) served from the start
    lora_dir: str | None = None  # clients load adapters from under it; None: they cannot
    lora_load_timeout_s: float = LOAD_TIMEOUT_S
    # hosts (and their subdomains) image URLs may be fetched from; empty: none
    allowed_media_domains: tuple[str, ...] = ()
    open_paths: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        paths = {"/health"} if self.metrics_require_auth else {"/health", "/metrics"}
        object.__setattr__(self, "open_paths", frozenset(paths) | PAGE_PATHS)


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving `engine`; its lifespan starts and shuts down the engine."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        for name, path in settings.lora_modules:
            if app.state.loras is None:
                raise ValueError("--lora-modules needs --enable-lora")
            await app.state.loras.add(name, path)  # an adapter that does not fit: no start
            logger.info("LoRA adapter %s from %s", name, path)
        yield
        await engine.shutdown(settings.shutdown_timeout_s)

    app = FastAPI(title="llmserve", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_error_handlers(app, settings.retry_after_s)
    _add_routes(app, engine, settings)
    add_web_ui_routes(app)
    install_openapi(app, settings)
    install_middleware(app, settings)
    return app


def _add_routes(app: FastAPI, engine: AsyncEngine, settings: ServerSettings) -> None:
    loras = None
    if engine.engine.lora is not None:
        loras = LoRARegistry(engine, settings.model_name, settings.lora_dir,
                             settings.lora_load_timeout_s)
        add_lora_routes(app, loras)
    elif settings.lora_dir is not None:
        raise ValueError("--allow-runtime-lora needs --enable-lora")
    app.state.loras = loras  # the lifespan registers --lora-modules once the engine runs
    completions = OpenAIServingCompletion(engine, settings.model_name, loras)
    parser = resolve_parser(settings.reasoning_parser, engine.tokenizer.chat_template)
    if settings.reasoning_parser == "auto" and parser is not None:
        logger.info("reasoning parser %s (from the model's chat template)", parser)
    chat = OpenAIServingChat(engine, settings.model_name, parser, loras,
                             MediaFetcher(settings.allowed_media_domains))
    tokenizer = engine.tokenizer

    @app.post("/v1/completions", responses=_STREAMED)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        _read_flag_headers(body, request)
        return await respond(request, completions.create(body, _arrival(request)))

    @app.post("/v1/chat/completions", responses=_STREAMED)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        _read_flag_headers(body, request)
        return await respond(request, chat.create(body, _arrival(request)))

    messages = AnthropicServingMessages(chat)
    responses = OpenAIServingResponses(chat)

    @app.post("/v1/responses", responses=_STREAMED)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await respond(request, responses.create(body, _arrival(request)))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return responses.retrieve(response_id)

    @app.post("/v1/messages", responses=_STREAMED)
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        return await respond(request, messages.create(body, _arrival(request)))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest) -> dict[str, Any]:
        return await messages.count_tokens(body)

    pooling = OpenAIServingPooling(engine, settings.model_name)
    add_ollama_routes(app, OllamaServing(chat, completions, pooling,
                                         engine.engine.loaded.source.path), _arrival)

    @app.post("/v1/embeddings")
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        return await respond(request, pooling.embeddings(body, _arrival(request)))

    @app.post("/classify")
    async def classify(body: ClassificationRequest, request: Request) -> Response:
        return await respond(request, pooling.classify(body, _arrival(request)))

    async def score(body: ScoreRequest, request: Request) -> Response:
        return await respond(request, pooling.score(body, _arrival(request)))

    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await respond(request, pooling.rerank(body, _arrival(request)))

    for path in ("/v1/score", "/score"):
        app.post(path)(score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(rerank)

    def model_card() -> dict[str, Any]:
        return {"id": settings.model_name, "object": "model", "created": now(),
                "owned_by": "llmserve", "root": settings.model_name,
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        adapters = loras.cards(now()) if loras is not None else []
        return {"object": "list", "data": [model_card(), *adapters]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        # another name: OpenAI's 404 model_not_found
        if completions.check_model(model_id) is not None:
            return next(c for c in loras.cards(now()) if c["id"] == model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        completions.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise BadRequest("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            if body.continue_final_message and body.add_generation_prompt:
                raise BadRequest("continue_final_message needs add_generation_prompt false",
                                 param="continue_final_message")
            tools = [t.model_dump(exclude_none=True) for t in body.tools or ()] or None
            ids = await engine.run_blocking(
                chat.prompt_ids, body.messages, tools, body.add_generation_prompt,
                body.chat_template_kwargs, body.continue_final_message,
                bool(body.add_special_tokens))
        else:
            for name in ("tools", "chat_template_kwargs"):
                if getattr(body, name) is not None:
                    raise BadRequest(f"{name} applies to messages", param=name)
            if body.continue_final_message:
                raise BadRequest("continue_final_message applies to messages",
                                 param="continue_final_message")
            ids = await engine.run_blocking(tokenizer.encode, body.prompt,
                                            body.add_special_tokens is not False)
        answer = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
        return answer

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        completions.check_model(body.model)
        vocab = engine.engine.loaded.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return {"prompt": await engine.run_blocking(tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        """What a client needs to tokenize as the server does (vLLM's endpoint; lm-eval's
        `tokenizer_backend=remote` reads it, then tokenizes through /tokenize)."""
        return {"tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": engine.max_model_len,
                "vocab_size": engine.engine.loaded.config.vocab_size,
                "chat_template": tokenizer.chat_template,
                **{name: None for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
                **tokenizer.special_token_strings()}

    @app.get("/health", responses={503: {"description": "the engine is not running"}})
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def _read_flag_headers(body: SamplingRequest, request: Request) -> None:
    """`X-Return-Metrics: 1` (or true, 0, false) sets `return_metrics` where the body does
    not."""
    value = request.headers.get("x-return-metrics")
    if value is None or body.return_metrics is not None:
        return
    flag = {"1": True, "true": True, "0": False, "false": False}.get(value.strip().lower())
    if flag is None:
        raise BadRequest(f"the X-Return-Metrics header must be 1, true, 0 or false, not "
                         f"{value!r}", param="X-Return-Metrics")
    body.return_metrics = flag


def _arrival(request: Request) -> float:
    return request.scope["state"]["arrival_time"]


# ---- `llmserve serve` ---------------------------------------------------------------------


def run_server(args: Any, engine_options: dict[str, Any]) -> int:
    """Load the model, serve until SIGTERM/SIGINT, shut down gracefully; returns 0."""
    set_thread_policy()  # the CLI set it before torch loaded; a caller of its own may not
    import uvicorn

    from llmserve.config.engine import EngineConfig
    from llmserve.engine.engine import Engine
    from llmserve.loader.catalog import DEFAULT_MODEL

    logging.getLogger("llmserve").setLevel(logging.INFO)
    model = args.model or DEFAULT_MODEL
    settings = ServerSettings(
        model_name=args.served_model_name or served_model_id(model),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        metrics_require_auth=args.metrics_require_auth,
        allowed_origins=tuple(o for v in args.allowed_origins or () for o in v.split(",") if o),
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        reasoning_parser=args.reasoning_parser,
        lora_modules=tuple(parse_lora_modules(getattr(args, "lora_modules", None))),
        lora_dir=getattr(args, "lora_dir", None),
        allowed_media_domains=tuple(d.lower() for v in args.allowed_media_domains or ()
                                    for d in v.split(",") if d),
        **edge_settings(args),
    )
    sock = listening_socket(args.host, args.port)  # before loading: a busy port fails fast
    max_num_waiting = None if args.max_num_waiting < 0 else args.max_num_waiting
    async_engine = AsyncEngine(Engine(EngineConfig(model=model, **engine_options)),
                               max_num_waiting, request_timeout=args.request_timeout,
                               grammar_timeout=args.grammar_timeout)
    app = build_app(async_engine, settings)
    config = uvicorn_config(app, settings, log_config=None, access_log=args.verbose,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s))
    server = uvicorn.Server(config)
    # the engine thread dying ends the server (exit 1), for a supervisor to restart it;
    # uvicorn watches `should_exit` from its own loop
    async_engine.on_fatal = lambda _: setattr(server, "should_exit", True)
    # uvicorn re-raises the SIGTERM it caught once its graceful shutdown is done; this
    # handler absorbs it so the process exits 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    asyncio.run(serve_announced(server, sock, f"serving '{settings.model_name}'", "server"))
    if async_engine.fatal is not None:
        logger.error("exiting: the engine thread died (%s)", async_engine.fatal)
        return 1
    return 0


async def serve_announced(server: Any, sock: socket.socket, banner: str, what: str) -> None:
    """Run a uvicorn server on `sock`; once it listens, print `llmserve: <banner> at
    <url>/v1` (what users and the tests read to find it)."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host, port = sock.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        print(f"llmserve: {banner} at http://{host}:{port}/v1", flush=True)
    await task
    if not server.started:
        raise LLMServeError(f"the {what} failed to start (see the log above)")


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise LLMServeError(f"cannot listen on {host}:{port}: {e.strerror}; "
                            "pick another --port or --host") from None
    sock.set_inheritable(True)
    return sock


def served_model_id(model: str) -> str:
    """The served id of a `--model` value: a catalog name as is, a path by its last part."""
    path = Path(model)
    if path.exists() or os.sep in model:
        return path.name or str(path)
    return model

