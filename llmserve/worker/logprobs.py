"""Logprobs of chosen tokens and their top-k alternatives, from the raw model distribution.

Raw means log_softmax of the model's logits before any processing (penalties, bias, masks,
temperature, truncation), like vLLM's default `raw_logprobs` mode. A token's rank is 1 +
the number of tokens with a strictly higher logprob.
"""

from dataclasses import dataclass

import torch


@dataclass
class PositionLogprobs:
    """One position: entry 0 is the chosen (sampled or prompt) token, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]

    def truncated(self, k: int) -> "PositionLogprobs":
        """Keep the chosen token and the k most likely alternatives."""
        n = k + 1
        return PositionLogprobs(self.token_ids[:n], self.logprobs[:n], self.ranks[:n])


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, k: int
) -> list[PositionLogprobs]:
    """logprobs: (P, V) raw log-probabilities, chosen: (P,) token ids -> P positions."""
    chosen_lp = logprobs.gather(1, chosen[:, None])  # (P, 1)
    chosen_rank = 1 + (logprobs > chosen_lp).sum(dim=-1, keepdim=True)  # (P, 1)
    top_lp, top_ids = logprobs.topk(k, dim=-1)  # (P, k), sorted descending
    # a token strictly above a top-k member is itself in the top-k, so count within it
    top_rank = 1 + (top_lp[:, None, :] > top_lp[:, :, None]).sum(dim=-1)  # (P, k)
    ids = torch.cat([chosen[:, None], top_ids], dim=1).tolist()
    lps = torch.cat([chosen_lp, top_lp], dim=1).tolist()
    ranks = torch.cat([chosen_rank, top_rank], dim=1).tolist()
    return [PositionLogprobs(i, lp, r) for i, lp, r in zip(ids, lps, ranks, strict=True)]
