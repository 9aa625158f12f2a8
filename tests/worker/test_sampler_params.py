"""Logits processors and the sampling distribution on hand-made logits, checked exactly."""

import torch

from llmserve.sampling_params import SamplingParams
from llmserve.worker.logits_processors import History, LogitsProcessing
from llmserve.worker.logprobs import gather_logprobs
from llmserve.worker.sampler import SamplingBatch, sample

NEG_INF = float("-inf")


def processed(logits: torch.Tensor, params: SamplingParams, history: History = None):
    processing = LogitsProcessing.build([params], [history or History()])
    assert processing is not None
    return processing.apply(logits)


def test_plain_params_build_no_processing():
    assert LogitsProcessing.build([SamplingParams()] * 3, [History()] * 3) is None


def test_penalties_on_a_handmade_history():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    history = History(prompt_token_ids=[0, 1], output_token_ids=[3, 3, 4])
    # repetition over prompt + output {0, 1, 3, 4}: positive / 2, negative * 2;
    # then output counts {3: 2, 4: 1}: -= 0.5 * count + 0.25
    expected = torch.tensor([[1.0, -2.0, 0.5, 1.5 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 1.0]])
    assert torch.equal(processed(logits, params, history), expected)


def test_frequency_and_presence_ignore_the_prompt():
    logits = torch.zeros(1, 4)
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=-0.5)
    history = History(prompt_token_ids=[0, 0, 1], output_token_ids=[1, 2, 2, 2])
    assert torch.equal(processed(logits, params, history),
                       torch.tensor([[0.0, -0.5, -2.5, 0.0]]))


def test_penalties_apply_only_to_their_rows():
    logits = torch.ones(2, 3)
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0)]
    histories = [History(output_token_ids=[0]), History(output_token_ids=[0])]
    out = LogitsProcessing.build(params, histories).apply(logits)
    assert torch.equal(out, torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]))
    assert torch.equal(logits, torch.ones(2, 3))  # the input is not modified


def test_logit_bias_forces_a_token():
    torch.manual_seed(0)
    logits = torch.randn(64, 100)
    params = [SamplingParams(temperature=1.0, logit_bias={7: 100})] * 64
    assert sample(logits, SamplingBatch.build(params, [None] * 64)).tolist() == [7] * 64
    out = processed(logits[:1], SamplingParams(logit_bias={7: 100, 3: -100}))
    assert out[0, 7] == logits[0, 7] + 100 and out[0, 3] == logits[0, 3] - 100


def test_allowed_token_ids():
    torch.manual_seed(0)
    logits = torch.randn(1, 10)
    out = processed(logits, SamplingParams(allowed_token_ids=[3, 5]))
    assert torch.equal(out[0, [3, 5]], logits[0, [3, 5]])
    assert (out[0, [0, 1, 2, 4, 6, 7, 8, 9]] == NEG_INF).all()
    params = [SamplingParams(temperature=2.0, allowed_token_ids=[3, 5])] * 500
    drawn = set(sample(logits.repeat(500, 1), SamplingBatch.build(params, [None] * 500)).tolist())
    assert drawn == {3, 5}


def test_bad_words_multi_token():
    logits = torch.zeros(1, 10)
    params = SamplingParams(bad_words=["x"])  # token ids come from the engine's tokenizer
    words = [[5, 6], [9], [1, 2, 3]]
    banned = lambda output: set(  # noqa: E731
        torch.nonzero(processed(logits, params, History(
            output_token_ids=output, bad_words_token_ids=words))[0] == NEG_INF).flatten().tolist())
    assert banned([]) == {9}  # a single-token word is always banned
    assert banned([4, 5]) == {6, 9}
    assert banned([5, 4]) == {9}
    assert banned([7, 1, 2]) == {3, 9}
    assert banned([2]) == {9}


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, 6)
    params = SamplingParams(min_tokens=3, stop_token_ids=[4])
    short = processed(logits, params, History(output_token_ids=[0, 1], eos_token_ids={2}))
    assert torch.nonzero(short[0] == NEG_INF).flatten().tolist() == [2, 4]
    history = History(output_token_ids=[0, 1, 0], eos_token_ids={2})
    assert LogitsProcessing.build([params], [history]) is None  # long enough: no mask


def test_greedy_honours_penalties_and_masks():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    greedy = dict(temperature=0)
    cases = [
        (SamplingParams(presence_penalty=0.5, **greedy), History(output_token_ids=[0]), 1),
        (SamplingParams(repetition_penalty=1.5, **greedy), History(prompt_token_ids=[0]), 1),
        (SamplingParams(logit_bias={2: 5}, **greedy), History(), 2),
        (SamplingParams(allowed_token_ids=[1, 2], **greedy), History(), 1),
        (SamplingParams(min_tokens=1, **greedy), History(eos_token_ids={0}), 1),
    ]
    for params, history, want in cases:
        batch = SamplingBatch.build([params], [None], histories=[history])
        assert sample(logits, batch).item() == want, params


def test_temperature_top_p_sampling_matches_analytic_distribution():
    torch.manual_seed(0)
    n, temperature, top_p = 20_000, 0.7, 0.9
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0, -0.5, 1.5, 0.0, -2.0])
    # analytic: softmax(logits / T), keep the smallest most-likely set reaching top_p, renormalise
    probs = (logits / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
    expected = torch.zeros_like(probs)
    expected[order[keep]] = sorted_probs[keep] / sorted_probs[keep].sum()
    assert set(order[keep].tolist()) == {1, 5, 3, 0}

    params = [SamplingParams(temperature=temperature, top_p=top_p)] * n
    drawn = sample(logits.repeat(n, 1), SamplingBatch.build(params, [None] * n))
    counts = torch.bincount(drawn, minlength=8).double()
    kept = order[keep]
    assert counts.sum() == counts[kept].sum()  # nothing outside the nucleus
    exp_counts = expected[kept].double() * n
    chi2 = ((counts[kept] - exp_counts) ** 2 / exp_counts).sum().item()
    assert chi2 < 16.27  # p = 0.001 for 3 degrees of freedom


def test_logprobs_ranks_and_top_k():
    logprobs = torch.tensor([[0.1, 0.4, 0.2, 0.2, 0.1]]).log()
    [position] = gather_logprobs(logprobs, torch.tensor([4]), 3)
    assert position.token_ids[0] == 4 and position.ranks[0] == 4  # three strictly higher
    assert position.token_ids[1] == 1 and position.ranks[1] == 1
    assert set(position.token_ids[2:]) == {2, 3} and position.ranks[2:] == [2, 2]  # a tie
    assert torch.allclose(torch.tensor(position.logprobs), logprobs[0, position.token_ids])
    assert position.truncated(1).token_ids == [4, 1]
