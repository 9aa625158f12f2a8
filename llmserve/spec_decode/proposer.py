"""Proposers: where draft tokens come from, behind one small interface."""

from collections.abc import Sequence

from llmserve.core.request import Request
from llmserve.spec_decode import ngram


class Proposer:
    """Proposes draft tokens to follow each request's verified tokens.

    `propose` reads `request.all_token_ids` (prompt and verified output) and does not
    change the request; a proposer that keeps per-request state (a draft model's KV
    cache) drops it in `remove`.
    """

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        """Up to `num_drafts[i]` drafts for `requests[i]` (fewer, or none, where it has no
        good guess)."""
        raise NotImplementedError

    def remove(self, request_id: str) -> None:
        """Forget a request that finished or was preempted."""


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from `max_n` down to `min_n`). Costs no model call."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[list[int]]:
        return [ngram.propose(r.all_token_ids, k, self.min_n, self.max_n) if k > 0 else []
                for r, k in zip(requests, num_drafts, strict=True)]
