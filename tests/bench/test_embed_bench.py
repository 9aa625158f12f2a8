"""`llmserve bench embed` on a tiny folder: both engines' rows, the JSON, and the two sides'
embeddings agreeing (its lowest cosine)."""

import json

from llmserve.entrypoints.cli import main


def test_bench_embed_writes_both_engines_and_their_agreement(tiny_folder, tmp_path, capsys):
    out = tmp_path / "embed.json"
    assert main(["bench", "embed", "--model", str(tiny_folder), "--num-texts", "6",
                 "--batch", "1,4", "--output-json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "machine:" in table and "sentence-transformers" in table
    data = json.loads(out.read_text())
    rows = {(r["engine"], r["batch"]) for r in data["results"]}
    assert rows == {(e, b) for e in ("llmserve", "sentence-transformers") for b in (1, 4)}
    assert all(r["embeddings_per_s"] > 0 and r["num_texts"] == 6 for r in data["results"])
    assert data["machine"]["cpu_flags"]
    assert min(data["lowest_cosine_by_batch"].values()) >= 0.9999
