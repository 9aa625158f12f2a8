"""Storms: random adds, aborts and client disconnects over real HTTP against a server whose
KV cache holds a few requests only (32 in flight preempt all the time), then the books.

One seeded RNG plans the operations; 32 run at once. Each is a completion or a chat
(whole or streamed, n = 1..3, several prompts in one request, logprobs, prompt logprobs,
echo, stop strings, seeds), a stream read slowly, a stream hung up on after a few chunks,
a request whose task is cancelled at a random moment (queued, prefilling or mid-stream:
the client disconnects), a request the server must refuse (400/404, OpenAI's error
shape), or a beam search with some aborted mid-search (in process, on the same engine:
beam search is not served over HTTP, where `use_beam_search` is one of the refusals).
A queue cap makes some requests 429s with Retry-After (retried after it, twice at most).

Afterwards nothing may be lost or left behind: every operation completed with a valid
body, was cancelled by us, or was refused with a reason, none hung (a timeout per
operation); the engine holds no request state; every KV block is back in the free queue
(`ref_cnt == 0`; the prefix-cached ones are free too, only findable); /metrics says
nothing runs or waits and the server finished every request it admitted; the server
still answers.

The default suite runs 100 operations (`NUM_OPS`); the `slow` cases run 1,000 (53 s on 2
quiet cores) and 3,000 (`pytest -m slow`).
"""

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from llmserve.engine.async_engine import QueueFull
from llmserve.sampling_params import SamplingParams
from tests.entrypoints.openai.conftest import MODEL, run_server, wait_engine_idle
from tests.entrypoints.openai.test_metrics import scrape, value

NUM_OPS = 100
NUM_OPS_SLOW = (1000, 3000)
CONCURRENCY = 32
# float32 KV of the default model: 8 blocks of 16 tokens. A request needs 2-4 blocks
# (prompt + up to 16 tokens; n > 1 siblings and beams share their prompt's), so 32 in
# flight preempt all the time, however fast the engine runs against its clients (beams
# hold blocks only for the step they run; with 12 blocks a busy machine saw no preemption)
KV_CACHE_MEMORY = f"{8 * 16 * 30 * 2 * 3 * 64 * 4}"
MAX_NUM_WAITING = 40  # engine requests (n > 1 siblings, each prompt of a request) waiting
MAX_TRIES, RETRY_AFTER_S = 3, 1.0  # a 429's Retry-After is 1 s
OP_TIMEOUT_S = 120.0
PROMPTS = ["The capital of France is", "The capital of France is a city that",
           "1, 2, 3, 4,", "Once upon a time", "The best way to learn Python is",
           "My favourite food is", "Water boils at", "A haiku about autumn:",
           "Translate to French: good morning", "def fibonacci(n):",
           "The three primary colours are", "Q: What is 2 + 2?\nA:"]
STOPS = [[" the"], ["\n"], [".", ","], ["is"]]
REFUSALS = [  # (body changes, HTTP status, the param the error names, completions only)
    ({"use_beam_search": True}, 400, "use_beam_search", False),
    ({"max_tokens": 0}, 400, "max_tokens", True),  # scoring only (0) needs echo
    ({"max_tokens": 10_000}, 400, "max_tokens", False),  # past the model's context
    ({"max_tokens": 300}, 400, "max_tokens", False),  # past the whole KV cache
    ({"model": "no-such-model"}, 404, "model", False),
    ({"n": 0}, 400, "n", False),
]


@dataclass
class Op:
    """One planned operation: `kind` and what it sends (HTTP) or runs (beam)."""

    index: int
    kind: str  # whole, stream, slow, hang_up, cancel, refuse, beam
    route: str  # completions or chat
    body: dict[str, Any]
    hang_up_after: int = 0  # hang_up: the chunks read before hanging up
    cancel_after_s: float | None = None  # cancel (HTTP or beam): when the task is cancelled
    refusal: tuple[int, str] | None = None  # refuse: (status, param)


def plan(rng: random.Random, index: int) -> Op:
    kind = rng.choices(("whole", "stream", "slow", "hang_up", "cancel", "refuse", "beam"),
                       weights=(30, 25, 8, 10, 12, 8, 7))[0]
    refusal = rng.choice(REFUSALS) if kind == "refuse" else None
    route = "completions" if refusal and refusal[3] else rng.choice(("completions", "chat"))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(4, 12),
                            "stream": kind in ("stream", "slow", "hang_up")
                            or (kind == "cancel" and rng.random() < 0.5)}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    elif rng.random() < 0.2:
        body["prompt"] = rng.sample(PROMPTS, 2)  # two prompts: two engine requests
    else:
        body["prompt"] = rng.choice(PROMPTS)
    body.update(_sampling_options(rng, route, body["stream"]))
    op = Op(index, kind, route, body)
    if kind == "hang_up":
        op.hang_up_after = rng.randint(1, 3)
    elif kind == "cancel" or (kind == "beam" and rng.random() < 0.4):
        # before it is sent, while it queues or prefills, or mid-answer on a slow machine
        op.cancel_after_s = rng.choice((0.0, rng.uniform(0.0, 0.3), rng.uniform(0.0, 3.0)))
    elif refusal is not None:
        changes, status, param, _ = refusal
        body.pop("echo", None)
        body.update(changes)
        op.refusal = (status, param)
    return op


def _sampling_options(rng: random.Random, route: str, stream: bool) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if rng.random() < 0.4:
        options["n"] = rng.randint(2, 3)
    if rng.random() < 0.5:
        options.update(temperature=0.8, seed=rng.randrange(1000))
    else:
        options["temperature"] = 0.0
    if rng.random() < 0.3:
        options["ignore_eos"] = True
    if rng.random() < 0.2:
        options["stop"] = rng.choice(STOPS)
    if rng.random() < 0.25:
        options["prompt_logprobs"] = rng.randint(0, 2)
    if rng.random() < 0.25:
        if route == "chat":
            options.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        else:
            options["logprobs"] = rng.randint(0, 3)
    elif route == "completions" and rng.random() < 0.2:
        options["echo"] = True
    if stream and rng.random() < 0.5:
        options["stream_options"] = {"include_usage": True}
    return options


# ---- checking what came back ---------------------------------------------------------------


def prompt_count(op: Op) -> int:
    """Prompts in the request: one engine request (and one n-choice group) each."""
    prompts = op.body.get("prompt")
    return len(prompts) if isinstance(prompts, list) else 1


def num_choices(op: Op) -> int:
    return prompt_count(op) * op.body.get("n", 1)


def check_error(response: httpx.Response, refusal: tuple[int, str] | None) -> str:
    """An explicit refusal in OpenAI's error shape: the one `refusal` expects (status, the
    param it names), or, for any request, queue full (429 with Retry-After)."""
    status = response.status_code
    assert status == 429 or (refusal is not None and status == refusal[0]), (status,
                                                                              response.text)
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"], error
    if status == 429:
        assert error["code"] == "rate_limit_exceeded", error
        assert int(response.headers["retry-after"]) >= 1
    else:
        assert error["param"] == refusal[1], error
    return f"refused {status}"


def check_whole(op: Op, body: dict[str, Any]) -> None:
    """A whole response: every choice, each finished, within max_tokens, asked-for extras."""
    max_tokens, choices = op.body["max_tokens"], body["choices"]
    assert sorted(c["index"] for c in choices) == list(range(num_choices(op)))
    usage = body["usage"]
    assert len(choices) <= usage["completion_tokens"] <= max_tokens * len(choices), usage
    for c in choices:
        assert c["finish_reason"] in ("stop", "length"), c
        if op.body.get("ignore_eos") and not op.body.get("stop"):
            assert c["finish_reason"] == "length", c
        if op.route == "chat":
            assert isinstance(c["message"]["content"], str)
            if op.body.get("logprobs"):
                assert 1 <= len(c["logprobs"]["content"]) <= max_tokens
        else:
            assert isinstance(c["text"], str)
            if op.body.get("logprobs") is not None:
                assert 1 <= len(c["logprobs"]["tokens"]) <= max_tokens
        if op.body.get("prompt_logprobs") is not None and op.route == "completions":
            check_prompt_logprobs(c["prompt_logprobs"])
    if op.body.get("prompt_logprobs") is not None and op.route == "chat":
        check_prompt_logprobs(body["prompt_logprobs"])
    if op.body.get("ignore_eos") and not op.body.get("stop"):
        assert usage["completion_tokens"] == max_tokens * len(choices), usage


def check_prompt_logprobs(entries: list[dict | None]) -> None:
    """One entry per prompt token, the first None (nothing before it to score it by)."""
    assert len(entries) > 1 and entries[0] is None and all(entries[1:]), entries


async def read_stream(op: Op, response: httpx.Response) -> str:
    """Read an SSE stream to [DONE] (slowly for `slow`, or hang up after a few chunks)."""
    finished: Counter = Counter()
    num_chunks, done, usage = 0, False, None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        event = json.loads(line[6:])
        assert "error" not in event, event
        for c in event["choices"]:
            if c.get("finish_reason") is not None:
                finished[c["index"]] += 1
                assert c["finish_reason"] in ("stop", "length"), c
        usage = event.get("usage") or usage
        num_chunks += 1
        if op.kind == "hang_up" and num_chunks == op.hang_up_after:
            return "hung up"  # leaving `client.stream` closes the connection
        if op.kind == "slow":
            await asyncio.sleep(0.05)
    assert done, "the stream ended without [DONE]"
    assert finished == Counter(range(num_choices(op))), finished  # each choice ends once
    if op.body.get("stream_options"):
        assert 0 < usage["completion_tokens"] <= op.body["max_tokens"] * num_choices(op)
    return "completed"


async def run_http(client: httpx.AsyncClient, op: Op) -> str:
    """Send the op; after a 429 wait its Retry-After and send again, as clients do (up to
    MAX_TRIES times)."""
    for _ in range(MAX_TRIES - 1):
        outcome = await send(client, op)
        if outcome != "refused 429":
            return outcome
        await asyncio.sleep(RETRY_AFTER_S)
    return await send(client, op)


async def send(client: httpx.AsyncClient, op: Op) -> str:
    path = f"/v1/{'chat/completions' if op.route == 'chat' else 'completions'}"
    if op.body["stream"]:
        async with client.stream("POST", path, json=op.body) as response:
            if response.status_code != 200:
                await response.aread()
                return check_error(response, op.refusal)
            assert op.refusal is None, f"{op.refusal} expected, got 200"
            return await read_stream(op, response)
    response = await client.post(path, json=op.body)
    if response.status_code != 200 or op.refusal is not None:
        return check_error(response, op.refusal)
    check_whole(op, response.json())
    return "completed"


async def run_beam(server, op: Op) -> str:
    """A beam search on the server's engine (2 of 3 beams kept), consumed to its end."""
    prompt = op.body.get("prompt") or op.body["messages"][0]["content"]
    prompt = prompt[0] if isinstance(prompt, list) else prompt
    params = SamplingParams(use_beam_search=True, n=2, beam_width=3,
                            max_tokens=op.body["max_tokens"])
    for _ in range(MAX_TRIES):
        final = None
        try:
            async for output in server.engine.generate(prompt, params):
                final = output
            break
        except QueueFull:  # the queue cap's refusal (429 over HTTP)
            await asyncio.sleep(RETRY_AFTER_S)
    else:
        return "refused QueueFull"
    assert final is not None and final.finished and len(final.outputs) == 2, final
    return "completed"


async def run_op(server, client: httpx.AsyncClient, op: Op) -> str:
    """The op's outcome: completed, hung up, cancelled, or refused ...; raises when the
    server's answer is wrong, or on a timeout (a hung request)."""
    work = run_beam(server, op) if op.kind == "beam" else run_http(client, op)
    task = asyncio.ensure_future(asyncio.wait_for(work, OP_TIMEOUT_S))
    if op.cancel_after_s is not None:
        done, _ = await asyncio.wait({task}, timeout=op.cancel_after_s)
        if not done:
            task.cancel()  # a client disconnect at whatever stage the request is in
            try:
                await task
            except asyncio.CancelledError:
                return "cancelled"
    return await task


# ---- the storm -----------------------------------------------------------------------------


@dataclass
class StormResult:
    outcomes: Counter  # (op kind, outcome) -> ops
    failures: list[str]  # wrong answers and timeouts
    completed_requests: int = 0  # engine requests (one per prompt) of completed ops
    other_requests: int = 0  # engine requests of ops cancelled, hung up on or refused

    def count(self, kind: str | None = None, outcome: str | None = None) -> int:
        return sum(n for (k, o), n in self.outcomes.items()
                   if kind in (None, k) and outcome in (None, o))


async def storm(server, num_ops: int, seed: int) -> StormResult:
    """Run `num_ops` planned operations, CONCURRENCY at a time."""
    rng = random.Random(seed)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(num_ops):
        queue.put_nowait(plan(rng, i))
    result = StormResult(Counter(), [])
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            op = queue.get_nowait()
            try:
                outcome = await run_op(server, client, op)
            except Exception as e:
                result.failures.append(f"op {op.index} {op.kind} {op.route} {op.body}: "
                                       f"{type(e).__name__}: {e}")
                continue
            result.outcomes[(op.kind, outcome)] += 1
            num_prompts = 1 if op.kind == "beam" else prompt_count(op)
            if outcome == "completed":
                result.completed_requests += num_prompts
            else:
                result.other_requests += num_prompts

    async with httpx.AsyncClient(base_url=server.url, timeout=OP_TIMEOUT_S,
                                 limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
    return result




def assert_nothing_left(server) -> None:
    """No request state anywhere, and every KV block free (prefix-cached ones included)."""
    async_engine, engine = server.engine, server.engine.engine
    scheduler, kv = engine.scheduler, engine.kv_manager
    pool = kv.pool
    assert async_engine._streams == {} and async_engine._adds == []
    assert engine.output_processor.states == {} and engine.output_processor.parents == {}
    assert scheduler.requests == {} and scheduler.waiting == [] and scheduler.running == []
    in_use = [b.block_id for b in pool.blocks if b.ref_cnt != 0]
    assert in_use == [], f"blocks still referenced: {in_use}"
    assert pool.num_free_blocks == pool.num_blocks, (pool.num_free_blocks, pool.num_blocks)
    assert sorted(pool.free_queue) == list(range(pool.num_blocks))
    for block_hash, block in pool.cached.items():  # free but findable by its prefix
        assert block.block_hash == block_hash
    # the runner drops finished rows at its next step: none may be held for anything else
    batch = engine.executor.runner.input_batch
    assert set(batch.requests) <= scheduler._finished_ids  # rows and parked generators
    assert async_engine.metrics._requests == {}


def finished_counts(families) -> Counter:
    return Counter({dict(labels)["finished_reason"]: v for (name, labels), v
                    in families.get("llmserve_request_success", {}).items()
                    if name == "llmserve_request_success_total"})


def run_storm(server, num_ops: int, seed: int) -> None:
    before = finished_counts(scrape(server))
    result = asyncio.run(storm(server, num_ops, seed))
    assert not result.failures, (f"{len(result.failures)} failed, first:\n"
                                 + "\n".join(result.failures[:5]))
    assert result.count() == num_ops  # every op has exactly one outcome
    for kind in ("whole", "stream", "slow", "hang_up", "cancel", "refuse", "beam"):
        assert result.count(kind), f"no {kind} op ran"
    assert result.count("cancel", "cancelled") and result.count("hang_up", "hung up")
    wait_engine_idle(server)
    assert_nothing_left(server)
    scheduler = server.engine.engine.scheduler
    assert scheduler.num_preemptions > 0, "the storm never preempted"
    families = scrape(server)
    assert value(families, "num_requests_running") == 0
    assert value(families, "num_requests_waiting") == 0
    assert value(families, "kv_cache_usage_ratio") == 0
    assert value(families, "num_preemptions", "num_preemptions_total") == (
        scheduler.num_preemptions)
    # every request the engine admitted was finished: the completed ones by a reason,
    # others by an abort (or by a reason, when it ended before the hang-up reached it)
    finished = finished_counts(families) - before
    num_aborts = finished.pop("abort", 0)
    assert 1 <= num_aborts <= result.other_requests
    assert result.completed_requests <= sum(finished.values()) <= (
        result.completed_requests + result.other_requests - num_aborts)
    assert_still_serves(server)
    print(f"storm of {num_ops}: {dict(sorted(result.outcomes.items()))}; "
          f"{scheduler.num_preemptions} preemptions; {num_aborts} aborts, "
          f"{dict(finished)} finished on the server")


def assert_still_serves(server) -> None:
    with server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and response.json()["usage"][
        "completion_tokens"] == 8


@pytest.fixture(scope="module")
def storm_server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, max_num_waiting=MAX_NUM_WAITING,
                    engine_options={"kv_cache_memory": KV_CACHE_MEMORY}) as running:
        yield running


def test_storm_leaves_nothing_behind(storm_server):
    run_storm(storm_server, NUM_OPS, seed=14)


@pytest.mark.slow
@pytest.mark.parametrize("num_ops", NUM_OPS_SLOW)
def test_long_storms(storm_server, num_ops):
    run_storm(storm_server, num_ops, seed=1000 + num_ops)
