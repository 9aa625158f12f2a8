"""The statistics of a serving benchmark, from per-request timelines; pure, no I/O.

One request's timeline (client clock, seconds)::

    start ......... chunk[0] ... chunk[1] ... chunk[k-1] ......... end
    |<--- TTFT --->|<-- ITL -->|<-- ITL -->|
    |<------------------------------ E2E ------------------------------>|

TTFT = chunk[0] - start; ITL = the gaps between consecutive token-bearing chunks;
TPOT = (E2E - TTFT) / (output_len - 1), the mean time per output token after the first
(a chunk may carry several tokens, so TPOT and ITL differ). Goodput counts the requests
that met every SLO given.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request (perf_counter seconds)."""

    prompt_len: int
    expected_output_len: int = 0
    output_len: int = 0
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def itl(self) -> list[float]:
        return inter_token_latencies(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)

    def to_dict(self) -> dict[str, Any]:
        return {"success": self.success, "error": self.error, "prompt_len": self.prompt_len,
                "expected_output_len": self.expected_output_len,
                "output_len": self.output_len, "ttft_s": self.ttft, "tpot_s": self.tpot,
                "e2el_s": self.e2el, "itl_s": self.itl}


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; None means "not constrained"."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.success:
            return False
        if self.ttft_s is not None and (record.ttft is None or record.ttft > self.ttft_s):
            return False
        return self.tpot_s is None or record.tpot is None or record.tpot <= self.tpot_s


def inter_token_latencies(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive chunk arrivals: [t1 - t0, t2 - t1, ...]."""
    return [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values: Sequence[float]) -> dict[str, float]:
    """mean and PERCENTILES (p50 is the median) of `values` (seconds), in milliseconds."""
    if not values:
        return {"mean": math.nan, **{f"p{q}": math.nan for q in PERCENTILES}}
    return {"mean": 1000 * sum(values) / len(values),
            **{f"p{q}": 1000 * percentile(values, q) for q in PERCENTILES}}


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slo: SLO = SLO()) -> dict[str, Any]:
    """The run's metrics: counts, throughputs, latency distributions (ms) and goodput."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "goodput": None,
        # finished, but fewer tokens than asked: the server ignored min_tokens or cut the stream
        "short_outputs": sum(r.output_len < r.expected_output_len for r in ok),
    }
    if slo.given:
        metrics["goodput"] = sum(slo.met_by(r) for r in ok) / duration_s
    samples = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }
    for name in LATENCY_METRICS:
        for stat, value in distribution_ms(samples[name]).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics
