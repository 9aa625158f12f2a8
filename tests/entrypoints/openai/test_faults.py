"""Faults and overload: a failing model step fails only its requests; a dead engine thread
turns /health 503 and ends the server with exit code 1; a request past the server's
timeout ends with an error and frees its blocks; a slow reader's stream stays bounded."""

import asyncio
import json
import threading
import time

import openai
import pytest

from llmserve import SamplingParams
from llmserve.engine import request_stream
from llmserve.engine.async_engine import AsyncEngine, RequestTimeout
from llmserve.engine.engine import Engine
from llmserve.sampling_params import RequestOutputKind
from tests.cli_server import cli_server
from tests.entrypoints.openai.conftest import MODEL, _engine_config, run_server, wait_engine_idle

POISON = 9999  # a prompt token id: steps of its request fail once it has FAIL_AFTER tokens
FAIL_AFTER = 24


def all_blocks_free(engine: Engine) -> bool:
    """No request holds a block (prefix-cached blocks are free: reusable at once)."""
    kv = engine.kv_manager
    return (not engine.scheduler.requests and kv.pool.num_free_blocks == kv.pool.num_blocks
            and not engine.has_unfinished_requests())


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.002)


@pytest.fixture
def poisoned(monkeypatch):
    """Make every model step raise that holds a request whose prompt has POISON and which
    has made FAIL_AFTER tokens (so that others can queue behind it first)."""
    def install(engine: Engine) -> None:
        execute = engine.executor.execute_model

        def poisoned_request(request_id: str) -> bool:
            request = engine.scheduler.requests.get(request_id)
            return (request is not None and POISON in request.prompt_token_ids
                    and request.num_output_tokens >= FAIL_AFTER)

        def faulty(out, *args, **kwargs):
            if any(poisoned_request(s.request_id) for s in out.scheduled):
                raise RuntimeError("injected fault")
            return execute(out, *args, **kwargs)

        monkeypatch.setattr(engine.executor, "execute_model", faulty)
    return install


def test_a_failing_step_fails_only_its_requests(smollm2_gguf, loaded_model, poisoned):
    """One sequence a step: the poisoned request fails (500 whole, an error event when
    streamed) while the request queued behind it, and later ones, complete."""
    with run_server(smollm2_gguf, loaded_model,
                    engine_options={"max_num_seqs": 1}) as server:
        engine = server.engine.engine
        poisoned(engine)
        client = server.client()
        queued: list = []

        def behind() -> None:  # admitted while the poisoned request runs: waits for it
            wait_for(lambda: engine.has_unfinished_requests())
            queued.append(client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=8,
                extra_body={"ignore_eos": True}))

        thread = threading.Thread(target=behind)
        thread.start()
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt=[1, 2, POISON, 4], max_tokens=64,
                                      extra_body={"ignore_eos": True})
        assert "model step failed" in err.value.body["message"]
        assert err.value.body["type"] == "server_error"
        thread.join(60)
        assert queued and queued[0].usage.completion_tokens == 8
        with server.http() as http:  # streamed: the error arrives as an event
            body = {"model": MODEL, "prompt": [1, POISON], "max_tokens": 64, "stream": True,
                    "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as resp:
                events = [json.loads(line[5:]) for line in resp.iter_lines()
                          if line.startswith("data:") and line != "data: [DONE]"]
            assert "model step failed" in events[-1]["error"]["message"]
            assert http.get("/health").status_code == 200  # the engine goes on
        again = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert again.usage.completion_tokens == 4
        wait_for(lambda: all_blocks_free(engine))


def test_request_timeout_ends_the_request_and_frees_its_blocks(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, request_timeout=0.5) as server:
        client = server.client()
        # 400 tokens run far past 0.5 s: the 504, not the answer, ends the request
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=MODEL, prompt="Count to a thousand:",
                                      max_tokens=400, extra_body={"ignore_eos": True})
        assert err.value.status_code == 504
        assert "request timeout" in err.value.body["message"]
        assert err.value.body["code"] == "request_timeout"
        wait_engine_idle(server)
        assert all_blocks_free(server.engine.engine)
        short = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert short.usage.completion_tokens == 2  # quick requests are unaffected


def test_a_slow_reader_holds_a_bounded_stream(smollm2_gguf, loaded_model, monkeypatch):
    """A stream nobody reads while its request makes 2.5x the pending cap keeps at most the
    cap's outputs (older ones merged), and reading it later gives exactly what a prompt
    reader gets. The cap (MAX_PENDING_OUTPUTS) is lowered to 16 for the test."""
    cap = 16
    monkeypatch.setattr(request_stream, "MAX_PENDING_OUTPUTS", cap)
    num_tokens = cap * 5 // 2
    engine = Engine(_engine_config(smollm2_gguf, loaded_model), loaded=loaded_model)
    async_engine = AsyncEngine(engine)
    async_engine.start()
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def run() -> tuple[list[int], list[int], int, int]:
        prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
        prompt_read = []
        async for out in async_engine.generate(prompt, params):
            prompt_read += out.outputs[0].token_ids
        stream = await async_engine.add_request(prompt, params)
        idle = await asyncio.get_running_loop().run_in_executor(None, async_engine.wait_idle,
                                                                 60)
        assert idle, "the engine did not finish the request"
        await asyncio.sleep(0)  # the loop runs the deliveries the engine thread queued
        pending, merged = stream.queue.qsize(), stream.num_merged
        late_read = []
        async for out in stream:
            late_read += out.outputs[0].token_ids
        return prompt_read, late_read, pending, merged

    try:
        prompt_read, late_read, pending, merged = asyncio.run(run())
    finally:
        asyncio.run(async_engine.shutdown())
    assert pending <= cap and merged > 0
    assert late_read == prompt_read and len(late_read) == num_tokens


def test_request_timeout_in_the_engine(smollm2_gguf, loaded_model):
    engine = Engine(_engine_config(smollm2_gguf, loaded_model), loaded=loaded_model)
    async_engine = AsyncEngine(engine, request_timeout=0.3)
    async_engine.start()
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def run() -> None:
        with pytest.raises(RequestTimeout):
            async for _ in async_engine.generate({"prompt_token_ids": [1, 2, 3]}, params):
                pass

    try:
        asyncio.run(run())
        wait_for(lambda: all_blocks_free(engine))
    finally:
        asyncio.run(async_engine.shutdown())


DIE_AFTER_FIRST_STEP = """
import sys
from llmserve.engine.async_engine import AsyncEngine
from llmserve.entrypoints.cli import main
deliver = AsyncEngine._deliver
def dying(self, outputs):
    deliver(self, outputs)
    raise SystemError("injected: the engine thread dies")
AsyncEngine._deliver = dying
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_thread_fails_requests_and_exits_nonzero(smollm2_gguf):
    """The engine thread dies after its first step: the request in flight gets a 503 (no
    hang), and the process exits 1 (for a supervisor to restart it)."""
    import httpx

    args = ["--model", str(smollm2_gguf), "--port", "0", "--kv-cache-memory", "32MiB",
            "--max-model-len", "256"]
    with cli_server(args, entry=["-c", DIE_AFTER_FIRST_STEP]) as (proc, url):
        base = url.removesuffix("/v1")
        with httpx.Client(base_url=base, timeout=60) as http:
            resp = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 32,
                                                      "ignore_eos": True})
            assert resp.status_code == 503
            assert "engine stopped" in resp.json()["error"]["message"]
        assert proc.wait(60) == 1
        assert "the engine thread died" in proc.stderr.read()


def test_a_dead_engine_thread_turns_health_503(smollm2_gguf, loaded_model, monkeypatch):
    """In process, where the server outlives its engine thread: /health says 503, new
    requests get a 503 at once, and `on_fatal` was told."""
    deliver = AsyncEngine._deliver

    def dying(self, outputs):
        deliver(self, outputs)
        raise SystemError("injected: the engine thread dies")

    monkeypatch.setattr(AsyncEngine, "_deliver", dying)
    with run_server(smollm2_gguf, loaded_model) as server:
        told: list[BaseException] = []
        server.engine.on_fatal = told.append
        with server.http() as http:
            assert http.get("/health").status_code == 200
            first = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                      "max_tokens": 8, "ignore_eos": True})
            assert first.status_code == 503
            wait_for(lambda: bool(told))
            assert isinstance(told[0], SystemError)
            assert http.get("/health").status_code == 503
            later = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                      "max_tokens": 8})
            assert later.status_code == 503
