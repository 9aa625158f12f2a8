"""A constraint that starts after a marker in the output: the answer after a reasoning block.

With a reasoning parser, a JSON schema, regex or tool grammar applies to the answer, not to
the thinking before it: every token is allowed until the output's text contains the marker
(`</think>`), the constraint decides from the next token on. Rollback (speculative drafts)
may cross the start.
"""

import torch

from llmserve.structured.backend import GrammarMatcher
from llmserve.tokenizer import Tokenizer

_WINDOW = 16  # tokens decoded to look for the marker (it is a few tokens at most)


class DeferredMatcher(GrammarMatcher):
    def __init__(self, inner: GrammarMatcher, tokenizer: Tokenizer, marker: str) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self.marker = marker
        self.free: list[int] = []  # the tokens before the constraint started
        self.started = False
        self.num_inner = 0  # tokens the constraint has accepted

    def _completes_marker(self, tokens: list[int]) -> bool:
        return self.marker in self.tokenizer.decode(tokens[-_WINDOW:])

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.started:
            self.inner.fill_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)  # every bit set: every token allowed

    def accept_token(self, token_id: int) -> bool:
        if self.started:
            accepted = self.inner.accept_token(token_id)
            self.num_inner += bool(accepted)
            return accepted
        self.free.append(token_id)
        self.started = self._completes_marker(self.free)
        return True

    def num_valid(self, token_ids: list[int]) -> int:
        if self.started:
            return self.inner.num_valid(token_ids)
        free = list(self.free)
        for i, token in enumerate(token_ids):
            free.append(token)
            if self._completes_marker(free):
                return i + 1 + self.inner.num_valid(token_ids[i + 1:])
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        from_inner = min(num_tokens, self.num_inner)
        if from_inner:
            self.inner.rollback(from_inner)
            self.num_inner -= from_inner
        rest = num_tokens - from_inner
        if rest:  # back into the free part: the token that completed the marker goes too
            del self.free[len(self.free) - rest:]
            self.started = False

    @property
    def is_terminated(self) -> bool:
        return self.started and self.inner.is_terminated

    @property
    def error(self) -> str | None:
        return self.inner.error if self.started else None
