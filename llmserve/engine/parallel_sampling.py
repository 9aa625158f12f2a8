"""`n > 1` and `best_of`: one request fanned out into sibling requests sharing its prompt.

Siblings carry the parent's id as their `share_group`, so the KV-cache manager lets them
share the prompt's full blocks (even with prefix caching off); only the last partial block
and the last prompt token are computed per sibling. With `best_of > n`, every sibling
tracks its cumulative logprob and the parent returns the n best once all are done.

Each step the engine `add`s the outputs of the siblings that progressed, then asks the
group for the parent's `output()`. Siblings produce outputs of the parent's kind, so a
DELTA parent's output holds the deltas of this step's siblings, each under its choice
index; a CUMULATIVE one the latest snapshot of every sibling; a FINAL_ONLY one (and any
best_of > n, whose best are not known before the end) every sibling's full output, once.
"""

from dataclasses import replace

from llmserve.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams


class ParallelGroup:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.best_of = params.best_of or params.n
        self.output_kind = params.output_kind
        if self.best_of > self.n:
            self.output_kind = RequestOutputKind.FINAL_ONLY
        # DELTA: this step's sibling deltas; otherwise each sibling's latest full output
        self.completions: dict[int, CompletionOutput] = {}
        self.num_finished = 0
        self.last_output: RequestOutput | None = None
        self.metrics: dict[int, RequestMetrics] = {}  # each sibling's latest
        self.prompt_logprobs: PromptLogprobs | None = None  # the first sibling's
        self._prompt_logprobs_sent = False  # DELTA: they go out once

    def child_id(self, index: int) -> str:
        return f"{self.request_id}#{index}"

    def child_params(self, index: int) -> SamplingParams:
        """Sibling i samples independently; a seeded parent gives each sibling seed + i."""
        seed = None if self.params.seed is None else self.params.seed + index
        logprobs = self.params.logprobs
        if self.best_of > self.n and logprobs is None:
            logprobs = 0  # ranking needs each sibling's cumulative logprob
        return replace(self.params, n=1, best_of=None, seed=seed, logprobs=logprobs,
                       output_kind=self.output_kind)

    def live_child_ids(self) -> list[str]:
        """The siblings' engine request ids (those that finished are no longer known)."""
        return [self.child_id(i) for i in range(self.best_of)]

    def add(self, index: int, output: RequestOutput, logprobs: list | None = None) -> None:
        """Take sibling `index`'s output of this step (its completion's index is `index`;
        the raw `logprobs` are a beam search's business, not a group's)."""
        completion = output.outputs[0]
        self.completions[index] = completion
        if completion.finished:
            self.num_finished += 1
        self.last_output = output
        if output.metrics is not None:
            self.metrics[index] = output.metrics
        if output.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            self.prompt_logprobs = output.prompt_logprobs

    @property
    def finished(self) -> bool:
        return self.num_finished == self.best_of

    def output(self) -> RequestOutput | None:
        """The parent's output after this step's `add`s; None when there is nothing to emit.

        With best_of > n nothing is emitted before all siblings finish (the best n are not
        known until then), as with OpenAI, which forbids streaming with best_of.
        """
        finished = self.finished
        if self.last_output is None or (
            self.output_kind is RequestOutputKind.FINAL_ONLY and not finished
        ):
            return None
        completions = [self.completions[i] for i in sorted(self.completions)]
        if self.output_kind is RequestOutputKind.DELTA:
            self.completions = {}
        if self.best_of > self.n:
            completions = self._best(completions)
        last = self.last_output
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind is RequestOutputKind.DELTA and prompt_logprobs is not None:
            self.prompt_logprobs, self._prompt_logprobs_sent = None, True
        return RequestOutput(
            self.request_id, last.prompt, last.prompt_token_ids, completions, finished,
            self._metrics(), last.num_cached_tokens, prompt_logprobs=prompt_logprobs,
        )

    def abort_output(self) -> RequestOutput | None:
        """The output after an abort (its siblings' aborted outputs were added)."""
        return self.output()

    def _metrics(self) -> RequestMetrics | None:
        """The request's metrics: its siblings' merged (those that have run so far)."""
        if not self.metrics:
            return None
        return RequestMetrics.merge([self.metrics[i] for i in sorted(self.metrics)])

    def _best(self, completions: list[CompletionOutput]) -> list[CompletionOutput]:
        completions = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)
        completions = completions[: self.n]
        for i, c in enumerate(completions):
            c.index = i
            if self.params.logprobs is None:
                c.logprobs = None
        return completions
