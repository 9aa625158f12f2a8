"""POST /v1/chat/completions: messages through the chat template, replies whole or streamed,
as text or tool calls."""

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from llmserve.entrypoints.openai.media import MediaFetcher
from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    ChatCompletionRequest,
    ChatMessage,
    build_sampling_params,
    now,
    random_id,
    usage,
)
from llmserve.entrypoints.openai.reasoning import (
    END,
    START,
    ReasoningStart,
    ReasoningStream,
    answer_start,
    split_reasoning,
)
from llmserve.entrypoints.openai.serving_base import (
    ChunkFormatter,
    OpenAIServing,
    PromptIds,
    final_outputs,
    output_kind,
    prompt_limit,
    prompt_logprobs_json,
    response_metrics,
    stream_response,
    stream_usage,
    token_logprobs,
    top_entries,
    usage_of,
)
from llmserve.entrypoints.openai.structured import (
    Constraint,
    request_constraints,
    single_constraint,
)
from llmserve.entrypoints.openai.tool_calls import (
    markers_are_special,
    plan_tools,
    template_messages,
    tool_format_for,
)
from llmserve.entrypoints.openai.tool_parsers import Extracted, ToolCallExtractor
from llmserve.errors import LLMServeError
from llmserve.multimodal.images import ImageError
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.tokenizer import PromptTooLong

Extractors = Callable[[], ToolCallExtractor] | None


def messages_to_dicts(messages: list[ChatMessage],
                      images: bool = False) -> list[dict[str, Any]]:
    """Messages as chat templates take them: list content joined (kept as parts, images
    among them, where the model takes `images`), tool calls' arguments as objects
    (templates write them with `tojson`), tool results with their call's id."""
    result = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if part.type == "image_url" and not images:
                    raise BadRequest("this model reads text only: it takes no images",
                                     param=where)
                if part.type == "image_url" and part.image_url is None:
                    raise BadRequest("an image_url part needs its image_url", param=where)
                if part.type not in ("text", "image_url") or (
                        part.type == "text" and part.text is None):
                    raise BadRequest(f"content part type '{part.type}' is not supported; only "
                                     "text and image_url parts", param=f"{where}.type")
                stray = "image_url" if part.type == "text" else "text"
                if getattr(part, stray) is not None:
                    raise BadRequest(f"a {part.type} part takes no {stray}",
                                     param=f"{where}.{stray}")
            content = [part.model_dump(exclude_none=True) for part in content] if images \
                else "".join(part.text for part in content)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [_call_dict(call.id, call.function.name,
                                                call.function.arguments, f"messages[{i}]"
                                                f".tool_calls[{j}].function.arguments")
                                     for j, call in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        result.append(message)
    return result


def _call_dict(call_id: str | None, name: str, arguments: str | dict,
               param: str) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise BadRequest("a tool call's arguments must be JSON text", param=param) from None
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: Any, model_name: str, reasoning_parser: str | None = None,
                 loras: Any = None, media: MediaFetcher | None = None) -> None:
        super().__init__(engine, model_name, loras)
        self.reasoning_parser = reasoning_parser  # reasoning.py: deepseek_r1, qwen3, None
        self.media = media or MediaFetcher()  # image URLs: fetched from allowed hosts only

    async def create(self, request: ChatCompletionRequest,
                     arrival_time: float) -> dict[str, Any] | AsyncIterator[str]:
        """The response body, or an iterator of SSE events when `request.stream`."""
        lora = self.check_model(request.model)
        served = lora.lora_name if lora is not None else self.model_name  # the name asked
        if request.continue_final_message and request.add_generation_prompt:
            raise BadRequest("continue_final_message and add_generation_prompt cannot both be "
                             "true (set add_generation_prompt to false)",
                             param="continue_final_message")
        tool_format = tool_format_for(self.tokenizer.chat_template)
        plan = plan_tools(request, tool_format)
        constraints = request_constraints(request)
        constraint = single_constraint(constraints + [c for c in [plan.constraint] if c])
        # a constrained output (response_format) is not in the template's call format
        extractors = None if plan.auto and constraints else plan.extractor
        # the extractor must see its markers, even where they are special tokens
        keep_markers = bool(plan.auto and extractors and request.skip_special_tokens is None
                            and markers_are_special(tool_format, self.tokenizer))
        # so must the reasoning parser see <think> and </think>
        special = set(self.tokenizer.all_special_ids)
        keep_markers |= bool(self.reasoning_parser and request.skip_special_tokens is None
                             and any(self.tokenizer.token_to_id(tag) in special
                                     for tag in (START, END)))
        params, max_tokens_field = self._params(request, constraint, keep_markers)
        if self.engine.image_prompts is not None:
            await self.media.inline_images(request.messages)
        prompt_ids = await self.engine.run_blocking(
            self.prompt_ids, request.messages, plan.tools, request.add_generation_prompt,
            _template_variables(request), request.continue_final_message,
            request.add_special_tokens, prompt_limit(self.engine, request))
        echo = _echoed(request)
        reasoning = self._reasoning(request, prompt_ids)
        if reasoning is not None and reasoning.thinking and constraint is not None:
            # the constraint (a schema, the tool grammar) is for the answer after thinking
            params.structured_outputs = replace(params.structured_outputs, starts_after=END)
        request_id = random_id("chatcmpl", request.request_id)
        streams = await self.submit([prompt_ids], params, request_id, arrival_time,
                                    request.priority, request.cache_salt, "messages",
                                    max_tokens_field, constraint, request.kv_transfer_params,
                                    lora)
        top_k = (request.top_logprobs or 0) if request.logprobs else None
        as_ids = bool(request.return_tokens_as_token_ids)
        with_ids = bool(request.return_token_ids)
        if request.stream:
            formatter = _ChatChunks(self, top_k, extractors, as_ids, echo, with_ids,
                                    reasoning, request.include_reasoning)
            return stream_response(streams, formatter, request_id, served,
                                   stream_usage(request.stream_options),
                                   bool(request.return_metrics))
        (final,) = await final_outputs(streams)
        choices = [self._choice(c, top_k, extractors, as_ids, echo, reasoning,
                                request.include_reasoning) for c in final.outputs]
        choices.sort(key=lambda c: c["index"])
        if with_ids:
            for choice, c in zip(choices, sorted(final.outputs, key=lambda c: c.index),
                                 strict=True):
                choice["token_ids"] = c.token_ids
        body = {"id": request_id, "object": "chat.completion", "created": now(),
                "model": served, "choices": choices, "usage": usage(*usage_of([final])),
                "prompt_logprobs": prompt_logprobs_json(final)}
        if with_ids:
            body["prompt_token_ids"] = final.prompt_token_ids
        if request.return_metrics:
            body["metrics"] = response_metrics([final])
        return body

    def _params(self, request: ChatCompletionRequest, constraint: Constraint | None,
                keep_special_tokens: bool) -> tuple[SamplingParams, str]:
        options = request.sampling_options()
        options["output_kind"] = output_kind(request.stream)
        if keep_special_tokens:
            options["skip_special_tokens"] = False
        if constraint is not None:
            options["structured_outputs"] = constraint.params
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

    def prompt_ids(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None,
                   add_generation_prompt: bool = True,
                   template_kwargs: dict[str, Any] | None = None,
                   continue_final_message: bool = False,
                   add_special_tokens: bool = False, limit: int | None = None) -> list[int]:
        """The prompt's token ids: the messages (and tools) rendered with the model's chat
        template, what it cannot render written in as its tool format writes it.

        `continue_final_message`: the text ends right after the last message's content (what
        the template writes after it, its end of turn, is cut), so the answer continues it,
        as transformers does. `add_special_tokens`: the tokenizer's own BOS/EOS are added
        around the text (templates write theirs, hence off by default). `limit`: a prompt
        of certainly more tokens is a 400 as soon as that is known (`Tokenizer.encode`)."""
        template = self.tokenizer.chat_template
        image_prompts = self.engine.image_prompts  # None: a text model
        dicts = messages_to_dicts(messages, images=image_prompts is not None)
        rendered = template_messages(dicts, tools, template, tool_format_for(template))
        images: list = []
        try:
            if image_prompts is None:
                text = self.tokenizer.apply_chat_template(
                    rendered, add_generation_prompt=add_generation_prompt, tokenize=False,
                    tools=tools, **(template_kwargs or {}))
            else:  # the images decoded and preprocessed here, off the engine's thread
                text, images = image_prompts.render_chat(
                    self.tokenizer, rendered, add_generation_prompt=add_generation_prompt,
                    tools=tools, **(template_kwargs or {}))
        except ImageError as e:
            raise BadRequest(str(e), param=e.param or "messages") from None
        except LLMServeError as e:
            raise BadRequest(str(e), param="messages") from None
        if continue_final_message:
            text = _cut_after_final_message(text, _text_of(dicts[-1]["content"]))
        try:
            if images:  # each image's tokens in place (they count toward the context)
                ids, placed = image_prompts.encode(self.tokenizer, text, images,
                                                   add_special_tokens)
                return PromptIds(ids, placed)
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                         limit=limit)
        except PromptTooLong as e:
            raise BadRequest(str(e), param="messages") from None
        except LLMServeError as e:
            raise BadRequest(str(e), param="messages") from None

    def _reasoning(self, request: ChatCompletionRequest,
                   prompt_ids: list[int]) -> ReasoningStart | None:
        """How the answer opens, with a reasoning parser; None without one."""
        if self.reasoning_parser is None:
            if not request.include_reasoning:
                raise BadRequest("'include_reasoning' false needs a server started with "
                                 "--reasoning-parser (reasoning is not split from the answer "
                                 "without one)", param="include_reasoning")
            return None
        tail = self.tokenizer.decode(prompt_ids[-16:])
        return answer_start(self.reasoning_parser, tail)

    def _choice(self, c: CompletionOutput, top_k: int | None, extractors: Extractors,
                as_ids: bool, echo: str, reasoning: ReasoningStart | None = None,
                include_reasoning: bool = True) -> dict[str, Any]:
        text, thought = c.text, None
        if reasoning is not None:
            thought, text = split_reasoning(c.text, reasoning)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thought is not None and include_reasoning:
            message["reasoning_content"] = thought
        finish_reason = c.finish_reason
        if extractors is not None:
            extractor = extractors()
            extracted = extractor.feed(text) + extractor.finish()
            calls = _whole_calls(extracted)
            message["content"] = extracted.content if extracted.content or not calls else None
            if calls:
                message["tool_calls"] = calls
                finish_reason = _finish_reason(c.finish_reason, extractor)
        if echo:
            message["content"] = echo + (message["content"] or "")
        return {"index": c.index, "message": message, "logprobs": self.logprobs(c, top_k, as_ids),
                "finish_reason": finish_reason, "stop_reason": c.stop_reason}

    def logprobs(self, c: CompletionOutput, top_k: int | None, as_ids: bool) -> dict | None:
        """OpenAI's chat logprobs of the completion's tokens (None when not asked); `as_ids`:
        tokens shown as `token_id:<id>`."""
        if top_k is None:
            return None
        content = []
        for token_id, entries in token_logprobs(c):
            sampled = entries.get(token_id)
            text = self.shown_token(token_id, sampled, as_ids)
            top = [_entry(self.shown_token(t, lp, as_ids), lp.logprob)
                   for t, lp in top_entries(entries, top_k)]
            content.append({**_entry(text, sampled.logprob if sampled else None),
                            "top_logprobs": top})
        return {"content": content}


def _template_variables(request: ChatCompletionRequest) -> dict[str, Any]:
    """`chat_template_kwargs`, with `documents` when the request sends them."""
    variables = dict(request.chat_template_kwargs or {})
    if request.documents is not None:
        variables["documents"] = request.documents
    return variables


def _echoed(request: ChatCompletionRequest) -> str:
    """What `echo` puts before the answer: the last message's text when it is the
    assistant's (the role the answer has), else nothing."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant":
        return ""
    content = last.content
    if isinstance(content, list):
        return "".join(part.text or "" for part in content)
    return content or ""


def _text_of(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content)


def _cut_after_final_message(text: str, content: str) -> str:
    """The rendered chat up to the end of the last message's content."""
    content = content.strip()
    end = text.rfind(content) if content else -1
    if end < 0:
        raise BadRequest("continue_final_message: the chat template does not write the last "
                         "message's content as it is, so it cannot be continued",
                         param="continue_final_message")
    return text[: end + len(content)]


def _entry(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _whole_calls(extracted: Extracted) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls` from every piece of the calls."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in extracted.tool_calls:
        if piece.id is not None:
            calls[piece.index] = {"id": piece.id, "type": "function",
                                  "function": {"name": piece.name, "arguments": ""}}
        calls[piece.index]["function"]["arguments"] += piece.arguments
    return [calls[i] for i in sorted(calls)]


def _finish_reason(reason: str | None, extractor: ToolCallExtractor) -> str | None:
    """"tool_calls" when the output ended complete with calls in it (a call cut short by
    max_tokens keeps "length": it should not be run)."""
    return "tool_calls" if reason == "stop" and extractor.num_calls else reason


@dataclass
class _ChoiceState:
    """What a stream has sent of one choice so far."""

    extractor: ToolCallExtractor | None  # None: the output is plain text
    reasoning: ReasoningStream | None = None  # with a reasoning parser: splits the thinking


class _ChatChunks(ChunkFormatter):
    """Chat's stream chunks: the role first, then content or tool-call deltas, logprobs."""

    object_name = "chat.completion.chunk"

    def __init__(self, serving: OpenAIServingChat, top_k: int | None,
                 extractors: Extractors, as_ids: bool, echo: str, with_ids: bool,
                 reasoning: ReasoningStart | None = None,
                 include_reasoning: bool = True) -> None:
        self.serving = serving
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning
        self.with_ids = with_ids
        self.prompt_token_ids: list[int] = []
        self.top_k = top_k
        self.as_ids = as_ids
        self.echo = echo
        self.extractors = extractors
        self.states: dict[int, _ChoiceState] = {}

    def output_arrived(self, prompt_index: int, output: RequestOutput) -> None:
        self.prompt_token_ids = output.prompt_token_ids

    def choice_chunks(self, prompt_index: int, c: CompletionOutput) -> list[dict[str, Any]]:
        state = self.states.get(c.index)
        chunks = []
        if state is None:
            extractor = self.extractors() if self.extractors else None
            state = self.states[c.index] = _ChoiceState(
                extractor, ReasoningStream(self.reasoning) if self.reasoning else None)
            chunks.append({"index": c.index, "delta": {"role": "assistant",
                                                        "content": self.echo},
                           "logprobs": None, "finish_reason": None})
            if self.with_ids:
                chunks[-1]["prompt_token_ids"] = self.prompt_token_ids
        text, thought = c.text, ""
        if state.reasoning is not None:
            thought, text = state.reasoning.feed(c.text)
            if c.finished:
                more_thought, more_text = state.reasoning.finish()
                thought, text = thought + more_thought, text + more_text
        extracted = Extracted(text)
        finish_reason = c.finish_reason
        if state.extractor is not None:
            extracted = state.extractor.feed(text)
            if c.finished:
                extracted += state.extractor.finish()
                finish_reason = _finish_reason(c.finish_reason, state.extractor)
        delta: dict[str, Any] = {}
        if thought and self.include_reasoning:
            delta["reasoning_content"] = thought
        if extracted.content:
            delta["content"] = extracted.content
        if extracted.tool_calls:
            delta["tool_calls"] = [piece.to_json() for piece in extracted.tool_calls]
        logprobs = self.serving.logprobs(c, self.top_k, self.as_ids)
        if delta or c.finished or (logprobs and logprobs["content"]) or (
                self.with_ids and c.token_ids):
            chunks.append({"index": c.index, "delta": delta, "logprobs": logprobs,
                           "finish_reason": finish_reason, "stop_reason": c.stop_reason})
            if self.with_ids:
                chunks[-1]["token_ids"] = c.token_ids
        return chunks
