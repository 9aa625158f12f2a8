"""RequestMetrics: a request of several sequences merged into one timeline."""

import pytest

from llmserve.outputs import RequestMetrics


def test_merge_spans_the_sequences_and_averages_tpot_over_them():
    a = RequestMetrics(10.0, 11.0, 12.0, 14.0, 14.5, 5, num_preemptions=1,
                       num_preempted_tokens=7)
    b = RequestMetrics(10.0, 11.5, 12.5, 13.5, 13.6, 3, num_draft_tokens=4,
                       num_accepted_tokens=2)
    merged = RequestMetrics.merge([a, b])
    assert (merged.arrival_time, merged.first_scheduled_time, merged.first_token_time,
            merged.last_token_time, merged.finished_time) == (10.0, 11.0, 12.0, 14.0, 14.5)
    assert merged.num_generated_tokens == 8
    assert (merged.num_preemptions, merged.num_preempted_tokens) == (1, 7)
    assert (merged.num_draft_tokens, merged.num_accepted_tokens) == (4, 2)
    # (2.0 s over 4 gaps + 1.0 s over 2 gaps) / 6 gaps, not (14 - 12) / 7
    assert merged.time_per_output_token == pytest.approx(3.0 / 6)
    assert merged.time_to_first_token == 2.0 and merged.e2e_latency == 4.5
    # merging merged metrics flattens them; one sequence merges into itself
    assert RequestMetrics.merge([merged]).sequences == (a, b)
    assert RequestMetrics.merge([a]) is a


def test_a_merge_is_unfinished_while_a_sequence_runs():
    done = RequestMetrics(1.0, 1.0, 2.0, 3.0, 3.0, 2)
    running = RequestMetrics(1.0, 1.0, None, None, None, 0)
    merged = RequestMetrics.merge([done, running])
    assert merged.finished_time is None and merged.first_token_time == 2.0
    assert merged.time_per_output_token == pytest.approx(1.0)
