"""`llmserve serve --data-parallel-size 2` end to end, as a user runs it, on the default
model: shared prefixes land on one replica and hit its prefix cache, other prompts go to the
other, a killed replica turns /health 503, and SIGTERM stops every child process."""

import os
import re
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.helpers import prompt_for, wait_for, wait_gone

SHARED = ("You are reviewing a pull request that adds data-parallel serving to an inference "
          "engine. The change starts several engine processes, puts an HTTP router in front "
          "of them, and routes each request by a hash of its prompt prefix so that requests "
          "sharing a system prompt reuse one replica's prefix cache. Point out any bug you "
          "find, explain why it matters, and suggest the smallest fix. Keep your answer "
          "short, use plain words, and do not repeat the question back. ") * 2


def router_counts(url: str) -> dict[str, dict[str, float]]:
    """{sample name: {replica (or result): value}} of the router's counters."""
    counts: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name.endswith("_total"):
                label = s.labels.get("replica", s.labels.get("result", ""))
                counts.setdefault(s.name, {})[label] = s.value
    return counts


# slow tier: two replica processes load the model; the router's routing, spill-over,
# metrics and failure handling run against fake backends in the default tier
@pytest.mark.slow
def test_data_parallel_serve_end_to_end(smollm2_gguf, tmp_path):
    assert len(SHARED) > 600
    out, err = (tmp_path / "stdout.txt").open("w+"), (tmp_path / "stderr.txt").open("w")
    parent = subprocess.Popen(
        [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--model", str(smollm2_gguf),
         "--served-model-name", "smollm2", "--data-parallel-size", "2", "--port", "0",
         "--kv-cache-memory", "64MiB", "--max-model-len", "512"], stdout=out, stderr=err)
    try:
        def banner() -> re.Match | None:
            return re.search(r"llmserve: serving 'smollm2' at (http://\S+)/v1",
                             (tmp_path / "stdout.txt").read_text())

        wait_for(lambda: banner() or parent.poll() is not None, 120, "no start")
        assert banner(), (tmp_path / "stderr.txt").read_text()
        logs = (tmp_path / "stdout.txt").read_text
        url = banner().group(1)
        children = [int(p) for p in re.findall(r"replica \d \(pid (\d+)\)", logs())]
        assert len(children) == 2
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

        for question in ("Is the hash stable?", "Who stops the children?",
                         "What if a replica dies?", "Is /metrics joined?"):
            client.chat.completions.create(
                model="smollm2", max_tokens=2, temperature=0,
                messages=[{"role": "user", "content": f"{SHARED}\n{question}"}])
        counts = router_counts(url)
        shared = max(counts["llmserve_router_requests_total"],
                     key=counts["llmserve_router_requests_total"].get)
        other = "1" if shared == "0" else "0"
        assert counts["llmserve_router_requests_total"] == {shared: 4, other: 0}
        assert counts["llmserve_router_affinity_total"] == {"hit": 3, "miss": 1, "overflow": 0}
        wait_for(lambda: router_counts(url)["llmserve_prefix_cache_hits_total"][shared] > 0, 5,
                 "no prefix-cache hits on the replica that got the shared prefix")

        for stem in ("The capital of France is", "A haiku about the sea:"):
            client.completions.create(model="smollm2", prompt=prompt_for(int(other), stem),
                                      max_tokens=2, temperature=0)
        assert router_counts(url)["llmserve_router_requests_total"] == {shared: 4, other: 2}
        assert httpx.get(f"{url}/health").status_code == 200

        os.kill(children[int(other)], signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, 5, "still healthy")
        health = httpx.get(f"{url}/health").json()
        assert health["error"]["message"].startswith(f"replica {other} is down")

        parent.send_signal(signal.SIGTERM)
        assert parent.wait(30) == 0
        assert all(wait_gone(pid, 5) for pid in children), "a replica outlived the server"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        out.close()
        err.close()
