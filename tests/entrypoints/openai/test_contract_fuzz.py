"""Contract fuzzing: schemathesis draws requests from the server's own /openapi.json (bodies
that fit the schema, and bodies that break it) and sends them to a real server. No answer
may be a 5xx; every 4xx is OpenAI's error shape, naming the field at fault where one is
(Anthropic's shape on /v1/messages and Ollama's on /api/..., which name no field)."""

import json
import re
from typing import Any

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from llmserve.entrypoints.openai.http_layer import error_shape
from llmserve.entrypoints.openai.protocol import (
    AnthropicErrorResponse,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    OllamaErrorResponse,
    TokenizeRequest,
)
from llmserve.entrypoints.openai.serving_messages import CountTokensRequest, MessagesRequest
from llmserve.entrypoints.openai.serving_ollama import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
)
from llmserve.entrypoints.openai.serving_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from llmserve.entrypoints.openai.serving_responses import ResponsesRequest
from llmserve.sampling_params import MAX_BEST_OF, MAX_LOGPROBS
from tests.entrypoints.openai.conftest import run_server

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
          "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
          "/v1/messages/count_tokens": CountTokensRequest,
          # the pooling runner's routes, fuzzed against a pooling server (aliases share a
          # handler: /score, /v1/rerank and /v2/rerank are listed, not fuzzed again)
          "/v1/embeddings": EmbeddingRequest, "/classify": ClassificationRequest,
          "/v1/score": ScoreRequest, "/score": ScoreRequest, "/rerank": RerankRequest,
          "/v1/rerank": RerankRequest, "/v2/rerank": RerankRequest,
          # Ollama's (translated into the routes above; /api/embed and /api/embeddings
          # answer 400 on a server that generates)
          "/api/chat": OllamaChatRequest, "/api/generate": OllamaGenerateRequest,
          "/api/embed": OllamaEmbedRequest, "/api/embeddings": OllamaEmbeddingsRequest,
          "/api/show": OllamaModelRequest, "/api/pull": OllamaModelRequest}
POOLING = ("/v1/embeddings", "/classify", "/v1/score", "/rerank")
ALIASES = ("/score", "/v1/rerank", "/v2/rerank")
# the lists of texts a pooling request may carry, capped as prompts are
POOLING_LISTS = ("input", "text_1", "text_2", "documents")
HEADERS = {"X-Return-Metrics"}
# Generated values are capped so that a case costs milliseconds of model time, not seconds
# (the limits themselves, n <= 64 and max_tokens <= max_model_len, have their own tests).
CAPS = {"n": 2, "best_of": 2, "max_tokens": 3, "max_completion_tokens": 3, "min_tokens": 3,
        "max_output_tokens": 3}
MAX_PROMPTS = 2
MAX_PROMPT_LENGTH = 64


@pytest.fixture(scope="module")
def fuzzed_server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


@pytest.fixture(scope="module")
def pooling_schema(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, engine_options={"runner": "pooling"}) as s:
        yield schemathesis.openapi.from_url(f"{s.url}/openapi.json")


def error_problem(status: int, content: bytes, path: str, body: Any) -> str | None:
    """What is wrong with a response's error body (None: nothing). A 4xx or 5xx body is
    exactly OpenAI's error shape; a 400 for a JSON object names the field at fault
    (`param`), and that field is one of the request's."""
    if status < 400:
        return None
    if path.startswith("/api/"):  # Ollama's shape: a message, naming no field apart
        try:
            OllamaErrorResponse.model_validate_json(content)
        except ValueError as e:
            return f"not Ollama's error shape: {e}"
        return None
    if path.startswith("/v1/messages"):
        try:
            anthropic = AnthropicErrorResponse.model_validate_json(content).error
        except ValueError as e:
            return f"not Anthropic's error shape: {e}"
        return None if anthropic.message and anthropic.type else f"empty: {anthropic}"
    try:
        error = ErrorResponse.model_validate_json(content).error
    except ValueError as e:
        return f"not OpenAI's error shape: {e}"
    if not error.message or not error.type:
        return f"an empty message or type: {error}"
    if status != 400 or not isinstance(body, dict):
        return None
    if error.param is None:
        return f"the 400 names no field: {error.message!r}"
    root = re.split(r"[.\[]", error.param, maxsplit=1)[0]
    model = BODIES.get(path)
    if error.param in body:  # a field whose own name holds "." or "["
        return None
    if root in body or root in HEADERS or (model is not None and root in model.model_fields):
        return None
    return f"param {error.param!r} is not a field of the request"


@schemathesis.check
def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    problem = error_problem(response.status_code, response.content, case.path, case.body)
    assert problem is None, problem
    return True if response.status_code >= 400 else None


def _cheap(body: Any) -> Any:
    """The body with counts capped (`CAPS`, `MAX_PROMPTS`, `MAX_PROMPT_LENGTH`) and
    max_tokens set."""
    if not isinstance(body, dict):
        return body
    for name, cap in CAPS.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    if ("messages" in body or "prompt" in body) and body.get("max_tokens") is None:
        body["max_tokens"] = CAPS["max_tokens"]  # not the default 16
    if "input" in body and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = CAPS["max_output_tokens"]
    # Ollama's bodies: `options.num_predict` caps the answer (-1 and -2 ask for the whole
    # context: capped too); on the other routes an `options` is an unknown field, ignored
    if "messages" in body or "prompt" in body:
        options = body.setdefault("options", {})
        predict = options.get("num_predict") if isinstance(options, dict) else 0
        if predict is None or isinstance(predict, int) and (predict > 3 or predict in (-1, -2)):
            options["num_predict"] = CAPS["max_tokens"]  # 0 and below -2 stay: refused
    for name in POOLING_LISTS:
        value = body.get(name)
        if isinstance(value, str):
            body[name] = value[:MAX_PROMPT_LENGTH]
        elif isinstance(value, list):
            body[name] = [v[:MAX_PROMPT_LENGTH] if isinstance(v, str | list) else v
                          for v in value[:MAX_PROMPTS]] if value and not isinstance(
                              value[0], int) else value[:MAX_PROMPT_LENGTH]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        body["prompt"] = prompt = prompt[:MAX_PROMPTS]
    # prompts of at most 64 tokens or characters: echo with logprobs and prompt_logprobs
    # score every prompt position over the whole vocabulary
    if isinstance(prompt, str | list) and prompt:
        parts = prompt if isinstance(prompt[0], list | str) else [prompt]
        cut = [part[:MAX_PROMPT_LENGTH] if isinstance(part, list | str) else part
               for part in parts]
        body["prompt"] = cut if parts is prompt else cut[0]
    return body


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          openai_error_shape]
FAST = hypothesis.settings(max_examples=25, deadline=None, database=None, derandomize=True,
                           suppress_health_check=list(HealthCheck))
SLOW = hypothesis.settings(max_examples=400, deadline=None, database=None,
                           suppress_health_check=list(HealthCheck))
# the Responses, Messages and Ollama routes translate into the chat route (fuzzed in
# full), and the pooling routes share one path (a prefill per input): fewer examples of
# their own
TRANSLATED = hypothesis.settings(FAST, max_examples=10)
FUZZED = [(path, mode) for path in BODIES if path not in ALIASES for mode in GenerationMode]


def _fuzz(api_schema: Any, path: str, mode: GenerationMode,
          settings: hypothesis.settings) -> None:
    operation = api_schema[path]["POST"]

    @settings
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        case.body = _cheap(case.body)
        case.call_and_validate(checks=CHECKS, timeout=60)

    run()


@pytest.mark.parametrize(("path", "mode"), FUZZED, ids=[f"{p}:{m.value}" for p, m in FUZZED])
def test_fuzzed_requests_get_no_5xx_and_openai_errors(request, path, mode):
    translated = path.startswith(("/v1/responses", "/v1/messages", "/api/")) or path in POOLING
    schema = request.getfixturevalue("pooling_schema" if path in POOLING else "api_schema")
    _fuzz(schema, path, mode, TRANSLATED if translated else FAST)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "mode"), FUZZED, ids=[f"{p}:{m.value}" for p, m in FUZZED])
def test_fuzzed_requests_many_more(request, path, mode):
    schema = request.getfixturevalue("pooling_schema" if path in POOLING else "api_schema")
    _fuzz(schema, path, mode, SLOW)


def test_the_error_check_can_fail():
    def error(**fields: Any) -> bytes:
        return json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": None,
                                     **fields}}).encode()

    completion = {"prompt": "hi", "n": 0}
    assert error_problem(400, error(param="n"), "/v1/completions", completion) is None
    assert error_problem(400, error(param="prompt[0]"), "/v1/completions", completion) is None
    assert error_problem(413, error(), "/v1/completions", completion) is None
    assert "names no field" in error_problem(400, error(), "/v1/completions", completion)
    assert "not a field" in error_problem(400, error(param="x"), "/v1/completions", completion)
    assert "shape" in error_problem(400, b'{"detail": "no"}', "/v1/completions", completion)
    assert "shape" in error_problem(500, error(extra=1), "/v1/completions", completion)
    assert "shape" in error_problem(404, b"Not Found", "/v1/completions", completion)


def test_the_schema_describes_every_route_and_its_errors(fuzzed_server):
    with fuzzed_server.http() as http:
        spec = http.get("/openapi.json").json()
    posts = {path for path, ops in spec["paths"].items() if "post" in ops}
    assert posts == set(BODIES)  # a new route with a body is fuzzed once it is listed here
    assert {"/v1/models", "/health", "/metrics", "/version"} <= set(spec["paths"])
    for path, ops in spec["paths"].items():
        shape = error_shape(path)[1]
        for op in ops.values():
            assert "422" not in op["responses"]
            assert op["responses"]["4XX"]["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{shape}"}
    completion = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == MAX_BEST_OF
    assert completion["logprobs"]["anyOf"][0]["maximum"] == MAX_LOGPROBS
