"""`return_metrics` (body) / `X-Return-Metrics` (header): the request's timeline in the
response, whole or streamed, for completions and chat."""

import json

import pytest

from tests.entrypoints.openai.conftest import MODEL

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
ASK = {"return_metrics": True, "ignore_eos": True}
TIMELINE = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time",
            "finished_time")


def check_timeline(metrics: dict, usage) -> None:
    """Ordered timestamps, latencies derived from them, counts as the usage says."""
    times = [metrics[k] for k in TIMELINE]
    assert times == sorted(times), dict(zip(TIMELINE, times, strict=True))
    assert metrics["queue_time_s"] == pytest.approx(times[1] - times[0])
    assert metrics["ttft_s"] == pytest.approx(times[2] - times[0])
    assert metrics["e2e_s"] == pytest.approx(times[4] - times[0])
    assert metrics["tpot_s"] == pytest.approx(
        (times[3] - times[2]) / (usage.completion_tokens - 1))
    assert metrics["num_prompt_tokens"] == usage.prompt_tokens
    assert metrics["num_cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert metrics["num_generation_tokens"] == usage.completion_tokens
    assert metrics["num_preemptions"] == 0 and metrics["num_preempted_tokens"] == 0
    assert metrics["num_draft_tokens"] == 0 and metrics["num_accepted_tokens"] == 0
    assert metrics["num_spec_rounds"] == 0
    assert metrics["spec_acceptance_rate"] is None
    assert metrics["spec_mean_acceptance_length"] is None
    assert metrics["tokens_per_decode_step"] == 1.0  # one token a step without drafts


def test_completion_metrics(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                     extra_body=ASK)
    assert resp.usage.completion_tokens == 5
    check_timeline(resp.model_extra["metrics"], resp.usage)


def test_chat_metrics(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                          extra_body=ASK)
    check_timeline(resp.model_extra["metrics"], resp.usage)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_streamed_metrics_come_in_the_usage_chunk(client, route):
    if route == "chat":
        stream = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_body=ASK)
    else:
        stream = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_body=ASK)
    chunks = list(stream)
    assert [i for i, c in enumerate(chunks) if "metrics" in c.model_extra] == [len(chunks) - 1]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    check_timeline(last.model_extra["metrics"], last.usage)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_metrics_without_usage_come_with_the_finish(server, route):
    body = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES}
    body |= {"model": MODEL, "max_tokens": 4, "stream": True, **ASK}
    with server.http() as http:
        events = [line.removeprefix("data: ") for line in
                  http.post(route, json=body).text.splitlines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [i for i, c in enumerate(chunks) if "metrics" in c] == [len(chunks) - 1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    metrics = chunks[-1]["metrics"]
    assert metrics["num_generation_tokens"] == 4
    assert metrics["ttft_s"] == pytest.approx(metrics["first_token_time"]
                                              - metrics["arrival_time"])


def test_a_repeated_long_prompt_shows_its_cached_tokens(client):
    prompt = "A long story about a lighthouse keeper and the sea. " * 12
    first, second = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                               extra_body=ASK) for _ in range(2))
    assert first.model_extra["metrics"]["num_cached_tokens"] == 0
    cached = second.model_extra["metrics"]["num_cached_tokens"]
    assert cached == second.usage.prompt_tokens_details.cached_tokens
    # all full blocks but the one holding the last prompt token (it is always computed)
    assert cached >= second.usage.prompt_tokens - 32


def test_the_header_asks_for_metrics(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                     extra_headers={"X-Return-Metrics": "1"},
                                     extra_body={"ignore_eos": True})
    check_timeline(resp.model_extra["metrics"], resp.usage)
    # the body's false wins over the header
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                     extra_headers={"X-Return-Metrics": "1"},
                                     extra_body={"return_metrics": False})
    assert "metrics" not in resp.model_extra


def test_no_flag_no_metrics_key(server):
    with server.http() as http:
        for route, body in [("/v1/completions", {"prompt": PROMPT}),
                            ("/v1/chat/completions", {"messages": MESSAGES})]:
            resp = http.post(route, json={"model": MODEL, "max_tokens": 2, **body})
            assert resp.status_code == 200 and "metrics" not in resp.json()
            stream = http.post(route, json={"model": MODEL, "max_tokens": 2, "stream": True,
                                            "stream_options": {"include_usage": True}, **body})
            assert '"metrics"' not in stream.text


def test_n_choices_report_the_request_and_each_choice(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2,
                                     temperature=1.0, seed=1, extra_body=ASK)
    metrics = resp.model_extra["metrics"]
    assert metrics["num_generation_tokens"] == resp.usage.completion_tokens == 8
    assert metrics["num_generation_tokens_per_choice"] == [4, 4]
    times = [metrics[k] for k in TIMELINE]
    assert times == sorted(times)


@pytest.mark.parametrize("body, headers, field", [
    ({"return_metrics": "yes"}, {}, "return_metrics"),
    ({"return_metrics": 1}, {}, "return_metrics"),
    ({}, {"X-Return-Metrics": "yes"}, "X-Return-Metrics"),
])
def test_an_invalid_flag_is_a_400_naming_it(server, body, headers, field):
    with server.http() as http:
        for route, prompt in [("/v1/completions", {"prompt": PROMPT}),
                              ("/v1/chat/completions", {"messages": MESSAGES})]:
            resp = http.post(route, json={"model": MODEL, **prompt, **body}, headers=headers)
            assert resp.status_code == 400
            error = resp.json()["error"]
            assert error["param"] == field and field in error["message"]
