"""Proposers: where draft tokens come from, behind one small interface.

The runner calls a proposer after a step's sampling (`worker/drafts.py`), with a
`DraftSeed` per request that asks for drafts: its verified tokens, the step's new ones
included.
"""

from collections.abc import Sequence

from llmserve.spec_decode import ngram
from llmserve.worker.drafts import DraftSeed


class Proposer:
    """Proposes draft tokens to follow each request's verified tokens (the runner's
    `DraftProposer`). `propose` reads the seeds and changes none of them; a proposer that
    keeps per-request state (a draft model's KV cache) drops it in `remove`."""

    needs_hidden = False  # True: the seeds bring the target's hidden rows (heads)
    feeds_every_chunk = False  # True: every computed chunk comes as a seed (EAGLE)
    # True: the hidden rows are the target's `aux_hidden` (EAGLE-3: the residual stream
    # entering its `aux_layers`, side by side), not its final ones
    reads_aux_hidden = False

    def propose(self, seeds: Sequence[DraftSeed]) -> list[list[int]]:
        """Up to `seeds[i].num_drafts` drafts for seed i (fewer, or none, where it has no
        good guess)."""
        raise NotImplementedError

    def remove(self, request_id: str) -> None:
        """Forget a request that finished."""

    def step_seconds(self, batch: int, repeats: int = 5) -> float:
        """Seconds one drafting step costs at `batch` sequences, best of `repeats`
        (start-up calibration, `cost.py`); a proposer that runs no model costs nothing."""
        return 0.0

    def chain_step_seconds(self, batch: int) -> float:
        """Seconds each draft after a chain's first costs at `batch` sequences (an EAGLE
        head's native chain: less than its first pass); by default a step's."""
        return self.step_seconds(batch)


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from `max_n` down to `min_n`). Costs no model call."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seeds: Sequence[DraftSeed]) -> list[list[int]]:
        return [ngram.propose(s.token_ids, s.num_drafts, self.min_n, self.max_n)
                if s.num_drafts > 0 else [] for s in seeds]
