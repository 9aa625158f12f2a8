"""What generation returns: vLLM-shaped `RequestOutput` and `CompletionOutput`; what
pooling returns: `PoolingRequestOutput` and its embedding, classification and scoring views.

A running request's outputs are snapshots, deltas or only the final one, as its
`SamplingParams.output_kind` asks (`RequestOutputKind`). A delta has the same shape as a
full output with only what is new in `outputs[i]` (text, token_ids, logprobs), each
completion keyed by its `index`; `OutputAccumulator` sums deltas back into full outputs.
"""

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per prompt token {token_id: Logprob} (actual token + top-k); the first is None
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock times of one request (seconds since the epoch) and derived latencies.

    A request of several sequences (n > 1 siblings, several prompts) is their `merge`:
    the earliest arrival, schedule and first token, the latest last token and finish, and
    the counts summed; its TPOT averages over the sequences it keeps in `sequences`.
    """

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_generated_tokens: int
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0  # of which accepted
    num_preemptions: int = 0  # times the scheduler freed its KV to make room
    num_preempted_tokens: int = 0  # computed tokens those preemptions freed (recomputed)
    # KV tier: prompt tokens of its prefix-cache hit read from the tier (not memory), and
    # tokens read back from it after preemptions
    num_tier_cached_tokens: int = 0
    num_swapped_in_tokens: int = 0
    # speculative decoding: steps that verified drafts for it, and every step that gave it
    # tokens after its first (without speculation: one token each)
    num_spec_rounds: int = 0
    num_decode_steps: int = 0
    sequences: tuple["RequestMetrics", ...] = ()  # a merged request's single sequences

    @classmethod
    def merge(cls, parts: "list[RequestMetrics]") -> "RequestMetrics":
        """One request's metrics from its sequences' (or from merged ones)."""
        seqs = tuple(s for p in parts for s in (p.sequences or (p,)))
        if len(seqs) == 1:
            return seqs[0]

        def first(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return min(known) if known else None

        def last(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return max(known) if known else None

        return cls(
            min(s.arrival_time for s in seqs),
            first([s.first_scheduled_time for s in seqs]),
            first([s.first_token_time for s in seqs]),
            last([s.last_token_time for s in seqs]),
            # unfinished while any sequence is
            None if any(s.finished_time is None for s in seqs)
            else max(s.finished_time for s in seqs),
            *(sum(getattr(s, name) for s in seqs) for name in (
                "num_generated_tokens", "num_draft_tokens", "num_accepted_tokens",
                "num_preemptions", "num_preempted_tokens", "num_tier_cached_tokens",
                "num_swapped_in_tokens", "num_spec_rounds", "num_decode_steps")),
            sequences=seqs,
        )

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens (None: no drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification round emitted, its bonus token included (None: none)."""
        return 1 + self.num_accepted_tokens / self.num_spec_rounds if self.num_spec_rounds \
            else None

    @property
    def tokens_per_decode_step(self) -> float | None:
        """Tokens after each sequence's first, per step that gave any: speculation's
        speed-up in target steps (1.0 without it; the drafting's own cost not counted)."""
        return (self.num_generated_tokens - len(self.sequences or (self,))) \
            / self.num_decode_steps if self.num_decode_steps else None

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (TPOT), over all sequences."""
        decoding = [s for s in self.sequences or (self,)
                    if s.num_generated_tokens >= 2 and s.first_token_time is not None]
        if not decoding:
            return None
        return (sum(s.last_token_time - s.first_token_time for s in decoding)
                / sum(s.num_generated_tokens - 1 for s in decoding))

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # per prompt token {token_id: Logprob} (actual token + top-k); the first is None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class _CompletionParts:
    """One choice's deltas so far; text stays in pieces until `build()`."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionOutput) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason

    def build(self, index: int) -> CompletionOutput:
        text = "".join(self.text)
        self.text[:] = [text]  # a later build joins only what came after
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return CompletionOutput(index, text, list(self.token_ids), self.cumulative_logprob,
                                logprobs, self.finish_reason, self.stop_reason)


class OutputAccumulator:
    """Sums one request's delta `RequestOutput`s into the full output (amortized O(1) per add).

    `build()` copies what was gathered (O(length)): call it once at the end, or per step
    only where snapshots are wanted (`RequestOutputKind.CUMULATIVE`).
    """

    def __init__(self) -> None:
        self._last: RequestOutput | None = None
        self._choices: dict[int, _CompletionParts] = {}
        self._prompt_logprobs: PromptLogprobs | None = None

    def add(self, delta: RequestOutput) -> None:
        self._last = delta
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        for completion in delta.outputs:
            parts = self._choices.get(completion.index)
            if parts is None:
                parts = self._choices[completion.index] = _CompletionParts()
            parts.add(completion)

    def build(self) -> RequestOutput:
        last = self._last
        if last is None:
            raise ValueError("no output was added yet")
        completions = [self._choices[i].build(i) for i in sorted(self._choices)]
        return RequestOutput(
            last.request_id, last.prompt, last.prompt_token_ids, completions, last.finished,
            last.metrics, last.num_cached_tokens, dict(last.extra),
            prompt_logprobs=self._prompt_logprobs,
        )


# ---- pooling: embeddings, class scores, similarity scores (vLLM's names) -----------------


@dataclass
class PoolingOutput:
    data: Any  # a float32 tensor: the embedding, or the class probabilities (or logits)


@dataclass
class PoolingRequestOutput:
    """A pooling request's one (final) output."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label (the logits if the request turned activation off)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class _PoolingView:
    """A `PoolingRequestOutput` as a task's result (vLLM's `*RequestOutput` shapes)."""

    request_id: str
    outputs: Any  # the task's output: EmbeddingOutput, ClassificationOutput, ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
    output_type: ClassVar[type] = EmbeddingOutput

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "_PoolingView":
        return cls(output.request_id, cls.output_type(output.outputs.data.tolist()),
                   output.prompt_token_ids, output.finished)


class EmbeddingRequestOutput(_PoolingView):
    output_type = EmbeddingOutput


class ClassificationRequestOutput(_PoolingView):
    output_type = ClassificationOutput


class ScoringRequestOutput(_PoolingView):
    output_type = ScoringOutput
