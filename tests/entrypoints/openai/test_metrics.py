"""/metrics: Prometheus text that parses, with counts that match the requests served."""

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.conftest import MODEL, run_server

HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_prompt_tokens", "request_generation_tokens")
COUNTERS = ("prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
            "prefix_cache_queries", "prefix_cache_hits")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio")


def scrape(server) -> dict[str, dict]:
    """{family name: {(sample name, labels): value}}."""
    with server.http() as http:
        resp = http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    families = {}
    for family in text_string_to_metric_families(resp.text):
        families[family.name] = {
            (s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
    return families


def value(families, family: str, sample: str | None = None, **labels) -> float:
    samples = families[f"llmserve_{family}"]
    name = f"llmserve_{sample or family}"
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def metrics_server(smollm2_gguf, loaded_model):
    with run_server(smollm2_gguf, loaded_model) as running:
        yield running


def test_metrics_count_the_requests_served(metrics_server):
    client = metrics_server.client()
    before = scrape(metrics_server)
    assert value(before, "time_to_first_token_seconds", "time_to_first_token_seconds_count") == 0
    usages = []
    prompt = ("Tell me a story about a cat and a dog who become friends on a farm by the sea, "
              "with a wise old owl, a lost lamb and a storm that brings them together.")
    for i in range(3):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5 + i,
                                         temperature=0, extra_body={"ignore_eos": True})
        usages.append(resp.usage)
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"ignore_eos": True})
    usages.append(chat.usage)
    stream = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=3,
                                       stream=True, stream_options={"include_usage": True})
    usages.append([c for c in stream][-1].usage)
    num_requests = len(usages)

    after = scrape(metrics_server)
    for name in HISTOGRAMS:
        assert f"llmserve_{name}" in after, name
    for name in COUNTERS + GAUGES:
        assert f"llmserve_{name}" in after, name
    assert value(after, "time_to_first_token_seconds",
                 "time_to_first_token_seconds_count") == num_requests
    assert value(after, "e2e_request_latency_seconds",
                 "e2e_request_latency_seconds_count") == num_requests
    assert value(after, "request_success", "request_success_total",
                 finished_reason="length") == num_requests
    assert value(after, "prompt_tokens", "prompt_tokens_total") == sum(
        u.prompt_tokens for u in usages)
    assert value(after, "generation_tokens", "generation_tokens_total") == sum(
        u.completion_tokens for u in usages)
    assert value(after, "request_generation_tokens", "request_generation_tokens_sum") == sum(
        u.completion_tokens for u in usages)
    # the same long prompt three times: the prefix cache was asked and hit
    assert value(after, "prefix_cache_queries", "prefix_cache_queries_total") > 0
    assert value(after, "prefix_cache_hits", "prefix_cache_hits_total") > 0
    assert value(after, "num_requests_running") == 0
    assert value(after, "kv_cache_usage_ratio") == 0
    ttft_sum = value(after, "time_to_first_token_seconds", "time_to_first_token_seconds_sum")
    assert 0 < ttft_sum < 60 * num_requests


def test_speculative_decoding_metrics_match_the_engines_counts(smollm2_gguf, loaded_model):
    """A server with prompt lookup: the spec_decode counters equal the engine's running
    totals, and a quoting request's drafts were verified and mostly accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    with run_server(smollm2_gguf, loaded_model,
                    engine_options={"speculative_config": spec}) as server:
        before = scrape(server)
        assert value(before, "spec_decode_num_draft_tokens",
                     "spec_decode_num_draft_tokens_total") == 0
        passage = ("The first half hour of the day sets a tone that is surprisingly hard to "
                   "change later, and people who wake to an alarm on the far side of the "
                   "room tend to get up.")
        resp = server.client().chat.completions.create(
            model=MODEL, max_tokens=48, temperature=0, extra_body={"return_metrics": True},
            messages=[{"role": "user", "content": f"Repeat exactly: {passage}"}])
        stats = server.engine.engine.speculator.stats
        deadline = time.monotonic() + 10  # the engine thread updates after its loop turn
        while (after := scrape(server)) and value(
                after, "spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens_total"
        ) != stats.num_draft_tokens and time.monotonic() < deadline:
            time.sleep(0.05)
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert value(after, "spec_decode_num_drafts", "spec_decode_num_drafts_total") == \
        stats.num_drafts
    assert value(after, "spec_decode_num_draft_tokens",
                 "spec_decode_num_draft_tokens_total") == stats.num_draft_tokens
    assert value(after, "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_total") == stats.num_accepted_tokens
    assert value(after, "spec_decode_num_accepted_tokens_per_pos",
                 "spec_decode_num_accepted_tokens_per_pos_total", position="0") == \
        stats.accepted_per_position[0]
    assert value(after, "spec_decode_acceptance_rate") == pytest.approx(stats.acceptance_rate)
    assert value(after, "spec_decode_mean_accepted_length") == pytest.approx(
        stats.mean_accepted_length)
    # the one request's own figures, in its response and in the per-request histograms
    mine = resp.model_extra["metrics"]
    assert (mine["num_draft_tokens"], mine["num_accepted_tokens"], mine["num_spec_rounds"]) \
        == (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_drafts)
    assert mine["spec_acceptance_rate"] == pytest.approx(stats.acceptance_rate)
    assert mine["spec_mean_acceptance_length"] == pytest.approx(stats.mean_accepted_length)
    assert 1 < mine["tokens_per_decode_step"] <= mine["spec_mean_acceptance_length"]
    assert value(after, "spec_decode_request_mean_acceptance_length",
                 "spec_decode_request_mean_acceptance_length_sum") == pytest.approx(
        stats.mean_accepted_length)
    assert value(after, "request_tokens_per_decode_step",
                 "request_tokens_per_decode_step_sum") == pytest.approx(
        mine["tokens_per_decode_step"])
