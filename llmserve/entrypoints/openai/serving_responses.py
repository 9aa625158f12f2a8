"""POST /v1/responses (and GET /v1/responses/{id}): OpenAI's Responses API, stateless or
chained, a thin translator over the chat route.

`input` (text, or items: messages, `function_call`s and their `function_call_output`s) and
`instructions` become chat messages; function `tools`, `tool_choice`, `parallel_tool_calls`,
`text.format` (json_schema, json_object), `max_output_tokens`, `temperature`, `top_p` map to
the chat request's. The answer's output items are a `message` (output_text) and
`function_call`s, whole or as the Responses event stream (response.created, output_item /
content_part / output_text / function_call_arguments events, response.completed).

`previous_response_id` continues a stored response: its input and output come before the new
input. Responses are stored (unless `store: false`) in memory, the newest `STORE_SIZE`
kept; an id no longer (or never) stored is a 400 naming the field.
"""

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationError

from llmserve.entrypoints.openai.http_layer import describe_validation_error
from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    OpenAIModel,
    Refusals,
    refuse_set_fields,
)
from llmserve.entrypoints.openai.serving_base import chat_events
from llmserve.entrypoints.openai.serving_chat import OpenAIServingChat

STORE_SIZE = 1024
# the Responses API's fields that would change the answer and that are not served here
_REFUSED = {"background": ((False,), "background responses are not served"),
            "conversation": ((), "conversations are not stored; use previous_response_id"),
            "prompt": ((), "stored prompt templates do not exist on this server"),
            "reasoning": (({}, {"effort": None}), "the served model takes no reasoning "
                                                  "settings (no reasoning parser)"),
            "include": (([],), "no extra output data (reasoning, logprobs) is served"),
            "truncation": (("disabled",), "the input is never truncated"),
            "max_tool_calls": ((), "a cap on tool calls is not served"),
            "service_tier": ((), "service tiers do not exist on a local server")}


class ResponsesRequest(OpenAIModel):
    REFUSED_FIELDS: ClassVar[Refusals] = _REFUSED
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # returned with the response, as OpenAI does
    user: str | None = None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        # response id -> (the conversation's chat messages, the response body)
        self.store: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = \
            OrderedDict()

    def retrieve(self, response_id: str) -> dict[str, Any]:
        if response_id not in self.store:
            raise BadRequest(f"no stored response has the id '{response_id}'",
                             param="response_id", status=404)
        return self.store[response_id][1]

    async def create(self, request: ResponsesRequest,
                     arrival_time: float) -> dict[str, Any] | AsyncIterator[str]:
        """The response, or an iterator of its SSE events when `request.stream`."""
        refuse_set_fields(request.model_extra or {}, _REFUSED)
        messages = self._conversation(request)
        try:
            chat_request = ChatCompletionRequest.model_validate(_chat_body(request, messages))
        except ValidationError as e:  # input items that make no chat message
            message, _ = describe_validation_error(e.errors())
            raise BadRequest(f"input does not make a conversation: {message}",
                             param="input") from None
        shell = self._shell(request)
        try:
            result = await self.chat.create(chat_request, arrival_time)
        except BadRequest as e:  # name the Responses field, not the chat one it became
            raise _in_responses_terms(e) from None
        if request.stream:
            return self._events(result, shell, request, messages)
        body = self._finish(shell, _output_of(result), result["usage"],
                            result["choices"][0]["finish_reason"])
        self._remember(request, messages, body)
        return body

    def _conversation(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        """The chat messages: a previous response's conversation, instructions, input."""
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            if request.previous_response_id not in self.store:
                raise BadRequest(f"no stored response has the id "
                                 f"'{request.previous_response_id}' (responses are kept in "
                                 f"memory, the newest {STORE_SIZE})",
                                 param="previous_response_id")
            previous_messages, previous = self.store[request.previous_response_id]
            history = [m for m in previous_messages if m["role"] != "system"]
            history += _input_messages(previous["output"], "previous output")
        messages = [{"role": "system", "content": request.instructions}] \
            if request.instructions else []
        new = ([{"role": "user", "content": request.input}] if isinstance(request.input, str)
               else _input_messages(request.input, "input"))
        return messages + history + new

    def _shell(self, request: ResponsesRequest) -> dict[str, Any]:
        """The response object before its output."""
        return {"id": _new_id("resp"), "object": "response", "created_at": int(time.time()),
                "status": "in_progress", "model": self.chat.model_name, "output": [],
                "error": None, "incomplete_details": None,
                "instructions": request.instructions,
                "max_output_tokens": request.max_output_tokens,
                "parallel_tool_calls": request.parallel_tool_calls,
                "previous_response_id": request.previous_response_id,
                "temperature": request.temperature if request.temperature is not None else 1.0,
                "top_p": request.top_p if request.top_p is not None else 1.0,
                "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
                "text": request.text or {"format": {"type": "text"}},
                "metadata": request.metadata or {}, "store": request.store,
                "truncation": "disabled", "reasoning": None, "user": request.user,
                "usage": None}

    @staticmethod
    def _finish(shell: dict[str, Any], output: list[dict[str, Any]], usage: dict[str, Any],
                finish_reason: str | None) -> dict[str, Any]:
        incomplete = finish_reason == "length"
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {**shell, "output": output,
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": {"input_tokens": usage["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": usage["completion_tokens"],
                          "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": usage["total_tokens"]}}

    def _remember(self, request: ResponsesRequest, messages: list[dict[str, Any]],
                  body: dict[str, Any]) -> None:
        if not request.store:
            return
        self.store[body["id"]] = (messages, body)
        while len(self.store) > STORE_SIZE:
            self.store.popitem(last=False)

    async def _events(self, chunks: AsyncIterator[str], shell: dict[str, Any],
                      request: ResponsesRequest,
                      messages: list[dict[str, Any]]) -> AsyncIterator[str]:
        stream = _EventStream(shell)
        try:
            async for event in stream.translate(chunks):
                yield event
        finally:
            await chunks.aclose()
        if stream.final is not None:
            self._remember(request, messages, stream.final)


class _EventStream:
    """The chat stream's chunks as Responses events, each with its sequence number."""

    def __init__(self, shell: dict[str, Any]) -> None:
        self.shell = shell
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items, the last one open
        self.final: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def translate(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.shell)
        yield self.event("response.in_progress", response=self.shell)
        usage: dict[str, Any] = {}
        finish_reason = None
        async for chunk in chat_events(chunks):
            if "error" in chunk:
                yield self.event("error", code="server_error",
                                 message=chunk["error"]["message"], param=None)
                return
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    for event in self.text(delta["content"]):
                        yield event
                for piece in delta.get("tool_calls") or []:
                    for event in self.call(piece):
                        yield event
                finish_reason = choice.get("finish_reason") or finish_reason
        for event in self.close_item():
            yield event
        self.final = OpenAIServingResponses._finish(self.shell, self.items, usage,
                                                    finish_reason)
        kind = "response.completed" if self.final["status"] == "completed" else \
            "response.incomplete"
        yield self.event(kind, response=self.final)

    def text(self, delta: str) -> list[str]:
        events = []
        if not self.items or self.items[-1]["type"] != "message" or \
                self.items[-1]["status"] != "in_progress":
            events += self.close_item()
            item = {"type": "message", "id": _new_id("msg"), "status": "in_progress",
                    "role": "assistant", "content": []}
            self.items.append(item)
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.items) - 1, item=item))
            part = {"type": "output_text", "text": "", "annotations": []}
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     part=part))
        item = self.items[-1]
        item["content"][0]["text"] += delta
        events.append(self.event("response.output_text.delta", item_id=item["id"],
                                 output_index=len(self.items) - 1, content_index=0,
                                 delta=delta, logprobs=[]))
        return events

    def call(self, piece: dict[str, Any]) -> list[str]:
        events = []
        function = piece.get("function") or {}
        if piece.get("id"):
            events += self.close_item()
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": piece["id"],
                    "name": function.get("name"), "arguments": "", "status": "in_progress"}
            self.items.append(item)
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.items) - 1, item=item))
        item = self.items[-1]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=item["id"], output_index=len(self.items) - 1,
                                     delta=function["arguments"]))
        return events

    def close_item(self) -> list[str]:
        """The done events of the open item, if any."""
        if not self.items or self.items[-1]["status"] != "in_progress":
            return []
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"],
                                     output_index=index, content_index=0, text=part["text"],
                                     logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"],
                                     output_index=index, content_index=0, part=part))
        else:
            events.append(self.event("response.function_call_arguments.done",
                                     item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


# chat fields the translation fills from Responses fields: errors name the latter
_RENAMED = {"max_tokens": "max_output_tokens", "messages": "input"}


def _in_responses_terms(error: BadRequest) -> BadRequest:
    root = (error.param or "").split(".")[0].split("[")[0]
    if root not in _RENAMED:
        return error
    name = _RENAMED[root]
    return BadRequest(str(error).replace(root, name), param=error.param.replace(root, name, 1),
                      status=error.status, code=error.code)


def _chat_body(request: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": request.model, "messages": messages,
                            "max_tokens": request.max_output_tokens,
                            "temperature": request.temperature, "top_p": request.top_p,
                            "parallel_tool_calls": request.parallel_tool_calls,
                            "user": request.user, "stream": request.stream}
    if request.stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if request.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        choice = request.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise BadRequest("tool_choice must be 'none', 'auto', 'required' or "
                                 "{\"type\": \"function\", \"name\": ...}",
                                 param="tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        body["tool_choice"] = choice
    text_format = (request.text or {}).get("format") or {"type": "text"}
    kind = text_format.get("type")
    if kind == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": text_format.get("name", "output"), "schema": text_format.get("schema"),
            "strict": text_format.get("strict")}}
    elif kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif kind != "text":
        raise BadRequest("text.format.type must be 'text', 'json_schema' or 'json_object'",
                         param="text.format.type")
    return body


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise BadRequest(f"tool type '{tool.get('type')}' is not supported; only function "
                         "tools (with a name)", param=f"tools[{index}].type")
    return {"type": "function", "function": {
        "name": tool["name"], "description": tool.get("description"),
        "parameters": tool.get("parameters"), "strict": tool.get("strict")}}


def _input_messages(items: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Chat messages of input (or stored output) items; consecutive function calls become
    one assistant message with several tool calls."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}[{i}].role must be user, assistant, system or "
                                 "developer", param=f"{where}[{i}].role")
            messages.append({"role": role, "content": _item_content(
                item.get("content"), f"{where}[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else _item_text(output, f"{where}[{i}].output")})
        else:
            raise BadRequest(f"input item type '{kind}' is not supported (message, "
                             "function_call, function_call_output)",
                             param=f"{where}[{i}].type")
    return messages


def _item_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content: its text, or chat parts where it holds `input_image`s
    (a data URL in `image_url`; the chat route decodes it, or refuses it on a text
    model)."""
    if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "input_image":
                if part.get("detail") not in (None, "auto"):
                    raise BadRequest("the model's tower takes one resolution: detail "
                                     "'auto' only", param=f"{where}[{j}].detail")
                if not isinstance(part.get("image_url"), str):
                    raise BadRequest("an input_image needs an image_url (a data URL; "
                                     "file_id is not served)", param=f"{where}[{j}]")
                parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
            else:
                parts.append({"type": "text", "text": _item_text([part], f"{where}[{j}]")})
        return parts
    return _item_text(content, where)


def _item_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content or []):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                   "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"content part type '{kind}' is not supported; only text",
                             param=f"{where}[{j}].type")
        parts.append(part.get("text") or "")
    return "".join(parts)


def _output_of(chat: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat answer's output items."""
    message = chat["choices"][0]["message"]
    output: list[dict[str, Any]] = []
    if message.get("content") or not message.get("tool_calls"):
        output.append({"type": "message", "id": _new_id("msg"), "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": message.get("content") or "",
                                    "annotations": []}]})
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
                       "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    return output

