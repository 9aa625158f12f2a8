"""`llmserve bench hostile` end to end against a real server, on two of its probes: the
report holds the normal chat's latencies alone and beside each, and what each got."""

from llmserve.bench import hostile
from llmserve.bench.hostile import HostileConfig, format_hostile, run_hostile
from tests.entrypoints.openai.conftest import MODEL, run_server


def test_the_report_sets_each_probe_beside_the_chat_alone(smollm2_gguf, float32_model,
                                                          monkeypatch):
    probes = {name: hostile.PROBES[name] for name in
              ("choice of 300,000 strings", "a 1.3M-token prompt")}
    monkeypatch.setattr(hostile, "PROBES", probes)
    with run_server(smollm2_gguf, float32_model) as server:
        report = run_hostile(HostileConfig(server.url, MODEL, repeats=2, output_tokens=4),
                             log=lambda _: None)
    assert len(report["alone_s"]) == 2
    rows = {row["probe"]: row for row in report["probes"]}
    assert rows.keys() == probes.keys()
    assert rows["choice of 300,000 strings"]["status"] == 400
    assert rows["choice of 300,000 strings"]["param"] == "structured_outputs"
    assert rows["a 1.3M-token prompt"]["param"] == "prompt"
    assert all(row["ratio"] > 0 and row["normal_p50_s"] > 0 for row in rows.values())
    table = format_hostile(report)
    assert "| choice of 300,000 strings |" in table and "naming prompt" in table
