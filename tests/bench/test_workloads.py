"""Benchmark prompts: exact token counts with the real tokenizer, shared prefixes, JSONL,
fresh prompts per sweep level, and the tokenizer choice (local, or the server's either shape)."""

import json

import httpx
import pytest

from llmserve.bench.serve import ServeBenchConfig, build_workload, pick_tokenizer
from llmserve.bench.workloads import (
    LocalTokenizer,
    ServerTokenizer,
    jsonl_workload,
    random_workload,
    shared_prefix_workload,
)
from llmserve.entrypoints.cli import main
from llmserve.errors import LLMServeError


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return LocalTokenizer(str(smollm2_gguf))


@pytest.mark.parametrize("input_len", [1, 7, 128])
def test_random_prompts_encode_to_exact_length(tokenizer, input_len):
    requests = random_workload(tokenizer, 4, input_len, output_len=5, seed=input_len)
    for r in requests:
        assert len(tokenizer.encode(r.prompt)) == r.prompt_len == input_len
        assert r.output_len == 5
    assert len({r.prompt for r in requests}) == 4


def test_same_seed_same_prompts(tokenizer):
    assert random_workload(tokenizer, 3, 16, 4, seed=1) == random_workload(tokenizer, 3, 16, 4,
                                                                             seed=1)


def test_shared_prefix(tokenizer):
    requests = shared_prefix_workload(tokenizer, 3, prefix_len=64, input_len=8, output_len=4)
    prefix = requests[0].prompt.split("\n")[0]
    assert len(tokenizer.encode(prefix)) == 64
    for r in requests:
        assert r.prompt.startswith(prefix + "\n")
        assert r.prompt_len == len(tokenizer.encode(r.prompt))


def test_jsonl(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Hello there"}, {"prompt": "Why?", "output_len": 3}, {"prompt": "x"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    requests = jsonl_workload(path, tokenizer, num_prompts=2, output_len=9)
    assert [(r.prompt, r.output_len) for r in requests] == [("Hello there", 9), ("Why?", 3)]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(LLMServeError, match="prompts.jsonl:1"):
        jsonl_workload(path, tokenizer, 2, 9)


def test_jsonl_offset_takes_the_next_prompts(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(5)) + "\n")
    assert [r.prompt for r in jsonl_workload(path, tokenizer, 2, 4, offset=2)] == ["p2", "p3"]
    assert [r.prompt for r in jsonl_workload(path, tokenizer, 2, 4, offset=4)] == ["p4", "p0"]


# ---- every concurrency level gets prompts of its own ---------------------------------------


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_sweep_levels_get_fresh_unrelated_prompts(tokenizer):
    config = ServeBenchConfig(base_url="http://unused", model="m", concurrencies=(1, 4, 16),
                              num_prompts=6, input_len=32)
    levels = [build_workload(config, tokenizer, level) for level in range(3)]
    prompts = [r.prompt for level in levels for r in level]
    assert len(set(prompts)) == len(prompts) == 18
    ids = [tokenizer.encode(p) for p in prompts]
    longest = max(_common_prefix(a, b) for i, a in enumerate(ids) for b in ids[i + 1:])
    assert longest <= 1  # random tokens: at most a chance first-token match
    again = [r.prompt for r in build_workload(config, tokenizer, 1)]
    assert again == [r.prompt for r in levels[1]]  # deterministic per (seed, level)


def test_shared_prefix_is_shared_within_a_level_only(tokenizer):
    config = ServeBenchConfig(base_url="http://unused", model="m", concurrencies=(1, 2),
                              num_prompts=3, input_len=8, workload="shared-prefix",
                              shared_prefix_len=32)
    first, second = (build_workload(config, tokenizer, level) for level in range(2))
    prefix = first[0].prompt.split("\n")[0]
    assert all(r.prompt.startswith(prefix + "\n") for r in first)
    assert not any(r.prompt.startswith(prefix) for r in second)


# ---- tokenizers: local for models llmserve knows, else the server's, in either shape ------


def _fake_server(backend: LocalTokenizer, shape: str) -> httpx.Client:
    """A /tokenize + /detokenize server in vLLM's ("prompt") or llama.cpp's ("content") shape."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            meta = {"meta": {"n_vocab": backend.vocab_size}} if shape == "content" else {}
            return httpx.Response(200, json={"data": [{"id": "m", **meta}]})
        body = json.loads(request.content)
        if request.url.path == "/tokenize":  # llama.cpp: no "content", no tokens
            text = body.get(shape)
            return httpx.Response(200, json={"tokens": backend.encode(text) if text else []})
        if request.url.path == "/detokenize":
            if max(body["tokens"]) >= backend.vocab_size:
                return httpx.Response(400, json={"error": "bad token id"})
            return httpx.Response(200, json={shape: backend.decode(body["tokens"])})
        return httpx.Response(404)

    return httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handle))


@pytest.mark.parametrize("shape", ["prompt", "content"])
def test_server_tokenizer_in_both_shapes(tokenizer, shape):
    with _fake_server(tokenizer, shape) as client:
        server = ServerTokenizer.probe(client, "m")
        assert server is not None and server.vocab_size == tokenizer.vocab_size
        for r in random_workload(server, 2, 16, 4, seed=3):
            assert len(tokenizer.encode(r.prompt)) == r.prompt_len == 16


def _no_server() -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, text="not found")

    return httpx.Client(base_url="http://fake", transport=httpx.MockTransport(handle))


def test_known_model_is_tokenized_locally(smollm2_gguf):
    with _no_server() as client:
        for model in ("smollm2-135m", str(smollm2_gguf)):
            config = ServeBenchConfig(base_url="http://fake", model=model)
            assert isinstance(pick_tokenizer(config, client), LocalTokenizer)


def test_unknown_model_without_tokenize_is_one_error():
    with _no_server() as client:
        config = ServeBenchConfig(base_url="http://fake", model="served-name")
        with pytest.raises(LLMServeError, match="--tokenizer-model"):
            pick_tokenizer(config, client)


@pytest.mark.parametrize("model", ["smollm2-135m", "served-name"])
def test_cli_errors_without_traceback(model, capsys):
    """Nothing listens on port 9: a known model fails at warm-up, an unknown one at /tokenize."""
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", model,
                 "--num-prompts", "1", "--input-len", "4", "--output-len", "2"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and "Traceback" not in err
