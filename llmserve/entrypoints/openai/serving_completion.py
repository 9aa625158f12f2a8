"""POST /v1/completions: prompt(s) in, completions out, whole or streamed (SSE)."""

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

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
    final_outputs,
    output_kind,
    prompt_logprobs_json,
    response_metrics,
    stream_response,
    token_logprobs,
    top_entries,
    usage_of,
)
from llmserve.entrypoints.openai.structured import request_constraints, single_constraint
from llmserve.outputs import CompletionOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, request: CompletionRequest,
                     arrival_time: float) -> dict[str, Any] | AsyncIterator[str]:
        """The response body, or an iterator of SSE events when `request.stream`."""
        self.check_model(request.model)
        if request.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        if request.echo and request.logprobs is not None:
            raise BadRequest("echo together with logprobs is not supported", param="echo")
        options = request.sampling_options()
        options["max_tokens"] = request.max_tokens
        if request.logprobs is not None:
            options["logprobs"] = request.logprobs
        options["output_kind"] = output_kind(request.stream)
        constraint = single_constraint(request_constraints(request))
        if constraint is not None:
            options["structured_outputs"] = constraint.params
        params = build_sampling_params(options)
        prompts = _prompt_list(request.prompt)
        _check_token_ids(prompts, self.engine.engine.loaded.config.vocab_size)
        token_ids = await self.engine.run_blocking(self._tokenize, prompts,
                                                   request.add_special_tokens)
        echoes = [""] * len(prompts)
        if request.echo:
            echoes = await self.engine.run_blocking(self._prompt_texts, prompts)
        request_id = random_id("cmpl")
        streams = await self.submit(token_ids, params, request_id, arrival_time,
                                    request.priority, request.cache_salt, "prompt", "max_tokens",
                                    constraint, request.kv_transfer_params)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            formatter = _CompletionChunks(self, params.n, echoes, request.logprobs)
            return stream_response(streams, formatter, request_id, self.model_name,
                                   include_usage, bool(request.return_metrics))
        finals = await final_outputs(streams)
        choices = [
            {**self._choice(i * params.n + c.index, c, echoes[i], request.logprobs),
             "prompt_logprobs": prompt_logprobs_json(out)}
            for i, out in enumerate(finals) for c in out.outputs
        ]
        choices.sort(key=lambda c: c["index"])
        body = {"id": request_id, "object": "text_completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage(*usage_of(finals))}
        if request.return_metrics:
            body["metrics"] = response_metrics(finals)
        return body

    def _tokenize(self, prompts: list[str | list[int]], add_special: bool) -> list[list[int]]:
        return [self.tokenizer.encode(p, add_special_tokens=add_special) if isinstance(p, str)
                else p for p in prompts]

    def _prompt_texts(self, prompts: list[str | list[int]]) -> list[str]:
        return [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]

    def _choice(self, index: int, completion: CompletionOutput, echo: str,
                num_logprobs: int | None) -> dict[str, Any]:
        logprobs = None
        if num_logprobs is not None:
            logprobs = self.logprobs(completion, 0, num_logprobs)
        return {"index": index, "text": echo + completion.text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason}

    def logprobs(self, completion: CompletionOutput, text_offset: int,
                 k: int) -> dict[str, Any]:
        """OpenAI's completions logprobs of the completion's tokens, the first at `text_offset`."""
        result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                   "text_offset": []}
        for token_id, entries in token_logprobs(completion):
            text = self.token_text(token_id, entries.get(token_id))
            sampled = entries.get(token_id)
            result["tokens"].append(text)
            result["token_logprobs"].append(sampled.logprob if sampled else None)
            top = {self.token_text(t, lp): lp.logprob for t, lp in top_entries(entries, k)}
            if sampled is not None:
                top.setdefault(text, sampled.logprob)
            result["top_logprobs"].append(top)
            result["text_offset"].append(text_offset)
            text_offset += len(text)
        return result


@dataclass
class _Choice:
    """What a stream has sent of one choice so far."""

    started: bool = False
    text_offset: int = 0  # characters sent, for the logprobs' text_offset


class _CompletionChunks(ChunkFormatter):
    """Completions' stream chunks: text, logprobs, the echoed prompt first."""

    object_name = "text_completion"

    def __init__(self, serving: OpenAIServingCompletion, n: int, echoes: list[str],
                 num_logprobs: int | None) -> None:
        self.serving = serving
        self.n = n
        self.echoes = echoes
        self.num_logprobs = num_logprobs
        self.states: dict[tuple[int, int], _Choice] = {}

    def choice_chunks(self, prompt_index: int, c: CompletionOutput) -> list[dict[str, Any]]:
        state = self.states.setdefault((prompt_index, c.index), _Choice())
        text = c.text
        if not state.started:
            text = self.echoes[prompt_index] + text
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = self.serving.logprobs(c, state.text_offset, self.num_logprobs)
            state.text_offset += sum(len(t) for t in logprobs["tokens"])
        if not text and not c.finished and not (logprobs and logprobs["tokens"]):
            return []
        state.started = True
        return [{"index": prompt_index * self.n + c.index, "text": text, "logprobs": logprobs,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]


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
