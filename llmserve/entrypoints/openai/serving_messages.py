"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, a thin
translator over the chat route (the same template, tool formats, grammars and engine).

A request becomes a chat request: `system` a system message, text blocks content,
`tool_use` blocks the assistant's tool calls, `tool_result` blocks tool messages; `tools`
(`input_schema`) and `tool_choice` (`auto`, `any` = required, `tool` = a named function,
`none`; `disable_parallel_tool_use`) map to chat's. The answer comes back as content blocks
(`text`, `tool_use` with its `input` object) with Anthropic's `stop_reason` (`end_turn`,
`max_tokens`, `stop_sequence`, `tool_use`) and usage, whole or as its event stream
(message_start, content_block_start / _delta / _stop, message_delta, message_stop).
Errors leave in Anthropic's shape (`{"type": "error", "error": {type, message}}`).
"""

import json
import logging
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from pydantic import Field

from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    OpenAIModel,
    Refusals,
    random_id,
    refuse_set_fields,
)
from llmserve.entrypoints.openai.serving_base import chat_events
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat

logger = logging.getLogger(__name__)

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                 "abort": "end_turn"}
# Anthropic's fields that would change the answer and that this server does not serve
_REFUSED = {"thinking": (({"type": "disabled"},),
                         "extended thinking is not served (no reasoning parser)"),
            "container": ((), "code-execution containers are not served"),
            "mcp_servers": (([],), "MCP servers are not served"),
            "service_tier": ((), "service tiers do not exist on a local server"),
            "speed": ((), "one serving speed exists on a local server"),
            "inference_geo": ((), "a local server runs where it runs"),
            "diagnostics": ((), "no diagnostics are returned")}


class ContentBlock(OpenAIModel):
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    # image: {"type": "base64", "media_type": "image/png", "data": "..."}
    source: dict[str, Any] | None = None


class AnthropicMessage(OpenAIModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]


class CountTokensRequest(OpenAIModel):
    REFUSED_FIELDS: ClassVar[Refusals] = _REFUSED
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None  # user_id: as OpenAI's `user`, for the caller
    # `format` (a JSON schema) constrains the answer; `effort` is refused (no reasoning)
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # prefix caching is automatic: always on


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, request: MessagesRequest,
                     arrival_time: float) -> dict[str, Any] | AsyncIterator[str]:
        """The message, or an iterator of its SSE events when `request.stream`."""
        chat_request = self._chat_request(request)
        message_id = random_id("msg").replace("msg-", "msg_", 1)
        result = await self.chat.create(chat_request, arrival_time)
        if request.stream:
            return self._events(result, message_id, request.stop_sequences or [])
        return self._message(result, message_id, request.stop_sequences or [])

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, Any]:
        chat_request = self._chat_request(request, max_tokens=1)
        self.chat.check_model(chat_request.model)
        tools = ([t.model_dump(exclude_none=True) for t in chat_request.tools]
                 if chat_request.tools else None)
        ids = await self.chat.engine.run_blocking(self.chat.prompt_ids,
                                                  chat_request.messages, tools)
        return {"input_tokens": len(ids)}

    def _chat_request(self, request: CountTokensRequest,
                      max_tokens: int | None = None) -> ChatCompletionRequest:
        refuse_set_fields(request.model_extra or {}, _REFUSED)
        body: dict[str, Any] = {"model": request.model,
                                "messages": _chat_messages(request)}
        if request.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in request.tools]
        if request.tool_choice is not None:
            body.update(_tool_choice(request.tool_choice))
        if isinstance(request, MessagesRequest):
            body.update(max_tokens=request.max_tokens, stream=request.stream,
                        temperature=request.temperature, top_p=request.top_p,
                        top_k=request.top_k, stop=request.stop_sequences or None)
            body.update(_output_config(request.output_config or {}))
            if request.stream:  # the prompt's size for message_start, from the first chunk
                body["stream_options"] = {"include_usage": True,
                                          "continuous_usage_stats": True}
        else:
            body["max_tokens"] = max_tokens
        return ChatCompletionRequest.model_validate(body)

    def _message(self, chat: dict[str, Any], message_id: str,
                 stop_sequences: list[str]) -> dict[str, Any]:
        (choice,) = chat["choices"]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call["id"],
                            "name": call["function"]["name"],
                            "input": _arguments(call["function"]["arguments"])})
        stop_reason, stop_sequence = _stop(choice, stop_sequences)
        usage = chat["usage"]
        return {"id": message_id, "type": "message", "role": "assistant",
                "model": chat["model"], "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": {**_input_usage(usage), "output_tokens": usage["completion_tokens"]}}

    async def _events(self, chunks: AsyncIterator[str], message_id: str,
                      stop_sequences: list[str]) -> AsyncIterator[str]:
        """The chat stream's chunks as Anthropic's events (closing this closes the chat
        stream, which aborts the request)."""
        try:
            async for event in self._translate(chunks, message_id, stop_sequences):
                yield event
        finally:
            await chunks.aclose()

    async def _translate(self, chunks: AsyncIterator[str], message_id: str,
                         stop_sequences: list[str]) -> AsyncIterator[str]:
        started = False
        block: str | None = None  # the open content block's type
        index = -1
        usage: dict[str, Any] = {}
        finish: dict[str, Any] | None = None

        def next_block(kind: str, content_block: dict[str, Any]) -> list[str]:
            """Close the open block (if any) and open the next, of `kind`."""
            nonlocal index, block
            events = [] if block is None else [
                _sse("content_block_stop", {"type": "content_block_stop", "index": index})]
            index, block = index + 1, kind
            return events + [_sse("content_block_start", {
                "type": "content_block_start", "index": index,
                "content_block": content_block})]

        async for chunk in chat_events(chunks):
            if "error" in chunk:
                yield _sse("error", {"type": "error", "error": {
                    "type": "api_error", "message": chunk["error"]["message"]}})
                return
            usage = chunk.get("usage") or usage
            if not started:
                started = True
                yield _sse("message_start", {"type": "message_start", "message": {
                    "id": message_id, "type": "message", "role": "assistant",
                    "model": chunk["model"], "content": [], "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {**_input_usage(usage), "output_tokens": 0}}})
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if block != "text":
                        for event in next_block("text", {"type": "text", "text": ""}):
                            yield event
                    yield _sse("content_block_delta", {
                        "type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": delta["content"]}})
                for piece in delta.get("tool_calls") or []:
                    function = piece.get("function") or {}
                    if piece.get("id"):
                        for event in next_block("tool_use", {
                                "type": "tool_use", "id": piece["id"],
                                "name": function.get("name"), "input": {}}):
                            yield event
                    if function.get("arguments"):
                        yield _sse("content_block_delta", {
                            "type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta",
                                      "partial_json": function["arguments"]}})
                if choice.get("finish_reason"):
                    finish = choice
        if block is not None:
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
        stop_reason, stop_sequence = _stop(finish or {}, stop_sequences)
        yield _sse("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {**_input_usage(usage), "output_tokens": usage.get("completion_tokens", 0)}})
        yield _sse("message_stop", {"type": "message_stop"})


def _chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The chat messages of an Anthropic request: system first, tool results as tool
    messages (before the user text that came with them)."""
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _text(request.system, "system")})
    for i, message in enumerate(request.messages):
        where = f"messages[{i}].content"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts, calls = [], []
        parts: list[dict[str, Any]] = []  # text and images in order, where images come
        for j, block in enumerate(message.content):
            if block.type == "text":
                texts.append(block.text or "")
                parts.append({"type": "text", "text": block.text or ""})
            elif block.type == "image" and message.role == "user":
                parts.append({"type": "image_url",
                              "image_url": {"url": _image_url(block, f"{where}[{j}]")}})
            elif block.type == "tool_use" and message.role == "assistant":
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input or {})}})
            elif block.type == "tool_result" and message.role == "user":
                result = block.content if block.content is not None else ""
                text = result if isinstance(result, str) else _text(result, f"{where}[{j}]")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": text})
            else:
                raise BadRequest(f"content block type '{block.type}' is not supported in a "
                                 f"{message.role} message (text, tool_use from the "
                                 "assistant, tool_result and image from the user)",
                                 param=f"{where}[{j}].type")
        has_image = any(p["type"] == "image_url" for p in parts)
        if texts or calls or has_image or message.role == "assistant":
            entry: dict[str, Any] = {"role": message.role,
                                     "content": parts if has_image else "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    return messages


def _image_url(block: ContentBlock, where: str) -> str:
    """An image block's source as the chat route takes it: base64 data as a data URL (the
    route decodes it), a URL as it is (fetched from --allowed-media-domains only)."""
    source = block.source or {}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    if source.get("type") != "base64" or not isinstance(source.get("data"), str):
        raise BadRequest("an image block's source must be base64 data or a url",
                         param=f"{where}.source")
    media = source.get("media_type")
    if media not in ("image/jpeg", "image/png", "image/gif", "image/webp"):
        raise BadRequest("media_type must be image/jpeg, image/png, image/gif or image/webp",
                         param=f"{where}.source.media_type")
    return f"data:{media};base64,{source['data']}"


def _text(blocks: str | list, where: str) -> str:
    """The text of a string or a list of text blocks (as dicts or models)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else block.type
        text = block.get("text") if isinstance(block, dict) else block.text
        if kind != "text":
            raise BadRequest(f"only text blocks are supported here, not '{kind}'",
                             param=f"{where}[{j}].type")
        parts.append(text or "")
    return "".join(parts)


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise BadRequest("tool_choice of type 'tool' needs a name", param="tool_choice")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    if mapped is None:
        raise BadRequest("tool_choice.type must be 'auto', 'any', 'tool' or 'none'",
                         param="tool_choice.type")
    body: dict[str, Any] = {"tool_choice": mapped}
    if choice.get("disable_parallel_tool_use"):
        body["parallel_tool_calls"] = False
    return body


def _arguments(text: str) -> dict[str, Any]:
    """A call's input object; a call cut short by max_tokens (stop_reason "max_tokens")
    has arguments that are not yet JSON: its input is then {"_partial_json": text}."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {"_partial_json": text}
    return value if isinstance(value, dict) else {"_value": value}


def _output_config(config: dict[str, Any]) -> dict[str, Any]:
    """The chat fields of `output_config`: its JSON schema `format` as `response_format`."""
    if config.get("effort") is not None:
        raise BadRequest("'output_config.effort' is not supported: the served model takes "
                         "no reasoning effort", param="output_config.effort")
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise BadRequest(f"output_config: unknown key {unknown[0]!r}", param="output_config")
    output_format = config.get("format")
    if output_format is None:
        return {}
    if output_format.get("type") != "json_schema" or "schema" not in output_format:
        raise BadRequest("output_config.format must be {\"type\": \"json_schema\", "
                         "\"schema\": ...}", param="output_config.format")
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": output_format["schema"]}}}


def _stop(choice: dict[str, Any], stop_sequences: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish."""
    reason = choice.get("finish_reason") or "stop"
    matched = choice.get("stop_reason")
    if reason == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return _STOP_REASONS.get(reason, "end_turn"), None


def _input_usage(usage: dict[str, Any]) -> dict[str, int]:
    """Anthropic's input counts from chat's usage: `input_tokens` leaves out the tokens read
    from the prefix cache, which `cache_read_input_tokens` counts (the prompt is their
    sum); nothing is written to a cache a client pays for."""
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    return {"input_tokens": usage.get("prompt_tokens", 0) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
