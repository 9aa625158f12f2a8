"""The serving-benchmark statistics on hand-made timelines."""

import math

import numpy as np
import pytest

from llmserve.bench.stats import (
    SLO,
    RequestRecord,
    distribution_ms,
    inter_token_latencies,
    percentile,
    summarize,
)


def record(start: float, chunks: list[float], end: float, output_len: int | None = None,
           prompt_len: int = 10, success: bool = True) -> RequestRecord:
    return RequestRecord(prompt_len=prompt_len, start=start, chunk_times=chunks, end=end,
                         output_len=len(chunks) if output_len is None else output_len,
                         success=success)


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_edges():
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 101)


def test_itl_is_gaps_between_chunks():
    assert inter_token_latencies([1.0, 1.1, 1.35, 1.4]) == pytest.approx([0.1, 0.25, 0.05])
    assert inter_token_latencies([1.0]) == []


def test_request_timeline():
    # sent at 10.0, tokens at 10.5, 10.6, 10.8, stream closed at 10.8
    r = record(10.0, [10.5, 10.6, 10.8], 10.8)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(0.8)
    assert r.itl == pytest.approx([0.1, 0.2])
    assert r.tpot == pytest.approx(0.15)  # (0.8 - 0.5) / (3 - 1)


def test_tpot_counts_tokens_not_chunks():
    # two chunks carrying five tokens: TPOT spreads over the tokens, ITL over the chunks
    r = record(0.0, [1.0, 2.0], 2.0, output_len=5)
    assert r.tpot == pytest.approx(0.25)
    assert r.itl == pytest.approx([1.0])


def test_single_token_has_no_tpot():
    assert record(0.0, [0.3], 0.3).tpot is None


def test_summarize_throughputs_and_distributions():
    records = [record(0.0, [1.0, 1.5, 2.0], 2.0), record(0.0, [2.0, 2.5, 3.0], 3.0),
               record(0.0, [], 0.5, success=False)]
    m = summarize(records, duration_s=4.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(1.5)
    assert m["total_token_throughput"] == pytest.approx(6.5)
    assert m["mean_ttft_ms"] == pytest.approx(1500)
    assert m["p50_ttft_ms"] == pytest.approx(1500)
    assert m["p99_ttft_ms"] == pytest.approx(1990)
    assert m["mean_itl_ms"] == pytest.approx(500)
    assert m["mean_tpot_ms"] == pytest.approx(500)
    assert m["p90_e2el_ms"] == pytest.approx(2900)
    assert m["goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    fast = record(0.0, [0.1, 0.2, 0.3], 0.3)       # TTFT 0.1, TPOT 0.1
    slow_start = record(0.0, [2.0, 2.1], 2.1)      # TTFT 2.0
    slow_decode = record(0.0, [0.1, 1.1], 1.1)     # TPOT 1.0
    failed = record(0.0, [0.1], 0.1, success=False)
    records = [fast, slow_start, slow_decode, failed]
    assert summarize(records, 2.0, SLO(ttft_s=0.5))["goodput"] == pytest.approx(1.0)
    assert summarize(records, 2.0, SLO(tpot_s=0.5))["goodput"] == pytest.approx(1.0)
    assert summarize(records, 2.0, SLO(0.5, 0.5))["goodput"] == pytest.approx(0.5)
    assert summarize(records, 2.0, SLO(5.0, 5.0))["goodput"] == pytest.approx(1.5)


def test_short_outputs_are_counted():
    short = record(0.0, [0.1, 0.2], 0.2)
    short.expected_output_len = 4
    exact = record(0.0, [0.1, 0.2], 0.2)
    exact.expected_output_len = 2
    assert summarize([short, exact], 1.0)["short_outputs"] == 1


def test_no_successes_gives_nan_latencies():
    m = summarize([record(0.0, [], 1.0, success=False)], 1.0)
    assert m["completed"] == 0 and math.isnan(m["mean_ttft_ms"])
    assert set(distribution_ms([])) == {"mean", "p50", "p90", "p99"}


def test_duration_must_be_positive():
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], 0.0)
