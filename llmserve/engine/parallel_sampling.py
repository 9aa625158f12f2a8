"""`n > 1` and `best_of`: one request fanned out into sibling requests sharing its prompt.

Siblings carry the parent's id as their `share_group`, so the KV-cache manager lets them
share the prompt's full blocks (even with prefix caching off); only the last partial block
and the last prompt token are computed per sibling. With `best_of > n`, every sibling
tracks its cumulative logprob and the parent returns the n best once all are done.
"""

from dataclasses import replace

from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams


class ParallelGroup:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self.best_of = params.best_of or params.n
        self.latest: dict[int, CompletionOutput] = {}
        self.last_output: RequestOutput | None = None

    def child_id(self, index: int) -> str:
        return f"{self.request_id}#{index}"

    def child_params(self, index: int) -> SamplingParams:
        """Sibling i samples independently; a seeded parent gives each sibling seed + i."""
        seed = None if self.params.seed is None else self.params.seed + index
        logprobs = self.params.logprobs
        if self.best_of > self.n and logprobs is None:
            logprobs = 0  # ranking needs each sibling's cumulative logprob
        return replace(self.params, n=1, best_of=None, seed=seed, logprobs=logprobs)

    def update(self, index: int, output: RequestOutput) -> RequestOutput | None:
        """Take sibling `index`'s latest output; return the parent's output to emit, if any.

        With best_of > n nothing is emitted before all siblings finish (the best n are not
        known until then), as with OpenAI, which forbids streaming with best_of.
        """
        completion = output.outputs[0]
        completion.index = index
        self.latest[index] = completion
        self.last_output = output
        finished = self.finished
        if self.best_of > self.n and not finished:
            return None
        return self._output(finished)

    @property
    def finished(self) -> bool:
        return len(self.latest) == self.best_of and all(c.finished for c in self.latest.values())

    def _output(self, finished: bool) -> RequestOutput:
        completions = [self.latest[i] for i in sorted(self.latest)]
        if self.best_of > self.n:
            completions.sort(key=lambda c: c.cumulative_logprob, reverse=True)
            completions = completions[: self.n]
            for i, c in enumerate(completions):
                c.index = i
                if self.params.logprobs is None:
                    c.logprobs = None
        last = self.last_output
        return RequestOutput(
            self.request_id, last.prompt, last.prompt_token_ids, completions, finished,
            last.metrics, last.num_cached_tokens, prompt_logprobs=last.prompt_logprobs,
        )
