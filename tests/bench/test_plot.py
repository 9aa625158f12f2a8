"""`llmserve bench plot` draws result files; a file without runs is a clear error."""

import json

import matplotlib  # noqa: E402,F401  (a test dependency: the plot must really be drawn)

from llmserve.entrypoints.cli import main


def result(path, label, throughputs):
    runs = [{"concurrency": c, "p50_ttft_ms": 100.0 * c, "p99_ttft_ms": 150.0 * c,
             "output_throughput": t} for c, t in zip((1, 4, 16), throughputs, strict=True)]
    path.write_text(json.dumps({"label": label, "runs": runs}))
    return str(path)


def test_plot_two_servers(tmp_path):
    a = result(tmp_path / "a.json", "llmserve", [10, 30, 80])
    b = result(tmp_path / "b.json", "peer", [30, 32, 35])
    out = tmp_path / "plot.png"
    assert main(["bench", "plot", a, b, "--output", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_rejects_non_results(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "plot", str(bad), "--output", str(tmp_path / "p.png")]) == 1
    assert "no runs" in capsys.readouterr().err
