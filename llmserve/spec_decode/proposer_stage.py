"""The proposer stage: speculative decoding's policy at the scheduler's edges (`StepStage`).

It runs no model code; the drafts are made by the runner after each step's sampling:

    after_schedule    each sampling request's number of drafts to propose after the step
                      (`ScheduledRequest.num_drafts`, the `Speculator`'s policy; none when
                      the batch is too large for speculation to pay, nor for a request
                      whose grammar is complete)
    ... the forward, the sampling, then the runner's proposer: ModelRunnerOutput.draft_token_ids
    after_update      the verified round counted; the new drafts set as the request's
                      `spec_token_ids`
    before_schedule   drafts cut to what the request can still use: its room (max_tokens,
                      the context) and its grammar (which the output processor has advanced
                      by the step's tokens since)

and the scheduler sends a request's drafts after its last token, within the budget, for
the runner to verify in the same forward.
"""

from collections.abc import Mapping

from llmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmserve.core.request import Request
from llmserve.core.stage import StepStage
from llmserve.spec_decode.speculator import Speculator


class ProposerStage(StepStage):
    def __init__(self, speculator: Speculator, max_model_len: int) -> None:
        self.speculator = speculator
        self.max_model_len = max_model_len
        # the requests each step in flight proposes for (by the step's SchedulerOutput: a
        # pipeline keeps several in flight)
        self._asked: dict[int, set[str]] = {}

    def before_schedule(self, running: list[Request], finished_ids: set[str]) -> None:
        for request in running:
            drafts = request.spec_token_ids
            if not drafts:
                continue
            drafts = drafts[: max(0, self._room(request))]
            grammar = request.grammar
            if drafts and grammar is not None:  # drafts the grammar refuses would be rejected
                drafts = [] if grammar.is_terminated else drafts[: grammar.num_valid(drafts)]
            request.spec_token_ids = drafts

    def after_schedule(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        asked = self._asked[id(out)] = set()
        batch_size = len(out.scheduled)
        if not self.speculator.enabled_for(batch_size):
            return
        for s in out.scheduled:
            request = requests.get(s.request_id)
            if not s.sample or request is None or request.pooling_params is not None:
                continue
            if request.grammar is not None and request.grammar.is_terminated:
                continue
            # the room once this step has emitted one token (if it emits more, the excess
            # drafts are cut before they are sent)
            s.num_drafts = self.speculator.num_drafts(request, self._room(request) - 1,
                                                      batch_size)
            s.draft_min_chance = self.speculator.min_chance(request, s.num_drafts, batch_size)
            s.draft_keep_chance = self.speculator.keep_chance(request, s.num_drafts,
                                                              batch_size)
            asked.add(s.request_id)

    def after_update(self, out: SchedulerOutput, result: ModelRunnerOutput,
                     requests: list[Request | None]) -> None:
        self.speculator.draft_seconds += result.draft_seconds
        asked = self._asked.pop(id(out), set())
        for i, (s, tokens, request) in enumerate(zip(out.scheduled, result.sampled_token_ids,
                                                     requests, strict=True)):
            if request is None or not tokens:
                continue
            if s.spec_token_ids:
                self.speculator.record(request, len(s.spec_token_ids), len(tokens) - 1)
            if s.request_id not in asked:
                continue
            drafts = result.draft_token_ids[i]
            if not drafts:
                self.speculator.drafted_nothing(request)
            elif not request.status.finished:
                request.spec_token_ids = list(drafts)

    def _room(self, request: Request) -> int:
        """Drafts the request can use after its tokens so far: the tokens a round emits
        (its drafts and one more) within max_tokens, the drafts' KV within the context."""
        return min(request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens)
