"""The grammar bitmask applied to the sampled rows' logits: native kernel and torch path."""

from concurrent.futures import Future

import pytest
import torch

from llmserve.structured.manager import GrammarStep


def reference(logits, bitmask, rows):
    vocab = logits.shape[1]
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    out = logits.clone()
    for i, row in enumerate(rows):
        out[row][~allowed[i]] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [49152, 49157, 7])
def test_native_mask_applies_to_exactly_the_constrained_rows(vocab, kernel_level):
    check_mask(vocab)


@pytest.mark.parametrize("vocab", [49152, 49157, 7])
def test_torch_mask_applies_to_exactly_the_constrained_rows(vocab, monkeypatch):
    # the torch path (CUDA, or no compiler)
    monkeypatch.setattr("llmserve.structured.manager.native_for", lambda *t: None)
    check_mask(vocab)


def check_mask(vocab: int) -> None:
    torch.manual_seed(0)
    ids = [f"r{i}" for i in range(6)]
    constrained = ["r1", "r2", "r4"]
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[0, 0] = -1  # a word of 32 allowed tokens
    bitmask[1, 0] = 0  # and one of none
    logits = torch.randn(6, vocab)
    done = Future()
    done.set_result(None)
    step = GrammarStep([(rid, 0) for rid in constrained], bitmask, done)
    keys = [(rid, 0) for rid in ids]
    out = step.apply(logits, keys)
    assert torch.equal(out, reference(logits, bitmask, [1, 2, 4]))
    assert not torch.isinf(logits).any()  # the raw logits (for logprobs) stay as they were
    in_place = step.apply(logits, keys, copy=False)  # when no row wants logprobs
    assert in_place.data_ptr() == logits.data_ptr() and torch.equal(in_place, out)
