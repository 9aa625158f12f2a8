"""Logprobs and prompt logprobs on the real model against `transformers`' log_softmax."""

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine

TOLERANCE = 1e-3
TOP_K = 5


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)


def reference_logprobs(reference_model, ids: list[int]) -> torch.Tensor:
    """(L, V): log_softmax of the reference logits at every position."""
    with torch.inference_mode():
        return reference_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_entries(entries: dict, chosen: int, row: torch.Tensor, k: int, tokenizer) -> None:
    """`entries` holds `chosen` and the k most likely tokens, with reference values and ranks."""
    assert chosen in entries
    assert len(entries) in (k, k + 1)
    kth_best = row.topk(k).values[-1].item()
    for token, lp in entries.items():
        ref = row[token].item()
        assert abs(lp.logprob - ref) <= TOLERANCE, (token, lp.logprob, ref)
        # rank = 1 + tokens strictly above; near-ties may order differently in the reference
        assert 1 + (row > ref + TOLERANCE).sum() <= lp.rank <= 1 + (row > ref - TOLERANCE).sum()
        assert lp.decoded_token == tokenizer.decode([token])
        if token != chosen:
            assert ref >= kth_best - TOLERANCE  # an alternative is among the reference top-k


def test_greedy_logprobs_match_reference(smollm2_llm, reference_model):
    prompt = chat_ids(smollm2_llm, "Name three colours of the rainbow.")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP_K)
    completion = smollm2_llm.generate([{"prompt_token_ids": prompt}], params,
                                      use_tqdm=False)[0].outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 8
    ref = reference_logprobs(reference_model, prompt + completion.token_ids)
    for i, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs,
                                             strict=True)):
        check_entries(entries, token, ref[len(prompt) - 1 + i], TOP_K, smollm2_llm.tokenizer)
        assert entries[token].rank == 1  # greedy
    total = sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs,
                                             strict=True))
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-5)


def test_no_logprobs_unless_asked(smollm2_llm):
    out = smollm2_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2),
                               use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None


@pytest.fixture(scope="module")
def chunked_llm(smollm2_llm) -> LLM:
    config = EngineConfig(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=16)
    return LLM.from_engine(Engine(config, loaded=smollm2_llm.engine.loaded))


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_prompt_logprobs_match_reference(smollm2_llm, chunked_llm, reference_model, chunked):
    llm = chunked_llm if chunked else smollm2_llm
    prompt = chat_ids(llm, f"Why do cats purr? ({'chunked' if chunked else 'whole'})")
    assert len(prompt) > 2 * 16  # several chunks of 16 tokens
    # a cached prefix must not cut the prompt logprobs short
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    ref = reference_logprobs(reference_model, prompt)
    for j in range(1, len(prompt)):
        check_entries(out.prompt_logprobs[j], prompt[j], ref[j - 1], 3, llm.tokenizer)
