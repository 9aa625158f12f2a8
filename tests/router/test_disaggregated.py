"""The disaggregated router (`llmserve router --prefill URL --decode URL`) over real HTTP, in
front of a fake prefill server and a fake decode server (tests/router/fake_backend.py):
what each hop's body holds, passthrough, what goes direct to decode, metrics, failures."""

import concurrent.futures
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.entrypoints.cli import main
from llmserve.router.app import RouterSettings, build_disaggregated_app
from llmserve.router.disaggregated import direct_reason, prefill_body
from tests.router.fake_backend import FakeBackend, serve_in_thread
from tests.router.helpers import FAST_HEALTH, wait_for

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass
class SplitRouter:
    url: str
    prefill: FakeBackend
    decode: FakeBackend
    decode_url: str

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0,
                             timeout=30)

    def transfer_ids(self) -> tuple[list[str], list[str]]:
        """The transfer ids the prefill server and the decode server were sent."""
        return ([b["kv_transfer_params"]["transfer_id"] for b in self.prefill.bodies],
                [b["kv_transfer_params"]["transfer_id"] for b in self.decode.bodies
                 if "kv_transfer_params" in b])


@contextmanager
def split_router(**settings: Any) -> Iterator[SplitRouter]:
    prefill = FakeBackend("prefill", prefix_hits=3)
    decode = FakeBackend("decode", prefix_hits=5)
    with serve_in_thread(prefill.app) as prefill_url, \
            serve_in_thread(decode.app) as decode_url:
        app = build_disaggregated_app(prefill_url, decode_url,
                                      RouterSettings(**{**FAST_HEALTH, **settings}))
        with serve_in_thread(app) as url:
            yield SplitRouter(url, prefill, decode, decode_url)


@pytest.fixture
def router() -> Iterator[SplitRouter]:
    with split_router() as running:
        yield running


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ---- which requests split, and the prefill hop's body (no HTTP) ---------------------------


@pytest.mark.parametrize(("path", "body", "reason"), [
    (COMPLETIONS, {"prompt": "Hi", "n": 1, "best_of": None, "logprobs": None}, None),
    (COMPLETIONS, {"prompt": [1, 2, 3]}, None),
    (COMPLETIONS, {"prompt": ["one prompt"]}, None),
    (COMPLETIONS, {"prompt": [[1, 2]]}, None),
    (CHAT, {"messages": [], "logprobs": False, "echo": False}, None),
    (COMPLETIONS, {"prompt": "Hi", "n": 2}, "n is 2, not 1"),
    (CHAT, {"messages": [], "n": True}, "n is True, not 1"),
    (COMPLETIONS, {"prompt": "Hi", "best_of": 3}, "best_of is 3, not 1"),
    (COMPLETIONS, {"prompt": "Hi", "use_beam_search": True}, "it uses beam search"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 0}, "it asks for logprobs"),
    (CHAT, {"messages": [], "logprobs": True}, "it asks for logprobs"),
    (CHAT, {"messages": [], "top_logprobs": 2}, "it asks for logprobs"),
    (CHAT, {"messages": [], "prompt_logprobs": 1}, "it asks for prompt logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "echo": True}, "it echoes the prompt"),
    (COMPLETIONS, {"prompt": ["one", "two"]}, "the prompt is not a single prompt"),
    (COMPLETIONS, {"prompt": [[1], [2]]}, "the prompt is not a single prompt"),
    (COMPLETIONS, {}, "the prompt is not a single prompt"),
    (COMPLETIONS, None, "the body is not a JSON object"),
])
def test_direct_reason(path, body, reason):
    assert direct_reason(path, body) == reason


def test_prefill_body_asks_for_one_whole_token_and_keeps_the_kv_cache():
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 50,
            "min_tokens": 4, "temperature": 0.5}
    assert prefill_body(chat, "t1") == {
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": False,
        "max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 1, "temperature": 0.5,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t1"}}
    assert prefill_body({"prompt": "Hi", "min_tokens": 0, "max_tokens": 9}, "t2") == {
        "prompt": "Hi", "min_tokens": 0, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t2"}}
    assert chat["stream"] is True and "kv_transfer_params" not in chat  # not modified


# ---- the two hops over HTTP ----------------------------------------------------------------


def test_split_request_prefills_one_token_then_decodes_the_original(router):
    body = {"model": "fake", "prompt": "Once upon a time", "max_tokens": 7, "min_tokens": 3,
            "temperature": 0}
    with router.http() as http:
        answers = [http.post(COMPLETIONS, json=body) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json()["choices"][0]["text"] == "decode"
    prefilled, decoded = router.transfer_ids()
    assert prefilled == decoded and len(set(decoded)) == 2
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in decoded)
    assert router.prefill.bodies[0] == {
        **body, "max_tokens": 1, "min_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": prefilled[0]}}
    assert router.decode.bodies[0] == {**body,
                                       "kv_transfer_params": {"transfer_id": decoded[0]}}


def test_stream_passes_through_and_the_prefill_hop_is_not_streamed(router):
    body = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 20}
    with router.http() as http:
        routed = http.post(CHAT, json=body)
    (transfer_id,), _ = router.transfer_ids()
    decoded = {**body, "kv_transfer_params": {"transfer_id": transfer_id}}
    direct = httpx.post(f"{router.decode_url}{CHAT}", json=decoded)
    assert routed.headers["content-type"].startswith("text/event-stream")
    assert routed.content == direct.content and routed.content.endswith(b"data: [DONE]\n\n")
    assert router.decode.bodies[0] == decoded
    prefill = router.prefill.bodies[0]
    assert (prefill["stream"], prefill["max_tokens"], prefill["max_completion_tokens"]) == (
        False, 1, 1)
    assert "stream_options" not in prefill
    stream = router.client().completions.create(model="fake", prompt="Once", stream=True)
    assert [chunk.choices[0].text for chunk in stream] == ["decode "] * 3


def test_client_leaving_a_stream_closes_it_on_the_decode_server(router):
    with router.http() as http:
        with http.stream("POST", COMPLETIONS, json={"prompt": "slow story", "stream": True}
                         ) as stream:
            lines = stream.iter_lines()  # held: a dropped iterator closes the connection
            assert next(lines).startswith("data: {") and router.decode.open_streams == 1
        wait_for(lambda: router.decode.open_streams == 0, 5, "decode streams to nobody")
        metrics = samples(http.get("/metrics").text)
    assert metrics[("llmserve_router_requests_in_flight", (("role", "decode"),))] == 0


def test_prefill_error_is_returned_unchanged_and_decode_not_called(router):
    with pytest.raises(openai.BadRequestError) as e:
        router.client().completions.create(model="fake", prompt="error please", max_tokens=0)
    assert e.value.body == {"message": "max_tokens: must be at least 1",
                            "type": "invalid_request_error", "param": "max_tokens",
                            "code": None}
    with router.http() as http:
        busy = http.post(CHAT, json={"messages": [{"role": "user", "content": "busy now"}]})
    assert busy.status_code == 429 and busy.headers["retry-after"] == "7"
    assert busy.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(router.prefill.bodies) == 2 and router.decode.bodies == []


def test_requests_that_cannot_be_split_go_to_decode_unchanged(router):
    direct = [
        (COMPLETIONS, {"prompt": "Hi", "n": 2}),
        (COMPLETIONS, {"prompt": "Hi", "logprobs": 2}),
        (COMPLETIONS, {"prompt": "Hi", "echo": True}),
        (COMPLETIONS, {"prompt": ["first", "second"], "max_tokens": 3}),
        (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}),
    ]
    with router.http() as http:
        for path, body in direct:
            assert http.post(path, json=body).json()["choices"][0]["index"] == 0
        tokens = http.post("/tokenize", json={"prompt": "hello"}).json()
        models = http.get("/v1/models").json()
        metrics = samples(http.get("/metrics").text)
    assert router.decode.bodies == [body for _, body in direct] + [{"prompt": "hello"}, {}]
    assert [path for path, _ in router.decode.seen] == [p for p, _ in direct] + [
        "/tokenize", "/v1/models"]
    assert router.prefill.seen == []
    assert (tokens["by"], models["data"][0]["owned_by"]) == ("decode", "decode")
    assert metrics[("llmserve_router_disaggregated_total", (("path", "direct"),))] == 5
    assert metrics[("llmserve_router_disaggregated_total", (("path", "split"),))] == 0


def test_metrics_carry_role_labels(router):
    client = router.client()
    client.completions.create(model="fake", prompt="split me", max_tokens=2)
    client.completions.create(model="fake", prompt="Hi", n=2)  # direct
    with router.http() as http:
        response = http.get("/metrics")
    metrics = samples(response.text)
    # the fakes hold 3 (prefill) and 5 (decode) prefix-cache hits
    assert metrics[("llmserve_prefix_cache_hits_total", (("role", "prefill"),))] == 3
    assert metrics[("llmserve_prefix_cache_hits_total", (("role", "decode"),))] == 5
    assert metrics[("llmserve_time_to_first_token_seconds_bucket",
                    (("le", "1.0"), ("role", "decode")))] == 1
    assert metrics[("llmserve_router_requests_total", (("role", "prefill"),))] == 1
    assert metrics[("llmserve_router_requests_total", (("role", "decode"),))] == 2
    assert metrics[("llmserve_router_disaggregated_total", (("path", "split"),))] == 1
    assert metrics[("llmserve_router_disaggregated_total", (("path", "direct"),))] == 1
    assert metrics[("llmserve_router_prefill_seconds_count", ())] == 1
    assert metrics[("llmserve_router_replica_up", (("role", "prefill"),))] == 1
    assert response.text.count("# TYPE llmserve_prefix_cache_hits_total counter") == 1
    assert "replica=" not in response.text and "llmserve_router_affinity" not in response.text


def test_api_key_checked_here_and_forwarded_on_both_hops():
    with split_router(api_key="secret") as router:
        assert httpx.post(f"{router.url}{COMPLETIONS}", json={"prompt": "x"}).status_code == 401
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="secret", max_retries=0)
        assert client.completions.create(model="fake", prompt="x").choices[0].text == "decode"
    for backend in (router.prefill, router.decode):
        assert [headers["authorization"] for _, headers in backend.seen] == ["Bearer secret"]


# ---- a server that is down -----------------------------------------------------------------


def test_health_is_503_naming_the_server_that_is_down(router):
    router.prefill.healthy = False
    with router.http() as http:
        wait_for(lambda: http.get("/health").status_code == 503, 5, "still healthy")
        health = http.get("/health").json()
        split = http.post(COMPLETIONS, json={"prompt": "split me"})
        direct = http.post(COMPLETIONS, json={"prompt": "Hi", "n": 2})
        router.prefill.healthy = True
        wait_for(lambda: http.get("/health").status_code == 200, 5, "prefill not back")
        router.decode.healthy = False
        wait_for(lambda: http.get("/health").status_code == 503, 5, "still healthy")
        no_decode = http.post(COMPLETIONS, json={"prompt": "split me"})
    assert health["error"]["message"] == "prefill server is down (/health answered 503)"
    assert [(d["role"], d["reason"]) for d in health["down"]] == [
        ("prefill", "/health answered 503")]
    assert split.status_code == 503 and split.headers["retry-after"] == "1"
    assert split.json()["error"]["message"] == "prefill server is down (/health answered 503)"
    assert direct.json()["choices"][0]["text"] == "decode"  # needs only the decode server
    assert no_decode.status_code == 503
    assert no_decode.json()["error"]["message"].startswith("decode server is down")
    assert router.prefill.seen == []  # a prefill nobody would decode is not started


def test_a_server_going_down_ends_its_requests_in_flight_with_503(router):
    client = router.client()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.completions.create, model="fake", prompt="hang on")
        wait_for(lambda: router.prefill.seen, 10, "the request did not reach prefill")
        router.prefill.healthy = False
        with pytest.raises(openai.InternalServerError) as prefilling:
            pending.result(timeout=10)
    assert prefilling.value.body["message"] == (
        "prefill server is down: /health answered 503")
    assert router.decode.seen == []
    router.prefill.healthy = True
    with router.http() as http:
        wait_for(lambda: http.get("/health").status_code == 200, 5, "prefill not back")
    stream = client.completions.create(model="fake", prompt="slow story", stream=True)
    assert next(iter(stream)).choices[0].text == "decode "
    router.decode.healthy = False
    with pytest.raises(openai.APIError) as decoding:
        for _ in stream:
            pass
    assert "decode server is down: /health answered 503" in str(decoding.value)


# ---- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["--replica", "http://a", "--prefill", "http://b", "--decode", "http://c"],
     "--replica cannot be combined with --prefill/--decode"),
    (["--prefill", "http://b"], "--prefill and --decode go together"),
    (["--prefill", "http://b", "--prefill", "http://c", "--decode", "http://d"],
     "--prefill was given 2 times"),
    ([], "give the servers to route to"),
])
def test_router_flags_take_replicas_or_one_prefill_and_one_decode(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["router", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
