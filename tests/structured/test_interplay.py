"""Constraints together with the rest of sampling and scheduling: n, logprobs, stop strings,
max_tokens, ignore_eos, chunked prefill, and batches mixing constrained and free requests."""

import json
import re

import pytest
from jsonschema import validate

from llmserve import SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine
from llmserve.sampling_params import StructuredOutputsParams
from tests.structured.helpers import chat_prompt

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
AS_PERSON = StructuredOutputsParams(json=PERSON)


def person_params(**options) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.9, "max_tokens": 80,
                             "structured_outputs": AS_PERSON, **options})


@pytest.fixture(scope="module")
def ask_person(structured_llm) -> dict:
    return chat_prompt(structured_llm.tokenizer, "Describe a person as JSON.")


def test_n_samples_are_each_valid(structured_llm, ask_person):
    for params in (person_params(n=2, seed=1), person_params(n=2, best_of=3, seed=2)):
        (output,) = structured_llm.generate([ask_person], params, use_tqdm=False)
        assert [c.index for c in output.outputs] == [0, 1]
        for choice in output.outputs:
            assert choice.finish_reason == "stop"
            validate(json.loads(choice.text), PERSON)


def test_logprobs_with_a_schema_are_of_the_raw_distribution(structured_llm, ask_person):
    """Greedy under the mask picks the best *allowed* token; its reported logprob and rank
    are of the unmasked distribution (as documented), so the forced tokens rank below 1."""
    (output,) = structured_llm.generate(
        [ask_person], person_params(temperature=0, logprobs=2), use_tqdm=False)
    choice = output.outputs[0]
    assert choice.finish_reason == "stop"
    validate(json.loads(choice.text), PERSON)
    assert len(choice.logprobs) == len(choice.token_ids)
    for token, entries in zip(choice.token_ids, choice.logprobs, strict=True):
        assert token in entries and 2 <= len(entries) <= 3
    chosen = [entries[token] for token, entries in zip(choice.token_ids, choice.logprobs,
                                                         strict=True)]
    assert max(entry.rank for entry in chosen) > 1, chosen
    assert choice.cumulative_logprob == pytest.approx(sum(entry.logprob for entry in chosen))


@pytest.mark.parametrize("stop", ["llow", " "], ids=["inside", "on the last token"])
def test_stop_string_cuts_a_choice(structured_llm, stop):
    """A stop string ends the request before the choice is complete ("llow" in "yellow"),
    or on the very token that completes it (" " comes with " apple"): either way the text
    ends before it and `stop_reason` says which string stopped it."""
    choices = ["red apple", "green apple", "yellow banana"]
    prompt = chat_prompt(structured_llm.tokenizer, "Which fruit would you like?")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=20, stop=[stop],
                             structured_outputs=StructuredOutputsParams(choice=choices))
              for seed in range(4)]
    chosen = []
    for output in structured_llm.generate([prompt] * 4, params, use_tqdm=False):
        choice = output.outputs[0]
        full = next(c for c in choices if c.startswith(choice.text))
        expected = (full[:full.index(stop)], stop) if stop in full else (full, None)
        assert (choice.text, choice.stop_reason) == expected
        assert choice.finish_reason == "stop"
        chosen.append(full)
    assert any(stop in full for full in chosen), chosen  # the stop string was reached


def test_max_tokens_cuts_a_prefix_never_claimed_complete(structured_llm, ask_person):
    short, full = structured_llm.generate(
        [ask_person] * 2, [person_params(seed=7, max_tokens=4), person_params(seed=7)],
        use_tqdm=False)
    short, full = short.outputs[0], full.outputs[0]
    assert full.finish_reason == "stop" and len(full.token_ids) > 4
    assert short.finish_reason == "length"
    assert short.token_ids == full.token_ids[:4]
    assert full.text.startswith(short.text)
    with pytest.raises(json.JSONDecodeError):
        json.loads(short.text)


def test_ignore_eos_still_ends_when_the_grammar_is_complete(structured_llm, ask_person):
    eos_ids = structured_llm.tokenizer.stop_token_ids
    with_eos, ignoring = structured_llm.generate(
        [ask_person] * 2, [person_params(seed=3), person_params(seed=3, ignore_eos=True)],
        use_tqdm=False)
    assert ignoring.outputs[0].finish_reason == "stop"
    assert ignoring.outputs[0].token_ids == with_eos.outputs[0].token_ids
    assert not eos_ids & set(ignoring.outputs[0].token_ids)
    validate(json.loads(ignoring.outputs[0].text), PERSON)
    # a regex that may end early: the end of the match, not EOS, finishes the request
    digits = StructuredOutputsParams(regex="[0-9]{1,3}")
    prompt = chat_prompt(structured_llm.tokenizer, "Pick a number.")
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=30, ignore_eos=True,
                             structured_outputs=digits) for seed in range(4)]
    for output in structured_llm.generate([prompt] * 4, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop"
        assert re.fullmatch("[0-9]{1,3}", output.outputs[0].text)


def test_chunked_prefill_with_a_schema(structured_engine, structured_llm):
    """A prompt prefilled over several steps of 64 tokens: the mask is applied only when
    the request samples, and the result is the same as with one prefill."""
    story = ("Maria, a nurse from Lisbon, met Tom, a pilot, at the airport café. " * 12
             + "List up to three people from this story as JSON.")
    schema = {"type": "object", "additionalProperties": False, "required": ["people"],
              "properties": {"people": {"type": "array", "minItems": 1, "maxItems": 3,
                                        "items": {"type": "string", "maxLength": 20}}}}
    prompt = chat_prompt(structured_llm.tokenizer, story)
    num_prompt = len(prompt["prompt_token_ids"])
    assert num_prompt > 3 * 64
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema))
    config = EngineConfig(kv_cache_memory="32MiB", max_num_batched_tokens=64,
                          enable_prefix_caching=False)
    chunked = Engine(config, loaded=structured_engine.loaded)
    request_id = chunked.add_request(prompt, params)
    steps, outputs = 0, []
    while chunked.has_unfinished_requests():
        steps += 1
        outputs += [o for o in chunked.step() if o.request_id == request_id]
    choice = outputs[-1].outputs[0]
    assert steps >= -(-num_prompt // 64) + len(choice.token_ids) - 1  # prefill in chunks
    assert choice.finish_reason == "stop"
    validate(json.loads(choice.text), schema)
    (whole,) = structured_llm.generate([prompt], params, use_tqdm=False)
    assert choice.token_ids == whole.outputs[0].token_ids


def test_free_requests_are_unaffected_by_constrained_ones(structured_llm):
    """A batch mixing greedy free requests with sampled constrained ones: the free ones
    give exactly the tokens and logprobs they give alone."""
    free = [chat_prompt(structured_llm.tokenizer, text) for text in (
        "Tell me about the moon.", "Write a haiku about rain.", "What is 2+2?")]
    greedy = SamplingParams(temperature=0, max_tokens=40, logprobs=1)
    alone = [structured_llm.generate([p], greedy, use_tqdm=False)[0].outputs[0] for p in free]
    constrained = [person_params(seed=seed) for seed in range(6)]
    ask = chat_prompt(structured_llm.tokenizer, "Describe a person as JSON.")
    mixed = structured_llm.generate(free + [ask] * 6, [greedy] * 3 + constrained,
                                    use_tqdm=False)
    for solo, batched in zip(alone, mixed[:3], strict=True):
        assert batched.outputs[0].token_ids == solo.token_ids
        assert batched.outputs[0].logprobs == solo.logprobs
    for output in mixed[3:]:
        assert output.outputs[0].finish_reason == "stop"
        validate(json.loads(output.outputs[0].text), PERSON)


def test_properties_are_generated_in_the_schema_order(structured_llm, ask_person):
    """The schema lists "name" before "age"; generation follows the schema's order (as
    OpenAI's structured outputs and vLLM do), which is what makes a "reasoning" field
    before an "answer" field useful."""
    outputs = structured_llm.generate([ask_person] * 3, [person_params(seed=s)
                                                         for s in range(3)], use_tqdm=False)
    for output in outputs:
        assert list(json.loads(output.outputs[0].text)) == ["name", "age"], output.outputs[0]


def test_preemption_keeps_the_matchers(structured_engine, structured_llm):
    """Requests preempted (blocks taken back, recomputed later) keep their matcher's state:
    the same greedy JSON as with room for all, each valid."""
    from llmserve import LLM

    prompts = [chat_prompt(structured_llm.tokenizer, f"Describe person number {i} as JSON.")
               for i in range(12)]
    params = person_params(temperature=0)
    roomy = structured_llm.generate(prompts, params, use_tqdm=False)
    per_token = structured_engine.kv_plan.bytes_per_token
    config = EngineConfig(kv_cache_memory=14 * 16 * per_token,  # 14 blocks, 12 requests
                          enable_prefix_caching=False)
    tight = LLM.from_engine(Engine(config, loaded=structured_engine.loaded))
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for out, ref in zip(outputs, roomy, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].finish_reason == "stop"
        validate(json.loads(out.outputs[0].text), PERSON)
