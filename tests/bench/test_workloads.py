"""Benchmark prompts: exact token counts with the real tokenizer, shared prefixes, JSONL."""

import json

import pytest

from llmserve.bench.workloads import (
    LocalTokenizer,
    jsonl_workload,
    random_workload,
    shared_prefix_workload,
)
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
