"""POST /v1/chat/completions: messages through the chat template, replies whole or streamed."""

from collections.abc import AsyncIterator
from typing import Any

from llmserve.engine.async_engine import RequestStream
from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    ChatMessage,
    build_sampling_params,
    now,
    random_id,
    usage,
)
from llmserve.entrypoints.openai.serving_base import (
    OpenAIServing,
    StreamUsage,
    final_outputs,
    merge_streams,
    output_kind,
    prompt_logprobs_json,
    sse,
    token_logprobs,
    top_entries,
    usage_of,
)
from llmserve.errors import LLMServeError
from llmserve.outputs import CompletionOutput


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them; list content is joined text parts."""
    result = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise BadRequest(f"content part type '{part.type}' is not supported; only "
                                     "text parts", param=f"messages[{i}].content[{j}].type")
            content = "".join(part.text for part in content)
        message = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        result.append(message)
    return result


class OpenAIServingChat(OpenAIServing):
    async def create(self, request: ChatCompletionRequest,
                     arrival_time: float) -> dict[str, Any] | AsyncIterator[str]:
        """The response body, or an iterator of SSE events when `request.stream`."""
        self.check_model(request.model)
        fmt = (request.response_format or {}).get("type", "text")
        if fmt != "text":
            raise BadRequest(f"response_format type '{fmt}' is not supported",
                             param="response_format")
        params, max_tokens_field = self._params(request)
        params.output_kind = output_kind(request.stream)
        prompt_ids = await self.engine.run_blocking(self.render, request)
        request_id = random_id("chatcmpl")
        streams = await self.submit([prompt_ids], params, request_id, arrival_time,
                                    request.priority, request.cache_salt, "messages",
                                    max_tokens_field)
        top_k = (request.top_logprobs or 0) if request.logprobs else None
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._stream(streams, request_id, top_k, include_usage)
        (final,) = await final_outputs(streams)
        choices = [self._choice(c, top_k) for c in final.outputs]
        choices.sort(key=lambda c: c["index"])
        return {"id": request_id, "object": "chat.completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage(*usage_of([final])),
                "prompt_logprobs": prompt_logprobs_json(final)}

    def _params(self, request: ChatCompletionRequest) -> tuple[Any, str]:
        options = request.sampling_options()
        max_tokens_field = "max_tokens"
        options["max_tokens"] = request.max_tokens
        if request.max_completion_tokens is not None:
            options["max_tokens"] = request.max_completion_tokens
            max_tokens_field = "max_completion_tokens"
        if request.top_logprobs is not None and not request.logprobs:
            raise BadRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        if request.logprobs:
            options["logprobs"] = request.top_logprobs or 0
        try:
            return build_sampling_params(options), max_tokens_field
        except BadRequest as e:
            renamed = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs"}
            if e.param not in renamed:
                raise
            message = str(e).replace(e.param, renamed[e.param], 1)
            raise BadRequest(message, param=renamed[e.param]) from None

    def render(self, request: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids: the messages rendered with the model's chat template."""
        messages = messages_to_dicts(request.messages)
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt, tokenize=True,
                tools=request.tools, **(request.chat_template_kwargs or {}))
        except LLMServeError as e:
            raise BadRequest(str(e), param="messages") from None

    def _choice(self, c: CompletionOutput, top_k: int | None) -> dict[str, Any]:
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c, top_k), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def _logprobs(self, c: CompletionOutput, top_k: int | None) -> dict | None:
        """OpenAI's chat logprobs of the completion's tokens (None when not asked)."""
        if top_k is None:
            return None
        content = []
        for token_id, entries in token_logprobs(c):
            sampled = entries.get(token_id)
            text = self.token_text(token_id, sampled)
            top = [self._entry(self.token_text(t, lp), lp.logprob)
                   for t, lp in top_entries(entries, top_k)]
            content.append({**self._entry(text, sampled.logprob if sampled else None),
                            "top_logprobs": top})
        return {"content": content}

    @staticmethod
    def _entry(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    async def _stream(self, streams: list[RequestStream], request_id: str,
                      top_k: int | None, include_usage: bool) -> AsyncIterator[str]:
        created = now()
        role_sent: set[int] = set()  # choice indexes whose first chunk (the role) went out
        tally = StreamUsage()
        try:
            async for _, delta in merge_streams(streams):
                tally.add(0, delta)
                for c in delta.outputs:
                    if c.index not in role_sent:
                        role_sent.add(c.index)
                        yield sse(self._chunk(request_id, created, [self._role(c.index)],
                                              include_usage))
                    choice = self._delta_choice(c, top_k)
                    if choice is not None:
                        yield sse(self._chunk(request_id, created, [choice], include_usage))
        except Exception as e:
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None,
                                 "code": 500}})
        if include_usage:
            body = self._chunk(request_id, created, [], include_usage)
            body["usage"] = usage(*tally.counts())
            yield sse(body)
        yield sse("[DONE]")

    @staticmethod
    def _role(index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def _delta_choice(self, c: CompletionOutput, top_k: int | None) -> dict[str, Any] | None:
        """One choice's chunk for a delta; None when it brings nothing to show."""
        logprobs = self._logprobs(c, top_k)
        if not (c.text or c.finished or (logprobs and logprobs["content"])):
            return None
        return {"index": c.index, "delta": {"content": c.text} if c.text else {},
                "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def _chunk(self, request_id: str, created: int, choices: list,
               include_usage: bool) -> dict[str, Any]:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name, "choices": choices}
        if include_usage:
            body["usage"] = None
        return body
