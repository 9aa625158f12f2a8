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


VARIANTS = (("fp32", ""), ("int8", "_int8"))  # llmserve variant, results file suffix


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def offline_table(folder: Path) -> list[str]:
    hf = load(folder, "offline_transformers.json")
    ours = {v: load(folder, f"offline_llmserve{s}.json") for v, s in VARIANTS}
    tps = {v: load(folder, f"throughput_llmserve{s}.json") for v, s in VARIANTS}
    if not (hf or any(ours.values())):
        return []
    rows = ["## Offline: 32 chat prompts x 64 tokens, greedy, ignore EOS, 2 threads", "",
            "| engine | time (s) | output tok/s | req/s | llmserve ÷ transformers |",
            "|---|---|---|---|---|"]
    if hf:
        rows.append(f"| transformers generate (static batch, fp32) | {hf['elapsed_s']:.2f} "
                    f"| {hf['output_tokens_per_s']:.1f} | {hf['requests_per_s']:.2f} | – |")
    hf_tps = (hf or {}).get("output_tokens_per_s")
    for v, r in ours.items():
        if r:
            rows.append(f"| llmserve LLM.generate ({v}) | {r['elapsed_s']:.2f} "
                        f"| {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.2f} "
                        f"| **{ratio(r['output_tokens_per_s'], hf_tps)}** |")
    for v, tp in tps.items():
        if tp:
            run = tp["runs"][0]
            rows.append(f"| llmserve bench throughput ({v}, 32 x {tp['input_len']} random "
                        f"tokens) | {run['elapsed_s']:.2f} | {run['output_tokens_per_s']:.1f} "
                        f"| {run['requests_per_s']:.2f} | – |")
    return rows + [""]


def weights_read(lat: dict) -> int:
    """Weight bytes per decode step: run_all.py's count from the loaded model, if present."""
    return lat.get("weight_bytes_read_per_step") or lat["weight_bytes"]


def latency_table(folder: Path) -> list[str]:
    lats = {v: load(folder, f"latency_llmserve{s}.json") for v, s in VARIANTS}
    if not any(lats.values()):
        return []
    first = next(lat for lat in lats.values() if lat)
    rows = ["## Latency on the engine (`llmserve bench latency`)", "",
            f"Peaks measured here: copy bandwidth "
            f"{first['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, fp32 GEMM "
            f"{first['flops_per_s'] / 1e9:.1f} GFLOP/s. MBU = (weight bytes read per step + KV "
            "bytes) / TPOT / peak bandwidth; int8 weights count 1 byte per weight plus their "
            "fp32 scales (the float embedding is only gathered, a row per token).", "",
            "| variant | weights read/step | batch | prefill (ms) | prefill MFU | TPOT (ms) "
            "| decode tok/s | MBU | decode MFU |",
            "|---|---|---|---|---|---|---|---|---|"]
    for v, lat in lats.items():
        if not lat:
            continue
        weights = weights_read(lat)
        for r in lat["runs"]:
            step_bytes = r["bytes_per_step"] - lat["weight_bytes"] + weights
            mbu = step_bytes / r["tpot_s"] / lat["bandwidth_bytes_per_s"]
            rows.append(f"| {v} | {weights / 1e6:.0f} MB | {r['batch']} "
                        f"| {1000 * r['prefill_s']:.0f} | {r['prefill_mfu']:.1%} "
                        f"| {1000 * r['tpot_s']:.1f} | {r['decode_tokens_per_s']:.1f} "
                        f"| {mbu:.1%} | {r['decode_mfu']:.1%} |")
    rows += ["", "MFU is against the fp32 GEMM peak for both variants (int8 has its own, higher, "
             "peak), so int8's MFU is not a utilisation of the int8 units."]
    return rows + [""]


def serving_table(folder: Path) -> list[str]:
    peer = load(folder, "serve_llama.cpp.json")
    ours = {v: load(folder, f"serve_{label}.json")
            for v, label in (("fp32", "llmserve"), ("int8", "llmserve-int8"))}
    if not any(ours.values()):
        return []
    peer_runs = {r["concurrency"]: r for r in (peer or {"runs": []})["runs"]}
    nan = float("nan")
    rows = ["## Serving: 32 requests x (128 in, 64 out) per concurrency, `/v1/completions`", "",
            "| conc | llmserve variant | out tok/s | llama.cpp out tok/s | ratio "
            "| TTFT p50 (s) | llama.cpp TTFT p50 (s) | ratio | TPOT p50 (ms) "
            "| llama.cpp TPOT p50 (ms) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    concurrencies = sorted({r["concurrency"] for o in ours.values() if o for r in o["runs"]})
    for c in concurrencies:
        p = peer_runs.get(c, {})
        for v, o in ours.items():
            r = next((r for r in (o or {"runs": []})["runs"] if r["concurrency"] == c), None)
            if r is None:
                continue
            rows.append(
                f"| {c} | {v} | {r['output_throughput']:.1f} "
                f"| {p.get('output_throughput', nan):.1f} "
                f"| {ratio(r['output_throughput'], p.get('output_throughput'))} "
                f"| {r['p50_ttft_ms'] / 1000:.2f} | {p.get('p50_ttft_ms', nan) / 1000:.2f} "
                f"| {ratio(r['p50_ttft_ms'], p.get('p50_ttft_ms'))} | {r['p50_tpot_ms']:.1f} "
                f"| {p.get('p50_tpot_ms', nan):.1f} |")
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
                     f"(servers {session['servers']}, llmserve "
                     f"{', '.join(session.get('variants', ['fp32']))}); load average "
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
