"""Structured output's cost, side by side: llmserve and llama.cpp's llama-server, each alone.

    python benchmarks/structured.py [--gguf FILE] [--out DIR] [--repeats 3]

Each server (2 threads; llama.cpp with 16 parallel slots and continuous batching) serves
streamed chat requests, free text and then with `--structured json_schema`
(response_format json_schema, the nested schema of `llmserve.bench.serve`), alternated
`--repeats` times, every run with prompts of its own (`--seed`) so that no prefix cache
helps. `llmserve bench serve` drives both at concurrency 1 and 16 (16 requests x (128 in,
128 out) per level). The machine's load is sampled during each server's runs. Prints the
medians, and the schema / free ratios paired run by run (each schema run against the free
run just before it: the machine drifts by 10-20 % over minutes, both variants with it);
every run's JSON goes to --out.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from monitor import LoadMonitor, warning
from run_all import ANCHORS, DEFAULT_GGUF, MODEL_ID, THREADS, free_port, server

VARIANTS = ("free", "json_schema")
LOAD = ["--endpoint", "chat", "--concurrency", "1,16", "--num-prompts", "16",
        "--input-len", "128", "--output-len", "128"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--llama-server", type=Path, default=ANCHORS / "bin" / "llama-server")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/structured"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    llmserve = str(Path(sys.executable).with_name("llmserve"))
    servers = {
        "llama.cpp": ([str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1",
                       "-a", MODEL_ID, "-t", str(THREADS), "-tb", str(THREADS), "-np", "16",
                       "-cb", "-c", str(16 * 320), "--no-webui", "--port"],
                      {"LD_LIBRARY_PATH": str(args.llama_server.parent)}),
        "llmserve": ([llmserve, "serve", "--model", str(args.gguf), "--served-model-name",
                      MODEL_ID, "--threads", str(THREADS), "--port"], None),
    }
    medians: dict[tuple[str, str, int], tuple[float, float, int]] = {}
    paired: dict[tuple[str, int], tuple[float, float]] = {}
    for name, (cmd, env) in servers.items():
        port = free_port()
        runs: dict[tuple[str, int], list[dict]] = {}
        with LoadMonitor() as monitor, server([*cmd, str(port)], port,
                                              args.out / f"{name}.log", monitor, env):
            for repeat in range(args.repeats):
                for i, variant in enumerate(VARIANTS):
                    result = args.out / f"{name}_{variant}_{repeat + 1}.json"
                    extra = [] if variant == "free" else ["--structured", variant]
                    seed = 1000 * (i + 1) + repeat  # prompts of its own, every run
                    _bench(llmserve, port, [*LOAD, *extra, "--seed", str(seed), "--label",
                                            f"{name} {variant}", "--output-json", str(result)])
                    for run in json.loads(result.read_text())["runs"]:
                        runs.setdefault((variant, run["concurrency"]), []).append(run)
        log = args.out / f"{name}.log"
        if log.stat().st_size > 100_000:  # keep the results folder small
            log.unlink()
        load = monitor.summary()
        print(f"{name}: machine load {json.dumps(load.get('other_cores'))}")
        note = warning(name, load)
        if note:
            print(note)
        for (variant, conc), rs in runs.items():
            medians[(name, variant, conc)] = (
                statistics.median(r["output_throughput"] for r in rs),
                statistics.median(r["p50_tpot_ms"] for r in rs),
                sum(r["total_output_tokens"] for r in rs) // len(rs))
        for conc in (1, 16):  # each schema run against the free run just before it
            pairs = list(zip(runs[("free", conc)], runs[("json_schema", conc)], strict=True))
            paired[(name, conc)] = (
                statistics.median(j["output_throughput"] / f["output_throughput"]
                                  for f, j in pairs),
                statistics.median(j["p50_tpot_ms"] / f["p50_tpot_ms"] for f, j in pairs))
    print("\n| server | streams | output tok/s free / schema (medians) | paired ratio | "
          "TPOT p50 ms free / schema (medians) | paired ratio | tokens per run free / "
          "schema |")
    print("|---|---|---|---|---|---|---|")
    for name in servers:
        for conc in (1, 16):
            free, schema = medians[(name, "free", conc)], medians[(name, "json_schema", conc)]
            tok_ratio, tpot_ratio = paired[(name, conc)]
            print(f"| {name} | {conc} | {free[0]:.1f} / {schema[0]:.1f} | {tok_ratio:.2f}x | "
                  f"{free[1]:.2f} / {schema[1]:.2f} | {tpot_ratio:.2f}x | "
                  f"{free[2]} / {schema[2]} |")
    for variant in VARIANTS:
        for conc in (1, 16):
            ours, peer = medians[("llmserve", variant, conc)], medians[("llama.cpp", variant, conc)]
            print(f"llmserve / llama.cpp, {variant}, {conc} streams: output tok/s "
                  f"{ours[0] / peer[0]:.2f}x")
    return 0


def _bench(llmserve: str, port: int, options: list[str]) -> None:
    subprocess.run([llmserve, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                    "--model", MODEL_ID, *options], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main())
