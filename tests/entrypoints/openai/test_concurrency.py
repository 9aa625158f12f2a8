"""Many clients at once: batching keeps answers, disconnects free the cache, overload is 429."""

import asyncio

import httpx
import openai
import pytest

from tests.entrypoints.openai.conftest import MODEL, run_server, wait_engine_idle
from tests.entrypoints.openai.test_metrics import scrape, value

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time",
           "The best way to learn Python is", "My favourite food is", "Water boils at",
           "The sun rises in the", "A haiku about autumn:"]


async def _stream_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, stream=True)
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def test_32_concurrent_streams_match_their_solo_text(server, client):
    max_tokens = 8
    alone = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens,
                                          temperature=0).choices[0].text for p in PROMPTS}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]

    async def run_all() -> list[str]:
        async with server.async_client() as aclient:
            return await asyncio.gather(*(_stream_text(aclient, p, max_tokens) for p in prompts))

    texts = asyncio.run(run_all())
    assert texts == [alone[p] for p in prompts]
    assert not server.engine.engine.has_unfinished_requests()


def _kv_usage(server) -> float:
    return value(scrape(server), "kv_cache_usage_ratio")


def test_disconnect_mid_stream_aborts_and_frees_kv(server):
    idle = _kv_usage(server)
    body = {"model": MODEL, "prompt": "Write a long essay about the sea.", "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    before = scrape(server)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            num_chunks = 0
            while num_chunks < 3:
                num_chunks += next(lines).startswith("data:")
            assert server.engine.engine.has_unfinished_requests()
            assert _kv_usage(server) > idle
    wait_engine_idle(server)
    # the request ended as an abort (run on, it would have ended as "length" at 400 tokens)
    # and its blocks are free
    assert _kv_usage(server) == idle
    assert _aborts(scrape(server)) == _aborts(before) + 1


def _aborts(families) -> float:
    return families.get("llmserve_request_success", {}).get(
        ("llmserve_request_success_total", (("finished_reason", "abort"),)), 0)


def test_disconnect_while_waiting_for_a_whole_answer_aborts(server):
    body = {"model": MODEL, "prompt": "Write a long essay about the sea.", "max_tokens": 400,
            "ignore_eos": True}
    before = scrape(server)
    with httpx.Client(base_url=server.url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body)
    wait_engine_idle(server)
    assert _aborts(scrape(server)) == _aborts(before) + 1


@pytest.fixture(scope="module")
def small_queue_server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, max_num_waiting=2,
                    engine_options={"max_num_seqs": 2}) as running:
        yield running


def test_queue_full_is_429_and_admitted_requests_complete(small_queue_server):
    num_requests, max_tokens = 12, 16

    async def one(aclient: openai.AsyncOpenAI, i: int):
        try:
            return await aclient.completions.create(
                model=MODEL, prompt=f"Count to {i}:", max_tokens=max_tokens,
                extra_body={"ignore_eos": True})
        except openai.RateLimitError as e:
            return e

    async def run_all():
        async with small_queue_server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(num_requests)))

    results = asyncio.run(run_all())
    rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, openai.RateLimitError)]
    assert rejected, "no request was refused"
    assert served, "no request was admitted"
    for error in rejected:
        assert error.status_code == 429
        assert int(error.response.headers["retry-after"]) >= 1
        assert error.response.json()["error"]["code"] == "rate_limit_exceeded"
    for resp in served:
        assert resp.usage.completion_tokens == max_tokens
        assert resp.choices[0].finish_reason == "length"
    assert not small_queue_server.engine.engine.has_unfinished_requests()
