"""What completions and chat share: model check, submission, the streaming state machine,
SSE, logprobs.

Whole responses ask the engine for the final output only (`RequestOutputKind.FINAL_ONLY`);
streams ask for deltas (`DELTA`) and turn each into chunks as it comes, nothing re-sent.
A stream runs `stream_response`; the routes differ only in their `ChunkFormatter`.
"""

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from llmserve.engine.async_engine import (
    AsyncEngine,
    ConstraintFailed,
    EngineUnavailable,
    RequestStream,
)
from llmserve.engine.input_processor import RequestRejected
from llmserve.entrypoints.openai.protocol import (
    SAMPLING_FIELDS,
    BadRequest,
    metrics_json,
    now,
    usage,
)
from llmserve.entrypoints.openai.structured import Constraint, rename_engine_error
from llmserve.lora_request import LoRARequest
from llmserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams

# how long a decode server waits for a prompt's KV from its prefill server
KV_WAIT_S = 60.0

T = TypeVar("T")


class PromptIds(list):
    """A chat prompt's token ids and the images placed on its image tokens
    (`multimodal.ImageInput`s, preprocessed), in prompt order."""

    def __init__(self, ids: list[int], images: list[Any]) -> None:
        super().__init__(ids)
        self.images = images


class OpenAIServing:
    """Base of the completions and chat handlers: one engine, one served model name."""

    def __init__(self, engine: AsyncEngine, model_name: str, loras: Any = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.loras = loras  # serving_lora.LoRARegistry: the adapters served (--enable-lora)
        self.tokenizer = engine.tokenizer

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        adapter = self.loras.get(model) if self.loras is not None else None
        if adapter is None:
            adapters = f" and its LoRA adapters ({', '.join(self.loras.names())})" \
                if self.loras is not None and self.loras.names() else ""
            raise BadRequest(f"the model '{model}' does not exist; this server serves "
                             f"'{self.model_name}'{adapters}", param="model", status=404,
                             code="model_not_found")
        return adapter

    async def submit(
        self, prompts: list[list[int]], params: SamplingParams, request_id: str,
        arrival_time: float, priority: int, cache_salt: str | None,
        prompt_field: str, max_tokens_field: str, constraint: Constraint | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """Admit every prompt or none: on the first refusal the admitted ones are aborted.

        The engine's refusals become `BadRequest`s naming the field the user set (for a
        constraint it cannot compile, the field that set it).
        """
        kv_transfer = None
        if kv_transfer_params is not None:
            kv_transfer = await self.kv_transfer(kv_transfer_params, len(prompts))
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt: dict[str, Any] = {"prompt_token_ids": list(ids)}
                if isinstance(ids, PromptIds):
                    prompt["multi_modal_data"] = {"image": ids.images}
                streams.append(await self.engine.add_request(
                    prompt, params, rid, arrival_time, priority, cache_salt,
                    kv_transfer, lora_request))
        except RequestRejected as e:
            _abort_all(streams)
            message = str(e)
            if constraint is not None and message.startswith("structured_outputs"):
                field = constraint.error_field
                raise BadRequest(rename_engine_error(message, field), param=field) from None
            first_word = message.split(" ", 1)[0].rstrip(":")  # "logit_bias: token id ..."
            param = max_tokens_field if "max_tokens" in message else prompt_field
            if "is already in use" in message:  # the client's request_id
                param = "request_id"
            if first_word in SAMPLING_FIELDS and first_word != "max_tokens":
                param = first_word
            if "max_tokens" in message and max_tokens_field != "max_tokens":
                message = message.replace("max_tokens", max_tokens_field)
            raise BadRequest(message, param=param) from None
        except BaseException:
            _abort_all(streams)
            raise
        if constraint is not None:
            return [_ConstraintErrors(stream, constraint) for stream in streams]
        return streams

    async def kv_transfer(self, options: dict[str, Any], num_prompts: int) -> Any:
        """`kv_transfer_params` as the engine takes it: a prefill server's transfer id, or
        the KV a decode server received under it (waited for, up to KV_WAIT_S)."""
        field = "kv_transfer_params"
        role = self.engine.engine.config.kv_role
        if role is None:
            raise BadRequest(f"'{field}' needs a server started with --role prefill or "
                             "--role decode", param=field)
        unknown = sorted(set(options) - {"transfer_id", "do_remote_decode"})
        if unknown:
            raise BadRequest(f"{field}: unknown key {unknown[0]!r} (known: do_remote_decode, "
                             "transfer_id)", param=field)
        transfer_id = options.get("transfer_id")
        if not isinstance(transfer_id, str) or not transfer_id:
            raise BadRequest(f"{field}.transfer_id must be a non-empty string",
                             param=f"{field}.transfer_id")
        if num_prompts != 1:
            raise BadRequest(f"{field}: one prompt per request", param=field)
        remote_decode = options.get("do_remote_decode", False)
        if role == "prefill":
            if remote_decode is not True:
                raise BadRequest(f"{field}: a prefill server takes do_remote_decode: true",
                                 param=f"{field}.do_remote_decode")
            return transfer_id
        if remote_decode:
            raise BadRequest(f"{field}: a decode server does not take do_remote_decode",
                             param=f"{field}.do_remote_decode")
        connector = self.engine.engine.kv_connector
        try:
            return await asyncio.to_thread(connector.wait_for, transfer_id, KV_WAIT_S)
        except TimeoutError as e:
            raise BadRequest(str(e), param=f"{field}.transfer_id", status=504) from None
        except ConnectionError as e:
            raise EngineUnavailable(f"the engine is unavailable: {e}") from None

    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def shown_token(self, token_id: int, logprob: Logprob | None, as_ids: bool) -> str:
        """A token as logprobs show it: its text, or `token_id:<id>` when the request set
        `return_tokens_as_token_ids` (for tokens whose text alone is not one token)."""
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id, logprob)


class ChunkFormatter(ABC):
    """How one route shows a streamed response: the chunks' object name, and the chunk
    choices for each delta of a choice (it keeps what it needs of earlier deltas)."""

    object_name: str

    def output_arrived(self, prompt_index: int, output: RequestOutput) -> None:
        """Sees each output before its choices' `choice_chunks` (the prompt's part of the
        first one: its prompt logprobs); nothing by default."""
        return None

    @abstractmethod
    def choice_chunks(self, prompt_index: int, delta: CompletionOutput) -> list[dict[str, Any]]:
        """The chunk choices (each goes out in its own chunk) for one choice's delta."""


def prompt_limit(engine: AsyncEngine, request: Any) -> int | None:
    """The most tokens a request's prompt may have (a longer one is refused while it is
    tokenized, `Tokenizer.encode`); None where `truncate_prompt_tokens` keeps the prompt's
    last tokens, so that the whole prompt is needed."""
    if getattr(request, "truncate_prompt_tokens", None) is not None:
        return None
    return engine.max_model_len


def stream_usage(options: Any) -> tuple[bool, bool]:
    """(a usage chunk at the end, the usage so far in every chunk) as `stream_options`
    asks."""
    if options is None:
        return False, False
    return bool(options.include_usage), bool(options.continuous_usage_stats)


async def stream_response(streams: list[RequestStream], formatter: ChunkFormatter,
                          request_id: str, model_name: str, usage_options: tuple[bool, bool],
                          return_metrics: bool = False) -> AsyncIterator[str]:
    """The SSE events of a streamed response: each delta's chunks as they come, an error
    event if the engine fails, the usage chunk when asked, then [DONE]. `usage_options`:
    `stream_usage`'s pair; with continuous usage every chunk carries the counts so far.
    `return_metrics`: the last chunk before [DONE] (the usage chunk, else the last finish)
    has `metrics`."""
    created = now()
    include_usage, continuous_usage = usage_options

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"id": request_id, "object": formatter.object_name, "created": created,
                "model": model_name, "choices": choices}
        if continuous_usage:
            body["usage"] = usage(*tally.counts())
        elif include_usage:
            body["usage"] = None
        return body

    tally = StreamUsage()
    num_finished = 0
    try:
        async for i, delta in merge_streams(streams):
            tally.add(i, delta)
            num_finished += delta.finished
            formatter.output_arrived(i, delta)
            bodies = [chunk([choice]) for c in delta.outputs
                      for choice in formatter.choice_chunks(i, c)]
            if return_metrics and not include_usage and num_finished == len(streams):
                bodies = bodies or [chunk([])]
                bodies[-1]["metrics"] = tally.metrics()
            for body in bodies:
                yield sse(body)
    except BadRequest as e:  # the constraint failed while generating: the field named
        yield sse({"error": {"message": str(e), "type": "invalid_request_error",
                             "param": e.param, "code": e.status}})
        return_metrics = False
    except Exception as e:
        yield sse({"error": {"message": str(e), "type": "server_error", "param": None,
                             "code": 500}})
        return_metrics = False
    if include_usage or continuous_usage:
        body = {**chunk([]), "usage": usage(*tally.counts())}
        if return_metrics:
            body["metrics"] = tally.metrics()
        yield sse(body)
    yield sse("[DONE]")


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The last output of every stream (they run concurrently in the engine)."""
    finals = []
    try:
        for stream in streams:
            final = None
            async for output in stream:
                final = output
            finals.append(final)
    finally:
        _abort_all(streams)
    return finals


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) pairs from all streams as they come; closing aborts them all."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].abort()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((i, output))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        _abort_all(streams)


class _ConstraintErrors:
    """A constrained request's stream whose `ConstraintFailed` (its parser budget spent
    while generating) is a `BadRequest` naming the field the user set: a 400, or an error
    event in a stream."""

    def __init__(self, stream: RequestStream, constraint: Constraint) -> None:
        self.stream = stream
        self.field = constraint.error_field

    def abort(self) -> None:
        self.stream.abort()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self.stream:
                yield output
        except ConstraintFailed as e:
            raise BadRequest(rename_engine_error(str(e), self.field),
                             param=self.field) from None


def _abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


async def chat_events(stream: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The chunks (and an error event's body) of a stream `stream_response` wrote, as
    dicts, up to [DONE]: what the Responses and Messages translators read."""
    async for event in stream:
        data = event.removeprefix("data: ").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event, as OpenAI streams them."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


class SSEResponse(StreamingResponse):
    """An event stream whose iterator is always closed, so a gone client aborts its request.

    Starlette cancels the streaming task on disconnect; closing the iterator here also covers
    a send that fails first.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class NDJSONResponse(SSEResponse):
    """Newline-delimited JSON, as Ollama streams; the iterator is always closed likewise."""

    media_type = "application/x-ndjson"


CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"


async def respond(request: Request, work: Awaitable[Any],
                  streamed: type[StreamingResponse] = SSEResponse) -> Response:
    """Run the handler until it answers or the client goes (then it is cancelled: abort);
    a dict answers as JSON, an iterator as `streamed` (server-sent events by default)."""
    result = await unless_client_gone(request, work)
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(result, dict):
        return JSONResponse(result)
    return streamed(result)


async def unless_client_gone(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, unless the client goes away first: then `work` is cancelled and the
    answer is None (`work` itself never answers None)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage_of(outputs: list[RequestOutput]) -> tuple[int, int, int]:
    """(prompt, completion, cached) token counts of the outputs, all choices included."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return prompt, completion, cached


def response_metrics(outputs: list[RequestOutput]) -> dict[str, Any] | None:
    """The `metrics` of a whole response from its final outputs (one per prompt)."""
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    if not metrics:
        return None
    prompt, _, cached = usage_of(outputs)
    choice_tokens = [len(c.token_ids) for o in outputs
                     for c in sorted(o.outputs, key=lambda c: c.index)]
    return metrics_json(RequestMetrics.merge(metrics), prompt, cached, choice_tokens)


def output_kind(stream: bool) -> RequestOutputKind:
    """Deltas for a streamed response, the final output only for a whole one."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


class StreamUsage:
    """Token counts of a streamed response, summed from its deltas (all choices)."""

    def __init__(self) -> None:
        self.prompt_tokens: dict[int, int] = {}  # per prompt index
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0
        self.choice_tokens: dict[tuple[int, int], int] = {}  # (prompt index, choice index)
        self.request_metrics: dict[int, RequestMetrics] = {}  # per prompt index, the latest

    def add(self, prompt_index: int, delta: RequestOutput) -> None:
        self.prompt_tokens[prompt_index] = len(delta.prompt_token_ids)
        self.cached_tokens[prompt_index] = delta.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in delta.outputs)
        for c in delta.outputs:
            key = (prompt_index, c.index)
            self.choice_tokens[key] = self.choice_tokens.get(key, 0) + len(c.token_ids)
        if delta.metrics is not None:
            self.request_metrics[prompt_index] = delta.metrics

    def metrics(self) -> dict[str, Any] | None:
        """The response's `metrics`, as `response_metrics` builds them for a whole one."""
        if not self.request_metrics:
            return None
        prompt, _, cached = self.counts()
        merged = RequestMetrics.merge([self.request_metrics[i]
                                       for i in sorted(self.request_metrics)])
        return metrics_json(merged, prompt, cached,
                            [self.choice_tokens[k] for k in sorted(self.choice_tokens)])

    def counts(self) -> tuple[int, int, int]:
        """(prompt, completion, cached), as `usage_of` counts them."""
        return (sum(self.prompt_tokens.values()), self.completion_tokens,
                sum(self.cached_tokens.values()))


def token_logprobs(completion: CompletionOutput) -> list[tuple[int, dict]]:
    """(token id, {id: Logprob}) of the completion's tokens (of a delta: its new ones)."""
    if not completion.logprobs:
        return []
    return list(zip(completion.token_ids, completion.logprobs, strict=False))


def top_entries(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The `k` most likely entries, best first."""
    ranked = sorted(entries.items(),
                    key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                    -kv[1].logprob))
    return ranked[:k]


def prompt_logprobs_json(output: RequestOutput) -> list[dict[str, dict] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None or {token id: {logprob, rank, ...}}."""
    if output.prompt_logprobs is None:
        return None
    return [None if entries is None else {
        str(token_id): {"logprob": lp.logprob, "rank": lp.rank,
                        "decoded_token": lp.decoded_token}
        for token_id, lp in entries.items()} for entries in output.prompt_logprobs]
