"""Beam search over the paged engine: keep the `beam_width` best hypotheses each step.

Each live beam is an ordinary running request that asks the runner for the raw logprobs of
its top K next tokens, K = max(2, 1 + number of stop ids) x width (enough that the global
top K over all beams is among them). When every live beam has reported, the group ranks the
candidates `score + logprob` and

* a candidate ending in a stop token, or reaching `max_tokens`, becomes a finished
  hypothesis if it ranks among the first `width` (score / length ** length_penalty);
* the best `width` other candidates become the next beams. A new beam is a child request
  that shares its parent's KV blocks; a shared, partly filled last block is copied before
  the child writes to it (copy-on-write), so beams never recompute their common prefix.

The search ends when no running beam can still beat the worst finished hypothesis (the same
heuristic as `transformers`' `early_stopping=False`), when all candidates finished
(`early_stopping=True` stops as soon as `width` hypotheses are finished), or at max_tokens.
Scores are accumulated in float32, as the reference does. A search has no partial result to
stream: whatever the `output_kind`, it yields one full output, when it ends.
"""

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from llmserve.core.request import Request, RequestStatus, RequestTimings
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmserve.core.scheduler import Scheduler
    from llmserve.tokenizer import Tokenizer


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens, the stop token included
    score: float  # cumulative logprob / length ** length_penalty
    finish_reason: str  # "stop" or "length"
    cumulative_logprob: float


@dataclass
class Continuation:
    """A new beam: `parent` extended by `token`, with cumulative logprob `score`."""

    parent: Request
    token: int
    score: np.float32


@dataclass
class BeamSearchGroup:
    request_id: str
    params: SamplingParams
    stop_token_ids: frozenset[int]
    max_tokens: int
    prompt: str | None
    prompt_token_ids: list[int]
    timings: RequestTimings  # the first beam's, shared by all its descendants
    beams: dict[str, np.float32] = field(default_factory=dict)  # running id -> score
    reports: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False
    _next_id: int = 0

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    def new_beam_id(self) -> str:
        self._next_id += 1
        return f"{self.request_id}#beam{self._next_id}"

    def add_beam(self, request_id: str, score: np.float32) -> None:
        self.beams[request_id] = score

    def report(self, request_id: str, top: list[tuple[int, float]]) -> bool:
        """A beam's top-K (token, logprob); True once every running beam has reported."""
        self.reports[request_id] = top
        return len(self.reports) == len(self.beams)

    def advance(self, requests: dict[str, Request]) -> list[Continuation]:
        """Rank all candidates; record finished hypotheses; return the next beams."""
        candidates = self._ranked_candidates(requests)
        num_generated = requests[next(iter(self.beams))].num_output_tokens + 1
        hits = [c.token in self.stop_token_ids or num_generated >= self.max_tokens
                for c in candidates]
        self._record_finished(candidates[: self.width], hits, num_generated)
        continuing = [c for c, hit in zip(candidates, hits, strict=True) if not hit][: self.width]
        self.beams, self.reports = {}, {}
        self.done = self._search_is_over(continuing, num_generated)
        return [] if self.done else continuing

    def best(self, n: int) -> list[Hypothesis]:
        return sorted(self.finished, key=lambda h: h.score, reverse=True)[:n]

    def _ranked_candidates(self, requests: dict[str, Request]) -> list[Continuation]:
        candidates = [
            Continuation(requests[beam_id], token, np.float32(score + np.float32(logprob)))
            for beam_id, score in self.beams.items()
            for token, logprob in self.reports[beam_id]
        ]
        candidates.sort(key=lambda c: -c.score)  # stable: ties keep beam order, like topk
        return candidates[: self.num_candidates]

    def _record_finished(self, top: list[Continuation], hits: list[bool], length: int) -> None:
        if self.params.early_stopping is True and len(self.finished) >= self.width:
            return
        penalty = np.float32(length**self.params.length_penalty)
        for candidate, hit in zip(top, hits, strict=False):
            if not hit:
                continue
            reason = "stop" if candidate.token in self.stop_token_ids else "length"
            tokens = candidate.parent.output_token_ids + [candidate.token]
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


class BeamSearchRunner:
    """Engine glue: turns beam groups into scheduler requests and reports into outputs."""

    def __init__(self, scheduler: "Scheduler", tokenizer: "Tokenizer") -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.group_of: dict[str, BeamSearchGroup] = {}  # running beam id -> its group

    def owns(self, request_id: str) -> bool:
        return request_id in self.group_of

    def add(self, request_id: str, new, params: SamplingParams) -> BeamSearchGroup:
        """Start a search: one beam (the prompt) asking for the top-K next-token logprobs."""
        stop_ids = frozenset() if params.ignore_eos else self.tokenizer.stop_token_ids
        beam_params = SamplingParams(temperature=0, max_tokens=new.max_tokens, ignore_eos=True)
        first = Request(
            f"{request_id}#beam0", new.ids, beam_params, new.max_tokens,
            priority=new.priority, cache_salt=new.cache_salt, arrival_time=new.arrival_time,
        )
        group = BeamSearchGroup(request_id, params, stop_ids, new.max_tokens, new.text,
                                new.ids, first.timings)
        beam_params.logprobs = group.num_candidates  # internal: may exceed the user maximum
        group.add_beam(first.request_id, np.float32(0.0))
        self.group_of[first.request_id] = group
        self.scheduler.add_request(first)
        return group

    def step(self, logprobs: dict) -> list[RequestOutput]:
        """Feed this step's top-K reports to their groups; outputs of searches that ended."""
        ready: list[BeamSearchGroup] = []
        for request_id, position in logprobs.items():
            group = self.group_of.get(request_id)
            if group is None:
                continue
            # position lists the chosen token first, then the top-K by logprob
            top = list(zip(position.token_ids[1:], position.logprobs[1:], strict=True))
            if group.report(request_id, top):
                ready.append(group)
        return [out for group in ready if (out := self._advance(group)) is not None]

    def abort(self, group: BeamSearchGroup) -> RequestOutput:
        self._release(group, list(group.beams))
        return self._output(group, aborted=True)

    def _advance(self, group: BeamSearchGroup) -> RequestOutput | None:
        requests = self.scheduler.requests
        parents = [requests[beam_id] for beam_id in group.beams]
        if group.timings.first_token is None:
            group.timings.first_token = time.time()
        continuations = group.advance(requests)
        children = [(self._child(group, c), c.parent) for c in continuations]
        for parent in parents:
            del self.group_of[parent.request_id]
        self.scheduler.fork(parents, children)
        if not group.done:
            return None
        self._release(group, list(group.beams))
        return self._output(group, aborted=False)

    def _child(self, group: BeamSearchGroup, c: Continuation) -> Request:
        parent = c.parent
        child = Request(
            group.new_beam_id(), parent.prompt_token_ids, parent.sampling_params,
            parent.max_tokens, priority=parent.priority, cache_salt=parent.cache_salt,
            arrival_time=parent.arrival_time,
        )
        child.output_token_ids = parent.output_token_ids + [c.token]
        child.all_token_ids = parent.all_token_ids + [c.token]
        child.timings = parent.timings
        group.add_beam(child.request_id, c.score)
        self.group_of[child.request_id] = group
        return child

    def _release(self, group: BeamSearchGroup, beam_ids: list[str]) -> None:
        for beam_id in beam_ids:
            self.group_of.pop(beam_id, None)
            self.scheduler.finish_request(beam_id, RequestStatus.FINISHED_ABORTED)

    def _output(self, group: BeamSearchGroup, aborted: bool) -> RequestOutput:
        timings = group.timings
        timings.finished = time.time()
        skip = group.params.skip_special_tokens
        completions = [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(h.token_ids, skip_special_tokens=skip),
                token_ids=h.token_ids,
                cumulative_logprob=h.cumulative_logprob,
                finish_reason=h.finish_reason,
                stop_reason=h.token_ids[-1] if h.finish_reason == "stop" else None,
            )
            for i, h in enumerate(group.best(group.params.n))
        ]
        if aborted and not completions:
            completions = [CompletionOutput(0, "", [], finish_reason="abort")]
        num_tokens = max((len(c.token_ids) for c in completions), default=0)
        metrics = RequestMetrics(
            timings.arrival, timings.first_scheduled, timings.first_token, timings.finished,
            timings.finished, num_tokens,
        )
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids,
                             completions, True, metrics)
