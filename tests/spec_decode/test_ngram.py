"""Prompt lookup: the latest earlier occurrence of the longest recurring suffix."""

import pytest

from llmserve.spec_decode.ngram import propose


def test_copies_what_followed_the_latest_match():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], k=3) == [4, 5, 1]
    # two earlier occurrences of (1, 2): the latest one's continuation
    assert propose([1, 2, 7, 1, 2, 8, 1, 2], k=2) == [8, 1]


def test_longest_suffix_first():
    # (3, 1, 2) recurs once (then 9); (1, 2) alone recurs later (then 5)
    seq = [3, 1, 2, 9, 1, 2, 5, 3, 1, 2]
    assert propose(seq, k=1, max_n=3) == [9]
    assert propose(seq, k=1, max_n=2) == [5]


def test_nothing_recurs_or_too_short():
    assert propose([1, 2, 3, 4], k=3) == []
    assert propose([1], k=3) == []
    assert propose([5, 1, 2, 9, 1, 2], k=4, min_n=3) == []


def test_draft_stops_at_the_end_of_the_sequence():
    assert propose([7, 7, 7, 7], k=3) == [7]


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_n"):
        propose([1, 2], k=0)
    with pytest.raises(ValueError, match="min_n"):
        propose([1, 2], k=2, min_n=3, max_n=2)
