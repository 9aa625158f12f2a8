"""The router over real HTTP, in front of fake backends: passthrough, affinity, metrics,
auth, and replicas that hang or die with requests in flight."""

import concurrent.futures
import os
import signal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.router.replicas import Replica
from tests.router.fake_backend import FakeBackend, serve_in_thread
from tests.router.helpers import (
    backend_process,
    prompt_for,
    run_router,
    wait_for,
)

SHARED = "Summarise the following report for a busy reader in three bullet points. " * 4


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_stream_passes_through_event_for_event(router):
    client = router.client()
    stream = client.completions.create(model="fake", prompt="Once", max_tokens=3, stream=True)
    texts = [chunk.choices[0].text for chunk in stream]
    name = texts[0].strip()
    assert texts == [f"{name} "] * 3 and name in ("replica-0", "replica-1")
    body = {"model": "fake", "prompt": "Once", "stream": True}
    backend_url = router.backend_urls[int(name[-1])]
    with router.http() as http:
        routed = http.post("/v1/completions", json=body)
    direct = httpx.post(f"{backend_url}/v1/completions", json=body)
    assert routed.headers["content-type"].startswith("text/event-stream")
    assert routed.content == direct.content and routed.content.endswith(b"data: [DONE]\n\n")
    chat = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "Hi"}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat).count("replica-") == 3


def test_client_leaving_a_stream_closes_it_on_the_replica(router):
    prompts = [prompt_for(i, "slow story") for i in range(2)]
    with router.http() as http:
        for prompt in prompts:
            with http.stream("POST", "/v1/completions",
                             json={"prompt": prompt, "stream": True}) as stream:
                lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
                next(lines)
                assert sum(b.open_streams for b in router.backends) == 1
        wait_for(lambda: sum(b.open_streams for b in router.backends) == 0, 5,
                 "a replica still streams to nobody")
        metrics = samples(http.get("/metrics").text)
    assert [metrics[("llmserve_router_requests_in_flight", (("replica", str(i)),))]
            for i in range(2)] == [0, 0]


def test_errors_pass_through_unchanged(router):
    client = router.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="fake", prompt="error please", max_tokens=0)
    assert e.value.status_code == 400
    assert e.value.body == {"message": "max_tokens: must be at least 1",
                            "type": "invalid_request_error", "param": "max_tokens",
                            "code": None}
    with router.http() as http:
        busy = http.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "busy now"}]})
        not_json = http.post("/v1/completions", content=b"{not json")
    assert busy.status_code == 429 and busy.headers["retry-after"] == "7"
    assert busy.json()["error"]["code"] == "rate_limit_exceeded"
    # a body the router cannot read is the replica's to judge (the fake fails on it)
    assert (not_json.status_code, not_json.text) == (500, "Internal Server Error")


def test_shared_prefix_lands_on_one_replica_and_prefixes_spread(router):
    client = router.client()
    names = {client.completions.create(model="fake", prompt=SHARED + suffix,
                                       max_tokens=2).choices[0].text
             for suffix in ("one", "two", "three", "four")}
    assert len(names) == 1
    spread = {client.completions.create(model="fake", prompt=f"{i}: unrelated",
                                        max_tokens=2).choices[0].text for i in range(12)}
    assert spread == {"replica-0", "replica-1"}
    with router.http() as http:
        metrics = samples(http.get("/metrics").text)
    assert metrics[("llmserve_router_affinity_total", (("result", "hit"),))] == 3
    assert metrics[("llmserve_router_affinity_total", (("result", "miss"),))] == 13
    per_replica = [metrics[("llmserve_router_requests_total", (("replica", str(i)),))]
                   for i in range(2)]
    assert sum(per_replica) == 16 and min(per_replica) >= 1


def test_metrics_joined_with_a_replica_label(router):
    with router.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    metrics = samples(response.text)
    # the fakes hold 3 and 5 prefix-cache hits
    assert metrics[("llmserve_prefix_cache_hits_total", (("replica", "0"),))] == 3
    assert metrics[("llmserve_prefix_cache_hits_total", (("replica", "1"),))] == 5
    assert metrics[("llmserve_request_success_total",
                    (("finished_reason", "stop"), ("replica", "1")))] == 2
    assert metrics[("llmserve_time_to_first_token_seconds_bucket",
                    (("le", "1.0"), ("replica", "0")))] == 1
    assert metrics[("llmserve_router_replica_up", (("replica", "1"),))] == 1
    assert metrics[("llmserve_router_requests_in_flight", (("replica", "0"),))] == 0
    # one HELP/TYPE block per family, both replicas' samples in it
    assert response.text.count("# TYPE llmserve_prefix_cache_hits_total counter") == 1


def test_models_tokenize_health_version(router):
    client = router.client()
    assert [m.id for m in client.models.list().data] == ["fake"]
    with router.http() as http:
        tokens = http.post("/tokenize", json={"prompt": "hello"}).json()
        health = http.get("/health")
        version = http.get("/version").json()
        missing = http.get("/v1/nothing")
    assert tokens["tokens"] == [1, 2] and tokens["prompt"] == "hello"
    assert health.status_code == 200
    assert "version" in version
    assert missing.status_code == 404 and "error" in missing.json()


def test_api_key_checked_here_and_forwarded():
    backend = FakeBackend("replica-0")
    with serve_in_thread(backend.app) as url, \
            run_router([Replica(0, url)], api_key="secret") as router_url:
        denied = httpx.post(f"{router_url}/v1/completions", json={"prompt": "x"})
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        assert backend.seen == []
        client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="secret", max_retries=0)
        assert client.completions.create(model="fake", prompt="x").choices[0].text == "replica-0"
        assert httpx.get(f"{router_url}/health").status_code == 200  # open, as on a server
        page = httpx.get(f"{router_url}/")  # the chat page too: it asks for the key
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert backend.seen[-1][1]["authorization"] == "Bearer secret"


def test_hung_replica_fails_its_requests_with_503_within_seconds(router):
    """A replica whose /health fails is marked down: /health turns 503 naming it, the
    request it holds gets a 503 at once, new requests go elsewhere."""
    client = router.client()
    prompt = prompt_for(1, "hang on")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.completions.create, model="fake", prompt=prompt)
        wait_for(lambda: router.backends[1].seen, 10, "the request did not reach replica 1")
        assert not pending.done()
        router.backends[1].healthy = False
        with pytest.raises(openai.InternalServerError) as e:
            pending.result(timeout=10)
    assert e.value.status_code == 503
    assert e.value.body["message"].startswith("replica 1 is down: /health answered 503")
    with router.http() as http:
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["message"].startswith("replica 1 is down")
        assert [d["replica"] for d in health.json()["down"]] == [1]
        assert http.post("/v1/completions", json={"prompt": prompt_for(1, "again")}).json()[
            "choices"][0]["text"] == "replica-0"
        router.backends[1].healthy = True
        wait_for(lambda: http.get("/health").status_code == 200, 5, "replica 1 not back")


def test_killed_replica_ends_streams_and_requests_with_503():
    """SIGKILL a replica with a stream and a whole request in flight: the stream ends with
    an error event, the request with a 503, /health names it, its prefixes move."""
    backend = FakeBackend("replica-0")
    with serve_in_thread(backend.app) as url0, backend_process("replica-1") as (process, url1):
        replicas = [Replica(0, url0), Replica(1, url1, process=process)]
        with run_router(replicas) as router_url:
            client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="none",
                                   max_retries=0, timeout=30)
            stream = client.completions.create(model="fake", prompt=prompt_for(1, "slow one"),
                                               stream=True)
            first = next(iter(stream))
            assert first.choices[0].text == "replica-1 "
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(client.completions.create, model="fake",
                                      prompt=prompt_for(1, "hang on"))
                # the replica's process says when it holds the request
                assert process.stdout.readline() == "holding\n"
                os.kill(process.pid, signal.SIGKILL)
                with pytest.raises(openai.APIError) as streamed:
                    for _ in stream:
                        pass
                with pytest.raises(openai.InternalServerError) as whole:
                    pending.result(timeout=10)
            assert "replica 1 is down" in str(streamed.value)
            assert whole.value.status_code == 503
            assert whole.value.body["message"].startswith("replica 1 is down")
            with httpx.Client(base_url=router_url) as http:
                wait_for(lambda: http.get("/health").status_code == 503, 3, "still healthy")
                # named by its exit (a check under way when it died may first see the
                # refused connection; the next check names the exit)
                wait_for(lambda: "exited" in http.get("/health").json()["down"][0]["reason"],
                         3, "the exit is not named")
                assert http.get("/health").json()["down"][0]["replica"] == 1
                again = http.post("/v1/completions", json={"prompt": prompt_for(1, "moved")})
                assert again.json()["choices"][0]["text"] == "replica-0"
                failures = samples(http.get("/metrics").text)
            assert failures[("llmserve_router_replica_failures_total",
                             (("replica", "1"),))] == 2
            assert failures[("llmserve_router_replica_up", (("replica", "1"),))] == 0


def test_no_replica_up_is_a_503():
    with run_router([Replica(0, "http://127.0.0.1:9")]) as router_url:
        response = httpx.post(f"{router_url}/v1/completions", json={"prompt": "x"})
        health = httpx.get(f"{router_url}/health")
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["message"].startswith("no replica is up: replica 0 is down")
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert health.status_code == 503
