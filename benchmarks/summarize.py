"""Markdown tables (with llmserve / peer ratios) from a benchmarks/run_all.py results folder.

    python benchmarks/summarize.py benchmarks/results   # writes results/summary.md, prints it
"""

import json
import sys
from pathlib import Path
from typing import Any


def load(folder: Path, name: str) -> Any:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def offline_table(folder: Path) -> list[str]:
    hf, ours = load(folder, "offline_transformers.json"), load(folder, "offline_llmserve.json")
    tp = load(folder, "throughput_llmserve.json")
    if not (hf or ours):
        return []
    rows = ["## Offline: 32 chat prompts x 64 tokens, greedy, ignore EOS, fp32, 2 threads", "",
            "| engine | time (s) | output tok/s | req/s |", "|---|---|---|---|"]
    for name, r in (("transformers generate (static batch)", hf), ("llmserve LLM.generate", ours)):
        if r:
            rows.append(f"| {name} | {r['elapsed_s']:.2f} | {r['output_tokens_per_s']:.1f} "
                        f"| {r['requests_per_s']:.2f} |")
    if tp:
        run = tp["runs"][0]
        rows.append(f"| llmserve bench throughput (32 x {tp['input_len']} random tokens) "
                    f"| {run['elapsed_s']:.2f} | {run['output_tokens_per_s']:.1f} "
                    f"| {run['requests_per_s']:.2f} |")
    if hf and ours:
        rows += ["", f"llmserve ÷ transformers, output tok/s: "
                 f"**{ratio(ours['output_tokens_per_s'], hf['output_tokens_per_s'])}**"]
    return rows + [""]


def latency_table(folder: Path) -> list[str]:
    lat = load(folder, "latency_llmserve.json")
    if not lat:
        return []
    rows = ["## Latency on the engine (`llmserve bench latency`)", "",
            f"Peaks measured here: copy bandwidth {lat['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
            f"fp32 GEMM {lat['flops_per_s'] / 1e9:.1f} GFLOP/s; weights "
            f"{lat['weight_bytes'] / 1e6:.0f} MB ({lat['dtype']}).", "",
            "| batch | prefill (ms) | prefill MFU | TPOT (ms) | decode tok/s | MBU | decode MFU |",
            "|---|---|---|---|---|---|---|"]
    for r in lat["runs"]:
        rows.append(f"| {r['batch']} | {1000 * r['prefill_s']:.0f} | {r['prefill_mfu']:.1%} "
                    f"| {1000 * r['tpot_s']:.1f} | {r['decode_tokens_per_s']:.1f} "
                    f"| {r['mbu']:.1%} | {r['decode_mfu']:.1%} |")
    return rows + [""]


def serving_table(folder: Path) -> list[str]:
    ours, peer = load(folder, "serve_llmserve.json"), load(folder, "serve_llama.cpp.json")
    if not ours:
        return []
    peer_runs = {r["concurrency"]: r for r in (peer or {"runs": []})["runs"]}
    rows = ["## Serving: 32 requests x (128 in, 64 out) per concurrency, `/v1/completions`", "",
            "| conc | llmserve out tok/s | llama.cpp out tok/s | ratio | llmserve TTFT p50 (s) "
            "| llama.cpp TTFT p50 (s) | ratio | llmserve TPOT p50 (ms) | llama.cpp TPOT p50 (ms) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in ours["runs"]:
        p = peer_runs.get(r["concurrency"], {})
        rows.append(
            f"| {r['concurrency']} | {r['output_throughput']:.1f} "
            f"| {p.get('output_throughput', float('nan')):.1f} "
            f"| {ratio(r['output_throughput'], p.get('output_throughput'))} "
            f"| {r['p50_ttft_ms'] / 1000:.2f} | {p.get('p50_ttft_ms', float('nan')) / 1000:.2f} "
            f"| {ratio(r['p50_ttft_ms'], p.get('p50_ttft_ms'))} | {r['p50_tpot_ms']:.1f} "
            f"| {p.get('p50_tpot_ms', float('nan')):.1f} |")
    rows += ["", "Ratios are llmserve ÷ llama.cpp: above 1 is better for tok/s, below 1 is "
             "better for TTFT."]
    meta = load(folder, "meta.json")
    if meta and meta.get("startup_s"):
        rows.append("Start-up to healthy: " + ", ".join(
            f"{k} {v:.1f} s" for k, v in meta["startup_s"].items()) + ".")
    return rows + [""]


def main() -> int:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results")
    meta = load(folder, "meta.json") or {}
    lines = ["# Benchmark results", ""]
    for session in meta.get("sessions", []):
        lines.append(f"- {session['date']}: stages {', '.join(session['stages'])} "
                     f"(servers {session['servers']}); load average "
                     f"{session['load_at_start']:.2f} at start, "
                     f"{session['load_at_end']:.2f} at end")
    lines.append("")
    lines += offline_table(folder) + latency_table(folder) + serving_table(folder)
    text = "\n".join(lines)
    (folder / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
