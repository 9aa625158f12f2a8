"""`bench latency`'s yardsticks: the peak matches the path's compute kind, a ratio above 1 is
never printed as a number, and every bench reports the machine's CPU flags."""

from types import SimpleNamespace

import pytest
import torch

from llmserve import LLM
from llmserve.bench.latency import (
    LatencyResult,
    MachinePeaks,
    capped,
    format_ratio,
    format_table,
    llm_peak_kind,
    measure_gemm,
    peak_kind,
    weight_bytes_and_params,
)
from llmserve.bench.machine import cpu_flags, format_machine, machine_info

CPUINFO = """processor\t: 0
model name\t: Some CPU
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile amx_int8
"""


@pytest.mark.parametrize("quantization,dtype,kind", [
    (None, torch.float32, "fp32"), (None, torch.bfloat16, "bf16"),
    (None, torch.float16, "fp16"), ("none", torch.float32, "fp32"),
    ("int8", torch.float32, "int8"), ("int8", torch.bfloat16, "int8"),
    ("int4", torch.float32, "int8"),
    ("some-future-method", torch.float32, None), ("auto", torch.float32, None),
])
def test_peak_kind(quantization, dtype, kind):
    assert peak_kind(quantization, dtype) == kind


def _fake_llm(config_quantization, loaded_quantization="absent", dtype=torch.float32):
    loaded = SimpleNamespace()
    if loaded_quantization != "absent":
        loaded.quantization = loaded_quantization
    engine = SimpleNamespace(config=SimpleNamespace(quantization=config_quantization),
                             loaded=loaded, dtype=dtype, device=torch.device("cpu"))
    return SimpleNamespace(engine=engine)


def test_llm_peak_kind_follows_what_the_loader_ran():
    assert llm_peak_kind(_fake_llm("int8")) == "int8"
    assert llm_peak_kind(_fake_llm(None, dtype=torch.bfloat16)) == "bf16"
    # a requested "auto" that the loader turned into int8 (a quantized checkpoint) or float
    assert llm_peak_kind(_fake_llm("auto", loaded_quantization="int8")) == "int8"
    assert llm_peak_kind(_fake_llm("auto", loaded_quantization=None)) == "fp32"


def test_unknown_kind_takes_the_max_peak():
    gemm = {"fp32": 50e9, "bf16": 300e9, "int8": 370e9}
    assert MachinePeaks(10e9, gemm, "bf16").flops_per_s == 300e9
    unknown = MachinePeaks(10e9, gemm, None)
    assert unknown.flops_per_s == 370e9 and "int8" in unknown.flops_label
    assert unknown.to_dict()["flops_per_s"] == 370e9


def test_ratio_above_one_is_never_a_number():
    assert format_ratio(0.423) == "42.3%"
    assert format_ratio(1.37) == ">100%*"
    assert capped("prefill_mfu", 1.37) == {"prefill_mfu": 1.0, "prefill_mfu_exceeds_peak": True}
    assert capped("mbu", 0.5) == {"mbu": 0.5, "mbu_exceeds_peak": False}
    result = LatencyResult(batch=8, input_len=128, output_len=64, prefill_s=0.01, tpot_s=0.02,
                           bytes_per_step=1e8, decode_flops_per_step=1e9, prefill_flops=1e12)
    peaks = MachinePeaks(10e9, {"fp32": 50e9}, "fp32")  # prefill at 100 TFLOP/s: > peak
    table = format_table([result], peaks)
    assert ">100%*" in table and "peak is underestimated" in table
    assert "fp32 GEMM 50.0 GFLOP/s" in table and "torch cpu capability" in table
    data = result.to_dict(peaks)
    assert data["prefill_mfu"] == 1.0 and data["prefill_mfu_exceeds_peak"]


def test_int8_gemm_peak_is_measured():
    assert measure_gemm("int8") > 1e9  # _int_mm, 2048 x 2048, ops per second


def test_cpu_flags_and_machine_info():
    assert cpu_flags(CPUINFO) == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                                  "amx_tile", "amx_int8"]
    assert cpu_flags("no flags here") == []
    info = machine_info()
    assert info["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["num_threads"] == torch.get_num_threads()
    line = format_machine({**info, "cpu_flags": ["avx2", "amx_int8"]})
    assert "flags: avx2 amx_int8" in line
    assert f"torch cpu capability {info['torch_cpu_capability']}" in line


def test_weight_bytes_skip_an_untied_embedding(tiny_folder):
    llm = LLM(str(tiny_folder), dtype="float32", kv_cache_memory="4MiB")
    num_bytes, num_params = weight_bytes_and_params(llm)
    model = llm.engine.loaded.model  # float32 linears are packed buffers on the CPU
    named = [*model.named_parameters(), *model.named_buffers()]
    total = sum(t.numel() for t in {id(t): t for n, t in named if "rotary" not in n}.values())
    config = llm.engine.loaded.config
    assert num_params == total - config.vocab_size * config.hidden_size
    assert num_bytes == 4 * num_params
    int8 = LLM(str(tiny_folder), dtype="float32", quantization="int8", kv_cache_memory="4MiB")
    int8_bytes, _ = weight_bytes_and_params(int8)
    assert num_bytes / 4.5 < int8_bytes < num_bytes / 3  # int8 weights + fp32 scales, norms


def test_repeated_decode_runs_report_their_median_and_spread(tiny_folder, capsys):
    from llmserve.bench.latency import run_latency

    llm = LLM(str(tiny_folder), dtype="float32", kv_cache_memory="4MiB")
    result = run_latency(llm, batch=2, input_len=8, output_len=5, repeats=3)
    assert len(result.tpot_runs_s) == 3 and all(t > 0 for t in result.tpot_runs_s)
    assert result.tpot_s == sorted(result.tpot_runs_s)[1]
    assert run_latency(llm, batch=1, input_len=8, output_len=5).tpot_runs_s == ()
    table = format_table([result], MachinePeaks(10e9, {"fp32": 50e9}, "fp32"))
    low, high = min(result.tpot_runs_s), max(result.tpot_runs_s)
    assert f"median of 3 decode runs; per batch min-max: 2: {1000 * low:.2f}-" in table
    assert f"{1000 * high:.2f} ms" in table


def test_mbu_pairs_each_decode_run_with_the_bandwidth_measured_after_it(tiny_folder, tmp_path,
                                                                        capsys, monkeypatch):
    import json

    import llmserve.bench.latency as latency
    from llmserve.entrypoints.cli import main

    # after run 1, after run 2, then the peak the MFU table uses
    bandwidths = iter([7e9, 5e9, 6e9])
    monkeypatch.setattr(latency, "measure_bandwidth", lambda device="cpu": next(bandwidths))
    monkeypatch.setattr(latency, "measure_gemm", lambda kind, device="cpu": 1e9)
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", str(tiny_folder), "--dtype", "float32",
                 "--batch", "1", "--input-len", "4", "--output-len", "3", "--repeat", "2",
                 "--output-json", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["bandwidth_runs"] == [7e9, 5e9] and len(run["tpot_runs_s"]) == 2
    per_run = [run["bytes_per_step"] / t / bw
               for t, bw in zip(run["tpot_runs_s"], run["bandwidth_runs"], strict=True)]
    assert run["mbu"] == pytest.approx(min(1.0, sum(per_run) / 2))
    text = capsys.readouterr().out
    assert "peak copy bandwidth 6.0 GB/s" in text
    assert "copy bandwidth measured right after it (5.0-7.0 GB/s)" in text
    assert main(["bench", "latency", "--model", str(tiny_folder), "--repeat", "0"]) != 0
