"""POST /v1/completions: prompt(s) in, completions out, whole or streamed (SSE).

`echo` with `logprobs` scores the prompt too, in OpenAI's legacy shape: the prompt's tokens
come first in `tokens`, `token_logprobs` (null for the first, which nothing predicts),
`top_logprobs` and `text_offset`, then the completion's. `max_tokens: 0` with `echo` scores
the prompt only: the engine runs the prompt (one token is sampled, as a prefill does) and
the response holds the prompt alone. This is how lm-eval's `local-completions` computes
log-likelihoods.
"""

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from llmserve.engine.async_engine import RequestStream
from llmserve.entrypoints.openai.protocol import (
    BadRequest,
    CompletionRequest,
    build_sampling_params,
    now,
    random_id,
    usage,
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
from llmserve.entrypoints.openai.structured import request_constraints, single_constraint
from llmserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from llmserve.tokenizer import PromptTooLong


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest, arrival_time: float,
                     images: list | None = None) -> dict[str, Any] | AsyncIterator[str]:
        """The response body, or an iterator of SSE events when `request.stream`.
        `images`: placed on the one prompt's image tokens (`multimodal.ImageInput`s; a
        route that renders images itself, Ollama's /api/generate)."""
        lora = self.check_model(request.model)
        served = lora.lora_name if lora is not None else self.model_name  # the name asked
        if request.suffix is not None:
            self._check_fill_in_middle(request)
        score_only = request.max_tokens == 0
        if score_only and not request.echo:
            raise BadRequest("max_tokens: 0 scores the prompt only, which needs echo: true",
                             param="max_tokens")
        options = request.sampling_options()
        options["max_tokens"] = 1 if score_only else request.max_tokens
        if request.logprobs is not None:
            options["logprobs"] = request.logprobs
            if request.echo:  # the prompt's logprobs too, as many alternatives
                options["prompt_logprobs"] = max(request.logprobs, request.prompt_logprobs or 0)
        options["output_kind"] = output_kind(request.stream)
        constraint = single_constraint(request_constraints(request))
        if constraint is not None:
            options["structured_outputs"] = constraint.params
        params = build_sampling_params(options)
        prompts = _prompt_list(request.prompt)
        _check_token_ids(prompts, self.engine.engine.loaded.config.vocab_size)
        if request.suffix is not None:  # the model writes what goes between them
            token_ids = await self.engine.run_blocking(
                self._fill_in_middle, prompts, request.suffix, prompt_limit(self.engine, request))
        else:
            token_ids = await self.engine.run_blocking(self._tokenize, prompts,
                                                       request.add_special_tokens,
                                                       prompt_limit(self.engine, request))
        echoes = [""] * len(prompts)
        if request.echo:
            echoes = await self.engine.run_blocking(self._prompt_texts, prompts)
        request_id = random_id("cmpl", request.request_id)
        if images:
            (ids,) = token_ids
            token_ids = [PromptIds(ids, images)]
        streams = await self.submit(token_ids, params, request_id, arrival_time,
                                    request.priority, request.cache_salt, "prompt", "max_tokens",
                                    constraint, request.kv_transfer_params, lora)
        if score_only:
            streams = [_PromptOnly(stream) for stream in streams]
        # the prompts' logprobs lead each choice's logprobs (echo); they are shown as vLLM's
        # `prompt_logprobs` only when that field asked for them
        echo_logprobs = request.echo and request.logprobs is not None
        show_prompt_logprobs = request.prompt_logprobs is not None
        as_ids = bool(request.return_tokens_as_token_ids)
        with_ids = bool(request.return_token_ids)
        if request.stream:
            formatter = _CompletionChunks(self, params.n, echoes, request.logprobs,
                                          echo_logprobs, as_ids, with_ids)
            return stream_response(streams, formatter, request_id, served,
                                   stream_usage(request.stream_options),
                                   bool(request.return_metrics))
        finals = await final_outputs(streams)
        choices = [
            {**self._choice(i * params.n + c.index, c, echoes[i], request.logprobs,
                            out if echo_logprobs else None, as_ids),
             "prompt_logprobs": prompt_logprobs_json(out) if show_prompt_logprobs else None,
             **({"prompt_token_ids": out.prompt_token_ids, "token_ids": c.token_ids}
                if with_ids else {})}
            for i, out in enumerate(finals) for c in out.outputs
        ]
        choices.sort(key=lambda c: c["index"])
        body = {"id": request_id, "object": "text_completion", "created": now(),
                "model": served, "choices": choices, "usage": usage(*usage_of(finals))}
        if request.return_metrics:
            body["metrics"] = response_metrics(finals)
        return body

    def _tokenize(self, prompts: list[str | list[int]], add_special: bool,
                  limit: int | None) -> list[list[int]]:
        try:
            return [self.tokenizer.encode(p, add_special_tokens=add_special, limit=limit)
                    if isinstance(p, str) else p for p in prompts]
        except PromptTooLong as e:
            raise BadRequest(str(e), param="prompt") from None

    def _check_fill_in_middle(self, request: CompletionRequest) -> None:
        """`suffix`: text after the hole the completion fills, for a model with
        fill-in-the-middle tokens, of text prompts, never echoed."""
        if self.tokenizer.fill_in_middle_ids is None:
            raise BadRequest("this model's vocabulary has no fill-in-the-middle tokens "
                             "(<|fim_prefix|>..., <fim_prefix>...): it cannot complete "
                             "between a prompt and a suffix", param="suffix")
        if any(not isinstance(p, str) for p in _prompt_list(request.prompt)):
            raise BadRequest("a suffix goes with text prompts, not token ids",
                             param="suffix")
        if request.echo:
            raise BadRequest("echo does not combine with suffix", param="echo")

    def _fill_in_middle(self, prompts: list[str | list[int]], suffix: str,
                        limit: int | None) -> list[list[int]]:
        try:
            return [self.tokenizer.encode_fill_in_middle(p, suffix, limit) for p in prompts]
        except PromptTooLong as e:
            raise BadRequest(str(e), param="prompt") from None

    def _prompt_texts(self, prompts: list[str | list[int]]) -> list[str]:
        return [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]

    def _choice(self, index: int, completion: CompletionOutput, echo: str,
                num_logprobs: int | None, prompt: RequestOutput | None,
                as_ids: bool) -> dict[str, Any]:
        """One choice of a whole response; `prompt`: its request's output, whose prompt
        logprobs lead the choice's (echo)."""
        logprobs = None
        if num_logprobs is not None:
            logprobs, length = self.logprobs(completion, 0, num_logprobs, as_ids)
            if prompt is not None:
                logprobs, _ = self.echoed_logprobs(prompt, num_logprobs, logprobs, length,
                                                   as_ids)
        return {"index": index, "text": echo + completion.text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason}

    def logprobs(self, completion: CompletionOutput, text_offset: int, k: int,
                 as_ids: bool) -> tuple[dict[str, Any], int]:
        """OpenAI's completions logprobs of the completion's tokens, the first at `text_offset`
        (`as_ids`: tokens shown as `token_id:<id>`), and the length of their text."""
        return self._legacy_logprobs(token_logprobs(completion), text_offset, k, as_ids)

    def echoed_logprobs(self, output: RequestOutput, k: int, completion: dict[str, Any],
                        completion_length: int, as_ids: bool) -> tuple[dict[str, Any], int]:
        """The prompt's legacy logprobs (from offset 0), then `completion`'s (whose text
        offsets, counted from 0, move past the prompt's text); and their text's length."""
        prompt, shift = self._legacy_logprobs(
            _prompt_entries(output.prompt_token_ids, output.prompt_logprobs), 0, k, as_ids)
        prompt["text_offset"] += [offset + shift for offset in completion["text_offset"]]
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            prompt[key] += completion[key]
        return prompt, shift + completion_length

    def _legacy_logprobs(self, positions: list[tuple[int, dict[int, Logprob] | None]],
                         text_offset: int, k: int, as_ids: bool
                         ) -> tuple[dict[str, Any], int]:
        """`tokens`, `token_logprobs`, `top_logprobs`, `text_offset` of (token id, entries)
        pairs (a position without entries, a prompt's first token, has null logprobs), and
        the length of the tokens' text (offsets count text, whether tokens show as text or
        ids)."""
        start = text_offset
        result: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                  "text_offset": []}
        for token_id, entries in positions:
            sampled = entries.get(token_id) if entries is not None else None
            text = self.token_text(token_id, sampled)
            result["tokens"].append(self.shown_token(token_id, sampled, as_ids))
            result["token_logprobs"].append(sampled.logprob if sampled else None)
            top = None
            if entries is not None:
                top = {self.shown_token(t, lp, as_ids): lp.logprob
                       for t, lp in top_entries(entries, k)}
                if sampled is not None:
                    top.setdefault(result["tokens"][-1], sampled.logprob)
            result["top_logprobs"].append(top)
            result["text_offset"].append(text_offset)
            text_offset += len(text)
        return result, text_offset - start


@dataclass
class _Choice:
    """What a stream has sent of one choice so far."""

    started: bool = False
    text_offset: int = 0  # characters sent, for the logprobs' text_offset


class _CompletionChunks(ChunkFormatter):
    """Completions' stream chunks: text, logprobs, the echoed prompt first."""

    object_name = "text_completion"

    def __init__(self, serving: OpenAIServingCompletion, n: int, echoes: list[str],
                 num_logprobs: int | None, echo_logprobs: bool, as_ids: bool,
                 with_ids: bool) -> None:
        self.serving = serving
        self.n = n
        self.echoes = echoes
        self.num_logprobs = num_logprobs
        self.echo_logprobs = echo_logprobs
        self.as_ids = as_ids
        self.with_ids = with_ids
        self.states: dict[tuple[int, int], _Choice] = {}
        self.first_outputs: dict[int, RequestOutput] = {}  # per prompt: has its logprobs

    def output_arrived(self, prompt_index: int, output: RequestOutput) -> None:
        self.first_outputs.setdefault(prompt_index, output)

    def choice_chunks(self, prompt_index: int, c: CompletionOutput) -> list[dict[str, Any]]:
        state = self.states.setdefault((prompt_index, c.index), _Choice())
        text = c.text
        if not state.started:
            text = self.echoes[prompt_index] + text
        logprobs = None
        if self.num_logprobs is not None:
            logprobs, length = self.serving.logprobs(c, state.text_offset, self.num_logprobs,
                                                     self.as_ids)
            if self.echo_logprobs and not state.started:
                logprobs, length = self.serving.echoed_logprobs(
                    self.first_outputs[prompt_index], self.num_logprobs, logprobs, length,
                    self.as_ids)
            state.text_offset += length
        if not (text or c.finished or (logprobs and logprobs["tokens"])
                or (self.with_ids and c.token_ids)):
            return []
        choice = {"index": prompt_index * self.n + c.index, "text": text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.with_ids:
            if not state.started:
                choice["prompt_token_ids"] = self.first_outputs[prompt_index].prompt_token_ids
            choice["token_ids"] = c.token_ids
        state.started = True
        return [choice]


class _PromptOnly:
    """A request stream whose outputs hold no generated token (`max_tokens: 0` with echo:
    the engine samples one token after the prompt, as every prefill does; it is dropped)."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream

    def abort(self) -> None:
        self.stream.abort()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for output in self.stream:
            yield replace(output, outputs=[
                replace(c, text="", token_ids=[], cumulative_logprob=None,
                        logprobs=None if c.logprobs is None else [])
                for c in output.outputs])


def _prompt_entries(prompt_token_ids: list[int], prompt_logprobs: PromptLogprobs | None,
                    ) -> list[tuple[int, dict[int, Logprob] | None]]:
    """(token id, its position's entries) of each prompt token; the first has none."""
    entries = prompt_logprobs or [None] * len(prompt_token_ids)
    return list(zip(prompt_token_ids, entries, strict=True))


def _check_token_ids(prompts: list[str | list[int]], vocab_size: int) -> None:
    """Token-id prompts hold ids of the vocabulary (checked before `echo` decodes them)."""
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab_size] if isinstance(prompt, list) else []
        if bad:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise BadRequest(f"{where}: token id {bad[0]} is out of range [0, {vocab_size})",
                             param=where)


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    """The request's prompts: a string, strings, token ids or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):  # never empty: CompletionRequest says so
        return [list(prompt)]
    return list(prompt)
