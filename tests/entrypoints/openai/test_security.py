"""The defaults SECURITY.md promises: loopback only, no CORS, the API key on every route but
the open ones (compared in constant time), /openapi.json behind it, the body-size cap."""

import secrets

import httpx
import pytest

from llmserve.entrypoints.cli import build_parser
from llmserve.entrypoints.openai import http_layer
from llmserve.entrypoints.openai.server import DEFAULT_MAX_REQUEST_BYTES
from llmserve.entrypoints.openai.web_ui import PAGE_PATHS
from tests.entrypoints.openai.conftest import run_server

KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def keyed(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, api_key=KEY) as running:
        yield running


@pytest.mark.parametrize("command", ["serve", "router"])
def test_defaults_listen_on_loopback_with_cors_off(command):
    args = build_parser().parse_args([command])
    assert args.host == "127.0.0.1"
    assert args.allowed_origins is None
    assert args.metrics_require_auth is False
    assert args.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES


def _routes(app) -> list[tuple[str, str]]:
    return sorted((route.path, method) for route in app.routes
                  for method in getattr(route, "methods", ()) if method != "HEAD")


def test_every_route_but_health_metrics_and_the_page_needs_the_key(keyed):
    app = keyed.server.config.app
    routes = _routes(app)
    assert ("/openapi.json", "GET") in routes and ("/v1/completions", "POST") in routes
    open_paths = {"/health", "/metrics"} | PAGE_PATHS
    with keyed.http() as http:
        for path, method in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                resp = http.request(method, path, json={}, headers=headers)
                if path in open_paths:
                    assert resp.status_code != 401, (method, path)
                else:
                    assert resp.status_code == 401, (method, path, resp.status_code)
                    error = resp.json()["error"]
                    if path.startswith("/v1/messages"):  # Anthropic's shape
                        assert error["type"] == "authentication_error", error
                    elif path.startswith("/api/"):  # Ollama's: the message alone
                        assert isinstance(error, str) and "key" in error, error
                    else:
                        assert error["code"] == "invalid_api_key"
        spec = http.get("/openapi.json", headers=AUTH)
    assert spec.status_code == 200
    assert spec.json()["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


@pytest.mark.parametrize("header", [
    f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"bearer {KEY}", f"Bearer  {KEY}", KEY,
    f"Basic {KEY}", "Bearer",
])
def test_near_misses_of_the_key_are_refused(keyed, header):
    with keyed.http() as http:
        assert http.get("/v1/models", headers={"Authorization": header}).status_code == 401
        assert http.get(f"/v1/models?api_key={KEY}").status_code == 401


def test_anthropic_clients_send_the_key_as_x_api_key(keyed):
    body = {"model": "x", "max_tokens": 1, "messages": []}
    with keyed.http() as http:
        assert http.post("/v1/messages", json=body,
                         headers={"x-api-key": KEY[:-1]}).status_code == 401
        # the key passes: the (empty) body is what is refused now
        assert http.post("/v1/messages", json=body,
                         headers={"x-api-key": KEY}).status_code == 400
        assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_the_key_is_compared_in_constant_time(keyed, monkeypatch):
    compared = []
    compare_digest = secrets.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(http_layer.secrets, "compare_digest", spy)
    with keyed.http() as http:
        assert http.get("/v1/models", headers=AUTH).status_code == 200
    assert compared == [(AUTH["Authorization"].encode(), AUTH["Authorization"].encode())]


def test_metrics_require_auth(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, api_key=KEY,
                    metrics_require_auth=True) as running, running.http() as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers=AUTH).status_code == 200
        assert http.get("/health").status_code == 200


def test_body_cap_counts_a_streamed_body(smollm2_gguf, loaded_model):
    """A chunked body (no Content-Length) is cut off at the cap too, not read whole."""
    def chunks():
        for _ in range(64):
            yield b" " * 1024

    with run_server(smollm2_gguf, loaded_model, max_request_bytes=4096) as running, \
            running.http() as http:
        resp = http.post("/v1/completions", content=chunks(),
                         headers={"Content-Type": "application/json"})
        assert resp.status_code == 413
        assert resp.json()["error"]["code"] == "request_too_large"
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200


def test_openapi_json_is_open_without_a_key(server):
    with httpx.Client(base_url=server.url) as http:
        spec = http.get("/openapi.json").json()
    assert "securitySchemes" not in spec["components"]
