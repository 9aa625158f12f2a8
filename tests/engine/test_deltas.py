"""Delta outputs (`RequestOutputKind.DELTA`) on the real model: each step carries only what
is new, and the deltas add up to exactly the final output of the same request."""

from dataclasses import replace

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config.engine import EngineConfig
from llmserve.engine.engine import Engine
from llmserve.outputs import OutputAccumulator, RequestOutput
from llmserve.sampling_params import RequestOutputKind

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPT = "Write a short story about a lighthouse keeper and a storm."


@pytest.fixture(scope="module")
def engine(smollm2_llm) -> Engine:
    # no prefix caching: a request and its rerun compute the same shapes, so their logprobs
    # are equal to the last bit and can be compared exactly
    config = EngineConfig(dtype="float32", kv_cache_memory="64MiB", enable_prefix_caching=False)
    return Engine(config, loaded=smollm2_llm.engine.loaded)


def chat_prompt(llm: LLM, text: str) -> dict:
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    return {"prompt_token_ids": ids}


def run(engine: Engine, prompt, params: SamplingParams) -> list[RequestOutput]:
    """Every output of one request, stepping the engine until it is done."""
    request_id = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def final(engine: Engine, prompt, params: SamplingParams) -> RequestOutput:
    (output,) = run(engine, prompt, replace(params, output_kind=FINAL_ONLY))
    assert output.finished
    return output


def concatenated(deltas: list[RequestOutput]) -> dict[int, dict]:
    """Per choice index: the deltas' text, token ids and logprobs, joined by hand."""
    choices: dict[int, dict] = {}
    for delta in deltas:
        for c in delta.outputs:
            choice = choices.setdefault(c.index, {"text": "", "token_ids": [], "logprobs": []})
            choice["text"] += c.text
            choice["token_ids"] += c.token_ids
            choice["logprobs"] += c.logprobs or []
            choice["finish_reason"], choice["stop_reason"] = c.finish_reason, c.stop_reason
    return choices


def assert_deltas_add_up(deltas: list[RequestOutput], whole: RequestOutput) -> None:
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    joined = concatenated(deltas)
    assert sorted(joined) == [c.index for c in whole.outputs]
    for c in whole.outputs:
        got = joined[c.index]
        assert got["text"] == c.text
        assert got["token_ids"] == c.token_ids
        assert got["logprobs"] == (c.logprobs or [])
        assert (got["finish_reason"], got["stop_reason"]) == (c.finish_reason, c.stop_reason)
    built = OutputAccumulator()
    for delta in deltas:
        built.add(delta)
    assert built.build().outputs == whole.outputs
    assert built.build().prompt_logprobs == whole.prompt_logprobs


def test_decode_steps_carry_only_the_new_token(engine):
    """80 decode steps: every output holds one new token id, its logprobs entry and the
    text it made visible; nothing of the history is sent again."""
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1, output_kind=DELTA)
    deltas = run(engine, PROMPT, params)
    assert len(deltas) == 80
    assert all(len(d.outputs) == 1 for d in deltas)
    assert [len(d.outputs[0].token_ids) for d in deltas] == [1] * 80
    assert [len(d.outputs[0].logprobs) for d in deltas] == [1] * 80
    assert deltas[0].prompt_logprobs is not None
    assert all(d.prompt_logprobs is None for d in deltas[1:])  # sent once
    assert sum(len(d.outputs[0].text) for d in deltas) > 80  # a token is a few characters
    assert_deltas_add_up(deltas, final(engine, PROMPT, params))


@pytest.mark.parametrize("include_stop", [False, True])
def test_deltas_with_a_stop_string_add_up(smollm2_llm, engine, include_stop):
    prompt = chat_prompt(smollm2_llm, "Count from one to twenty in words.")
    greedy = SamplingParams(temperature=0, max_tokens=40, logprobs=3)
    unstopped = final(engine, prompt, greedy).outputs[0].text
    stop = unstopped[len(unstopped) // 2:][:6]  # several characters, likely several tokens
    assert len(stop.strip()) >= 3, unstopped
    params = replace(greedy, stop=[stop], include_stop_str_in_output=include_stop,
                     output_kind=DELTA)
    deltas = run(engine, prompt, params)
    whole = final(engine, prompt, params)
    c = whole.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    cut = unstopped.index(stop) + (len(stop) if include_stop else 0)
    assert c.text == unstopped[:cut]
    assert_deltas_add_up(deltas, whole)
    # the stop string is held back while running: no piece before the last shows its start
    assert all(stop[:3] not in d.outputs[0].text for d in deltas[:-1])


def test_n_deltas_per_choice_add_up(smollm2_llm, engine):
    prompt = chat_prompt(smollm2_llm, "Name some animals that live in the sea.")
    params = SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=24, logprobs=1,
                            stop=[", ", "\n\n"], output_kind=DELTA)
    deltas = run(engine, prompt, params)
    whole = final(engine, prompt, params)
    assert_deltas_add_up(deltas, whole)
    # per step, each choice that progressed brings exactly its one new token
    for delta in deltas:
        indexes = [c.index for c in delta.outputs]
        assert indexes == sorted(set(indexes))
        assert all(len(c.token_ids) == 1 for c in delta.outputs)


def test_best_of_and_beam_search_deltas_are_one_final_output(engine):
    for params in (SamplingParams(n=2, best_of=4, seed=3, max_tokens=8),
                   SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=8)):
        deltas = run(engine, PROMPT, replace(params, output_kind=DELTA))
        assert len(deltas) == 1
        assert deltas[0].outputs == final(engine, PROMPT, params).outputs


def test_cumulative_is_the_default_and_snapshots_every_step(engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    snapshots = run(engine, PROMPT, params)
    assert [len(s.outputs[0].token_ids) for s in snapshots] == list(range(1, 13))
    assert snapshots[-1].outputs == final(engine, PROMPT, params).outputs


def test_aborted_request_ends_with_a_final_delta(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind=DELTA)
    request_id = engine.add_request(PROMPT, params)
    deltas = engine.step() + engine.step() + engine.step()
    last = engine.abort_request(request_id)
    assert last is not None and last.finished
    assert last.outputs[0].finish_reason == "abort" and last.outputs[0].token_ids == []
    assert [len(d.outputs[0].token_ids) for d in deltas] == [1, 1, 1]
    assert not engine.has_unfinished_requests()


def test_async_streams_give_each_kind(engine):
    """AsyncEngine always takes deltas from the engine; a stream gives its caller the kind
    the caller asked for."""
    import asyncio

    from llmserve.engine.async_engine import AsyncEngine

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    whole = final(engine, PROMPT, params)

    async def outputs(kind: RequestOutputKind) -> list[RequestOutput]:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            return [o async for o in async_engine.generate(PROMPT, replace(params,
                                                                            output_kind=kind))]
        finally:
            await async_engine.shutdown()

    deltas = asyncio.run(outputs(DELTA))
    assert [len(d.outputs[0].token_ids) for d in deltas] == [1] * 10
    assert_deltas_add_up(deltas, whole)
    snapshots = asyncio.run(outputs(RequestOutputKind.CUMULATIVE))
    assert [len(s.outputs[0].token_ids) for s in snapshots] == list(range(1, 11))
    assert snapshots[-1].outputs == whole.outputs
    (last,) = asyncio.run(outputs(FINAL_ONLY))
    assert last.finished and last.outputs == whole.outputs
