"""docs/benchmarks.md from a benchmarks/run_all.py results folder: every figure, the issue's
targets (met, or missed by how much), the machine, its load per stage and the commands.

    python benchmarks/summarize.py [benchmarks/results] [--doc docs/benchmarks.md]

Writes the same text to the folder's summary.md and to --doc (a full regeneration). A run at
the AVX2 level (`run_all.py --isa avx2`: benchmarks/results-avx2 beside the folder) becomes
its own section, with the same tables and that level's targets. So does each run on a
public model's shape (`run_all.py --shape NAME --qtype TYPE`: shapes/<NAME>.<TYPE> inside
either folder); a shape folder given as the folder is rendered alone.
"""

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SERVERS = (("llama.cpp", "llama.cpp server"), ("llmserve", "llmserve default"),
           ("llmserve-fp32", "llmserve fp32"))
VARIANTS = (("default", ""), ("fp32", "_fp32"))  # llmserve variant, results file suffix


def load(folder: Path, name: str) -> Any:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def run_at(report: dict | None, concurrency: int) -> dict | None:
    return next((r for r in (report or {}).get("runs", []) if r["concurrency"] == concurrency),
                None)


def fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


@dataclass(frozen=True)
class Target:
    name: str
    value: float | None  # None: not measured in this folder
    bound: float
    higher_is_better: bool
    spec: str  # format of value and bound, e.g. ".2f" with unit "x"
    unit: str
    detail: str  # the figures the value comes from

    def verdict(self) -> str:
        if self.value is None:
            return "not measured"
        if not self.value:
            return "**missed** (zero)"
        margin = self.value / self.bound if self.higher_is_better else self.bound / self.value
        if margin >= 1:
            return f"met ({margin:.2f}x the bound)"
        word = "short" if self.higher_is_better else "over"
        return f"**missed**: {1 / margin:.2f}x {word}"

    def row(self) -> str:
        goal = (">= " if self.higher_is_better else "<= ") + fmt(self.bound, self.spec, self.unit)
        return (f"| {self.name} | {fmt(self.value, self.spec, self.unit)} | {goal} "
                f"| {self.verdict()} | {self.detail} |")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# the default model's bounds at each level: 1 stream vs llama.cpp, batch-1 MBU, 32 streams
# vs llama.cpp, TTFT p50 at 16 streams vs llama.cpp
LEVEL_BOUNDS = {"native": (1.5, 0.70, 3.0, 0.25), "avx2": (1.2, 0.60, 3.0, 0.25)}
SHAPE_BOUNDS = (1.1, 0.90, 2.0, 0.5)  # a 1-8B shape's, at every level


def targets(folder: Path) -> list[Target]:
    meta = load(folder, "meta.json") or {}
    isa = meta.get("isa", "native")
    one_stream, mbu, many, ttft = (SHAPE_BOUNDS if "shape" in meta else
                                   LEVEL_BOUNDS.get(isa, LEVEL_BOUNDS["native"]))
    peer, ours = load(folder, "serve_llama.cpp.json"), load(folder, "serve_llmserve.json")
    exact = load(folder, "serve_llmserve-fp32.json")
    f1, f32 = run_at(exact, 1), run_at(exact, 32)
    p1, o1 = run_at(peer, 1), run_at(ours, 1)
    p16, o16 = run_at(peer, 16), run_at(ours, 16)
    p32, o32 = run_at(peer, 32), run_at(ours, 32)
    tpot = (o1 or {}).get("p50_tpot_ms"), (p1 or {}).get("p50_tpot_ms")
    out32 = (o32 or {}).get("output_throughput"), (p32 or {}).get("output_throughput")
    ttft16 = (o16 or {}).get("p50_ttft_ms"), (p16 or {}).get("p50_ttft_ms")
    hf = (load(folder, "offline_transformers.json") or {}).get("output_tokens_per_s")
    off = {v: (load(folder, f"offline_llmserve{s}.json") or {}).get("output_tokens_per_s")
           for v, s in VARIANTS}
    lat = load(folder, "latency_llmserve.json") or {}
    b1 = next((r for r in lat.get("runs", []) if r["batch"] == 1), {})
    servers = meta.get("servers", {})
    start = servers.get("llmserve", {}).get("start_to_healthy_s")
    ms, toks = (lambda x: fmt(x, ".1f", " ms")), (lambda x: fmt(x, ".1f", " tok/s"))
    vs_fp32 = {c: ((o or {}).get("output_throughput"), (f or {}).get("output_throughput"))
               for c, o, f in ((1, o1, f1), (32, o32, f32))}
    return [
        Target("batch-1 decode vs llama.cpp server, 1 stream", ratio(tpot[1], tpot[0]),
               one_stream, True, ".2f", "x", f"TPOT p50 {ms(tpot[0])} vs {ms(tpot[1])}"),
        Target("output tok/s at 32 streams vs llama.cpp", ratio(*out32), many, True, ".2f", "x",
               f"{toks(out32[0])} vs {toks(out32[1])}"),
        Target("TTFT p50 at 16 streams vs llama.cpp", ratio(*ttft16), ttft, False, ".2f", "x",
               f"{ms(ttft16[0])} vs {ms(ttft16[1])}"),
        Target("default vs fp32, 1 stream", ratio(*vs_fp32[1]), 2.0, True, ".2f", "x",
               f"{toks(vs_fp32[1][0])} vs {toks(vs_fp32[1][1])}"),
        Target("default vs fp32, 32 streams", ratio(*vs_fp32[32]), 1.0, True, ".2f", "x",
               f"{toks(vs_fp32[32][0])} vs {toks(vs_fp32[32][1])}"),
        Target("offline 32x64, default vs transformers", ratio(off["default"], hf), 3.0, True,
               ".2f", "x", f"{toks(off['default'])} vs {toks(hf)}"),
        Target("offline 32x64, fp32 vs transformers", ratio(off["fp32"], hf), 1.5, True, ".2f",
               "x", f"{toks(off['fp32'])} vs {toks(hf)}"),
        Target("MBU at batch 1 (default)", b1.get("mbu"), mbu, True, ".0%", "",
               f"TPOT {fmt(b1.get('tpot_s') and 1000 * b1['tpot_s'], '.1f', ' ms')}, "
               f"{fmt(b1.get('bytes_per_step') and b1['bytes_per_step'] / 1e6, '.0f', ' MB')}"
               f"/step" + (" (exceeds the measured peak)" if b1.get("mbu_exceeds_peak") else "")),
        Target("start to healthy (default)", start, 10.0, False, ".1f", " s",
               f"llama.cpp {fmt(servers.get('llama.cpp', {}).get('start_to_healthy_s'), '.1f')} s"),
    ]


def mib(kib: int | None) -> str:
    return fmt(kib and kib / 1024, ".0f", " MiB")


def header(meta: dict, folder: Path) -> list[str]:
    m = meta.get("machine", {})
    sizes, llama = meta.get("sizes", {}), load(folder, "llama_bench.json") or {}
    lines = ["# Benchmarks", ""]
    if meta.get("smoke"):
        lines += ["**SMOKE RUN** (`--smoke`: tiny sizes, to check the pipeline only). The "
                  "figures below mean nothing; the targets are defined at sizes this run did "
                  "not use.", ""]
    dates = ", ".join(f"{x['date']} ({', '.join(x['stages'])})" for x in meta.get("sessions", []))
    lines += [
        f"Generated by `benchmarks/run_all.py` and `benchmarks/summarize.py`; runs: {dates}.",
        "",
        f"* Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores; flags: "
        f"{' '.join(m.get('cpu_flags', [])) or 'none known'}; torch {m.get('torch_version', '?')}"
        f" (CPU capability {m.get('torch_cpu_capability', '?')}); "
        f"{m.get('threads_per_engine', 2)} threads for every engine.",
        "* Model: SmolLM2-135M-Instruct, GGUF Q4_1 (the default `smollm2-135m`), the same file "
        "for every engine.",
        "* llmserve variants: **default** (no dtype or quantization flag: the Q4_1 GGUF runs on "
        "its own 4-bit weights, int4 kernels with a bfloat16 KV cache) and **fp32** "
        "(`--dtype float32`: the exact path on the native float32 GEMM, equal to transformers "
        "token for token).",
        "* Peer: llama.cpp's C++ `llama-server` "
        f"(build {llama.get('build_commit', '?')}, built by `tools/build_llama_server.sh` from the "
        f"shared tools) with {max(sizes.get('concurrency', [32]))} parallel slots and continuous "
        "batching; transformers `generate` (fp32, one static batch) offline.", ""]
    return lines


def target_table(folder: Path) -> list[str]:
    rows = ["## Targets", "", "Ratios are llmserve default ÷ peer.", "",
            "| target | measured | goal | verdict | from (llmserve vs peer) |",
            "|---|---|---|---|---|"]
    rows += [t.row() for t in targets(folder)]
    servers = (load(folder, "meta.json") or {}).get("servers", {})
    peer_rss = servers.get("llama.cpp", {}).get("vm_hwm_kib")
    rss = servers.get("llmserve", {}).get("vm_hwm_kib")
    rows.append(f"| peak RSS (default) | {mib(rss)} | no bound | – | llama.cpp {mib(peer_rss)}; "
                f"{fmt(ratio(rss, peer_rss), '.1f', 'x')} |")
    return rows + [""]


def load_table(meta: dict) -> list[str]:
    rows = ["## Machine load per stage", "",
            "Sampled every second: the 1-minute load average, and the CPU used by processes "
            "other than the benchmark's own (servers, clients and their children), in cores. "
            "A stage is quiet when the others used at most 0.10 cores on average.", "",
            "| stage | seconds | load avg mean / max | others, cores mean / max "
            "| busiest others (CPU s) | quiet |", "|---|---|---|---|---|---|"]
    for stage, x in meta.get("load", {}).items():
        la, other = x["load_avg_1min"], x["other_cores"]
        busiest = ", ".join(f"{k} {v:.1f}" for k, v in x["busiest_other_cpu_s"].items()) or "–"
        rows.append(f"| {stage} | {x['seconds']:.0f} | {fmt(la['mean'], '.2f')} / "
                    f"{fmt(la['max'], '.2f')} | {fmt(other['mean'], '.2f')} / "
                    f"{fmt(other['max'], '.2f')} | {busiest} | "
                    f"{'yes' if x['quiet'] else '**no**'} |")
    return rows + [""]


def serving_table(folder: Path, meta: dict, doc: Path) -> list[str]:
    reports = {label: load(folder, f"serve_{label}.json") for label, _ in SERVERS}
    if not any(reports.values()):
        return []
    s = meta.get("sizes", {})
    peer = reports["llama.cpp"]
    rows = [f"## Serving: {s.get('num_prompts')} requests x ({s.get('input_len')} in, "
            f"{s.get('output_len')} out) per concurrency, streamed `/v1/completions`", "",
            "Each server alone on the machine; fresh random prompts per level; `max_tokens = "
            "min_tokens` = output length, `ignore_eos`. TTFT: request sent to first text chunk; "
            "TPOT: (E2E - TTFT) / (output tokens - 1). ÷ llama.cpp: above 1 is better for tok/s, "
            "below 1 for TTFT. short: streams with fewer tokens than asked.", "",
            "| conc | server | ok / failed / short | out tok/s | ÷ llama.cpp | TTFT p50 (ms) "
            "| ÷ llama.cpp | TTFT p99 (ms) | TPOT p50 (ms) |", "|---" * 9 + "|"]
    levels = sorted({r["concurrency"] for rep in reports.values() if rep for r in rep["runs"]})
    for c in levels:
        p = run_at(peer, c) or {}
        for label, name in SERVERS:
            r = run_at(reports[label], c)
            if r is None:
                continue
            rows.append(
                f"| {c} | {name} | {r['completed']} / {r['failed']} / {r['short_outputs']} "
                f"| {r['output_throughput']:.1f} "
                f"| {fmt(ratio(r['output_throughput'], p.get('output_throughput')), '.2f', 'x')} "
                f"| {r['p50_ttft_ms']:.0f} "
                f"| {fmt(ratio(r['p50_ttft_ms'], p.get('p50_ttft_ms')), '.2f', 'x')} "
                f"| {r['p99_ttft_ms']:.0f} | {r['p50_tpot_ms']:.1f} |")
    rows += ["", "| server | start to healthy (s) | peak RSS (VmHWM) | max sampled VmRSS |",
             "|---|---|---|---|"]
    for label, name in SERVERS:
        if x := meta.get("servers", {}).get(label):
            rows.append(f"| {name} | {fmt(x.get('start_to_healthy_s'), '.1f')} "
                        f"| {mib(x.get('vm_hwm_kib'))} | {mib(x.get('vm_rss_max_kib'))} |")
    if (folder / "serve.png").exists():
        rows += ["", f"![serving]({os.path.relpath(folder / 'serve.png', doc.parent)})"]
    return rows + [""]


def llama_bench_table(folder: Path) -> list[str]:
    lb = load(folder, "llama_bench.json")
    if not lb:
        return []
    rows = ["## llama.cpp's own figures (`llama-bench`, the same GGUF, "
            f"{lb.get('n_threads')} threads)", "", "| test | tok/s | stddev |", "|---|---|---|"]
    rows += [f"| {name} | {t['tokens_per_s']:.1f} | {t['stddev']:.1f} |"
             for name, t in lb["tests"].items()]
    return rows + [""]


def offline_table(folder: Path, meta: dict) -> list[str]:
    runs = [("transformers generate (static batch)", load(folder, "offline_transformers.json"))]
    runs += [(f"llmserve LLM.generate ({v})", load(folder, f"offline_llmserve{s}.json"))
             for v, s in VARIANTS]
    if not any(r for _, r in runs):
        return []
    hf = (runs[0][1] or {}).get("output_tokens_per_s")
    s = meta.get("sizes", {})
    rows = [f"## Offline: {s.get('num_prompts')} chat prompts x {s.get('output_len')} tokens, "
            "greedy, EOS ignored (`benchmarks/offline.py`)", "",
            "Same token ids for every engine. Each runs with the OpenMP wait policy its users "
            "get: llmserve sets PASSIVE, transformers keeps OpenMP's default (spinning, which "
            "collapses when another process competes for the cores).", "",
            "| engine | path | OpenMP wait | time (s) | output tok/s | ÷ transformers |",
            "|---|---|---|---|---|---|"]
    for name, r in runs:
        if r:
            path = f"{r.get('dtype', '?')}, {r.get('quantization') or 'no'} quantization"
            rows.append(f"| {name} | {path} | {r.get('omp_wait_policy', '?')} "
                        f"| {r['elapsed_s']:.2f} | {r['output_tokens_per_s']:.1f} "
                        f"| {fmt(ratio(r['output_tokens_per_s'], hf), '.2f', 'x')} |")
    return rows + [""]


def latency_table(folder: Path) -> list[str]:
    lats = [(v, load(folder, f"latency_llmserve{s}.json")) for v, s in VARIANTS]
    if not any(lat for _, lat in lats):
        return []
    rows = ["## Latency on the engine (`llmserve bench latency`)", "",
            "MBU = (weight bytes + KV bytes read per decode step) / TPOT / measured copy "
            "bandwidth; MFU against the measured GEMM peak of the kind the path computes in.", "",
            "| variant | peaks: copy GB/s, GEMM GFLOP/s (kind) | batch | prefill (ms) "
            "| prefill MFU | TPOT (ms) | decode tok/s | MB/step | MBU | decode MFU |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for v, lat in lats:
        peaks = (f"{lat['bandwidth_bytes_per_s'] / 1e9:.1f}, {lat['flops_per_s'] / 1e9:.0f} "
                 f"({lat.get('peak_kind') or 'max'})") if lat else ""
        for r in (lat or {}).get("runs", []):
            rows.append(f"| {v} | {peaks} | {r['batch']} | {1000 * r['prefill_s']:.0f} "
                        f"| {r['prefill_mfu']:.1%} | {1000 * r['tpot_s']:.1f} "
                        f"| {r['decode_tokens_per_s']:.1f} | {r['bytes_per_step'] / 1e6:.0f} "
                        f"| {r['mbu']:.1%} | {r['decode_mfu']:.1%} |")
    return rows + [""]


def commands(folder: Path, meta: dict) -> list[str]:
    path = folder / "commands.txt"
    if not path.exists():
        return []
    names = sorted(meta.get("path_names", {}).items(), key=lambda kv: -len(kv[0]))
    lines = []
    for line in path.read_text().splitlines():
        for full, short in names:
            line = line.replace(full, short)
        line = re.sub(r"(--port |127\.0\.0\.1:)\d+", r"\1$PORT", line)  # a free port per run
        if line not in lines:
            lines.append(line)
    return ["## Commands, as run", "",
            "`$GGUF`: the model file; `$OUT`: the results folder; `$LLAMA_BIN`: the folder of "
            "`llama-server` and `llama-bench`. Regenerate everything with "
            "`python benchmarks/run_all.py` (`--only STAGE` reruns one stage).", "",
            "```bash", *lines, "```", ""]


def notes() -> list[str]:
    """The hand-written analysis (benchmarks/notes.md), if present."""
    path = HERE / "notes.md"
    return [path.read_text().rstrip(), ""] if path.exists() else []


def render(folder: Path, doc: Path) -> str:
    meta = load(folder, "meta.json") or {}
    parts = [header(meta, folder), target_table(folder), load_table(meta),
             serving_table(folder, meta, doc), llama_bench_table(folder),
             offline_table(folder, meta), latency_table(folder), notes(),
             commands(folder, meta)]
    return "\n".join(line for part in parts for line in part)


def level_section(folder: Path, doc: Path) -> list[str]:
    """A run at a named instruction-set level (`run_all.py --isa`), as one section: its
    targets, load, serving, llama-bench and latency tables one heading level down."""
    meta = load(folder, "meta.json") or {}
    isa = meta.get("isa", folder.name)
    m = meta.get("machine", {})
    parts = [[f"## At the {isa} level: llmserve with LLMSERVE_CPU_ISA={isa}, llama.cpp built "
              f"with ISA={isa}", "",
              f"The same machine ({m.get('cpu', '?')}; flags {' '.join(m.get('cpu_flags', []))})"
              f", both engines capped at {isa}; llmserve's kernels ran as "
              f"`{m.get('kernel_level', '?')}`. Generated by `benchmarks/run_all.py --isa {isa}`; "
              f"runs: {', '.join(x['date'] for x in meta.get('sessions', []))}.", ""],
             target_table(folder), load_table(meta), serving_table(folder, meta, doc),
             llama_bench_table(folder), latency_table(folder), commands(folder, meta)]
    return demoted([line for part in parts for line in part])


def demoted(lines: list[str]) -> list[str]:
    """A section's tables one heading level below its own title (the first line)."""
    return [("#" + line) if line.startswith("## ") and i else line
            for i, line in enumerate(lines)]


def shape_section(folder: Path, doc: Path, alone: bool = False) -> list[str]:
    """A run on a public model's shape (`run_all.py --shape`) as one section titled with
    shape, type and level; `alone`: as a whole report, its tables at their own level."""
    meta = load(folder, "meta.json") or {}
    x, m, isa = meta["shape"], meta.get("machine", {}), meta.get("isa", "native")
    level = m.get("kernel_level", "?").split(" (")[0]
    title = f"{x['name']}, {x['qtype']}, at the {isa} level ({level}, {m.get('cpu', '?')})"
    flags = f"--shape {x['name']} --qtype {x['qtype']}" + ("" if isa == "native" else
                                                          f" --isa {isa}")
    mlp = (f"{x['experts']} experts of {x['expert_intermediate']}, "
           f"{x['experts_per_token']} a token" if x.get("experts")
           else f"MLP {x['intermediate_size']}")
    layout = (f"{x['arch']}: hidden {x['hidden_size']}, {x['num_layers']} layers, "
              f"{x['num_heads']} query / {x['num_kv_heads']} KV heads of {x['head_dim']}, "
              f"{mlp}, vocabulary {x['vocab_size']}"
              + (", tied embeddings" if x["tied_embeddings"] else "")
              + (", QKV bias" if x.get("qkv_bias") else "")
              + (", Q/K norms" if x.get("qk_norm") else ""))
    intro = [("# Benchmarks: " if alone else "## ") + title, ""]
    if meta.get("smoke"):
        intro += ["**SMOKE RUN** (`--smoke`): the figures below mean nothing.", ""]
    intro += [
        f"Random weights in the published shape of {x['name']} ({layout}; "
        f"{x['params'] / 1e9:.2f}B parameters): a {x['file_bytes'] / 1e9:.2f} GB {x['qtype']} "
        "GGUF written by `benchmarks/shapes.py`, SmolLM2's tokenizer padded to the vocabulary. "
        "The tokens mean nothing; the work is that of the real model. Both servers serve it "
        f"as `{x['name']}`.", "",
        f"Machine: {m.get('cpu', '?')}; flags {' '.join(m.get('cpu_flags', []))}; llmserve's "
        f"kernels ran as `{m.get('kernel_level', '?')}`. Generated by `benchmarks/run_all.py "
        f"{flags}`; runs: {', '.join(y['date'] for y in meta.get('sessions', []))}. The "
        f"bounds of the first three targets and of MBU are the 1-8B sizes' ({SHAPE_BOUNDS[0]}x "
        f"at 1 stream, {SHAPE_BOUNDS[2]:.0f}x at 32, TTFT {SHAPE_BOUNDS[3]}x, MBU "
        f"{SHAPE_BOUNDS[1]:.0%}); the others were set for the default model and are a "
        "yardstick here.", ""]
    parts = [intro, target_table(folder), load_table(meta), serving_table(folder, meta, doc),
             llama_bench_table(folder), offline_table(folder, meta), latency_table(folder),
             commands(folder, meta)]
    lines = [line for part in parts for line in part]
    return lines if alone else demoted(lines)


def shape_folders(folders: list[Path]) -> list[Path]:
    """The shape runs kept inside each results folder (shapes/<shape>.<type>)."""
    return [f for folder in folders for f in sorted((folder / "shapes").glob("*"))
            if (f / "meta.json").exists()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", default=HERE / "results")
    parser.add_argument("--doc", type=Path, default=HERE.parent / "docs/benchmarks.md")
    args = parser.parse_args()
    summary = args.folder / "summary.md"
    if "shape" in (load(args.folder, "meta.json") or {}):
        summary.write_text("\n".join(shape_section(args.folder, summary, alone=True)))
        text = "\n".join(shape_section(args.folder, args.doc, alone=True))
        return write_doc(text, args.doc, summary)
    levels = [f for f in sorted(args.folder.parent.glob(args.folder.name + "-*"))
              if (f / "meta.json").exists()]
    summary.write_text(render(args.folder, summary))  # links relative to each file
    text = render(args.folder, args.doc)
    for folder in levels:
        text += "\n" + "\n".join(level_section(folder, args.doc)) + "\n"
    for folder in shape_folders([args.folder, *levels]):
        text += "\n" + "\n".join(shape_section(folder, args.doc)) + "\n"
    return write_doc(text, args.doc, summary)


def write_doc(text: str, doc: Path, summary: Path) -> int:
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    print(text)
    print(f"wrote {summary} and {doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
