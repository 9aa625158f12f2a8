"""guidellm's benchmark against a live server: it streams chat completions with
`stream_options.continuous_usage_stats` (usage in every chunk) and counts tokens from that
usage. Slow tier: the guidellm CLI takes seconds to import and start."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.openai.conftest import MODEL

pytestmark = pytest.mark.slow

NUM_REQUESTS, OUTPUT_TOKENS = 3, 8


def test_guidellm_benchmark_counts_tokens_from_continuous_usage(server, tmp_path):
    guidellm = shutil.which("guidellm", path=str(Path(sys.executable).parent))
    assert guidellm, "guidellm is not installed (pip install -e '.[test]')"
    tokenizer = tmp_path / "tokenizer"  # guidellm's synthetic prompts need a tokenizer, offline
    tokenizer.mkdir()
    server.engine.tokenizer.backend.save(str(tokenizer / "tokenizer.json"))
    (tokenizer / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    out = tmp_path / "guidellm.json"
    run = subprocess.run(
        [guidellm, "run", "--backend", f"kind=openai_http,target={server.url},model={MODEL}",
         "--profile", "kind=synchronous",
         "--constraint", f"kind=max_requests,count={NUM_REQUESTS}",
         "--tokenizer", f"kind=hf_auto,model={tokenizer}",
         "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={OUTPUT_TOKENS}",
         "--output", f"kind=json,path={out}", "--disable-console-interactive"],
        capture_output=True, text=True, timeout=300,
        env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    assert benchmark["metrics"]["request_totals"]["errored"] == 0
    requests = benchmark["requests"]["successful"]
    assert len(requests) == NUM_REQUESTS
    for request in requests:
        # the usage of every chunk: one token a chunk, the last one's total
        assert request["output_tokens"] == OUTPUT_TOKENS
        assert request["info"]["timings"]["token_iterations"] == OUTPUT_TOKENS
        assert request["prompt_tokens"] > 32  # the 32 synthetic tokens in the chat template
        assert request["time_to_first_token_ms"] > 0
