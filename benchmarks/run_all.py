"""Every side-by-side benchmark of docs/benchmarks.md, in one command.

    pip install -e '.[bench]'        # llama-cpp-python[server] (compiles llama.cpp), matplotlib
    python benchmarks/run_all.py [--gguf FILE] [--out DIR] [--only STAGE] [--servers NAMES]

1. offline: the same 32 chat prompts x 64 tokens through transformers' static-batch
   `generate` and llmserve's `LLM.generate` (benchmarks/offline.py, one process each, back
   to back: transformers, llmserve fp32, llmserve int8), and `llmserve bench throughput`
   on synthetic prompts;
2. latency: `llmserve bench latency --batch 1,8` (prefill, TPOT, MBU, MFU);
3. serving: llama.cpp's OpenAI server (llama-cpp-python, 2 threads) and `llmserve serve`
   on the same GGUF, one at a time, each driven by `llmserve bench serve` at concurrency
   1/4/16/32 with identical prompts; then `llmserve bench plot` of all.

llmserve runs in each of --variants: `fp32` (the exact path, `--dtype float32`) and `int8`
(`--quantization int8`, W8A8 linear layers); files of the int8 variant end in `_int8`
(`serve_llmserve-int8.json`). Results (JSON, PNG and summary.md with the llmserve / peer
ratios) go to --out.
"""

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

DEFAULT_GGUF = Path.home() / ".cache/llmserve/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ID = "smollm2-135m"
CONCURRENCIES = "1,4,16,32"
SERVE_ARGS = ["--num-prompts", "32", "--input-len", "128", "--output-len", "64"]
THREADS = 2
HERE = Path(__file__).resolve().parent
VARIANTS = {"fp32": [], "int8": ["--quantization", "int8"]}  # extra llmserve flags


def suffix(variant: str) -> str:
    return "" if variant == "fp32" else f"_{variant}"


def sh(cmd: list[str], log: Path | None = None) -> None:
    print(f"$ {shlex.join(cmd)}", flush=True)
    if log is not None:
        with log.open("a") as f:
            f.write(shlex.join(cmd) + "\n")
    subprocess.run(cmd, check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(cmd: list[str], health_url: str, log: Path) -> Iterator[float]:
    """Start a server process; yield its seconds to healthy; stop it (SIGTERM) on exit."""
    print(f"$ {shlex.join(cmd)} &", flush=True)
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > 300:
                raise RuntimeError(f"server not healthy after 300 s; see {log}")
            time.sleep(0.25)
        yield time.perf_counter() - start
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_offline(gguf: Path, out: Path, commands: Path, variants: list[str]) -> None:
    offline = [sys.executable, str(HERE / "offline.py"), "--gguf", str(gguf)]
    sh([*offline, "--engine", "transformers",
        "--output-json", str(out / "offline_transformers.json")], commands)
    for v in variants:  # right after transformers: the ratio is measured side by side
        sh([*offline, "--engine", "llmserve", *VARIANTS[v],
            "--output-json", str(out / f"offline_llmserve{suffix(v)}.json")], commands)
    for v in variants:
        sh(["llmserve", "bench", "throughput", "--model", str(gguf), "--num-prompts", "32",
            "--input-len", "32", "--output-len", "64", "--dtype", "float32", *VARIANTS[v],
            "--output-json", str(out / f"throughput_llmserve{suffix(v)}.json")], commands)


def weights_read_per_step(gguf: Path, variant: str) -> int:
    """Bytes of weights one decode step reads, counted from the loaded model.

    `llmserve bench latency` counts parameters; int8 weights are buffers (qweight and
    weight_scale), and the float embedding of a quantized model is only gathered (a row per
    token), its LM head being a separate int8 copy. fp32: every parameter once (tied).
    """
    from llmserve import LLM

    llm = LLM(str(gguf), dtype="float32", quantization=None if variant == "fp32" else variant)
    model = llm.engine.loaded.model
    params = {id(p): (n, p) for n, p in model.named_parameters()}.values()
    if variant == "fp32":
        return sum(p.numel() * p.element_size() for _, p in params)
    floats = sum(p.numel() * p.element_size() for n, p in params if "embed_tokens" not in n)
    packed = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                 if n.endswith(("qweight", "weight_scale")))
    return floats + packed


def run_latency(gguf: Path, out: Path, commands: Path, variants: list[str]) -> None:
    for v in variants:
        path = out / f"latency_llmserve{suffix(v)}.json"
        sh(["llmserve", "bench", "latency", "--model", str(gguf), "--batch", "1,8",
            "--input-len", "128", "--output-len", "64", "--dtype", "float32", *VARIANTS[v],
            "--output-json", str(path)], commands)
        result = json.loads(path.read_text())
        result["quantization"] = None if v == "fp32" else v
        result["weight_bytes_read_per_step"] = weights_read_per_step(gguf, v)
        path.write_text(json.dumps(result, indent=2) + "\n")


def bench_serve(label: str, url: str, gguf: Path, out: Path, commands: Path) -> None:
    sh(["llmserve", "bench", "serve", "--base-url", url, "--model", MODEL_ID,
        "--tokenizer-model", str(gguf), "--concurrency", CONCURRENCIES, *SERVE_ARGS,
        "--label", label, "--output-json", str(out / f"serve_{label}.json")], commands)


def run_serving(gguf: Path, out: Path, commands: Path, servers: list[str],
                variants: list[str]) -> dict:
    startup = {}
    if "llama.cpp" in servers:
        port = free_port()
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
               "--model_alias", MODEL_ID, "--n_threads", str(THREADS),
               "--n_threads_batch", str(THREADS), "--n_ctx", "4096", "--host", "127.0.0.1",
               "--interrupt_requests", "False",  # else each new request cuts the running one
               "--port", str(port)]
        log = out / "llamacpp.log"
        with server(cmd, f"http://127.0.0.1:{port}/v1/models", log) as t:
            startup["llama.cpp"] = t
            bench_serve("llama.cpp", f"http://127.0.0.1:{port}", gguf, out, commands)
        if log.stat().st_size > 100_000:
            log.unlink()
    for v in variants if "llmserve" in servers else []:
        label = "llmserve" if v == "fp32" else f"llmserve-{v}"
        port = free_port()
        cmd = ["llmserve", "serve", "--model", str(gguf), "--served-model-name", MODEL_ID,
               "--port", str(port), "--dtype", "float32", *VARIANTS[v]]
        log = out / f"{label}.log"
        with server(cmd, f"http://127.0.0.1:{port}/health", log) as t:
            startup[label] = t
            bench_serve(label, f"http://127.0.0.1:{port}", gguf, out, commands)
        if log.stat().st_size > 100_000:  # keep the results folder small
            log.unlink()
    files = [str(out / f"serve_{n}.json") for n in ("llama.cpp", "llmserve", "llmserve-int8")
             if (out / f"serve_{n}.json").exists()]
    sh(["llmserve", "bench", "plot", *files, "--output", str(out / "serve.png")], commands)
    return startup


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--servers", default="llama.cpp,llmserve",
                        help="servers of the serving stage, comma-separated")
    parser.add_argument("--variants", default="fp32,int8",
                        help="llmserve variants, comma-separated: fp32 (exact), int8 (W8A8)")
    parser.add_argument("--only", choices=("offline", "latency", "serving"), action="append")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    commands = args.out / "commands.txt"  # appended to: several sessions may fill one folder
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    stages = args.only or ["offline", "latency", "serving"]
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.2f}", flush=True)
    if "offline" in stages:
        run_offline(args.gguf, args.out, commands, variants)
    if "latency" in stages:
        run_latency(args.gguf, args.out, commands, variants)
    startup = {}
    if "serving" in stages:
        startup = run_serving(args.gguf, args.out, commands, args.servers.split(","), variants)
    meta_path = args.out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta.setdefault("sessions", []).append(
        {"stages": stages, "servers": args.servers, "variants": variants,
         "date": time.strftime("%Y-%m-%d %H:%M"),
         "load_at_start": load, "load_at_end": os.getloadavg()[0]})
    meta["startup_s"] = {**meta.get("startup_s", {}), **startup}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    sh([sys.executable, str(HERE / "summarize.py"), str(args.out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
