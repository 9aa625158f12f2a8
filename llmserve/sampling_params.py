"""SamplingParams: what a request asks of generation, validated at construction.

Field names follow vLLM's. A value out of range raises `ValueError` whose message names the
field and the allowed range.
"""

import enum
import json
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_BEST_OF = 64
MAX_BEAM_WIDTH = 16
# a seed is a signed 64-bit integer (vLLM's range; torch.Generator takes no wider)
SEED_RANGE = (-(2**63), 2**63 - 1)


MAX_TOP_K = 2**31 - 1  # a 32-bit count; any k at or above the vocabulary keeps every token

# A constraint's size, checked before anything compiles it: grammar construction grows
# faster than linearly in its alternatives (measured on the default model's vocabulary:
# 20,000 choices 0.5 s, 50,000 7 s, 300,000 minutes), and a request must not buy that
# much of a core. `choice` and a JSON schema's `enum` lists share the count cap.
MAX_CONSTRAINT_CHOICES = 10_000
MAX_CONSTRAINT_BYTES = 256 * 1024  # the constraint's text: a regex, grammar, schema, choices


def _longest_enum(schema: dict | str) -> int:
    """The longest `enum` list anywhere in a JSON schema (0 for text that is not JSON: the
    compiler refuses it, naming the problem)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return 0
    longest, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                longest = max(longest, len(node["enum"]))
            stack.extend(v for k, v in node.items() if k not in ("enum", "const"))
        elif isinstance(node, list):
            stack.extend(node)
    return longest


@dataclass
class StructuredOutputsParams:
    """A constraint every generated token obeys (vLLM's `StructuredOutputsParams`): exactly
    one of `json` (a JSON schema, dict or string), `json_object` (any JSON object),
    `regex`, `choice` (one of these strings) or `grammar` (a Lark grammar; llama.cpp GBNF
    is accepted too, recognised by its `::=` rules).

    The output is then a complete match, or the request ends by length
    (`finish_reason "length"`) with a prefix of one; it never stops early on EOS or a stop
    token the constraint does not allow. Validity of the schema or grammar is checked when
    the request is added (`ValueError` naming what is wrong).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # JSON only: allow any whitespace between tokens (as llguidance's "flexible" mode);
    # False: compact separators as `json.dumps` writes them
    whitespace_flexible: bool = False
    # the constraint applies after this text in the output (a reasoning block's end,
    # "</think>"); before it every token is allowed. None: from the first token
    starts_after: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] * self.json_object)
        _check(len(given) == 1, "structured_outputs",
               f"needs exactly one of json, json_object, regex, choice, grammar; got "
               f"{', '.join(given) or 'none'}")
        if self.choice is not None:
            self.choice = list(self.choice)
            _check(bool(self.choice) and all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice", "must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value.strip()),
                   f"structured_outputs.{name}", "must be a non-empty string")
        _check(self.json is None or isinstance(self.json, (dict, str)),
               "structured_outputs.json", "must be a JSON schema (an object or its text)")
        self._check_size()

    def _check_size(self) -> None:
        """The caps above, naming the field: a constraint too large to compile within the
        server's grammar budget is refused before it costs anything."""
        field = f"structured_outputs.{self.kind}"
        if self.choice is not None:
            _check(len(self.choice) <= MAX_CONSTRAINT_CHOICES, field,
                   f"has {len(self.choice)} strings; at most {MAX_CONSTRAINT_CHOICES} "
                   "are allowed")
            size = sum(len(c.encode("utf-8", "surrogatepass")) for c in self.choice)
        else:
            value = self.json if self.json is not None else self.regex or self.grammar or ""
            if isinstance(value, dict):
                value = json.dumps(value)
            size = len(value.encode("utf-8", "surrogatepass"))
            if self.json is not None:
                longest = _longest_enum(self.json)
                _check(longest <= MAX_CONSTRAINT_CHOICES, field,
                       f"has an enum of {longest} values; at most "
                       f"{MAX_CONSTRAINT_CHOICES} are allowed")
        _check(size <= MAX_CONSTRAINT_BYTES, field,
               f"is {size} bytes; at most {MAX_CONSTRAINT_BYTES} are allowed")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None)


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a running request carries (vLLM's names and values).

    * CUMULATIVE: everything so far, every step (text, token ids, logprobs re-sent: O(n)).
    * DELTA: only what is new since the request's previous output: new token ids, newly
      visible text, new logprobs entries; prompt logprobs once, in the first output;
      finish_reason and stop_reason in the last. Concatenating the deltas gives the
      CUMULATIVE output (`outputs.OutputAccumulator` does it).
    * FINAL_ONLY: nothing until the request finishes, then one full output.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick the next tokens and when to stop.

    `temperature=0` is greedy. `top_k` of 0 or -1 disables top-k; `top_p=1` and `min_p=0`
    disable theirs. `seed` (a signed 64-bit integer) makes a request's samples reproducible
    whatever else is batched with it. Stop strings are matched on the detokenized text and
    are not returned unless `include_stop_str_in_output`.

    Penalties follow vLLM: `repetition_penalty` (> 0, 1 = off) divides positive and
    multiplies negative logits of tokens seen in the prompt or the output;
    `frequency_penalty` and `presence_penalty` (in [-2, 2], 0 = off) subtract
    `frequency * count + presence * (count > 0)` over output tokens. `logit_bias` adds a
    bias in [-100, 100] to token ids; `allowed_token_ids` restricts sampling to those ids;
    `bad_words` are never completed (each word with and without a leading space).

    `n` completions are returned; `best_of` (>= n) are generated and the n with the highest
    cumulative logprob kept. `use_beam_search` runs beam search of `beam_width` beams
    (default: best_of or n) and returns the n best hypotheses, ranked by cumulative logprob
    / length ** `length_penalty`; `early_stopping` is True, False or "never" as in
    `transformers`. Beam search is deterministic (temperature and truncation do not apply).

    `logprobs=k` returns, per generated token, the sampled token's logprob and the k most
    likely alternatives; `prompt_logprobs=k` the same for every prompt token after the
    first. Both are of the RAW model distribution (log_softmax of the logits before
    temperature, penalties, bias, masks and truncation), like vLLM's default
    `raw_logprobs` mode.

    `structured_outputs` constrains the output to a JSON schema, regex, choice or grammar
    (`StructuredOutputsParams`; not with beam search).

    `truncate_prompt_tokens=k` keeps only the prompt's last k tokens (-1: as many as the
    model's context holds) instead of refusing a longer prompt; the text is then not
    returned as the prompt. `detokenize=False` returns token ids without text (no stop
    strings then). `spaces_between_special_tokens` is vLLM's: this tokenizer (HF `tokenizers`,
    as vLLM's fast detokenizer) joins special tokens without spaces either way, so both
    values give the same text. `logits_processors` (custom per-request callables) and
    `extra_args` (read by such plugins) are refused when set: no plugin runs here.

    `output_kind` says whether the engine reports each step's snapshot (CUMULATIVE, the
    default, as in vLLM), only what is new (DELTA: what servers stream) or only the final
    output (FINAL_ONLY: what `LLM.generate` asks for).
    """

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list | None = None
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]}"
                             f", got {self.output_kind!r}") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        self._check_fan_out()
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed",
               f"must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0 <= self.top_k <= MAX_TOP_K, "top_k",
               f"must be -1 (off), 0 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens", f"must be at least 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        _check(all(self.stop), "stop", "stop strings must be non-empty")
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
        )
        self._check_penalties()
        self._check_token_lists()
        self._check_vllm_extras()
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams")

    def _check_fan_out(self) -> None:
        if self.best_of is not None:
            _check(
                self.best_of >= self.n, "best_of",
                f"must be >= n ({self.n}), got {self.best_of}",
            )
            _check(self.best_of <= MAX_BEST_OF, "best_of", f"must be <= {MAX_BEST_OF}")
        _check(self.n <= MAX_BEST_OF, "n", f"must be <= {MAX_BEST_OF}, got {self.n}")
        _check(
            self.early_stopping in (True, False, "never"), "early_stopping",
            f"must be true, false or 'never', got {self.early_stopping!r}",
        )
        if not self.use_beam_search:
            return
        if self.beam_width is None:
            self.beam_width = self.best_of or self.n
        _check(
            1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
            f"must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}",
        )
        _check(
            self.n <= self.beam_width, "n",
            f"must be <= beam_width ({self.beam_width}) with beam search, got {self.n}",
        )
        for name in ("stop", "logprobs", "prompt_logprobs", "bad_words", "allowed_token_ids",
                     "structured_outputs"):
            _check(not getattr(self, name), name, "is not supported with beam search")

    def _check_vllm_extras(self) -> None:
        k = self.truncate_prompt_tokens
        _check(k is None or k == -1 or k >= 1, "truncate_prompt_tokens",
               f"must be -1 (the model's context) or at least 1, got {k}")
        _check(self.detokenize or not self.stop, "stop",
               "stop strings need detokenize=True (they are matched in the text)")
        _check(not self.logits_processors, "logits_processors",
               "custom logits processors are not supported (logit_bias, allowed_token_ids, "
               "bad_words and structured_outputs cover the built-in cases)")
        _check(not self.extra_args, "extra_args",
               "no plugin on this server reads extra_args, so they would have no effect")

    def _check_penalties(self) -> None:
        _check(
            self.repetition_penalty > 0, "repetition_penalty",
            f"must be > 0 (1 = off), got {self.repetition_penalty}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, f"must be in [-2, 2], got {value}")

    def _check_token_lists(self) -> None:
        if self.logit_bias:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            for token, bias in self.logit_bias.items():
                _check(
                    -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias",
                    f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {token}",
                )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
            _check(bool(self.allowed_token_ids), "allowed_token_ids", "must not be empty")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            _check(
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words", "must be non-empty strings",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
