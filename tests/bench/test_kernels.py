"""`llmserve bench kernels`: every candidate timed at each batch, the engine's roles named."""

from llmserve.bench.kernels import format_kernels, run_kernels
from tests.loader.test_kernel_choice import TINY


def test_bench_kernels_times_every_candidate(tmp_path, monkeypatch, kernel_level):
    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    result = run_kernels(TINY, (1, 4))
    assert result["level"].split("+")[0] == kernel_level
    names = [row["kernel"] for row in result["rows"]]
    blocks = [f"llmserve kquant {t}" for t in
              ("Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q3_K",
               "IQ4_XS")]
    assert names[:15] == [*blocks, "llmserve int4 (W4A15)", "llmserve int4-a8 (W4A8)",
                          "llmserve int8 (W8A15)", "llmserve float32", "torch F.linear float32"]
    for row in result["rows"][10:15]:  # ours and torch's float32 run everywhere
        assert all(isinstance(row["ms"][b], float) and row["ms"][b] > 0 for b in (1, 4))
    for row in result["rows"][:10]:  # a file's blocks where the columns are whole blocks
        whole = all(k % 256 == 0 for _, k, _ in result["shapes"])
        assert all(isinstance(row["ms"][b], float) == whole for b in (1, 4))
    assert result["read_bandwidth_bytes_per_s"] > 1e8 and result["int8_peak_ops_per_s"] > 1e8
    table = format_kernels(result)
    assert f"kernel level: {result['level']}" in table
    assert f"engine: default = {result['default']}" in table
    assert "llmserve float32" in table and "--dtype float32" in table
    assert table.count("batch 1: default") == 1 and "batch 4: default" in table
    assert "read bandwidth" in table and "int8 dot-product peak" in table
    int4 = next(line for line in table.splitlines()[-20:] if line.startswith("llmserve int4 "))
    assert "%" in int4  # its MBU at batch 1 and share of the peak at batch 4


def test_retime_decides_again_and_a_busy_machine_is_refused(tmp_path, monkeypatch):
    import json

    from llmserve.bench import kernels
    from llmserve.bench.kernels import decided_while_busy
    from llmserve.loader.kernel_choice import choose_quantization
    from tests.loader.test_kernel_choice import decisions_in, machine

    decisions_in(monkeypatch, tmp_path)
    for probe in ("measure_read_bandwidth", "measure_int8_peak"):  # the decisions alone
        monkeypatch.setattr(kernels, probe, lambda: None)
    monkeypatch.setattr(kernels, "candidates", lambda block_type: [])
    machine(monkeypatch, 0.1)
    choose_quantization("int4", TINY)
    (entry,) = (tmp_path / "kernels").glob("choice-*.json")
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "quantization": "stale"}))
    result = run_kernels(TINY, (1,), retime=True)
    assert result["decision"]["source"] == "measured" and not decided_while_busy(result)
    decided = result["decision"]["quantization"]
    assert json.loads(entry.read_text())["quantization"] == decided != "stale"
    assert {e["source"] for e in result["attention"].values()} == {"measured"}
    table = format_kernels(result)
    assert f"decision: auto runs {result['default']} (measured; " in table
    assert "vs int4-a8 at 32" in table and "decision (bfloat16 KV cache): attention: " in table
    machine(monkeypatch, 1.5)
    busy = run_kernels(TINY, (1,), retime=True)
    assert decided_while_busy(busy) and busy["default"] == "int4-a8"
    assert json.loads(entry.read_text())["quantization"] == decided  # left as it was
