"""A server with `--kv-offload-dir`, restarted: the second life reads the first life's
blocks, says so in `return_metrics` and `usage`, and counts them in /metrics."""

from tests.entrypoints.openai.conftest import MODEL, run_server, wait_engine_idle
from tests.entrypoints.openai.test_metrics import scrape, value

PROMPT = ("A field guide to the birds of the northern coast, chapter one. " * 20
          + "The first bird in this chapter is the")


def ask(server) -> tuple:
    resp = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "return_metrics": True})
    return resp.choices[0].text, resp.usage, resp.model_extra["metrics"]


def test_a_restarted_server_reads_its_previous_lifes_blocks(smollm2_gguf, loaded_model,
                                                            tmp_path):
    options = {"kv_offload_dir": str(tmp_path)}
    with run_server(smollm2_gguf, loaded_model, engine_options=options) as first:
        text, usage, metrics = ask(first)
        assert metrics["num_tier_cached_tokens"] == 0 and usage.prompt_tokens > 256
        wait_engine_idle(first)
        tier = first.engine.engine.kv_tier
        assert tier.flush(60)  # the writer runs at idle priority: it may not have yet
        assert tier.stats.bytes_written > 0
    with run_server(smollm2_gguf, loaded_model, engine_options=options) as second:
        again, usage, metrics = ask(second)
        assert again == text  # greedy: the blocks read back are the ones computed
        num_full = (usage.prompt_tokens - 1) // 16 * 16
        assert metrics["num_tier_cached_tokens"] == num_full
        assert metrics["num_cached_tokens"] == usage.prompt_tokens_details.cached_tokens
        assert usage.prompt_tokens_details.cached_tokens == num_full
        wait_engine_idle(second)
        families = scrape(second)
        assert value(families, "kv_tier_hits", "kv_tier_hits_total", tier="disk") \
            == num_full // 16
        assert value(families, "kv_tier_misses", "kv_tier_misses_total", tier="disk") == 0
        assert value(families, "prefix_cache_hits_by_tier", "prefix_cache_hits_by_tier_total",
                     tier="disk") == num_full
        assert value(families, "kv_tier_bytes_read", "kv_tier_bytes_read_total",
                     tier="disk") > 0
