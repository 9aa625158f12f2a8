"""n, best_of and beam search on the real model: block sharing, ranking, and the reference."""

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine

LONG_PROMPT = "Write one sentence about the sea. " * 8  # several full blocks


def fresh(llm: LLM, **options) -> Engine:
    config = EngineConfig(**{"dtype": "float32", "kv_cache_memory": "64MiB", **options})
    return Engine(config, loaded=llm.engine.loaded)


def run(engine: Engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("caching", [True, False])
def test_n_siblings_share_the_prompt_blocks(smollm2_llm, caching):
    engine = fresh(smollm2_llm, enable_prefix_caching=caching)
    request_id = engine.add_request(LONG_PROMPT, SamplingParams(n=4, seed=7, max_tokens=8))
    engine.step()  # all four siblings admitted in one step
    tables = [engine.scheduler.requests[f"{request_id}#{i}"].blocks for i in range(4)]
    num_full = len(engine.tokenizer.encode(LONG_PROMPT)) // engine.kv_manager.block_size
    assert num_full >= 3
    for table in tables[1:]:
        assert [b.block_id for b in table[:num_full]] == [b.block_id for b in tables[0][:num_full]]
    assert [b.ref_cnt for b in tables[0][:num_full]] == [4] * num_full
    outputs = run(engine)
    final = outputs[-1]
    assert final.request_id == request_id and final.finished
    assert sorted(c.index for c in final.outputs) == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # independent samples
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_n_with_seed_is_reproducible(smollm2_llm):
    params = SamplingParams(n=3, seed=11, max_tokens=8)
    first = smollm2_llm.generate(LONG_PROMPT, params, use_tqdm=False)[0]
    second = smollm2_llm.generate(LONG_PROMPT, params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]


def test_best_of_returns_the_n_most_likely(smollm2_llm):
    params = SamplingParams(n=2, best_of=5, seed=3, max_tokens=8)
    engine = fresh(smollm2_llm)
    request_id = engine.add_request(LONG_PROMPT, params)
    outputs = run(engine)
    assert len(outputs) == 1  # nothing is streamed before the best are known
    final = outputs[0]
    assert final.request_id == request_id and len(final.outputs) == 2
    assert [c.index for c in final.outputs] == [0, 1]
    scores = [c.cumulative_logprob for c in final.outputs]
    assert scores == sorted(scores, reverse=True)
    assert all(c.logprobs is None for c in final.outputs)  # not asked for

    # the same five siblings, all returned: the two kept are the best of them
    everyone = smollm2_llm.generate(
        LONG_PROMPT, SamplingParams(n=5, seed=3, max_tokens=8, logprobs=0), use_tqdm=False
    )[0]
    best = sorted((c.cumulative_logprob for c in everyone.outputs), reverse=True)[:2]
    assert scores == pytest.approx(best)


def test_abort_of_a_group_frees_every_sibling(smollm2_llm):
    engine = fresh(smollm2_llm)
    request_id = engine.add_request(LONG_PROMPT, SamplingParams(n=3, max_tokens=50))
    engine.step()
    engine.step()
    final = engine.abort_request(request_id)
    assert final is not None and all(c.finish_reason == "abort" for c in final.outputs)
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


BEAM_QUESTIONS = [
    "What is the capital of France?",
    "Give me a word that rhymes with cat.",
    "Name two planets of the solar system.",
]


@pytest.mark.parametrize(("question", "length_penalty"), [  # length penalties 1 and 0.5
    pytest.param(BEAM_QUESTIONS[0], 1.0, marks=pytest.mark.slow), (BEAM_QUESTIONS[1], 1.0),
    (BEAM_QUESTIONS[2], 0.5),
])
def test_beam_search_equals_reference(smollm2_llm, reference_model, question, length_penalty):
    tokenizer = smollm2_llm.tokenizer
    stop = sorted(tokenizer.stop_token_ids)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True)
    params = SamplingParams(use_beam_search=True, beam_width=4, max_tokens=24,
                            length_penalty=length_penalty)
    engine = fresh(smollm2_llm)
    engine.add_request({"prompt_token_ids": ids}, params)
    (output,) = run(engine)
    ours = output.outputs[0].token_ids
    with torch.inference_mode():
        ref = reference_model.generate(
            torch.tensor([ids]), num_beams=4, do_sample=False, max_new_tokens=24,
            length_penalty=length_penalty, eos_token_id=stop, pad_token_id=stop[0],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )[0, len(ids):].tolist()
    ref = ref[: len(ours)] if ref[len(ours):] == [stop[0]] * (len(ref) - len(ours)) else ref
    assert ours == ref
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_beam_search_returns_n_ranked_hypotheses(smollm2_llm):
    params = SamplingParams(use_beam_search=True, beam_width=4, n=3, max_tokens=12)
    (output,) = smollm2_llm.generate("The best thing about mornings is", params, use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    assert all(c.finish_reason in ("stop", "length") for c in output.outputs)
    # LLM.beam_search: the same search, use_beam_search set for the caller
    (again,) = smollm2_llm.beam_search("The best thing about mornings is",
                                       SamplingParams(beam_width=4, n=3, max_tokens=12),
                                       use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]


def test_beams_share_their_common_prefix_through_the_prefix_cache(smollm2_llm):
    """Each step's beams are new one-token requests above the engine core: they find the
    prompt's full blocks (and their own prefix's) in the cache and compute only the rest."""
    for caching in (True, False):  # beams of one search share blocks as siblings do
        engine = fresh(smollm2_llm, enable_prefix_caching=caching)
        engine.add_request(LONG_PROMPT, SamplingParams(use_beam_search=True, beam_width=4,
                                                       max_tokens=6))
        engine.step()  # the prompt; its top-K is reported and the first beams are added
        beams = list(engine.scheduler.requests.values())
        assert len(beams) == 4 and all(b.num_output_tokens == 0 for b in beams)
        num_prompt = len(engine.tokenizer.encode(LONG_PROMPT))
        block_size = engine.kv_manager.block_size
        assert {len(b.prompt_token_ids) for b in beams} == {num_prompt + 1}
        engine.step()  # every beam admitted with the prompt's full blocks found cached
        assert [b.num_cached_tokens for b in beams] == [num_prompt // block_size * block_size] * 4
        (output,) = run(engine)
        assert len(output.outputs[0].token_ids) == 6 or output.outputs[0].finish_reason == "stop"
        assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.pool.num_blocks
