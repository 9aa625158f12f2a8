"""Hostile constraints stall nobody: a constraint compiles off the engine thread, under a
size cap and a time budget, and one the parser cannot follow is a 400 naming the field.

Each probe runs beside a normal chat, whose latency is compared with the same chat's
alone, measured in the same test (the bound is a ratio, never an absolute time: a loaded
CI machine is slow for both). Before this, 300,000 choices stalled every other request
for ~7 minutes, and a nested-repeat regex answered 200 with text that broke it.
"""

import json
import logging
import statistics
import threading
import time
from typing import Any

import httpx
import pytest

from llmserve.sampling_params import MAX_CONSTRAINT_CHOICES
from tests.entrypoints.openai.conftest import run_server, wait_engine_idle
from tests.entrypoints.openai.test_metrics import scrape

CHAT = "/v1/chat/completions"
NORMAL = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
          "max_tokens": 24, "temperature": 0, "ignore_eos": True}
# a normal chat beside a hostile request takes at most this many times its time alone,
# measured just before it in the same test (the target is 1.5x, measured side by side by
# `llmserve bench hostile`: 1.10x at worst; the test leaves room for a 2-core CI machine
# whose other test worker comes and goes; before the fix the stall was minutes)
MAX_SLOWDOWN = 4.0
NESTED_REGEX = "((a{100}){100}){100}"  # passes the compile, spends the parser's budget


def _chat_seconds(http: httpx.Client) -> float:
    start = time.monotonic()
    reply = http.post(CHAT, json=NORMAL)
    assert reply.status_code == 200, reply.text
    return time.monotonic() - start


def _beside(http: httpx.Client, hostile: Any) -> tuple[float, Any]:
    """(the median latency of 3 normal chats run while `hostile()` runs on a thread, what
    `hostile()` returned)."""
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", hostile()))
    thread.start()
    latencies = [_chat_seconds(http) for _ in range(3)]
    thread.join(120)
    assert not thread.is_alive(), "the hostile request hung"
    return statistics.median(latencies), result["value"]


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as http:
        return http.post(CHAT, json=body)


def _stream(url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    with httpx.Client(base_url=url, timeout=120) as http, \
            http.stream("POST", CHAT, json={**body, "stream": True}) as reply:
        return reply.status_code, [line for line in reply.iter_lines() if line]


def _constrained(constraint: dict[str, Any], max_tokens: int = 16) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Pick one."}], "max_tokens": max_tokens,
            "temperature": 0, "structured_outputs": constraint}


@pytest.fixture(scope="module")
def server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model) as running:
        yield running


@pytest.fixture
def alone(server) -> float:
    """A normal chat's latency with nothing beside it, just before the probe (the median of
    3, after a warm-up)."""
    with server.http() as http:
        _chat_seconds(http)
        return statistics.median(_chat_seconds(http) for _ in range(3))


def test_a_huge_choice_is_refused_at_once_and_stalls_nobody(server, alone, caplog):
    choices = [f"c{i}x" for i in range(300_000)]  # 3.3 MB: under the body cap
    with server.http() as http, caplog.at_level(logging.INFO, logger="llmserve"):
        beside, reply = _beside(http, lambda: _post(server.url, _constrained(
            {"choice": choices})))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "structured_outputs"
    assert f"at most {MAX_CONSTRAINT_CHOICES}" in error["message"]
    assert beside <= MAX_SLOWDOWN * alone, (beside, alone)
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)  # no grammar in the log


def test_a_large_choice_under_the_cap_is_served_beside_the_others(server, alone):
    choices = [f"c{i}x" for i in range(MAX_CONSTRAINT_CHOICES)]
    with server.http() as http:
        beside, reply = _beside(http, lambda: _post(server.url, _constrained(
            {"choice": choices})))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] in choices
    assert beside <= MAX_SLOWDOWN * alone, (beside, alone)


@pytest.mark.parametrize("route", ["whole", "streamed"])
def test_a_constraint_the_parser_cannot_follow_is_an_error_naming_the_field(
        server, alone, route, caplog):
    """Over the parser's per-token budget while generating: a 400 (an error event when
    streamed), never a 200 with text that breaks the constraint."""
    body = _constrained({"regex": NESTED_REGEX})
    with server.http() as http, caplog.at_level(logging.INFO, logger="llmserve"):
        if route == "whole":
            beside, reply = _beside(http, lambda: _post(server.url, body))
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
        else:
            beside, (status, lines) = _beside(http, lambda: _stream(server.url, body))
            assert status == 200 and lines[-1] == "data: [DONE]", lines
            events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
            assert "error" in events[-1], events
            assert not any(choice["delta"].get("content")
                           for e in events[:-1] for choice in e["choices"]), events
            error = events[-1]["error"]
            assert error["code"] == 400
    assert error["param"] == "structured_outputs"
    assert error["type"] == "invalid_request_error"
    assert "structured_outputs" in error["message"]
    assert beside <= MAX_SLOWDOWN * alone, (beside, alone)
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)
    wait_engine_idle(server)
    assert server.engine.engine.kv_manager.usage == 0


def test_the_same_field_is_named_wherever_the_constraint_came_from(server):
    reply = _post(server.url, {**_constrained({}), "structured_outputs": None,
                               "response_format": {"type": "json_schema", "json_schema": {
                                   "name": "x", "schema": {"type": "string",
                                                           "enum": list(range(20_000))}}}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith("response_format"), error
    assert f"at most {MAX_CONSTRAINT_CHOICES}" in error["message"], error


class _SlowCompiles:
    """The grammar pool's work made to wait for `release` (a constraint that compiles for
    a long time), counting the compiles that ran."""

    def __init__(self, engine) -> None:
        self.structured = engine.engine.structured
        self.prepare = self.structured.prepare
        self.release = threading.Event()
        self.ran = 0

    def __enter__(self) -> "_SlowCompiles":
        def slow(*args: Any) -> Any:
            self.ran += 1
            self.release.wait(60)
            return self.prepare(*args)

        self.structured.prepare = slow
        return self

    def __exit__(self, *_: Any) -> None:
        self.release.set()
        self.structured.prepare = self.prepare


def test_past_the_grammar_timeout_a_request_is_refused_and_others_run(
        smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, grammar_timeout=0.5) as server, \
            _SlowCompiles(server.engine) as slow, server.http() as http:
        start = time.monotonic()
        reply = http.post(CHAT, json=_constrained({"choice": ["yes", "no"]}))
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "structured_outputs"
        assert "longer than 0.5 s to compile" in error["message"]
        assert time.monotonic() - start < 30
        _chat_seconds(http)  # the engine never waited for it
        slow.release.set()
        wait_engine_idle(server)
        assert server.engine.engine.kv_manager.usage == 0


def test_a_client_that_goes_away_cancels_its_wait(smollm2_gguf, loaded_model):
    """A request waiting for its constraint to compile never reaches the engine once its
    client has gone; a queued compile is dropped without running."""
    with run_server(smollm2_gguf, loaded_model, grammar_timeout=60) as server, \
            _SlowCompiles(server.engine) as slow:
        first = threading.Thread(target=_post, args=(
            server.url, _constrained({"choice": ["yes", "no"]})))
        first.start()  # holds the grammar pool's one thread
        deadline = time.monotonic() + 30
        while slow.ran < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with httpx.Client(base_url=server.url, timeout=1.0) as http, \
                pytest.raises(httpx.ReadTimeout):
            http.post(CHAT, json=_constrained({"choice": ["up", "down"]}))
        deadline = time.monotonic() + 30  # the server sees the disconnect and cancels
        while server.engine._num_compiling > 1:  # the queued compile (its count drops)
            assert time.monotonic() < deadline, "the queued compile was not cancelled"
            time.sleep(0.01)
        slow.release.set()
        first.join(60)
        assert slow.ran == 1  # the second constraint never compiled
        wait_engine_idle(server)
        finished = scrape(server)["llmserve_request_success"]
        assert sum(v for (name, _), v in finished.items()
                   if name == "llmserve_request_success_total") == 1, finished
        assert server.engine._num_compiling == 0


def test_compiles_waiting_past_the_queue_cap_are_429s(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model, max_num_waiting=1) as server, \
            _SlowCompiles(server.engine) as slow:
        first = threading.Thread(target=_post, args=(
            server.url, _constrained({"choice": ["yes", "no"]})))
        first.start()
        deadline = time.monotonic() + 30
        while slow.ran < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reply = _post(server.url, _constrained({"choice": ["up", "down"]}))
        assert reply.status_code == 429, reply.text
        assert "Retry-After" in reply.headers
        slow.release.set()
        first.join(60)
