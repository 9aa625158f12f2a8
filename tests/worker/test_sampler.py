"""Batched sampler on hand-made logits: each parameter changes the distribution as defined."""

import math

import pytest
import torch

from llmserve.sampling_params import SamplingParams
from llmserve.worker.sampler import (
    NUCLEUS_CANDIDATES,
    SamplingBatch,
    _sorted_top_k_top_p,
    apply_min_p,
    apply_top_k_top_p,
    draw,
    sample,
)


def batch(*params: SamplingParams, generators=None) -> SamplingBatch:
    return SamplingBatch.build(list(params), generators or [None] * len(params))


LOGITS = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))  # probs, in a shuffled order


def kept(masked: torch.Tensor) -> set[int]:
    return set(torch.nonzero(masked[0] > float("-inf")).flatten().tolist())


def test_greedy_is_argmax():
    logits = torch.randn(8, 100)
    assert torch.equal(sample(logits, batch(*[SamplingParams(temperature=0)] * 8)),
                       logits.argmax(-1))


def test_top_k_one_is_greedy():
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=1.3, top_k=1)] * 8
    assert torch.equal(sample(logits, batch(*params)), logits.argmax(-1))


def test_top_k_keeps_k_most_likely():
    masked = apply_top_k_top_p(LOGITS, torch.tensor([2]), torch.tensor([1.0]))
    assert kept(masked) == {1, 3}


def test_top_p_keeps_smallest_set_reaching_p():
    # sorted probs 0.4, 0.3, 0.15, 0.1, 0.05: mass 0.4 < 0.6, 0.7 >= 0.6 -> {1, 3}
    assert kept(apply_top_k_top_p(LOGITS, torch.tensor([0]), torch.tensor([0.6]))) == {1, 3}
    # exactly reaching p keeps no more: 0.4 + 0.3 = 0.7
    assert kept(apply_top_k_top_p(LOGITS, torch.tensor([0]), torch.tensor([0.7]))) == {1, 3}
    assert kept(apply_top_k_top_p(LOGITS, torch.tensor([0]), torch.tensor([0.71]))) == {1, 3, 4}
    # a tiny p still keeps the most likely token
    assert kept(apply_top_k_top_p(LOGITS, torch.tensor([0]), torch.tensor([0.01]))) == {1}


def test_min_p_drops_tokens_below_fraction_of_max():
    # max prob 0.4; min_p 0.3 -> threshold 0.12 keeps 0.4, 0.3, 0.15
    assert kept(apply_min_p(LOGITS, torch.tensor([0.3]))) == {1, 3, 4}


def test_rows_use_their_own_parameters():
    logits = LOGITS.repeat(3, 1)
    masked = apply_top_k_top_p(logits, torch.tensor([1, 0, 3]), torch.tensor([1.0, 0.6, 1.0]))
    assert [set(torch.nonzero(r > float("-inf")).flatten().tolist()) for r in masked] == [
        {1}, {1, 3}, {1, 3, 4}]


def test_seeded_rows_are_reproducible_whatever_the_batch():
    logits = torch.randn(1, 1000)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draw(n_others: int) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        others = [SamplingParams(temperature=1.0)] * n_others
        rows = logits.repeat(1 + n_others, 1)
        out = []
        for _ in range(5):
            out.append(sample(rows, batch(seeded, *others,
                                          generators=[gen] + [None] * n_others))[0].item())
        return out

    assert draw(0) == draw(7)


def test_temperature_sampling_matches_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(20000, 1)
    params = [SamplingParams(temperature=1.0)] * 20000
    counts = torch.bincount(sample(logits, batch(*params)), minlength=3).float()
    expected = probs * 20000
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 13.8  # p = 0.001 for 2 degrees of freedom
    assert math.isclose(counts.sum().item(), 20000)


@pytest.mark.parametrize("shape", [(1, 7), (3, 16), (5, 49152), (32, 1000)])
def test_argmax_equals_torch_first_index_and_nan_rows(shape, kernel_level):
    """The native argmax gives torch's indices: the first of equal values, NaN rows too."""
    from llmserve.worker.sampler import argmax

    torch.manual_seed(shape[1])
    logits = torch.randn(*shape)
    logits[0, shape[1] // 2] = logits[0, -1] = logits[0].max() + 1  # a tie: first wins
    if shape[0] > 2:
        logits[1] = float("-inf")  # all equal
        logits[2, 3] = float("nan")
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))


def test_the_nucleus_found_among_candidates_is_the_full_sorts():
    """A vocabulary larger than the candidates: peaked rows decided among them, flat rows
    (their nucleus reaches past them) and a top-k past them sorted whole; each row as the
    full sort masks it, and as it is alone."""
    vocab = 4 * NUCLEUS_CANDIDATES
    g = torch.Generator().manual_seed(5)
    scale = torch.tensor([8.0, 8.0, 0.05, 8.0, 0.05, 3.0, 8.0, 1.0])[:, None]
    logits = torch.randn(8, vocab, generator=g) * scale
    top_k = torch.tensor([0, 40, 0, 2 * NUCLEUS_CANDIDATES, 0, 0, 0, 7])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 0.99, 0.3, 0.8])
    got = apply_top_k_top_p(logits, top_k, top_p)
    want = _sorted_top_k_top_p(logits, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], want[~torch.isinf(want)])
    kept_per_row = (~torch.isinf(got)).sum(-1)
    assert kept_per_row[2] > NUCLEUS_CANDIDATES and kept_per_row[1] == 40
    assert kept_per_row[7] <= 7 and kept_per_row[6] < 10
    for row in range(8):
        alone = apply_top_k_top_p(logits[row:row + 1], top_k[row:row + 1], top_p[row:row + 1])
        assert torch.equal(alone[0], got[row]), row


def test_a_draw_follows_the_distribution_and_its_seed():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3]] * 20000) * 3  # need not sum to 1
    counts = torch.bincount(draw(probs, [None] * len(probs)), minlength=5).float()
    assert counts[0] == counts[2] == 0
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3]),
                          atol=0.015)
    one = [torch.Generator().manual_seed(9) for _ in range(3)]
    two = [torch.Generator().manual_seed(9) for _ in range(3)]
    assert torch.equal(draw(probs[:3], one), draw(probs[:3], two))
    assert one[0].get_state().equal(two[0].get_state())
