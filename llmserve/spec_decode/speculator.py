"""The engine's speculation policy: who drafts, how many tokens, and the running counts.

Before each step the engine asks `Speculator.propose` for drafts for its decoding
requests; the scheduler sends them with the request's last token and the runner verifies
them in the same forward (`worker/model_runner.py`). The policy:

* off for the whole step once `disable_by_batch_size` requests run: a large batch is
  compute-bound, so every draft token costs about what a decoded token costs, and the
  rejected ones are lost;
* adaptive k: each request keeps a moving estimate a of its acceptance rate (on the
  request: `Request.draft_acceptance`); with independent acceptances a round of k
  drafts emits E(k) = (1 - a^(k+1)) / (1 - a)
  tokens at a cost of 1 + c k plain steps (c: one draft token's share of a step at the
  current batch size, measured at start-up, `cost.py`), and k is the one that maximises
  E(k) / (1 + c k). A request whose rate falls too low stops drafting; its estimate
  drifts back towards the prior so that it tries again later. As the batch grows c grows
  (the step turns compute-bound), and k falls to 0 by itself.
"""

import time
from dataclasses import dataclass, field

from llmserve.config.engine import SpeculativeConfig
from llmserve.core.request import Request
from llmserve.spec_decode.cost import StepCosts
from llmserve.spec_decode.proposer import NgramProposer, Proposer

PRIOR_ACCEPTANCE = 0.7  # a new request's estimate
EMA_WEIGHT = 0.3  # weight of the latest round in the estimate
PRIOR_DRIFT = 0.05  # per step without drafts, the estimate moves this far to the prior


@dataclass
class SpecDecodeStats:
    """Running totals since the engine started (Prometheus counters derive from them)."""

    num_drafts: int = 0  # verification rounds with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted tokens by draft position: accepted_per_position[j] rounds kept draft j
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per round with drafts: the accepted ones plus the target's."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 costs: StepCosts | None = None) -> None:
        self.config = config
        self.proposer = proposer
        self.costs = costs or StepCosts({1: 0.0})
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.draft_seconds = 0.0  # time spent proposing (a draft model's forwards)

    @classmethod
    def build(cls, config: SpeculativeConfig, draft: "Proposer | None" = None,
              costs: StepCosts | None = None) -> "Speculator":
        if config.method == "ngram":
            draft = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        return cls(config, draft, costs)

    def enabled_for(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def num_drafts(self, request: Request, room: int, batch_size: int = 1) -> int:
        """How many drafts to ask for `request` (at most `room`) in a step of
        `batch_size` requests."""
        k_max = min(self.config.num_speculative_tokens, room)
        if k_max <= 0:
            return 0
        if not self.config.adaptive:
            return k_max
        return best_num_drafts(_acceptance(request), k_max, self.costs.draft_token_cost(batch_size))

    def propose(self, requests: list[Request], rooms: list[int],
                batch_size: int = 1) -> list[list[int]]:
        """Drafts for each of `requests` (decoding, not finished) in a step of
        `batch_size` requests; `rooms[i]`: the most drafts request i can use (its
        max_tokens and the context leave room for)."""
        ks = [self.num_drafts(r, room, batch_size)
              for r, room in zip(requests, rooms, strict=True)]
        asked = [(r, k) for r, k in zip(requests, ks, strict=True) if k > 0]
        drafts: dict[str, list[int]] = {}
        if asked:
            start = time.perf_counter()
            proposed = self.proposer.propose([r for r, _ in asked], [k for _, k in asked])
            self.draft_seconds += time.perf_counter() - start
            drafts = {r.request_id: d for (r, _), d in zip(asked, proposed, strict=True)}
        for r in requests:
            if not drafts.get(r.request_id):  # no round: drift back towards trying again
                a = _acceptance(r)
                r.draft_acceptance = a + PRIOR_DRIFT * (PRIOR_ACCEPTANCE - a)
        return [drafts.get(r.request_id, []) for r in requests]

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """One verification round's outcome (the estimate lives on the request)."""
        if num_drafts == 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            stats.accepted_per_position[j] += 1
        # the fraction accepted, counting a round cut short by a rejection as evidence
        # for the rate (a^n (1 - a) is the chance of n acceptances then a rejection)
        observed = num_accepted / num_drafts if num_accepted == num_drafts else \
            num_accepted / (num_accepted + 1)
        a = _acceptance(request)
        request.draft_acceptance = (1 - EMA_WEIGHT) * a + EMA_WEIGHT * observed

    def remove(self, request_id: str) -> None:
        """Forget a finished request (a draft model's cache of it)."""
        self.proposer.remove(request_id)


def _acceptance(request: Request) -> float:
    a = request.draft_acceptance
    return PRIOR_ACCEPTANCE if a is None else a


def best_num_drafts(acceptance: float, k_max: int, cost: float) -> int:
    """The k in [0, k_max] maximising expected tokens per unit of step cost."""
    best_k, best_rate = 0, 1.0  # no drafts: one token per plain step
    for k in range(1, k_max + 1):
        expected = sum(acceptance ** i for i in range(k + 1))  # E(k) = 1 + a + ... + a^k
        rate = expected / (1 + cost * k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
