"""The verification rule keeps the target's distribution: chi-square tests over 20,000+
draws on handmade target and draft distributions; greedy rows are exact; seeds reproduce."""

import math

import pytest
import torch

from llmserve.worker.rejection_sampler import verify

V, K = 6, 3
DRAWS = 24_000


def chi_square_critical(df: int, z: float = 3.0902) -> float:
    """The chi-square quantile at 1 - 0.001 (Wilson-Hilferty; within 2 % of the exact)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_distributed_as(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=V).double()
    expected = probs.double() * len(tokens)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target gives no probability was emitted"
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    assert chi2 < chi_square_critical(df), (chi2, counts.tolist(), expected.tolist())


@pytest.fixture(autouse=True)
def _seeded_global_generator():
    """Rows without a generator of their own draw from torch's global one: seeded here, so
    that a run's draws do not depend on which tests ran before in this process."""
    torch.manual_seed(1234)


def handmade(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p (K + 1, V) and draft q (K, V), unlike each other, one target zero."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(K + 1, V, generator=gen) ** 2
    p[:, 0] = 0.0
    q = torch.rand(K, V, generator=gen)
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def emitted_at(outputs: list[list[int]], i: int) -> list[int]:
    return [out[i] for out in outputs if len(out) > i]


@pytest.mark.parametrize("seed", [0, 1])
def test_draft_model_drafts_keep_the_target_distribution(seed):
    p, q = handmade(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    drafts = torch.stack([torch.multinomial(q[i], DRAWS, replacement=True, generator=gen)
                          for i in range(K)], dim=1)  # drafts drawn from q, as a drafter would
    outputs = verify(p.expand(DRAWS, -1, -1), drafts, [K] * DRAWS, [False] * DRAWS,
                     [None] * DRAWS, draft_probs=q.expand(DRAWS, -1, -1))
    for i in range(K + 1):  # every position's token, given that it was emitted
        assert_distributed_as(emitted_at(outputs, i), p[i])
    accepted = sum(len(o) - 1 for o in outputs) / DRAWS
    assert 0 < accepted < K  # some drafts accepted, some rejected


def test_point_mass_drafts_keep_the_target_distribution():
    """n-gram drafts: the same fixed tokens every time (q a point mass)."""
    p, _ = handmade(2)
    drafts = torch.tensor([[1, 2, 3]]).expand(DRAWS, -1)
    outputs = verify(p.expand(DRAWS, -1, -1), drafts, [K] * DRAWS, [False] * DRAWS,
                     [None] * DRAWS)
    for i in range(K + 1):
        assert_distributed_as(emitted_at(outputs, i), p[i])


def test_rows_with_fewer_or_no_drafts():
    p, _ = handmade(3)
    counts = [0, 1, 2, 3] * (DRAWS // 4)
    drafts = torch.tensor([[4, 4, 4]]).expand(DRAWS, -1)
    outputs = verify(p.expand(DRAWS, -1, -1), drafts, counts, [False] * DRAWS,
                     [None] * DRAWS)
    assert all(1 <= len(o) <= c + 1 for o, c in zip(outputs, counts, strict=True))
    assert_distributed_as([o[0] for o, c in zip(outputs, counts, strict=True) if c == 0], p[0])
    assert_distributed_as(emitted_at(outputs, 0), p[0])


def test_greedy_rows_are_the_targets_argmax_exactly():
    p, _ = handmade(4)
    best = p.argmax(-1).tolist()
    drafts = torch.tensor([best[:K], [best[0], 5 if best[1] != 5 else 4, best[2]],
                           [(best[0] + 1) % V, best[1], best[2]]])
    outputs = verify(p.expand(3, -1, -1), drafts, [K, K, K], [True] * 3, [None] * 3)
    assert outputs[0] == best  # all accepted, then the bonus argmax
    assert outputs[1] == best[:2]  # first accepted, second rejected: the argmax there
    assert outputs[2] == best[:1]


def test_seeded_rows_reproduce():
    p, q = handmade(5)
    drafts = torch.tensor([[1, 2, 3]]).expand(64, -1)

    def run() -> list[list[int]]:
        gens = [torch.Generator().manual_seed(i) for i in range(64)]
        return verify(p.expand(64, -1, -1), drafts, [K] * 64, [False] * 64, gens,
                      draft_probs=q.expand(64, -1, -1))

    assert run() == run()
