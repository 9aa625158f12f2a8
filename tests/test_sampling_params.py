"""SamplingParams rejects invalid values with a message naming the field and the range."""

import pytest

from llmserve.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SEED_RANGE, SamplingParams

INVALID = [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), "stop"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(logit_bias={3: 101}), "logit_bias"),
    (dict(logit_bias={3: -100.5}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(seed=2**64), "seed"),  # torch.Generator refuses it: it failed the whole step
    (dict(seed=-(2**63) - 1), "seed"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID, ids=[f for _, f in INVALID])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(f"{field} ")


def test_valid_edges_are_accepted():
    params = SamplingParams(
        temperature=0, top_p=1, logprobs=MAX_LOGPROBS, prompt_logprobs=0,
        repetition_penalty=0.5, presence_penalty=-2, frequency_penalty=2,
        logit_bias={"5": 100, 6: -100}, allowed_token_ids=[1], bad_words=["bad"],
        seed=SEED_RANGE[1],
    )
    assert params.logit_bias == {5: 100.0, 6: -100.0}
