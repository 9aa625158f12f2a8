"""Beam search as a loop above the engine core: keep the `beam_width` best hypotheses each step.

Each live beam is an ordinary one-token request (its prompt: the caller's prompt and the
beam's tokens) asking for the raw logprobs of its top K next tokens, K = max(2, 1 + number
of stop ids) x width (enough that the global top K over all beams is among them). The
engine admits, schedules and finishes it like any other request; the search only reads its
output. When every live beam has reported, the search ranks the candidates
`score + logprob` and

* a candidate ending in a stop token, or reaching `max_tokens`, becomes a finished
  hypothesis if it ranks among the first `width` (score / length ** length_penalty);
* the best `width` other candidates become the next step's beams: new requests, which find
  their common prefix's full blocks in the prefix cache (beams of one search share blocks
  even with prefix caching off, as siblings do: `share_group`) and compute only the rest.

The search ends when no running beam can still beat the worst finished hypothesis (the same
heuristic as `transformers`' `early_stopping=False`), when all candidates finished
(`early_stopping=True` stops as soon as `width` hypotheses are finished), or at max_tokens.
Scores are accumulated in float32, as the reference does. A search has no partial result to
stream: whatever the `output_kind`, it yields one full output, when it ends.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens, the stop token included
    score: float  # cumulative logprob / length ** length_penalty
    finish_reason: str  # "stop" or "length"
    cumulative_logprob: float


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    score: np.float32  # cumulative logprob


@dataclass
class Continuation:
    """A new beam: `parent` extended by `token`, with cumulative logprob `score`."""

    parent: Beam
    token: int
    score: np.float32


# adds a beam's request to the engine: (request id, prompt + beam tokens, params, search)
AddBeam = Callable[[str, list[int], SamplingParams, "BeamSearch"], None]


@dataclass
class BeamSearch:
    """One caller's search; `add` takes its beams' outputs (the engine's output processor
    routes a beam's output here, as a sibling's goes to its `ParallelGroup`)."""

    request_id: str
    params: SamplingParams
    stop_token_ids: frozenset[int]
    max_tokens: int
    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    add_beam: AddBeam
    decode: Callable[..., str]  # the tokenizer's
    priority: int = 0
    cache_salt: str | None = None
    beams: dict[str, Beam] = field(default_factory=dict)  # live beams, in rank order
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False
    first_scheduled: float | None = None
    first_token: float | None = None
    _next_id: int = 0

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    def start(self) -> None:
        self._add(Beam([], np.float32(0.0)))

    def live_child_ids(self) -> list[str]:
        return list(self.beams)

    def add(self, index: int, output: RequestOutput, logprobs: list | None = None) -> None:
        """A beam's one-token output; `logprobs`: its raw top-K (chosen token first)."""
        if self.first_scheduled is None and output.metrics is not None:
            self.first_scheduled = output.metrics.first_scheduled_time
        if output.request_id not in self.beams or not logprobs:
            return  # an aborted beam
        position = logprobs[-1]
        self.reports[output.request_id] = list(zip(position.token_ids[1:],
                                                   position.logprobs[1:], strict=True))
        if len(self.reports) == len(self.beams):
            self._advance()

    def output(self) -> RequestOutput | None:
        return self._output(aborted=False) if self.done else None

    def abort_output(self) -> RequestOutput:
        self.beams = {}
        return self._output(aborted=True)

    def _add(self, beam: Beam) -> None:
        beam_id = f"{self.request_id}#beam{self._next_id}"
        self._next_id += 1
        self.beams[beam_id] = beam
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        params.logprobs = self.num_candidates  # internal: may exceed the user maximum
        self.add_beam(beam_id, self.prompt_token_ids + beam.token_ids, params, self)

    def _advance(self) -> None:
        """Rank all candidates; record finished hypotheses; start the next beams."""
        if self.first_token is None:
            self.first_token = time.time()
        candidates = [
            Continuation(beam, token, np.float32(beam.score + np.float32(logprob)))
            for beam_id, beam in self.beams.items()
            for token, logprob in self.reports[beam_id]
        ]
        candidates.sort(key=lambda c: -c.score)  # stable: ties keep beam order, like topk
        candidates = candidates[: self.num_candidates]
        num_generated = len(next(iter(self.beams.values())).token_ids) + 1
        hits = [c.token in self.stop_token_ids or num_generated >= self.max_tokens
                for c in candidates]
        self._record_finished(candidates[: self.width], hits, num_generated)
        continuing = [c for c, hit in zip(candidates, hits, strict=True) if not hit][: self.width]
        self.beams, self.reports = {}, {}
        self.done = self._search_is_over(continuing, num_generated)
        if not self.done:
            for c in continuing:
                self._add(Beam(c.parent.token_ids + [c.token], c.score))

    def best(self, n: int) -> list[Hypothesis]:
        return sorted(self.finished, key=lambda h: h.score, reverse=True)[:n]

    def _record_finished(self, top: list[Continuation], hits: list[bool], length: int) -> None:
        if self.params.early_stopping is True and len(self.finished) >= self.width:
            return
        penalty = np.float32(length**self.params.length_penalty)
        for candidate, hit in zip(top, hits, strict=False):
            if not hit:
                continue
            reason = "stop" if candidate.token in self.stop_token_ids else "length"
            tokens = candidate.parent.token_ids + [candidate.token]
            score = float(candidate.score / penalty)
            self.finished.append(Hypothesis(tokens, score, reason, float(candidate.score)))
        self.finished = self.best(self.width)

    def _search_is_over(self, continuing: list[Continuation], length: int) -> bool:
        if not continuing or length >= self.max_tokens:
            return True
        if len(self.finished) < self.width:
            return False
        if self.params.early_stopping is True:
            return True
        lp = self.params.length_penalty
        if self.params.early_stopping == "never" and lp > 0:
            best_length = self.max_tokens
        else:
            best_length = length
        best_possible = continuing[0].score / np.float32(best_length**lp)
        return not best_possible > min(h.score for h in self.finished)

    def _output(self, aborted: bool) -> RequestOutput:
        finished = time.time()
        skip = self.params.skip_special_tokens
        completions = [
            CompletionOutput(
                index=i,
                text=self.decode(h.token_ids, skip_special_tokens=skip),
                token_ids=h.token_ids,
                cumulative_logprob=h.cumulative_logprob,
                finish_reason=h.finish_reason,
                stop_reason=h.token_ids[-1] if h.finish_reason == "stop" else None,
            )
            for i, h in enumerate(self.best(self.params.n))
        ]
        if aborted and not completions:
            completions = [CompletionOutput(0, "", [], finish_reason="abort")]
        num_tokens = max((len(c.token_ids) for c in completions), default=0)
        metrics = RequestMetrics(self.arrival_time, self.first_scheduled, self.first_token,
                                 finished, finished, num_tokens)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             completions, True, metrics)
