"""Pydantic models of the OpenAI API (and vLLM's extra fields), and request -> SamplingParams.

Field names are OpenAI's; the vLLM extensions (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, ...) are accepted beside them. Unknown fields are ignored and
logged, as vLLM does: OpenAI clients send fields a server may not know.
"""

import logging
import time
import uuid
from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from llmserve.outputs import RequestMetrics
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
# Values that ask nothing of a sampling feature, so they are fine while it is missing.
NEUTRAL_VALUES: dict[str, Any] = {
    "n": 1, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "logit_bias": {}, "bad_words": [], "allowed_token_ids": None,
}


class BadRequest(ValueError):
    """A request the server cannot serve: HTTP 400 (or `status`), naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


class OpenAIModel(BaseModel):
    """A request body: unknown fields are kept aside (and logged), not refused."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> "OpenAIModel":
        if self.model_extra:
            logger.info("ignoring unknown request fields: %s", ", ".join(self.model_extra))
        return self


# Fields of the OpenAI and vLLM request APIs that would change the output and that llmserve
# does not serve (on the route at hand): refused with a 400 naming them, never dropped. (Fields
# nobody defines are logged and ignored, as vLLM does: clients send their own extras.) Each
# maps to the values that leave it a no-op (None always does) and why it is refused otherwise.
# A field a route declares (chat's `tools`) is never an extra there, so is never refused there.
_BEAM = "it applies to beam search, which is not served over HTTP"
_CHAT_ONLY = "tool calls are served by /v1/chat/completions"
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not served over HTTP (offline: "
                                  "LLM.beam_search)"),
    "length_penalty": ((1.0,), _BEAM),
    "early_stopping": ((False,), _BEAM),
    "guided_whitespace_pattern": ((), "JSON whitespace is compact, or any with "
                                      "structured_outputs.whitespace_flexible"),
    "tools": (([],), _CHAT_ONLY),
    "tool_choice": (("none", "auto"), _CHAT_ONLY),
    "logits_processors": ((), "custom logits processors are not supported"),
    "truncate_prompt_tokens": ((), "prompts are never truncated; send a shorter prompt"),
    "functions": ((), "legacy function calling is not supported; use tools"),
    "function_call": ((), "legacy function calling is not supported; use tool_choice"),
}


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    # disaggregated prefill/decode (distributed/kv_transfer.py): set by `llmserve router`
    kv_transfer_params: dict[str, Any] | None = None
    # output constraints (structured.py turns them into StructuredOutputsParams)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # llmserve's: the request's timeline in the response (`metrics_json`); None: as the
    # X-Return-Metrics header says. Strict: "yes" is refused, not read as true
    return_metrics: StrictBool | None = None

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field set that llmserve cannot honour (`UNSUPPORTED_FIELDS`)."""
        extra = self.model_extra or {}
        for name, (no_ops, why) in UNSUPPORTED_FIELDS.items():
            value = extra.get(name)
            if value is not None and value not in no_ops:
                raise BadRequest(f"'{name}' is not supported: {why}", param=name)

    def sampling_options(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments this request sets (OpenAI names -> vLLM's);
        a field it cannot honour is refused first."""
        self.refuse_unsupported()
        options = {name: getattr(self, name) for name in (
            "n", "best_of", "temperature", "top_p", "seed", "presence_penalty",
            "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
            "ignore_eos", "stop_token_ids", "skip_special_tokens",
            "include_stop_str_in_output", "allowed_token_ids", "bad_words", "prompt_logprobs",
        )}
        if self.stop is not None:
            options["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.logit_bias is not None:
            options["logit_bias"] = _parse_logit_bias(self.logit_bias)
        return {k: v for k, v in options.items() if v is not None}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(OpenAIModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; a dict is taken too


class ToolCall(OpenAIModel):
    """A call an earlier assistant message made, sent back as conversation history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---- building SamplingParams ------------------------------------------------------------


def build_sampling_params(options: dict[str, Any]) -> SamplingParams:
    """SamplingParams from request options; a bad or unsupported value is a `BadRequest`."""
    unsupported = [k for k in options if k not in SAMPLING_FIELDS]
    for name in unsupported:
        value = options.pop(name)
        if value != NEUTRAL_VALUES.get(name, object()):
            raise BadRequest(f"{name} is not supported by this server yet", param=name)
    try:
        return SamplingParams(**options)
    except (ValueError, TypeError) as e:
        message = str(e)
        param = message.split(" ", 1)[0]
        raise BadRequest(message, param=param if param in options else None) from None


def _parse_logit_bias(bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(token): float(value) for token, value in bias.items()}
    except ValueError:
        raise BadRequest("logit_bias keys must be token ids (integers as strings)",
                         param="logit_bias") from None


# ---- responses ----------------------------------------------------------------------------


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def metrics_json(metrics: RequestMetrics, prompt_tokens: int, cached_tokens: int,
                 choice_tokens: list[int]) -> dict[str, Any]:
    """A response's `metrics`: the request's timeline (unix seconds), its latencies, and
    its counts (`choice_tokens`: generated tokens per choice, in choice order).

    Several sequences (n > 1, several prompts) count as one request: the earliest
    arrival and first token, the latest finish, TPOT averaged over the sequences.
    """
    body = {
        "arrival_time": metrics.arrival_time,
        "first_scheduled_time": metrics.first_scheduled_time,
        "first_token_time": metrics.first_token_time,
        "last_token_time": metrics.last_token_time,
        "finished_time": metrics.finished_time,
        "queue_time_s": metrics.queue_time,
        "ttft_s": metrics.time_to_first_token,
        "tpot_s": metrics.time_per_output_token,
        "e2e_s": metrics.e2e_latency,
        "num_prompt_tokens": prompt_tokens,
        "num_cached_tokens": cached_tokens,
        # every generated token, also the choices best_of drops
        "num_generation_tokens": metrics.num_generated_tokens,
        "num_preemptions": metrics.num_preemptions,
        "num_preempted_tokens": metrics.num_preempted_tokens,
        "num_draft_tokens": metrics.num_draft_tokens,
        "num_accepted_tokens": metrics.num_accepted_tokens,
    }
    if len(choice_tokens) > 1:
        body["num_generation_tokens_per_choice"] = choice_tokens
    return body


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
