"""Batching, prefix caching, chunked prefill and preemption change no output (real model, fp32).

Each optimisation is checked against the plain path with greedy decoding: the token ids
must be identical, not merely close.
"""

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

TOPICS = [
    "the ocean", "volcanoes", "a small robot", "winter mornings", "the history of tea",
    "how bridges stand", "a lost key", "mountain goats", "jazz music", "the moon landing",
    "bread baking", "honey bees", "desert nights", "old libraries", "trains in India",
    "learning to swim",
]


def engine_like(llm: LLM, **options) -> LLM:
    """A fresh engine sharing the already loaded model, with other engine options."""
    config = EngineConfig(**{"dtype": "float32", "kv_cache_memory": "64MiB", **options})
    return LLM.from_engine(Engine(config, loaded=llm.engine.loaded))


def chat_ids(llm: LLM, text: str) -> dict:
    messages = [{"role": "user", "content": text}]
    return {"prompt_token_ids": llm.tokenizer.apply_chat_template(messages, tokenize=True)}


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts(smollm2_llm):
    # different lengths on purpose: the batch mixes prefills and decodes of many sizes
    return [chat_ids(smollm2_llm, f"Tell me {'briefly ' * (i % 5)}about {t}.")
            for i, t in enumerate(TOPICS)]


@pytest.fixture(scope="module")
def alone(smollm2_llm, prompts):
    return [token_ids(smollm2_llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]


def test_batch_invariance(smollm2_llm, prompts, alone):
    together = smollm2_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(together) == alone


def test_prefix_cache_is_transparent(smollm2_llm):
    system = "You are a careful assistant. " * 20
    shared = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Name a color."},
    ]
    other = [shared[0], {"role": "user", "content": "Name an animal."}]
    first = {"prompt_token_ids": smollm2_llm.tokenizer.apply_chat_template(shared, tokenize=True)}
    second = {"prompt_token_ids": smollm2_llm.tokenizer.apply_chat_template(other, tokenize=True)}

    cached = engine_like(smollm2_llm, enable_prefix_caching=True)
    cached.generate(first, GREEDY, use_tqdm=False)
    hits_before = cached.engine.kv_manager.num_hits
    with_cache = cached.generate(second, GREEDY, use_tqdm=False)[0]
    num_prompt = len(second["prompt_token_ids"])
    assert with_cache.num_cached_tokens >= 128  # the long shared system prompt
    assert cached.engine.kv_manager.num_hits - hits_before == with_cache.num_cached_tokens
    assert with_cache.num_cached_tokens < num_prompt

    uncached = engine_like(smollm2_llm, enable_prefix_caching=False)
    without = uncached.generate(second, GREEDY, use_tqdm=False)[0]
    assert without.num_cached_tokens == 0
    assert with_cache.outputs[0].token_ids == without.outputs[0].token_ids


def test_chunked_prefill_is_transparent(smollm2_llm):
    text = "Summarize: " + " ".join(f"Item {i} is a {t}." for i, t in enumerate(TOPICS * 2))
    prompt = chat_ids(smollm2_llm, text)
    assert len(prompt["prompt_token_ids"]) > 200
    one_chunk = engine_like(smollm2_llm, max_num_batched_tokens=2048)
    chunked = engine_like(smollm2_llm, max_num_batched_tokens=32)
    whole = one_chunk.generate(prompt, GREEDY, use_tqdm=False)
    pieces = chunked.generate(prompt, GREEDY, use_tqdm=False)
    assert token_ids(pieces) == token_ids(whole)


def test_preemption_is_transparent(smollm2_llm, prompts, alone):
    # 6 blocks of 16 tokens per request at most; 40 blocks cannot hold 16 requests at once
    tight = engine_like(smollm2_llm, kv_cache_memory=40 * 16 * 46080)
    outputs = tight.generate(prompts, GREEDY, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert token_ids(outputs) == alone
    assert tight.engine.kv_manager.pool.num_free_blocks == tight.engine.kv_manager.pool.num_blocks
