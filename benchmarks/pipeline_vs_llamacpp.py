"""Layers split over two hosts, side by side: llmserve's pipeline parallelism and llama.cpp's
RPC backend, one run.

    sudo python benchmarks/pipeline_vs_llamacpp.py [--shape llama-3.2-1b] [--qtype Q4_K_M]
        [--batch 1,16] [--out benchmarks/results/scaling/pipeline_hosts]

Two hosts made on this machine as network namespaces on a bridge (tests/distributed/
hosts.py; root), one thread each, the model file of a public shape (benchmarks/shapes.py).

* llama.cpp: `ggml-rpc-server -t 1` on host 1; on host 0 `llama-bench` (batch 1: pp and tg) and
  `llama-batched-bench` (parallel sequences) with `--rpc HOST1:PORT -ngl L/2`: the last
  L/2 layers on host 1, the first L/2, the embedding and the output head on host 0. Its
  build needs the RPC backend (`GGML_RPC=ON`: `RPC=1 build_llama_server.sh`).
* llmserve: torchrun on each host, `llmserve bench latency -pp 2
  --distributed-executor-backend external_launcher` with `--pipeline-layer-partition
  L/2,L/2` (the same split) and with its own split.
* Each alone on host 0 with 1 and 2 threads, for scale.

Decode tok/s: batch / the step (llmserve's median TPOT; llama.cpp's tg and S_TG). Prompt
tok/s: prompt tokens / the prefill. Writes results.json and the commands to --out.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from shapes import SHAPES, shape_gguf  # noqa: E402

from tests.distributed.hosts import llmserve_argv, namespace_hosts, torchrun_argv  # noqa: E402

RPC_BIN = Path.home() / ".cache/llmserve-anchors/bin-rpc"
RPC_PORT = 50052
MASTER_PORT = 29611


def llama_env() -> dict[str, str]:
    return {"LD_LIBRARY_PATH": str(RPC_BIN)}


def run_in(host, argv: list[str], log: Path, timeout: float, **env: str) -> str:
    """`argv` on `host` to the end; its output (also in `log`)."""
    process = host.popen(argv, log, **env)
    if process.wait(timeout) != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {process.returncode}:\n"
                           + log.read_text()[-3000:])
    return log.read_text()


def llama_bench(host, gguf: Path, extra: list[str], threads: int, prompt: int, out: int,
                log: Path) -> dict[str, float]:
    """llama-bench's pp and tg tok/s (batch 1)."""
    text = run_in(host, [str(RPC_BIN / "llama-bench"), "-m", str(gguf), "-t", str(threads),
                         "-p", str(prompt), "-n", str(out), "-r", "3", "-o", "json", *extra],
                  log, 1800, **llama_env())
    rows = json.loads(text[text.index("["): text.rindex("]") + 1])
    got = {}
    for row in rows:
        kind = "prompt" if row["n_prompt"] else "decode"
        got[kind] = row["avg_ts"]
    return got


def batched_bench(host, gguf: Path, extra: list[str], threads: int, prompt: int, out: int,
                  batch: int, log: Path) -> dict[str, float]:
    """llama-batched-bench's S_PP and S_TG tok/s at `batch` parallel sequences."""
    text = run_in(host, [str(RPC_BIN / "llama-batched-bench"), "-m", str(gguf), "-t",
                         str(threads), "-c", str(batch * (prompt + out) + 64), "-b", "2048",
                         "-npp", str(prompt), "-ntg", str(out), "-npl", str(batch),
                         "--output-format", "jsonl", *extra], log, 3600, **llama_env())
    row = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
    return {"prompt": row["speed_pp"], "decode": row["speed_tg"]}


def llmserve_latency(hosts, gguf: Path, batch: int, prompt: int, out: int, out_dir: Path,
                     tag: str, extra: list[str]) -> dict[str, float]:
    """`llmserve bench latency` at `batch`: on host 0 alone (one host given) or as a
    pipeline under torchrun across the hosts."""
    result = out_dir / f"latency_{tag}.json"
    command = ["bench", "latency", "-v", "--model", str(gguf), "--batch", str(batch),
               "--input-len", str(prompt), "--output-len", str(out), "--repeat", "3",
               "--output-json", str(result), *extra]
    if len(hosts) == 1:
        run_in(hosts[0], llmserve_argv() + command, out_dir / f"{tag}.log", 3600)
    else:
        master = hosts[0].address
        procs = [host.popen(torchrun_argv(len(hosts), node, 1, master, MASTER_PORT)
                            + llmserve_argv() + command
                            + ["--distributed-executor-backend", "external_launcher"],
                            out_dir / f"{tag}.node{node}.log")
                 for node, host in enumerate(hosts)]
        codes = [p.wait(3600) for p in procs]
        if any(codes):
            raise RuntimeError(f"{tag}: exit codes {codes}; see {out_dir}/{tag}.node*.log")
    run = json.loads(result.read_text())["runs"][0]
    return {"prompt": batch * prompt / run["prefill_s"] if run.get("prefill_s") else None,
            "decode": batch / run["tpot_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--qtype", default="Q4_K_M")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks/results/scaling/pipeline_hosts")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = shape_gguf(args.shape, args.qtype)
    layers = SHAPES[args.shape].num_layers
    half = layers // 2
    p, n = args.input_len, args.output_len
    rows: list[dict] = []

    def row(engine: str, layout: str, batch: int, got: dict[str, float]) -> None:
        rows.append({"engine": engine, "layout": layout, "batch": batch, **got})
        prompt = f"{got['prompt']:.1f}" if got.get("prompt") else "-"
        print(f"{engine:9} {layout:36} {batch:5} {prompt:>10} {got['decode']:>10.1f}",
              flush=True)

    print(f"{args.shape} {args.qtype} ({gguf}); {layers} layers; prompts {p}, outputs {n}")
    print(f"{'engine':9} {'layout':36} {'batch':>5} {'prompt t/s':>10} {'decode t/s':>10}")
    with namespace_hosts(2) as hosts:
        a, b = hosts
        for threads in (1, 2):
            for batch in batches:
                got = llama_bench(a, gguf, [], threads, p, n, args.out / "llama_one.log") \
                    if batch == 1 else batched_bench(a, gguf, [], threads, p, n, batch,
                                                     args.out / "llama_one.log")
                row("llama.cpp", f"one host, {threads} threads", batch, got)
                got = llmserve_latency([a], gguf, batch, p, n, args.out,
                                       f"one_{threads}t_b{batch}",
                                       ["--threads", str(threads)])
                row("llmserve", f"one host, {threads} threads", batch, got)
        server = b.popen([str(RPC_BIN / "ggml-rpc-server"), "-H", b.address, "-p", str(RPC_PORT),
                          "-t", "1"], args.out / "rpc-server.log", **llama_env())
        time.sleep(3)
        rpc = ["--rpc", f"{b.address}:{RPC_PORT}", "-ngl", str(half)]
        try:
            for batch in batches:
                got = llama_bench(a, gguf, rpc, 1, p, n, args.out / "llama_rpc.log") \
                    if batch == 1 else batched_bench(a, gguf, rpc, 1, p, n, batch,
                                                     args.out / "llama_rpc.log")
                row("llama.cpp", f"RPC, layers {half} | {layers - half}", batch, got)
        finally:
            server.terminate()
            server.wait(30)
        for batch in batches:
            got = llmserve_latency(hosts, gguf, batch, p, n, args.out, f"pp2_even_b{batch}",
                                   ["-pp", "2", "--pipeline-layer-partition",
                                    f"{half},{layers - half}"])
            row("llmserve", f"PP=2, layers {half} | {layers - half}", batch, got)
            got = llmserve_latency(hosts, gguf, batch, p, n, args.out, f"pp2_auto_b{batch}",
                                   ["-pp", "2"])
            split = re.search(r"pipeline: layers ([0-9-]+, [0-9-]+)",
                              (args.out / f"pp2_auto_b{batch}.node0.log").read_text())
            row("llmserve", f"PP=2, its split ({split.group(1) if split else '?'})", batch,
                got)
    machine = subprocess.run([sys.executable, "-c", "from llmserve.bench.machine import "
                              "format_machine; print(format_machine())"],
                             capture_output=True, text=True).stdout.strip()
    print(machine)
    (args.out / "results.json").write_text(json.dumps(
        {"shape": args.shape, "qtype": args.qtype, "file": str(gguf), "input_len": p,
         "output_len": n, "machine": machine, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
