"""Pydantic models of the OpenAI API (and vLLM's extra fields), and request -> SamplingParams.

Field names are OpenAI's; the vLLM extensions (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, ...) are accepted beside them. Unknown fields are ignored and
logged, as vLLM does: OpenAI clients send fields a server may not know.
"""

import logging
import time
import uuid
from dataclasses import fields
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from llmserve.outputs import RequestMetrics
from llmserve.sampling_params import (
    MAX_BEST_OF,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_TOP_K,
    SEED_RANGE,
    SamplingParams,
)

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
# Values that ask nothing of a sampling feature, so they are fine while it is missing.
NEUTRAL_VALUES: dict[str, Any] = {
    "n": 1, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "logit_bias": {}, "bad_words": [], "allowed_token_ids": None,
}


# Ranges SamplingParams enforces, stated in the fields too, so that /openapi.json shows them
# (and the contract fuzzer draws valid requests from it). Token ids' upper bound is the
# model's vocabulary, checked when the request is admitted.
TokenId = Annotated[int, Field(ge=0)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# one prompt (text or token ids) or several
Prompt = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[
    list[TokenIds], Field(min_length=1)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
StopList = Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
# template variables the server sets; `chat_template_kwargs` may not replace them
TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "documents")


class BadRequest(ValueError):
    """A request the server cannot serve: HTTP 400 (or `status`), naming `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


# a route's refused fields: name -> (the values that leave it a no-op, why it is refused)
Refusals = dict[str, tuple[tuple[Any, ...], str]]


class OpenAIModel(BaseModel):
    """A request body: unknown fields are kept aside (and logged), not refused.

    Every declared string must be valid Unicode: JSON can spell a lone surrogate
    ("\\ud800"), which the Rust tokenizer cannot take. pydantic checks that only for strings
    with a length bound, hence a bound no body reaches (the body cap is the real one).
    """

    model_config = ConfigDict(extra="allow", str_max_length=2**40)
    # the extras this body's route refuses (`refuse_set_fields`): not logged as ignored
    REFUSED_FIELDS: ClassVar[Refusals] = {}

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> "OpenAIModel":
        ignored = [name for name in self.model_extra or () if name not in self.REFUSED_FIELDS]
        if ignored:  # names quoted (a newline in one cannot forge a log line), 8 at most
            names = [repr(name[:40]) for name in ignored[:8]]
            more = len(ignored) - len(names)
            logger.info("ignoring unknown request fields: %s%s", ", ".join(names),
                        f" and {more} more" if more else "")
        return self


# Fields of the OpenAI and vLLM request APIs that would change the output and that llmserve
# does not serve (on the route at hand): refused with a 400 naming them, never dropped. (Fields
# nobody defines are logged and ignored, as vLLM does: clients send their own extras.) Each
# maps to the values that leave it a no-op (None always does) and why it is refused otherwise.
# A field a route declares (chat's `tools`) is never an extra there, so is never refused there.
_BEAM = "it applies to beam search, which is not served over HTTP"
_CHAT_ONLY = "tool calls are served by /v1/chat/completions"
UNSUPPORTED_FIELDS: Refusals = {
    "use_beam_search": ((False,), "beam search is not served over HTTP (offline: "
                                  "LLM.beam_search)"),
    "length_penalty": ((1.0,), _BEAM),
    "early_stopping": ((False,), _BEAM),
    "guided_whitespace_pattern": ((), "JSON whitespace is compact, or any with "
                                      "structured_outputs.whitespace_flexible"),
    "tools": (([],), _CHAT_ONLY),
    "tool_choice": (("none", "auto"), _CHAT_ONLY),
    "logits_processors": ((), "custom logits processors are not supported"),
    "functions": ((), "legacy function calling is not supported; use tools"),
    "chat_template": ((), "a chat template per request is not accepted: the model's own "
                          "template renders every chat"),
    "function_call": ((), "legacy function calling is not supported; use tool_choice"),
    "prompt_embeds": ((), "prompt embeddings are not accepted; send text or token ids"),
    "vllm_xargs": (({},), "no plugin on this server reads vllm_xargs"),
    "mm_processor_kwargs": (({},), "this server serves text-only models"),
    "structural_tag": ((), "structural tags are not supported; use tools or "
                           "structured_outputs"),
    "reasoning_effort": ((), "the served model's chat template takes no reasoning effort"),
}


def refuse_set_fields(extra: dict[str, Any],
                      table: Refusals) -> None:
    """A 400 naming the first of `table`'s fields that `extra` sets to a value other than
    its no-ops (None always is one), with the table's reason."""
    for name, (no_ops, why) in table.items():
        value = extra.get(name)
        if value is not None and value not in no_ops:
            raise BadRequest(f"'{name}' is not supported: {why}", param=name)


class StreamOptions(OpenAIModel):
    include_usage: bool = False  # a last chunk with the usage
    continuous_usage_stats: bool = False  # every chunk with the usage so far (vLLM's)


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    REFUSED_FIELDS: ClassVar[Refusals] = UNSUPPORTED_FIELDS

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_BEST_OF)
    best_of: int | None = Field(None, ge=1, le=MAX_BEST_OF)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: Text | StopList | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: NumLogprobs | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:<id>"
    return_token_ids: bool | None = None  # the prompt's and each choice's token ids too
    # the response's id is "<cmpl|chatcmpl>-<request_id>" (unique among running requests)
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # the prompt's last k tokens only (-1: as many as the context holds), asked for
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    spaces_between_special_tokens: bool | None = None
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
        refuse_set_fields(self.model_extra or {}, UNSUPPORTED_FIELDS)

    def sampling_options(self) -> dict[str, Any]:
        """The SamplingParams keyword arguments this request sets (OpenAI names -> vLLM's);
        a field it cannot honour is refused first."""
        self.refuse_unsupported()
        options = {name: getattr(self, name) for name in (
            "n", "best_of", "temperature", "top_p", "seed", "presence_penalty",
            "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
            "ignore_eos", "stop_token_ids", "skip_special_tokens",
            "include_stop_str_in_output", "allowed_token_ids", "bad_words", "prompt_logprobs",
            "truncate_prompt_tokens", "spaces_between_special_tokens",
        )}
        if self.stop is not None:
            options["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.logit_bias is not None:
            options["logit_bias"] = _parse_logit_bias(self.logit_bias)
        return {k: v for k, v in options.items() if v is not None}


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    # 0 with echo: score the prompt only (its logprobs), generate nothing
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: NumLogprobs | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ImageURL(OpenAIModel):
    url: str  # a data URL (data:image/png;base64,...)
    # the one resolution the model's tower takes: "auto" (the default) only
    detail: Literal["auto"] | None = None


class TextPart(OpenAIModel):
    """A content part: text, or an image (`image_url`) for a vision-language model."""

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


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
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[ToolDefinition] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    # the last message is continued (an assistant's prefix the answer goes on from), not
    # closed by the template: needs add_generation_prompt false
    continue_final_message: bool = False
    echo: bool = False  # the answer starts with the last message's text if it is assistant's
    add_special_tokens: bool = False  # the tokenizer's BOS/EOS around the rendered template
    include_reasoning: bool = True  # with --reasoning-parser: false leaves the thinking out
    documents: list[dict[str, str]] | None = None  # for templates that cite documents (RAG)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_server_variables(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = [name for name in TEMPLATE_VARIABLES if name in (kwargs or {})]
        if taken:
            raise ValueError(f"'{taken[0]}' is set by the request itself, not by "
                             "chat_template_kwargs")
        return kwargs


class TokenizeRequest(OpenAIModel):
    """/tokenize: a field it does not know is refused, not ignored (a tokenizer option it
    dropped would give the client other ids than it asked for)."""

    model_config = ConfigDict(extra="forbid", str_max_length=2**40)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model_config = ConfigDict(extra="forbid", str_max_length=2**40)
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


def random_id(prefix: str, chosen: str | None = None) -> str:
    """`prefix`-<the client's `request_id`>, or a random one."""
    return f"{prefix}-{chosen or uuid.uuid4().hex}"


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
        # of which read from the KV tier (--kv-offload-dir), the rest from memory
        "num_tier_cached_tokens": metrics.num_tier_cached_tokens,
        # every generated token, also the choices best_of drops
        "num_generation_tokens": metrics.num_generated_tokens,
        "num_preemptions": metrics.num_preemptions,
        "num_preempted_tokens": metrics.num_preempted_tokens,
        "num_swapped_in_tokens": metrics.num_swapped_in_tokens,
        "num_draft_tokens": metrics.num_draft_tokens,
        "num_accepted_tokens": metrics.num_accepted_tokens,
        "num_spec_rounds": metrics.num_spec_rounds,
        "spec_acceptance_rate": metrics.acceptance_rate,
        "spec_mean_acceptance_length": metrics.mean_acceptance_length,
        "tokens_per_decode_step": metrics.tokens_per_decode_step,
    }
    if len(choice_tokens) > 1:
        body["num_generation_tokens_per_choice"] = choice_tokens
    return body


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None  # the request field (or header) at fault, as `messages[0].content`
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, the body of every 4xx and 5xx (described in /openapi.json)."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorInfo


class AnthropicErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error shape, the body of every 4xx and 5xx of /v1/messages..."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["error"]
    error: AnthropicErrorInfo


class OllamaErrorResponse(BaseModel):
    """Ollama's error shape, the body of every 4xx and 5xx of /api/..."""

    model_config = ConfigDict(extra="forbid")

    error: str = Field(min_length=1)


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error shape (`ErrorResponse`)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
