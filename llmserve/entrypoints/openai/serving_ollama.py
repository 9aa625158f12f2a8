"""Ollama's native API on the same server (/api/...), as Ollama's API documentation defines
it: a translator over the chat, completion and embedding routes (the same templates, tool
formats, grammars and engine), so `llmserve serve --port 11434` stands in for Ollama.

* POST /api/chat: messages (tool calls and tool results, `tool_name`), `tools`, `format`
  (`"json"` or a JSON schema, enforced by the grammar engine), `think` (with a reasoning
  parser), `options`, `stream` (on by default: newline-delimited JSON), `keep_alive`.
* POST /api/generate: `prompt` through the chat template (`system` before it) or `raw`,
  `context` (the token ids a previous answer returned) before it, `format`, `options`;
  with `suffix`, the prompt and suffix around the model's fill-in-the-middle tokens.
* POST /api/embed (`input`, `truncate`: each input's first tokens that fit the context,
  as Ollama keeps them, `dimensions`) and the older /api/embeddings.
* GET /api/tags, POST /api/show, GET /api/ps, GET /api/version, POST /api/pull (a catalog
  model), DELETE /api/delete (a pulled catalog model not being served), HEAD and GET /.

`options` maps to the sampling settings (`num_predict` max tokens, `repeat_penalty` the
repetition penalty over the whole context, `num_ctx` a cap on prompt and answer); an
option that would change the answer and that this server does not serve is a 400 naming
it. Durations are the request's own timeline in nanoseconds: `total_duration` from
arrival to finish, `prompt_eval_duration` from scheduling to the first token,
`eval_duration` from the first token to the last, `load_duration` 0 (the model is loaded
before the server listens) or, behind a many-model server, the wait for its load. Errors
are `{"error": "..."}` (http_layer.shaped).
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import Field

from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIModel,
    Refusals,
    refuse_set_fields,
)
from llmserve.entrypoints.openai.serving_base import NDJSONResponse, chat_events, respond
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat
from llmserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmserve.entrypoints.openai.serving_pooling import EmbeddingRequest, OpenAIServingPooling
from llmserve.tokenizer import PromptTooLong

# The Ollama release whose API these routes follow (clients read it from /api/version).
OLLAMA_API_VERSION = "0.12.6"
NS = 1_000_000_000
# how /openapi.json describes a route that streams newline-delimited JSON unless asked not to
_STREAMED: dict[int | str, Any] = {
    200: {"content": {"application/x-ndjson": {"schema": {"type": "string"}}}}}

# Ollama's options that would change the answer and that this server does not serve, with
# the values that leave them a no-op.
_REFUSED_OPTIONS = {
    "num_keep": ((), "the context is never shifted: a prompt past num_ctx is refused"),
    "typical_p": ((1, 1.0), "locally typical sampling is not served"),
    "repeat_last_n": ((-1,), "repeat_penalty applies to the whole context (-1)"),
    "tfs_z": ((1, 1.0), "tail-free sampling is not served"),
    "mirostat": ((0,), "mirostat sampling is not served"),
    "mirostat_tau": ((), "mirostat sampling is not served"),
    "mirostat_eta": ((), "mirostat sampling is not served"),
    "penalize_newline": ((), "repeat_penalty applies to every token"),
    "num_batch": ((), "the server's batching is set at start (--max-num-batched-tokens)"),
    "num_gpu": ((), "the model's placement is set at start (--device)"),
    "main_gpu": ((), "the model's placement is set at start (--device)"),
    "num_thread": ((), "threads are set at start (--threads)"),
    "numa": ((), "threads are set at start (--threads)"),
    "low_vram": ((), "the model's placement is set at start (--device)"),
    "use_mmap": ((), "weights are loaded as the server starts"),
    "use_mlock": ((), "weights are loaded as the server starts"),
    "vocab_only": ((), "the model is loaded whole"),
}
_REFUSED_CHAT = {"template": (("",), "the model's own chat template is used")}
_REFUSED_GENERATE = {
    "template": (("",), "the model's own chat template is used"),
}
_DONE_REASONS = {"stop": "stop", "tool_calls": "stop", "length": "length", "abort": "stop"}


class OllamaOptions(OpenAIModel):
    REFUSED_FIELDS: ClassVar[Refusals] = _REFUSED_OPTIONS
    num_ctx: int | None = Field(None, ge=1)
    num_predict: int | None = None
    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None


class OllamaFunctionCall(OpenAIModel):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    index: int | None = None


class OllamaToolCall(OpenAIModel):
    function: OllamaFunctionCall


class OllamaMessage(OpenAIModel):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    thinking: str | None = None  # a past answer's thinking: templates drop it, as here
    tool_name: str | None = None


class _Generating(OpenAIModel):
    model: str = Field(min_length=1)
    format: str | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: bool | str | None = None


class OllamaChatRequest(_Generating):
    REFUSED_FIELDS: ClassVar[Refusals] = _REFUSED_CHAT
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_Generating):
    REFUSED_FIELDS: ClassVar[Refusals] = _REFUSED_GENERATE
    prompt: str = ""
    suffix: str = ""
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None
    context: list[int] | None = None


class OllamaEmbedRequest(OpenAIModel):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: OllamaOptions | None = None
    keep_alive: str | int | float | None = None


class OllamaEmbeddingsRequest(OpenAIModel):
    model: str = Field(min_length=1)
    prompt: str
    options: OllamaOptions | None = None
    keep_alive: str | int | float | None = None


class OllamaModelRequest(OpenAIModel):
    model: str | None = None
    name: str | None = None  # older clients' spelling
    verbose: bool = False
    insecure: bool = False
    stream: bool = True

    def named(self) -> str:
        name = self.model or self.name
        if not name:
            raise BadRequest("model is required", param="model")
        return name


def ollama_name(name: str) -> str:
    """A model name as Ollama writes it, without its default tag (`x:latest` is `x`)."""
    return name.removesuffix(":latest")


def created_at() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


# what a many-model server in front says its request waited for this model to load
LOAD_HEADER = "x-llmserve-load-seconds"
_load_seconds: ContextVar[float] = ContextVar("ollama_load_seconds", default=0.0)


def durations(metrics: dict[str, Any] | None, prompt_tokens: int,
              output_tokens: int) -> dict[str, int]:
    """Ollama's counts and durations (nanoseconds) from a response's `metrics`; the load a
    many-model server waited for (`LOAD_HEADER`) is `load_duration`, and in the total."""
    def span(start: str, end: str) -> int:
        if metrics is None or metrics.get(start) is None or metrics.get(end) is None:
            return 0
        return max(0, round((metrics[end] - metrics[start]) * NS))

    load = round(_load_seconds.get() * NS)
    return {"total_duration": span("arrival_time", "finished_time") + load,
            "load_duration": load,
            "prompt_eval_count": prompt_tokens,
            "prompt_eval_duration": span("first_scheduled_time", "first_token_time"),
            "eval_count": output_tokens,
            "eval_duration": span("first_token_time", "last_token_time")}


class OllamaServing:
    """The /api routes' work: requests translated for the chat, completion and embedding
    handlers of the same server, their answers translated back."""

    def __init__(self, chat: OpenAIServingChat, completions: OpenAIServingCompletion,
                 pooling: OpenAIServingPooling, model_path: Path | None) -> None:
        self.chat = chat
        self.completions = completions
        self.pooling = pooling
        self.engine = chat.engine
        self.model_name = chat.model_name
        self.model_path = model_path
        self._digest: tuple[tuple, str] | None = None
        # hashing a model file and pulling one take seconds to minutes: on a thread of
        # their own, never the tokenizer pool other requests wait on
        self._files = ThreadPoolExecutor(1, thread_name_prefix="llmserve-ollama-files")

    async def _on_files_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._files, fn, *args)

    # ---- names -----------------------------------------------------------------------

    def served(self, name: str) -> str:
        """The served name `name` means (`x`, `x:latest`, a file's name without its
        extension); 404 in Ollama's words for any other."""
        wanted = ollama_name(name)
        names = {self.model_name, ollama_name(self.model_name)}
        if self.model_path is not None:
            names |= {self.model_path.name, self.model_path.stem}
        if wanted in names or name in names:
            return self.model_name
        raise BadRequest(f"model '{name}' not found", param="model", status=404)

    # ---- chat ------------------------------------------------------------------------

    async def chat_request(self, body: OllamaChatRequest, arrival: float
                           ) -> dict[str, Any] | AsyncIterator[str]:
        self.served(body.model)
        refuse_set_fields(body.model_extra or {}, _REFUSED_CHAT)
        self._keep_alive(body.keep_alive)
        if not body.messages:  # Ollama's way to load a model: nothing to answer
            return self._loaded(body.model, {"message": {"role": "assistant", "content": ""}})
        chat_body: dict[str, Any] = {
            "model": self.model_name, "messages": _chat_messages(
                body.messages, self.engine.image_prompts is not None),
            "stream": body.stream, "return_metrics": True, **self._thinking(body.think)}
        if body.tools:
            chat_body["tools"] = body.tools
        if body.options is not None and body.options.num_ctx is not None:
            prompt = ChatCompletionRequest.model_validate(chat_body)
            self._check_context(body.options, await self._chat_prompt_size(prompt))
        chat_body.update(self._sampling(body.options, body.format, "options"))
        if body.stream:
            chat_body["stream_options"] = {"include_usage": True}
        result = await self.chat.create(ChatCompletionRequest.model_validate(chat_body),
                                        arrival)
        if body.stream:
            return self._chat_stream(body.model, result)
        return self._chat_whole(body.model, result)

    async def _chat_prompt_size(self, request: ChatCompletionRequest) -> int:
        tools = [t.model_dump(exclude_none=True) for t in request.tools or ()] or None
        ids = await self.engine.run_blocking(self.chat.prompt_ids, request.messages, tools,
                                             True, request.chat_template_kwargs, False, False,
                                             self.engine.max_model_len)
        return len(ids)

    def _chat_whole(self, model: str, chat: dict[str, Any]) -> dict[str, Any]:
        (choice,) = chat["choices"]
        message = _ollama_message(choice["message"])
        usage = chat.get("usage", {})
        return {"model": model, "created_at": created_at(), "message": message, "done": True,
                "done_reason": _DONE_REASONS.get(choice["finish_reason"], "stop"),
                **durations(chat.get("metrics"), usage.get("prompt_tokens", 0),
                            usage.get("completion_tokens", 0))}

    async def _chat_stream(self, model: str, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        calls: dict[int, dict[str, Any]] = {}
        finish = "stop"
        async for chunk in chat_events(stream):
            if "error" in chunk:  # the stream's error event, as Ollama's: one line
                yield ndjson_line({"error": chunk["error"].get("message", "error")})
                return
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta", {})
                for call in delta.get("tool_calls") or ():
                    whole = calls.setdefault(call.get("index", len(calls)),
                                             {"name": "", "arguments": ""})
                    function = call.get("function") or {}
                    whole["name"] += function.get("name") or ""
                    whole["arguments"] += function.get("arguments") or ""
                message: dict[str, Any] = {"role": "assistant",
                                           "content": delta.get("content") or ""}
                if delta.get("reasoning_content"):
                    message["thinking"] = delta["reasoning_content"]
                if message["content"] or "thinking" in message:
                    yield ndjson_line({"model": model, "created_at": created_at(),
                                 "message": message, "done": False})
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
            if chunk.get("usage") is not None and not chunk.get("choices"):
                usage = chunk["usage"]
                message = {"role": "assistant", "content": ""}
                if calls:  # whole calls, once their arguments are complete, as Ollama's
                    message["tool_calls"] = [_ollama_call(c["name"], c["arguments"])
                                             for _, c in sorted(calls.items())]
                yield ndjson_line({"model": model, "created_at": created_at(), "message": message,
                             "done": True, "done_reason": _DONE_REASONS.get(finish, "stop"),
                             **durations(chunk.get("metrics"), usage["prompt_tokens"],
                                         usage["completion_tokens"])})

    # ---- generate --------------------------------------------------------------------

    async def generate(self, body: OllamaGenerateRequest, arrival: float
                       ) -> dict[str, Any] | AsyncIterator[str]:
        self.served(body.model)
        refuse_set_fields(body.model_extra or {}, _REFUSED_GENERATE)
        self._keep_alive(body.keep_alive)
        if body.images and self.engine.image_prompts is None:
            raise BadRequest("this model reads text only", param="images")
        if body.images and (body.raw or body.suffix):
            raise BadRequest("images go in the templated prompt (not raw, no suffix)",
                             param="images")
        if body.think not in (None, False):
            raise BadRequest("thinking is split from the answer on /api/chat; /api/generate "
                             "returns the text as generated", param="think")
        if not (body.prompt or body.context or body.suffix or body.images):  # a model load
            return self._loaded(body.model, {"response": ""})
        if body.raw and body.system:
            raise BadRequest("a raw prompt is not templated: put the system text in it",
                             param="system")
        if body.suffix:
            self._check_fill_in_middle(body)
        ids = list(body.context or ())
        images: list = []  # placed in `ids`
        limit = self.engine.max_model_len  # a longer prompt is refused while tokenized
        try:
            if body.suffix:  # the model writes what goes between prompt and suffix
                ids = await self.engine.run_blocking(
                    self.chat.tokenizer.encode_fill_in_middle, body.prompt, body.suffix, limit)
            elif body.raw:
                ids += await self.engine.run_blocking(self.chat.tokenizer.encode, body.prompt,
                                                      not ids, limit)
            elif body.prompt or body.images:
                content: Any = body.prompt or ""
                if body.images:  # before the text, as Ollama places them
                    content = [*({"type": "image_url", "image_url": {
                        "url": f"data:image/*;base64,{data}"}} for data in body.images),
                        {"type": "text", "text": body.prompt or ""}]
                messages = [*([{"role": "system", "content": body.system}]
                              if body.system else []), {"role": "user", "content": content}]
                request = ChatCompletionRequest.model_validate({"messages": messages})
                rendered = await self.engine.run_blocking(
                    self.chat.prompt_ids, request.messages, None, True, None, False, False,
                    limit)
                # after `context`: the images' places move past it
                images = [m.placed(m.offset + len(ids), m.length)
                          for m in getattr(rendered, "images", ())]
                ids += rendered
        except PromptTooLong as e:
            raise BadRequest(str(e), param="prompt") from None
        self._check_context(body.options, len(ids))
        completion = {"model": self.model_name, "prompt": ids, "stream": body.stream,
                      "return_metrics": True, "return_token_ids": True, "max_tokens": None,
                      **self._sampling(body.options, body.format, "options")}
        if body.stream:
            completion["stream_options"] = {"include_usage": True}
        result = await self.completions.create(CompletionRequest.model_validate(completion),
                                               arrival, images)
        if body.stream:
            return self._generate_stream(body.model, ids, result)
        (choice,) = result["choices"]
        usage = result.get("usage", {})
        return {"model": body.model, "created_at": created_at(), "response": choice["text"],
                "done": True, "done_reason": _DONE_REASONS.get(choice["finish_reason"], "stop"),
                "context": ids + list(choice.get("token_ids") or ()),
                **durations(result.get("metrics"), usage.get("prompt_tokens", 0),
                            usage.get("completion_tokens", 0))}

    async def _generate_stream(self, model: str, ids: list[int],
                               stream: AsyncIterator[str]) -> AsyncIterator[str]:
        generated: list[int] = []
        finish = "stop"
        async for chunk in chat_events(stream):
            if "error" in chunk:
                yield ndjson_line({"error": chunk["error"].get("message", "error")})
                return
            for choice in chunk.get("choices", ()):
                generated += choice.get("token_ids") or ()
                if choice.get("text"):
                    yield ndjson_line({"model": model, "created_at": created_at(),
                                 "response": choice["text"], "done": False})
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
            if chunk.get("usage") is not None and not chunk.get("choices"):
                usage = chunk["usage"]
                yield ndjson_line({"model": model, "created_at": created_at(), "response": "",
                             "done": True, "done_reason": _DONE_REASONS.get(finish, "stop"),
                             "context": ids + generated,
                             **durations(chunk.get("metrics"), usage["prompt_tokens"],
                                         usage["completion_tokens"])})

    # ---- embeddings ------------------------------------------------------------------

    async def embed(self, body: OllamaEmbedRequest, arrival: float) -> dict[str, Any]:
        self.served(body.model)
        self._keep_alive(body.keep_alive)
        self._no_options(body.options)
        texts = [body.input] if isinstance(body.input, str) else body.input
        inputs: list[str] | list[list[int]] = texts
        if body.truncate:  # Ollama's truncation keeps each input's beginning
            limit = self.engine.max_model_len - 1  # as many as a prompt may have here
            inputs = [await self.engine.run_blocking(self.chat.tokenizer.encode_head, text,
                                                     limit) for text in texts]
        request = EmbeddingRequest.model_validate({
            "model": self.model_name, "input": inputs, "dimensions": body.dimensions})
        start = time.monotonic()
        result = await self.pooling.embeddings(request, arrival)
        return {"model": body.model,
                "embeddings": [item["embedding"] for item in result["data"]],
                "total_duration": round((time.monotonic() - start) * NS)
                + round(_load_seconds.get() * NS),
                "load_duration": round(_load_seconds.get() * NS),
                "prompt_eval_count": result["usage"]["prompt_tokens"]}

    async def embeddings(self, body: OllamaEmbeddingsRequest, arrival: float) -> dict[str, Any]:
        self.served(body.model)
        self._keep_alive(body.keep_alive)
        self._no_options(body.options)
        request = EmbeddingRequest.model_validate({"model": self.model_name,
                                                   "input": [body.prompt]})
        result = await self.pooling.embeddings(request, arrival)
        return {"embedding": result["data"][0]["embedding"]}

    # ---- models ----------------------------------------------------------------------

    async def tags(self) -> dict[str, Any]:
        return {"models": [await self._listing()]}

    async def ps(self) -> dict[str, Any]:
        from llmserve.engine.engine import model_bytes

        listing = await self._listing()
        size = model_bytes(self.engine.engine.loaded.model)
        on_gpu = self.engine.engine.device.type != "cpu"
        return {"models": [{
            "name": listing["name"], "model": listing["model"], "size": size,
            "digest": listing["digest"], "details": listing["details"],
            # loaded for as long as the server runs
            "expires_at": "2318-01-01T00:00:00Z", "size_vram": size if on_gpu else 0,
            "context_length": self.engine.max_model_len}]}

    async def show(self, body: OllamaModelRequest) -> dict[str, Any]:
        self.served(body.named())
        loaded = self.engine.engine.loaded
        config = loaded.config
        arch = config.architecture
        info = {"general.architecture": arch,
                "general.parameter_count": _parameter_count(config),
                f"{arch}.context_length": self.engine.max_model_len,
                f"{arch}.embedding_length": config.hidden_size,
                f"{arch}.block_count": config.num_hidden_layers,
                f"{arch}.attention.head_count": config.num_attention_heads,
                f"{arch}.attention.head_count_kv": config.num_key_value_heads,
                f"{arch}.vocab_size": config.vocab_size}
        details = (await self._listing())["details"]
        source = self.model_path or Path(self.model_name)
        return {"modelfile": f"# served by llmserve\nFROM {source}\n",
                "parameters": "", "template": self.chat.tokenizer.chat_template or "",
                "details": details, "model_info": info, "capabilities": self._capabilities(),
                "modified_at": modified_at(self.model_path)}

    def _capabilities(self) -> list[str]:
        if self.engine.engine.pooler is not None:
            return ["embedding"]
        found = ["completion"]
        if self.chat.tokenizer.fill_in_middle_ids is not None:
            found.append("insert")  # Ollama's word for fill-in-the-middle
        if "tools" in (self.chat.tokenizer.chat_template or ""):
            found.append("tools")
        if self.chat.reasoning_parser is not None:
            found.append("thinking")
        if self.engine.image_prompts is not None:
            found.append("vision")
        return found

    async def _listing(self) -> dict[str, Any]:
        loaded = self.engine.engine.loaded
        size = size_on_disk(self.model_path)
        return {"name": f"{ollama_name(self.model_name)}:latest",
                "model": f"{ollama_name(self.model_name)}:latest",
                "modified_at": modified_at(self.model_path), "size": size,
                "digest": await self._file_digest(),
                "details": {"parent_model": "", "format": loaded.source.kind,
                            "family": loaded.config.architecture,
                            "families": [loaded.config.architecture],
                            "parameter_size": _parameter_size(loaded.config),
                            "quantization_level": _quantization_level(loaded)}}

    async def _file_digest(self) -> str:
        """The model file's sha256 (a folder's: of its files' digests), computed once per
        file version off the event loop."""
        path = self.model_path
        if path is None:
            return ""
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
        if self._digest is None or self._digest[0] != stamp:
            self._digest = (stamp, await self._on_files_thread(model_digest, files))
        return self._digest[1]

    # ---- pull and delete -------------------------------------------------------------

    async def pull(self, body: OllamaModelRequest) -> dict[str, Any] | AsyncIterator[str]:
        return await pull_from_catalog(body, self._on_files_thread)

    def delete(self, body: OllamaModelRequest) -> None:
        delete_from_catalog(body, [self.model_path] if self.model_path else [])

    # ---- shared ----------------------------------------------------------------------

    def _loaded(self, model: str, answer: dict[str, Any]) -> dict[str, Any]:
        return {"model": model, "created_at": created_at(), **answer, "done": True,
                "done_reason": "load"}

    def _keep_alive(self, value: str | int | float | None) -> None:
        """`keep_alive`: how long the model stays loaded after the request. This server
        loads its one model at start and keeps it until it stops; 0 (unload now) cannot
        be honoured."""
        if value is None:
            return
        if keep_alive_seconds(value) == 0:
            raise BadRequest("this server serves one model, loaded for as long as it runs: "
                             "it cannot be unloaded", param="keep_alive")

    def _check_fill_in_middle(self, body: OllamaGenerateRequest) -> None:
        """`suffix` (editors' code completion): the prompt is the text before the cursor,
        the suffix the text after it, laid out with the model's fill-in-the-middle tokens
        instead of the chat template."""
        if self.chat.tokenizer.fill_in_middle_ids is None:
            raise BadRequest("this model's vocabulary has no fill-in-the-middle tokens "
                             "(<|fim_prefix|>..., <fim_prefix>...): it cannot complete "
                             "between a prompt and a suffix", param="suffix")
        for name in ("system", "context"):
            if getattr(body, name):
                raise BadRequest(f"{name} does not combine with suffix (a fill-in-the-middle "
                                 "prompt is the text around the hole alone)", param=name)

    def _no_options(self, options: OllamaOptions | None) -> None:
        if options is None:
            return
        refuse_set_fields(options.model_extra or {}, _REFUSED_OPTIONS)
        set_ = [k for k, v in options.model_dump(exclude_none=True).items()
                if k != "num_ctx"]
        if set_:
            raise BadRequest(f"'{set_[0]}' does not apply to embeddings",
                             param=f"options.{set_[0]}")

    def _sampling(self, options: OllamaOptions | None, format_: str | dict[str, Any] | None,
                  where: str) -> dict[str, Any]:
        """Chat/completion request fields from Ollama's `options` and `format`."""
        body: dict[str, Any] = {}
        if format_ == "json":
            body["response_format"] = {"type": "json_object"}
        elif isinstance(format_, dict):
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "format", "schema": format_}}
        elif format_ not in (None, ""):
            raise BadRequest(f"format must be \"json\" or a JSON schema, not {format_!r}",
                             param="format")
        if options is None:
            return body
        refuse_set_fields(options.model_extra or {}, _REFUSED_OPTIONS)
        for ours, theirs in (("temperature", "temperature"), ("top_k", "top_k"),
                             ("top_p", "top_p"), ("min_p", "min_p"), ("seed", "seed"),
                             ("repetition_penalty", "repeat_penalty"),
                             ("presence_penalty", "presence_penalty"),
                             ("frequency_penalty", "frequency_penalty")):
            if (value := getattr(options, theirs)) is not None:
                body[ours] = value
        if options.top_k == 0:
            body["top_k"] = -1  # Ollama's 0: no top-k
        if options.stop is not None:
            body["stop"] = [options.stop] if isinstance(options.stop, str) else options.stop
        predict = options.num_predict
        if predict is not None and predict not in (-1, -2):
            if predict < 1:
                raise BadRequest("num_predict must be at least 1 (or -1: up to the context)",
                                 param=f"{where}.num_predict")
            body["max_tokens"] = predict
        return body

    def _check_context(self, options: OllamaOptions | None, prompt_tokens: int) -> None:
        """`num_ctx` caps prompt and answer: a longer prompt is refused (Ollama would cut
        it), a longer answer stops there."""
        if options is None or options.num_ctx is None:
            return
        if prompt_tokens >= options.num_ctx:
            raise BadRequest(f"the prompt is {prompt_tokens} tokens, num_ctx is "
                             f"{options.num_ctx}", param="options.num_ctx")
        room = options.num_ctx - prompt_tokens
        limit = options.num_predict if options.num_predict and options.num_predict > 0 else room
        options.num_predict = min(limit, room)

    def _thinking(self, think: bool | str | None) -> dict[str, Any]:
        if think is None:
            return {}
        if isinstance(think, str):
            raise BadRequest("thinking levels are not served; think takes true or false",
                             param="think")
        if self.chat.reasoning_parser is None:
            if think:
                raise BadRequest(f'"{self.model_name}" does not support thinking',
                                 param="think")
            return {}
        if think:
            return {"include_reasoning": True}
        return {"include_reasoning": False,
                "chat_template_kwargs": {"enable_thinking": False}}


def _chat_messages(messages: list[OllamaMessage], images: bool) -> list[dict[str, Any]]:
    """Chat messages: Ollama's calls carry no ids, so each gets one, and a tool result is
    the answer to the first call before it not yet answered (of its `tool_name`, if given);
    a message's `images` (base64, on a model that takes `images`) go before its text."""
    out = []
    pending: list[tuple[str, str]] = []  # (call id, function name) not yet answered
    for i, message in enumerate(messages):
        if message.images and not images:
            raise BadRequest("this model reads text only", param=f"messages[{i}].images")
        item: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.images:
            item["content"] = [*({"type": "image_url", "image_url": {
                "url": f"data:image/*;base64,{data}"}} for data in message.images),
                {"type": "text", "text": message.content or ""}]
        if message.tool_calls:
            item["tool_calls"] = [
                {"id": f"call_{i}_{j}", "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": call.function.arguments
                              if isinstance(call.function.arguments, str)
                              else json.dumps(call.function.arguments)}}
                for j, call in enumerate(message.tool_calls)]
            pending = [(c["id"], c["function"]["name"]) for c in item["tool_calls"]]
        if message.role == "tool":
            match = next((p for p in pending if message.tool_name in (None, p[1])), None)
            if match is not None:
                pending.remove(match)
                item["tool_call_id"] = match[0]
            if message.tool_name:
                item["name"] = message.tool_name
        out.append(item)
    return out


def _ollama_call(name: str, arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        parsed = arguments
    return {"function": {"name": name, "arguments": parsed}}


def _ollama_message(message: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        out["thinking"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = [_ollama_call(c["function"]["name"], c["function"]["arguments"])
                             for c in message["tool_calls"]]
    return out


def ndjson_line(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False) + "\n"


def keep_alive_seconds(value: str | int | float) -> float:
    """Ollama's keep_alive: seconds as a number, or a duration such as "5m", "1h", "-1"."""
    if isinstance(value, int | float):
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    units = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    for unit in ("ms", "s", "m", "h"):
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * units[unit]
            except ValueError:
                break
    raise BadRequest(f"keep_alive must be a duration such as 5m or 30s, not {value!r}",
                     param="keep_alive")


def _parameter_count(config: Any) -> int:
    from llmserve.memory import parameter_counts

    return parameter_counts(config)[0]


def _parameter_size(config: Any) -> str:
    count = _parameter_count(config)
    if count >= 10**9:
        return f"{count / 10**9:.1f}B"
    return f"{count / 10**6:.0f}M"


def _quantization_level(loaded: Any) -> str:
    if loaded.source.kind == "gguf":
        from llmserve.loader.gguf import gguf_file_type

        return gguf_file_type(loaded.source.path)
    return "F32" if loaded.quantization is None else loaded.quantization.upper()


def size_on_disk(path: Path | None) -> int:
    if path is None:
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def modified_at(path: Path | None) -> str:
    if path is None or not path.exists():
        return created_at()
    return datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat().replace("+00:00", "Z")


def model_digest(files: list[Path]) -> str:
    """Ollama's digest of a model: its file's sha256, or a folder's (of its files')."""
    import hashlib

    from llmserve.loader.catalog import file_sha256

    digests = [file_sha256(path) for path in files]
    if len(digests) == 1:
        return f"sha256:{digests[0]}"
    return "sha256:" + hashlib.sha256("".join(digests).encode()).hexdigest()


async def pull_from_catalog(body: OllamaModelRequest,
                            on_thread: Callable[..., Awaitable[Any]]
                            ) -> dict[str, Any] | AsyncIterator[str]:
    """/api/pull: fetch a catalog model into the cache (as `llmserve pull` does), the
    download run by `on_thread(fn, *args)` off the event loop; streamed as Ollama streams
    its progress unless `stream` is false."""
    from llmserve.loader.catalog import catalog_entry, fetch_model

    name = ollama_name(body.named())
    try:
        catalog_entry(name)
    except Exception as exc:  # noqa: BLE001 - not a catalog name: Ollama's 404 wording
        raise BadRequest(f"pull model manifest: file does not exist ({exc})",
                         param="model", status=404) from None

    async def progress() -> AsyncIterator[str]:
        yield ndjson_line({"status": "pulling manifest"})
        await on_thread(fetch_model, name, None, False)
        yield ndjson_line({"status": "verifying sha256 digest"})
        yield ndjson_line({"status": "success"})

    if body.stream:
        return progress()
    await on_thread(fetch_model, name, None, False)
    return {"status": "success"}


def delete_from_catalog(body: OllamaModelRequest, in_use: list[Path]) -> None:
    """/api/delete: remove a pulled catalog model from the cache; 404 for a name that is
    not one, 409 while it is served (`in_use`: the paths being served)."""
    from llmserve.loader.catalog import cached_path, catalog_entry

    name = ollama_name(body.named())
    try:
        catalog_entry(name)
    except Exception:  # noqa: BLE001
        raise BadRequest(f"model '{body.named()}' not found", param="model",
                         status=404) from None
    path = cached_path(name)
    if not path.exists():
        raise BadRequest(f"model '{body.named()}' not found", param="model", status=404)
    if any(path.resolve() == served.resolve() for served in in_use):
        raise BadRequest(f"model '{body.named()}' is being served; stop the server to "
                         "delete it", param="model", status=409)
    for extra in (path, path.with_name(path.name + ".sha256")):
        extra.unlink(missing_ok=True)


def add_ollama_routes(app: FastAPI, ollama: OllamaServing,
                      arrival: Callable[[Request], float]) -> None:
    """Ollama's routes on `app`."""

    async def answer(request: Request, work: Any) -> Response:
        try:
            _load_seconds.set(max(0.0, float(request.headers.get(LOAD_HEADER, 0))))
        except ValueError:
            raise BadRequest(f"the {LOAD_HEADER} header must be seconds") from None
        return await respond(request, work, NDJSONResponse)

    @app.post("/api/chat", responses=_STREAMED)
    async def ollama_chat(body: OllamaChatRequest, request: Request) -> Response:
        return await answer(request, ollama.chat_request(body, arrival(request)))

    @app.post("/api/generate", responses=_STREAMED)
    async def ollama_generate(body: OllamaGenerateRequest, request: Request) -> Response:
        return await answer(request, ollama.generate(body, arrival(request)))

    @app.post("/api/embed")
    async def ollama_embed(body: OllamaEmbedRequest, request: Request) -> Response:
        return await answer(request, ollama.embed(body, arrival(request)))

    @app.post("/api/embeddings")
    async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: Request) -> Response:
        return await answer(request, ollama.embeddings(body, arrival(request)))

    @app.get("/api/tags")
    async def ollama_tags() -> dict[str, Any]:
        return await ollama.tags()

    @app.get("/api/ps")
    async def ollama_ps() -> dict[str, Any]:
        return await ollama.ps()

    @app.post("/api/show")
    async def ollama_show(body: OllamaModelRequest) -> dict[str, Any]:
        return await ollama.show(body)

    @app.get("/api/version")
    async def ollama_version() -> dict[str, str]:
        return {"version": OLLAMA_API_VERSION}

    @app.post("/api/pull", responses=_STREAMED)
    async def ollama_pull(body: OllamaModelRequest, request: Request) -> Response:
        return await answer(request, ollama.pull(body))

    @app.delete("/api/delete")
    async def ollama_delete(body: OllamaModelRequest) -> Response:
        ollama.delete(body)
        return Response(status_code=200)

    @app.head("/")
    async def running() -> Response:  # clients probe the server with HEAD /
        return PlainTextResponse("llmserve is running")


__all__ = ["OLLAMA_API_VERSION", "OllamaServing", "add_ollama_routes"]
