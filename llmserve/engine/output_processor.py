"""From the scheduler's updates to the caller's outputs: detokenize, stop strings, logprobs.

One `RequestState` per engine request (`states`), and one parent per caller's request that
fanned out (`parents`: an n > 1 / best_of `ParallelGroup`, or a `BeamSearch`), by the
caller's id. For each request that progressed in a step, `process` takes its new tokens in
order (grammar, logprobs, detokenizer, stop strings) and builds its output as its
`output_kind` asks; a child's output goes to its parent, which answers for the caller.
"""

import logging

from llmserve.core.outputs import RequestUpdate
from llmserve.core.request import Request, RequestStatus
from llmserve.core.scheduler import Scheduler
from llmserve.engine.beam_search import BeamSearch
from llmserve.engine.parallel_sampling import ParallelGroup
from llmserve.engine.request_state import LogprobsDecoder, RequestState
from llmserve.outputs import PoolingRequestOutput, RequestOutput
from llmserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Parent = ParallelGroup | BeamSearch


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler) -> None:
        self.scheduler = scheduler  # to end a request at a stop string
        self.logprobs_decoder = LogprobsDecoder(tokenizer)
        self.states: dict[str, RequestState] = {}  # by engine request id
        self.parents: dict[str, Parent] = {}  # by the caller's request id
        # the latest step's requests whose constraint failed while generating (its parser
        # budget spent): caller's request id -> why, naming the field; the caller gets that
        # error instead of text that breaks the constraint
        self.failures: dict[str, str] = {}

    def has_unfinished(self) -> bool:
        return bool(self.states or self.parents)

    def in_use(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.parents

    def add(self, state: RequestState) -> None:
        self.states[state.request.request_id] = state

    def caller_of(self, request_id: str) -> str:
        """The caller's request id behind an engine request id (a sibling of n > 1 or a
        beam belongs to its caller's request)."""
        state = self.states.get(request_id)
        return state.parent.request_id if state is not None and state.parent else request_id

    def engine_ids(self, request_id: str) -> list[str]:
        """The engine requests behind a caller's request id (its live children)."""
        parent = self.parents.get(request_id)
        return parent.live_child_ids() if parent is not None else [request_id]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a caller's request; its final output. The scheduler already freed it."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for child_id in parent.live_child_ids():
                state = self.states.pop(child_id, None)
                if state is not None:
                    parent.add(state.index, state.output())
            return parent.abort_output()
        state = self.states.pop(request_id, None)
        return None if state is None else state.output()

    def process(self, updates: list[RequestUpdate]
                ) -> list[RequestOutput | PoolingRequestOutput]:
        """The outputs (per `output_kind`) of the step's requests that got tokens, one per
        caller's request id."""
        outputs: list[RequestOutput] = []
        touched: dict[str, Parent] = {}  # parents with a child output this step
        self.failures = {}
        for update in updates:
            state = self.states.get(update.request.request_id)
            if state is None:
                continue
            if update.pooled is not None:  # a pooling request: its one output
                del self.states[update.request.request_id]
                outputs.append(state.pooling_output(update.pooled))
                continue
            if update.prompt_logprobs is not None and state.prompt_logprobs is not None:
                first, positions = update.prompt_logprobs
                state.set_prompt_logprobs(
                    first, [self.logprobs_decoder.entries(p) for p in positions])
            if not update.new_tokens:
                continue
            output = self._process(state, update.logprobs or [])
            if output is None:
                continue
            if state.parent is None:
                outputs.append(output)
            else:
                state.parent.add(state.index, output, update.logprobs)
                touched[state.parent.request_id] = state.parent
        for parent in touched.values():
            output = parent.output()
            if output is not None:
                outputs.append(output)
                if output.finished:
                    del self.parents[parent.request_id]
        return outputs

    def _process(self, state: RequestState, positions: list) -> RequestOutput | None:
        """Take the request's new tokens in order, and build its output. Tokens after one
        that ends the request (a stop string, a complete grammar) are dropped: they were
        verified drafts past the end."""
        request = state.request
        new = request.output_token_ids[state.num_processed_tokens:]
        stop = None
        # the scheduler ends a request (eos, length) only at its last new token
        ended_at_last = request.status.finished
        for i, token in enumerate(new):
            state.num_processed_tokens += 1
            grammar_ok = request.grammar is None or self._advance_grammar(request, token)
            if i < len(positions):
                state.add_logprobs(self.logprobs_decoder.entries(positions[i]),
                                   positions[i].logprobs[0])
            stop = state.detokenizer.append(token)
            if not grammar_ok or (ended_at_last and i == len(new) - 1):
                break
            if stop is not None:
                self._end_early(request, stop)
                break
            if request.grammar is not None and request.grammar.is_terminated:
                self._end_early(request, None)  # the constraint is complete
                break
        if state.num_processed_tokens < request.num_output_tokens:
            request.truncate_output(state.num_processed_tokens)
        if request.status.finished:
            if stop is None:
                state.detokenizer.flush()
            del self.states[request.request_id]
        return state.output()

    def _end_early(self, request: Request, stop_reason: str | None) -> None:
        """Stop a request at the token just processed (a stop string, a complete grammar),
        even if the scheduler ended it at a later one of this step's tokens."""
        request.stop_reason = stop_reason
        if request.status.finished:  # already freed: only the reason changes
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _advance_grammar(self, request: Request, token: int) -> bool:
        """Feed a new token to the request's matcher; False if it refused the token and
        the request was ended (a complete grammar ends the request in `_process`, after
        stop strings have had their say)."""
        if request.grammar.accept_token(token):
            return True
        # the mask allowed only valid tokens, so the parser spent its budget (a constraint
        # too complex to follow) or failed: end the request rather than return text that
        # breaks the constraint
        error = request.grammar.error or "the parser refused a token its mask allowed"
        kind = request.sampling_params.structured_outputs.kind
        self.failures[self.caller_of(request.request_id)] = (
            f"structured_outputs.{kind} could not be followed while generating: {error}")
        logger.warning("request %s: constraint failed at output token %d (%s); ending it",
                       request.request_id, request.num_output_tokens, error)
        if not request.status.finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
        return False
