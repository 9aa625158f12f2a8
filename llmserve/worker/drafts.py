"""What the runner asks of a speculative proposer, after a step's sampling.

Drafts are proposed after the forward, by the runner, not before the schedule: a proposer
that reads the target's hidden states can only work there, and the scheduler stays policy
without tensors. The scheduler says how many drafts each sampling request wants
(`ScheduledRequest.num_drafts`, the speculator's policy); once the step has sampled, the
runner hands the proposer a `DraftSeed` per such request, and the drafts travel back in
`ModelRunnerOutput.draft_token_ids` to be verified in the next step. The proposers
themselves (prompt lookup, a draft model) are in `spec_decode/`, above this layer.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass
class DraftSeed:
    """One request's state once a step has sampled for it."""

    request_id: str
    # prompt and verified output, through the token this step sampled (the drafts follow)
    token_ids: list[int]
    num_drafts: int  # at most this many drafts (fewer, or none, where there is no guess)
    # for a proposer that reads the target's hidden states (`needs_hidden`): the target's
    # final hidden rows (n, H) of the step's verified positions of this request (with
    # `reads_aux_hidden`, the model's `aux_hidden` rows, (n, A x H)), the
    # chunk's tokens then its accepted drafts; row j gave the token after position j, so
    # the last row of a sampling chunk gave the token this step sampled. Else None.
    hidden: torch.Tensor | None = None
    start_position: int = 0  # the position of hidden[0] (the chunk's first)
    # for a proposer fed every chunk (`feeds_every_chunk`): the request's KV block ids,
    # those after its tokens included (SchedulerConfig.num_lookahead_tokens)
    block_ids: np.ndarray | None = None
    # a proposer that knows how sure it is stops before a draft whose chance of being
    # right falls below this (`ScheduledRequest.draft_min_chance`)
    min_chance: float = 0.0
    # ... and keeps a draft it has made down to this (`ScheduledRequest.draft_keep_chance`)
    keep_chance: float = 0.0


class DraftProposer(Protocol):
    needs_hidden: bool  # the seeds carry the target's hidden rows
    reads_aux_hidden: bool  # those rows are the model's `aux_hidden` (EAGLE-3's taps)
    # every computed chunk is handed over, those that sample nothing too (num_drafts 0)
    feeds_every_chunk: bool

    def propose(self, seeds: Sequence[DraftSeed]) -> list[list[int]]:
        """Drafts for each seed, in order; reads the seeds and changes none of them."""
        ...

    def remove(self, request_id: str) -> None:
        """Forget a request that finished (a draft model's cache of it)."""
        ...
