"""Sampling parameters through the engine on the real model: seeds, bad words, id checks."""

import pytest

from llmserve import SamplingParams
from llmserve.engine.engine import RequestRejected


def chat(llm, text: str) -> dict:
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    return {"prompt_token_ids": ids}


def test_seed_gives_same_text_alone_and_in_a_busy_batch(smollm2_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=10,
                            ignore_eos=True)
    prompt = chat(smollm2_llm, "Tell me a story about a dragon.")
    alone = smollm2_llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].text
    others = [chat(smollm2_llm, t) for t in ("Describe the sea.", "What is jazz?",
                                             "Write a haiku about snow and long winter nights.",
                                             "Count to ten.", "Why is grass green?")]
    busy = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    prompts = others[:2] + [prompt] + others[2:]
    params = [busy, busy, seeded, busy, busy, busy]
    outputs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    assert outputs[2].outputs[0].text == alone
    again = smollm2_llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].text
    assert again == alone


def test_bad_words_are_never_generated(smollm2_llm):
    prompt = chat(smollm2_llm, "What is the capital of France?")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = smollm2_llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text
    banned = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=["Paris"])
    assert "Paris" not in smollm2_llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids", "stop_token_ids"])
def test_token_ids_out_of_vocab_are_rejected(smollm2_llm, field):
    vocab = smollm2_llm.engine.loaded.config.vocab_size
    value = {vocab: 1.0} if field == "logit_bias" else [vocab]
    with pytest.raises(RequestRejected, match=field):
        smollm2_llm.engine.add_request("Hi", SamplingParams(**{field: value}))


def test_a_prompt_dict_takes_cache_salt_and_refuses_unknown_keys(smollm2_llm):
    engine = smollm2_llm.engine
    request_id = engine.add_request({"prompt": "Hi", "cache_salt": "tenant-a"},
                                    SamplingParams(max_tokens=1))
    request = engine.scheduler.requests[request_id]
    assert request.cache_salt == "tenant-a"
    engine.abort_request(request_id)
    with pytest.raises(RequestRejected, match="'mm_processor_kwargs' is not supported"):
        engine.add_request({"prompt": "Hi", "mm_processor_kwargs": {}}, SamplingParams())
    with pytest.raises(RequestRejected, match="text only"):  # images on a text model
        engine.add_request({"prompt": "Hi", "multi_modal_data": {"image": [object()]}},
                           SamplingParams())
    with pytest.raises(RequestRejected, match="cache_salt is given twice"):
        engine.add_request({"prompt": "Hi", "cache_salt": "a"}, SamplingParams(),
                           cache_salt="b")
