"""What the engine keeps per scheduled sequence, and how it turns that into outputs.

The token ids live on the `Request` (shared with the scheduler); everything else the frontend
needs about a sequence is one `RequestState`: its prompt text, detokenizer, logprobs, its
place in a parallel group, and how much of its output has been handed out. An output is
built as the request's `output_kind` asks:

    output_token_ids:  | handed out in earlier deltas | new: this delta |
                       0                      num_sent_tokens     num_output_tokens

DELTA outputs slice only the new part (O(new) per step); CUMULATIVE ones copy everything
(O(length) per step, vLLM's default); FINAL_ONLY builds one full output at the end.
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.core.request import Request
from llmserve.engine.detokenizer import Decoder, IncrementalDetokenizer
from llmserve.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from llmserve.sampling_params import RequestOutputKind
from llmserve.worker.logprobs import PositionLogprobs

if TYPE_CHECKING:
    import torch

    from llmserve.engine.beam_search import BeamSearch
    from llmserve.engine.parallel_sampling import ParallelGroup


@dataclass(eq=False)
class RequestState:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    # the parent of an n > 1 / best_of sibling or of a beam
    parent: "ParallelGroup | BeamSearch | None" = None
    index: int = 0  # the sibling's choice index in its group
    logprobs: list[dict[int, Logprob]] | None = field(init=False, default=None)
    cumulative_logprob: float | None = field(init=False, default=None)
    prompt_logprobs: PromptLogprobs | None = field(init=False, default=None)
    num_sent_tokens: int = field(init=False, default=0)  # output tokens in earlier deltas
    num_processed_tokens: int = field(init=False, default=0)  # detokenized so far
    prompt_logprobs_sent: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        params = self.request.sampling_params
        if params.logprobs is not None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.request.num_prompt_tokens

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.request.sampling_params.output_kind

    def add_logprobs(self, entries: dict[int, Logprob], sampled_logprob: float) -> None:
        """The newest output token's entries (sampled token first) and its logprob."""
        if self.logprobs is not None:
            self.logprobs.append(entries)
            self.cumulative_logprob += sampled_logprob

    def set_prompt_logprobs(self, first: int, entries: list[dict[int, Logprob]]) -> None:
        """Entries of prompt positions `first`, `first + 1`, ... (a prefill chunk's worth)."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs[first : first + len(entries)] = entries

    def output(self) -> RequestOutput | None:
        """This step's output as `output_kind` asks; None while a FINAL_ONLY one runs."""
        finished = self.request.status.finished
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            completion, prompt_logprobs = self._delta(finished)
        else:
            completion, prompt_logprobs = self._full(finished)
        request = self.request
        t = request.timings
        metrics = RequestMetrics(
            t.arrival, t.first_scheduled, t.first_token, t.last_token, t.finished,
            request.num_output_tokens, request.num_draft_tokens, request.num_accepted_tokens,
            request.num_preemptions, request.num_preempted_tokens,
            request.num_tier_cached_tokens, request.num_swapped_in_tokens,
            num_spec_rounds=request.num_spec_rounds,
            num_decode_steps=request.num_decode_steps,
        )
        return RequestOutput(
            request.request_id, self.prompt, request.prompt_token_ids, [completion],
            finished, metrics, request.num_cached_tokens, prompt_logprobs=prompt_logprobs,
        )

    def pooling_output(self, pooled: "torch.Tensor") -> PoolingRequestOutput:
        """A pooling request's output (its prompt is done; nothing was sampled)."""
        request = self.request
        t = request.timings
        metrics = RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.last_token,
                                 t.finished, 0, num_preemptions=request.num_preemptions,
                                 num_preempted_tokens=request.num_preempted_tokens,
                                 num_tier_cached_tokens=request.num_tier_cached_tokens)
        return PoolingRequestOutput(request.request_id, PoolingOutput(pooled),
                                    list(request.prompt_token_ids), True,
                                    request.num_cached_tokens, metrics)

    def _delta(self, finished: bool) -> tuple[CompletionOutput, PromptLogprobs | None]:
        """What is new since the last output; the prompt logprobs only the first time."""
        request = self.request
        start, self.num_sent_tokens = self.num_sent_tokens, request.num_output_tokens
        prompt_logprobs = None
        if not self.prompt_logprobs_sent:
            # the first output comes after the whole prompt was computed (or at an abort)
            self.prompt_logprobs_sent = True
            prompt_logprobs = self.prompt_logprobs
        completion = CompletionOutput(
            index=self.index,
            text=self.detokenizer.next_text(finished),
            token_ids=request.output_token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[start:],
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
        )
        return completion, prompt_logprobs

    def _full(self, finished: bool) -> tuple[CompletionOutput, PromptLogprobs | None]:
        request = self.request
        completion = CompletionOutput(
            index=self.index,
            text=self.detokenizer.visible_text(finished),
            token_ids=list(request.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
        )
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return completion, prompt_logprobs


class LogprobsDecoder:
    """The runner's logprobs of one position as `{token_id: Logprob}`, token texts cached."""

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}

    def entries(self, position: PositionLogprobs) -> dict[int, Logprob]:
        """Chosen token first, then the top-k (a chosen token in the top-k appears once)."""
        entries: dict[int, Logprob] = {}
        for token, logprob, rank in zip(
            position.token_ids, position.logprobs, position.ranks, strict=True
        ):
            if token not in entries:
                entries[token] = Logprob(logprob, rank, self._token_text(token))
        return entries

    def _token_text(self, token: int) -> str:
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([token])
        return text
