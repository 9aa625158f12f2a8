"""Real servers on 127.0.0.1 (uvicorn in a thread), all sharing one loaded default model."""

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from llmserve.config.engine import DEFAULT_GRAMMAR_TIMEOUT_S, EngineConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.engine import Engine
from llmserve.entrypoints.openai.http_layer import uvicorn_config
from llmserve.entrypoints.openai.server import ServerSettings, build_app, listening_socket

MODEL = "smollm2-test"
MAX_MODEL_LEN = 512


@dataclass
class RunningServer:
    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=kwargs.pop("api_key", "none"),
                             max_retries=0, timeout=120, **kwargs)

    def async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0,
                                  timeout=120, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)


@pytest.fixture(scope="session")
def loaded_model(float32_model):
    """The servers' weights, loaded once; every server's engine shares them. The exact
    float32 path: its sampled outputs are the same bits on every CPU, where the default
    path's depend on the format "auto" timed fastest there."""
    return float32_model


def _engine_config(gguf: Any, loaded: Any, **options: Any) -> EngineConfig:
    # the dtype follows the weights; an engine that loads its own (tensor parallelism) is
    # the exact float32 path
    dtype = "auto" if loaded is not None and loaded.quantization else "float32"
    options = {"dtype": dtype, "kv_cache_memory": "96MiB", "max_model_len": MAX_MODEL_LEN,
               **options}
    return EngineConfig(model=str(gguf), **options)


@contextmanager
def run_server(gguf: Any, loaded: Any, max_num_waiting: int | None = None,
               engine_options: dict | None = None, request_timeout: float | None = None,
               grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT_S,
               **settings: Any) -> Iterator[RunningServer]:
    """A real server on a free port; stopped (gracefully) on exit."""
    engine = Engine(_engine_config(gguf, loaded, **(engine_options or {})), loaded=loaded)
    async_engine = AsyncEngine(engine, max_num_waiting, request_timeout=request_timeout,
                               grammar_timeout=grammar_timeout)
    server_settings = ServerSettings(model_name=MODEL, **settings)
    app = build_app(async_engine, server_settings)
    server = uvicorn.Server(uvicorn_config(app, server_settings, log_config=None,
                                           access_log=False, timeout_graceful_shutdown=5))
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=asyncio.run, args=(server.serve(sockets=[sock]),),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", async_engine, server, thread)
    finally:
        server.should_exit = True
        thread.join(30)


def wait_engine_idle(server: RunningServer, timeout_s: float = 60) -> None:
    """Until the engine thread holds no request and has published its state after the last
    one (metrics, KV usage); `timeout_s` only guards against a hang."""
    assert server.engine.wait_idle(timeout_s), f"the engine was still busy after {timeout_s} s"


@pytest.fixture(scope="session")
def server(smollm2_gguf, loaded_model) -> Iterator[RunningServer]:
    """The shared server: no key, no queue cap."""
    with run_server(smollm2_gguf, loaded_model) as running:
        yield running


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="session")
def tokenizer(loaded_model):
    return loaded_model.tokenizer
