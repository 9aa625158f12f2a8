"""Disaggregated prefill/decode end to end, as a user runs it: a prefill server and a
decode server (`llmserve serve --role ...`) meeting over gloo, and `llmserve router
--prefill URL --decode URL` in front. Greedy outputs equal a single engine's; a 1,000-token
prompt's KV is transferred, not recomputed (the decode server computes no prompt token);
the metrics carry each role."""

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve import SamplingParams
from llmserve.executor.ranks import free_port
from tests.router.helpers import wait_for

SERVE = ["--dtype", "float32", "--kv-cache-memory", "128MiB", "--max-model-len", "2048",
         "--threads", "1"]
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Name three prime numbers."]


@contextmanager
def process(args: list[str], log: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llmserve.entrypoints.cli", *args],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc, log
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def url_of(proc: subprocess.Popen, log: Path) -> str:
    def banner() -> re.Match | None:
        return re.search(r"at (http://\S+)/v1", log.read_text())

    wait_for(lambda: banner() or proc.poll() is not None, 120, f"no start: {log}")
    assert banner(), log.read_text()
    return banner().group(1)


@contextmanager
def server_pair(gguf: Path, logs: Path) -> Iterator[dict]:
    """A decode and a prefill server meeting at a free port: {role: (process, log)}."""
    address = f"127.0.0.1:{free_port()}"
    model = ["--model", str(gguf), "--served-model-name", "smollm2", "--port", "0"]
    with (process(["serve", *model, *SERVE, "--role", "decode", "--kv-transfer-address",
                   address], logs / "decode.log") as decode,
          process(["serve", *model, *SERVE, "--role", "prefill", "--kv-transfer-address",
                   address], logs / "prefill.log") as prefill):
        yield {"decode": decode, "prefill": prefill}


@pytest.fixture(scope="module")
def servers(smollm2_gguf, tmp_path_factory):
    """(router URL, prefill URL, decode URL)."""
    logs = tmp_path_factory.mktemp("pd")
    with server_pair(smollm2_gguf, logs) as pair:
        decode_url, prefill_url = url_of(*pair["decode"]), url_of(*pair["prefill"])
        with process(["router", "--prefill", prefill_url, "--decode", decode_url, "--port",
                      "0"], logs / "router.log") as router:
            yield url_of(*router), prefill_url, decode_url


def counters(url: str) -> dict[str, float]:
    """{sample name[labels]: value} of a server's or the router's metrics."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}[{labels}]" if labels else s.name] = s.value
    return values


def single_engine(llm, prompt_ids: list[int], max_tokens: int) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0] \
        .outputs[0].text


def test_long_prompt_kv_is_transferred_not_recomputed(servers, smollm2_llm):
    """Two hops by hand: 700+ prompt tokens computed on the prefill server only."""
    _, prefill_url, decode_url = servers
    tokenizer = smollm2_llm.tokenizer
    text = " ".join(f"Item {i} is a {'red' if i % 3 else 'blue'} box." for i in range(80))
    ids = tokenizer.encode(text)
    assert len(ids) >= 700
    before = counters(decode_url)
    transfer = uuid.uuid4().hex
    body = {"model": "smollm2", "prompt": ids, "temperature": 0}
    first = httpx.post(f"{prefill_url}/v1/completions", timeout=120, json={
        **body, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer}})
    assert first.status_code == 200, first.text
    rest = httpx.post(f"{decode_url}/v1/completions", timeout=120, json={
        **body, "max_tokens": 16, "kv_transfer_params": {"transfer_id": transfer}})
    assert rest.status_code == 200, rest.text
    assert rest.json()["choices"][0]["text"] == single_engine(smollm2_llm, ids, 16)
    assert rest.json()["choices"][0]["text"].startswith(first.json()["choices"][0]["text"])
    wait_for(lambda: counters(decode_url)["llmserve_kv_transfer_requests_total"]
             == before["llmserve_kv_transfer_requests_total"] + 1, 15, "no transfer counted")
    after = counters(decode_url)
    assert after["llmserve_prefill_computed_tokens_total"] == \
        before["llmserve_prefill_computed_tokens_total"] == 0
    # float32 K and V of every prompt block: 30 layers x 2 x blocks x 16 x 3 heads x 64
    num_blocks = -(-len(ids) // 16)
    assert after["llmserve_kv_transfer_bytes_total"] - before[
        "llmserve_kv_transfer_bytes_total"] == 30 * 2 * num_blocks * 16 * 3 * 64 * 4
    print(f"{len(ids)} prompt tokens: {num_blocks} blocks transferred, "
          f"{after['llmserve_kv_transfer_seconds_total']:.4f} s on the wire in total")


def test_router_outputs_equal_a_single_engine(servers, smollm2_llm):
    router_url, _, decode_url = servers
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0,
                           timeout=120)
    tokenizer = smollm2_llm.tokenizer
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        expected = single_engine(smollm2_llm, tokenizer.apply_chat_template(
            messages, tokenize=True), 24)
        reply = client.chat.completions.create(model="smollm2", messages=messages,
                                               max_tokens=24, temperature=0)
        assert reply.choices[0].message.content == expected
        stream = client.chat.completions.create(model="smollm2", messages=messages,
                                                max_tokens=24, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream
                       if c.choices) == expected
    completion = client.completions.create(model="smollm2", prompt="The capital of France is",
                                           max_tokens=12, temperature=0)
    assert completion.choices[0].text == single_engine(
        smollm2_llm, tokenizer.encode("The capital of France is"), 12)
    # every prompt above came through the transfer: none computed on the decode server
    assert counters(decode_url)["llmserve_prefill_computed_tokens_total"] == 0


def test_router_metrics_per_role(servers):
    router_url, _, _ = servers
    values = counters(router_url)
    for role in ("prefill", "decode"):
        assert f"llmserve_time_to_first_token_seconds_count[role={role}]" in values
        assert f"llmserve_kv_role_info[role={role}]" in values
    assert values["llmserve_prefill_computed_tokens_total[role=decode]"] == 0
    assert values["llmserve_prefill_computed_tokens_total[role=prefill]"] > 0


def test_decode_without_its_transfer_fails_clearly(servers):
    _, prefill_url, decode_url = servers
    plain = httpx.post(f"{prefill_url}/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 1, "kv_transfer_params": {"transfer_id": "t"}})
    assert plain.status_code == 400
    assert "do_remote_decode" in plain.json()["error"]["message"]
    unknown = httpx.post(f"{decode_url}/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 1, "kv_transfer_params": {"transfer": "t"}})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["param"] == "kv_transfer_params"


# slow tier: a server pair of its own (two model loads); the default tier's router tests
# cover a server that goes down (tests/router/test_disaggregated.py)
@pytest.mark.slow
@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_role_that_dies_turns_its_peer_unavailable(smollm2_gguf, tmp_path, victim):
    """SIGKILL one server: its peer sees the closed connection at once, /health turns 503
    within seconds, and a request that needs the peer gets a 503, not a hang."""
    with server_pair(smollm2_gguf, tmp_path) as pair:
        urls = {role: url_of(*server) for role, server in pair.items()}
        survivor = "decode" if victim == "prefill" else "prefill"
        pair[victim][0].kill()
        seconds = wait_for(lambda: httpx.get(f"{urls[survivor]}/health").status_code == 503,
                           5, f"the {survivor} server stayed healthy")
        print(f"{victim} killed: {survivor} unhealthy after {seconds:.2f} s")
        options = ({"transfer_id": "x"} if survivor == "decode"
                   else {"do_remote_decode": True, "transfer_id": "x"})
        refused = httpx.post(f"{urls[survivor]}/v1/completions", timeout=30, json={
            "prompt": "Hello", "max_tokens": 2, "kv_transfer_params": options})
        assert refused.status_code == 503
        assert f"the {victim} server went away" in refused.json()["error"]["message"]
