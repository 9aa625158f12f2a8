"""The proposer stage: speculative decoding attached at the scheduler's edges (`StepStage`).

Before a step is scheduled it asks the `Speculator` for drafts for the decoding requests
and sets them as `Request.spec_token_ids` (the scheduler sends them after each request's
last token, within the budget, and the runner verifies them in the same forward); after
the step it counts what was accepted. None when the batch is too large for speculation to
pay, nor for a request whose grammar is complete.
"""

from llmserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmserve.core.request import Request
from llmserve.core.stage import StepStage
from llmserve.spec_decode.speculator import Speculator


class ProposerStage(StepStage):
    def __init__(self, speculator: Speculator, max_model_len: int) -> None:
        self.speculator = speculator
        self.max_model_len = max_model_len

    def before_schedule(self, running: list[Request], finished_ids: set[str]) -> None:
        for request_id in finished_ids:
            self.speculator.remove(request_id)
        if not self.speculator.enabled_for(len(running)):
            return
        requests, rooms = [], []
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1:
                continue  # a prompt still prefilling
            if request.grammar is not None and request.grammar.is_terminated:
                continue
            # emitted tokens (drafts + 1) within max_tokens; draft KV within the context
            room = min(request.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens)
            requests.append(request)
            rooms.append(room)
        if not requests:
            return
        proposed = self.speculator.propose(requests, rooms, len(running))
        for request, drafts in zip(requests, proposed, strict=True):
            grammar = request.grammar
            if drafts and grammar is not None:  # drafts the grammar refuses would be rejected
                drafts = drafts[: grammar.num_valid(drafts)]
            request.spec_token_ids = drafts

    def after_update(self, out: SchedulerOutput, result: ModelRunnerOutput,
                     requests: list[Request | None]) -> None:
        for s, tokens, request in zip(out.scheduled, result.sampled_token_ids, requests,
                                      strict=True):
            if s.spec_token_ids and tokens and request is not None:
                self.speculator.record(request, len(s.spec_token_ids), len(tokens) - 1)
