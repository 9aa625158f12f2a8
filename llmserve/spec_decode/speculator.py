"""The engine's speculation policy: how many drafts each request asks for, and the counts.

Pure policy, no model code: when a step is scheduled, `Speculator.num_drafts` says how
many drafts each sampling request wants after it (`ScheduledRequest.num_drafts`); the
runner's proposer makes them once the step has sampled, and the next step verifies them
(`proposer_stage.py`). The policy:

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
* the prior is the engine's: what this method's drafts have met here lately (accepted
  tokens over accepted tokens and rejections, the evidence fading by EVIDENCE_DECAY a
  round, PRIOR_ACCEPTANCE counting as PRIOR_WEIGHT tokens of it). A new request starts
  from it, so a proposer that is rarely right on the workload (a head trained on other
  text) stops costing new requests their verification and draft steps; once nothing has
  been drafted for a while the evidence has faded back towards PRIOR_ACCEPTANCE and
  requests try again.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmserve.config.engine import SpeculativeConfig
from llmserve.core.request import Request

PRIOR_ACCEPTANCE = 0.7  # the engine's estimate before any evidence
PRIOR_WEIGHT = 8.0  # ... counting as this many draft tokens of evidence
EVIDENCE_DECAY = 0.995  # per request round, the engine's old evidence fades by this
EMA_WEIGHT = 0.3  # weight of the latest round in a request's estimate
PRIOR_DRIFT = 0.05  # per step without drafts, the estimate moves this far to the prior


@dataclass
class StepCosts:
    """What drafts add to a step, per calibrated batch size (the nearest below is used),
    measured at start-up by `cost.measure_step_costs`: `by_batch[b]`, the share of a plain
    step that one draft token per request adds (a straight line through k drafts); and
    where measured, `by_k[b][k - 1]`, the share that k drafts per request add. A step's
    cost does not grow in line with k: the GEMMs stream the weights once for a few rows
    and turn compute-bound past them (on a 2-core Zen 3 the exact path's float32 linears
    take about one row's time up to 12 rows, benchmarks/f32_gemm_rows.py; the default
    path's int4 ones grow from the third row on)."""

    by_batch: dict[int, float]
    by_k: dict[int, tuple[float, ...]] = field(default_factory=dict)
    # where measured, the part of `by_k[b][k - 1]` that verifying the k drafts adds (the
    # rest: the proposer's steps, paid before it knows whether a draft is worth keeping)
    verify_by_k: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def draft_token_cost(self, batch: int) -> float:
        return self.by_batch[_nearest_below(self.by_batch, batch)]

    def extra_cost(self, batch: int, k_max: int) -> list[float]:
        """The share of a plain step that k = 1 .. k_max drafts per request add."""
        nearest = _nearest_below(self.by_batch, batch)
        measured = self.by_k.get(nearest, ())  # larger batches: calibrated in line only
        return [measured[k - 1] if k <= len(measured) else self.by_batch[nearest] * k
                for k in range(1, k_max + 1)]


    def verify_cost(self, batch: int, k: int) -> float:
        """The share of a plain step that verifying k drafts per request adds (where not
        measured apart: all that k drafts add)."""
        nearest = _nearest_below(self.by_batch, batch)
        measured = self.verify_by_k.get(nearest, ())
        return measured[k - 1] if k <= len(measured) else self.extra_cost(batch, k)[-1]


def _nearest_below(table: dict[int, object], batch: int) -> int:
    below = [b for b in table if b <= batch] or [min(table)]
    return max(below)


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
    def __init__(self, config: SpeculativeConfig, costs: StepCosts | None = None) -> None:
        self.config = config
        self.costs = costs or StepCosts({1: 0.0})
        self.stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.draft_seconds = 0.0  # time spent proposing (a draft model's forwards)
        # the engine's evidence: accepted draft tokens, and those plus rejections
        self._accepted = 0.0
        self._trials = 0.0

    @property
    def prior(self) -> float:
        """A new request's acceptance estimate: the method's recent rate here."""
        return (self._accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (self._trials + PRIOR_WEIGHT)

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
        return best_num_drafts(self._acceptance(request), k_max,
                               self.costs.extra_cost(batch_size, k_max))

    def min_chance(self, request: Request, k: int, batch_size: int = 1) -> float:
        """The chance of being right below which `request`'s proposer stops its chain of
        (up to) `k` drafts, for a proposer that knows how sure it is (an EAGLE head): a
        draft right with chance c adds c to the E(k) tokens the round is expected to emit
        and its share d of the round's cost 1 + X (X: what k drafts add, their
        verification rows and proposer steps; d = X / k), so it pays while
        c > E(k) d / (1 + X). Where a row is nearly free (the exact path at batch 1: the
        linears stream the weights once for up to ~8 rows, a head step a few % of a step)
        that is a few hundredths; on the int4 kernels, whose every row costs, about a
        fifth. 0 where k does not adapt (k drafts every round) or is 0."""
        if k <= 0 or not self.config.adaptive:
            return 0.0
        return self._break_even(request, k, batch_size, self.costs.extra_cost(batch_size, k)[-1])

    def keep_chance(self, request: Request, k: int, batch_size: int = 1) -> float:
        """`min_chance` for a draft the proposer has already made: its step is paid, so
        keeping it costs only its verification row (d = V / k, V what verifying k drafts
        adds; on the int4 kernels a head pass is ~0.15-0.25 of a step's 0.3-0.4 for one
        draft, 2-core Zen 3). The proposer keeps drafts down to this, and runs its next
        step while the chain stays at `min_chance`."""
        if k <= 0 or not self.config.adaptive:
            return 0.0
        return self._break_even(request, k, batch_size,
                                self.costs.verify_cost(batch_size, k),
                                self.costs.extra_cost(batch_size, k)[-1])

    def _break_even(self, request: Request, k: int, batch_size: int, paid: float,
                    extra: float | None = None) -> float:
        """c = E(k) d / (1 + X), d = paid / k."""
        extra = paid if extra is None else extra
        a = self._acceptance(request)
        expected = sum(a ** i for i in range(k + 1))
        return min(1.0, expected * (paid / k) / (1 + extra))

    def drafted_nothing(self, request: Request) -> None:
        """A round in which `request` drafted nothing (k was 0, or the proposer had no
        guess): its estimate drifts back towards the prior, so that it tries again later."""
        a = self._acceptance(request)
        request.draft_acceptance = a + PRIOR_DRIFT * (self.prior - a)
        self._accepted *= EVIDENCE_DECAY
        self._trials *= EVIDENCE_DECAY

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
        a = self._acceptance(request)
        request.draft_acceptance = (1 - EMA_WEIGHT) * a + EMA_WEIGHT * observed
        trials = num_accepted + (num_accepted < num_drafts)
        self._accepted = EVIDENCE_DECAY * self._accepted + num_accepted
        self._trials = EVIDENCE_DECAY * self._trials + trials

    def _acceptance(self, request: Request) -> float:
        a = request.draft_acceptance
        return self.prior if a is None else a


def best_num_drafts(acceptance: float, k_max: int, cost: float | Sequence[float]) -> int:
    """The k in [0, k_max] maximising expected tokens per unit of step cost; `cost`: one
    draft token's share of a step (k drafts: k times it), or what k = 1 .. k_max add."""
    extra = [cost * k for k in range(1, k_max + 1)] if isinstance(cost, int | float) \
        else cost
    best_k, best_rate = 0, 1.0  # no drafts: one token per plain step
    for k in range(1, k_max + 1):
        expected = sum(acceptance ** i for i in range(k + 1))  # E(k) = 1 + a + ... + a^k
        rate = expected / (1 + extra[k - 1])
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
