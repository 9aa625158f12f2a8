"""Every side-by-side benchmark of docs/benchmarks.md, in one command.

    pip install -e '.[bench]'        # llama-cpp-python[server] (compiles llama.cpp), matplotlib
    python benchmarks/run_all.py [--gguf FILE] [--out DIR] [--only STAGE] [--servers NAMES]

1. offline: the same 32 chat prompts x 64 tokens through transformers' static-batch
   `generate` and llmserve's `LLM.generate` (benchmarks/offline.py, one process each), and
   `llmserve bench throughput` on synthetic prompts;
2. latency: `llmserve bench latency --batch 1,8` (prefill, TPOT, MBU, MFU);
3. serving: llama.cpp's OpenAI server (llama-cpp-python, 2 threads) and `llmserve serve`
   on the same GGUF, one at a time, each driven by `llmserve bench serve` at concurrency
   1/4/16/32 with identical prompts; then `llmserve bench plot` of both.

Results (JSON, PNG and summary.md with the llmserve / peer ratios) go to --out.
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


def run_offline(gguf: Path, out: Path, commands: Path) -> None:
    for engine in ("transformers", "llmserve"):
        sh([sys.executable, str(HERE / "offline.py"), "--engine", engine, "--gguf", str(gguf),
            "--output-json", str(out / f"offline_{engine}.json")], commands)
    sh(["llmserve", "bench", "throughput", "--model", str(gguf), "--num-prompts", "32",
        "--input-len", "32", "--output-len", "64", "--dtype", "float32",
        "--output-json", str(out / "throughput_llmserve.json")], commands)


def run_latency(gguf: Path, out: Path, commands: Path) -> None:
    sh(["llmserve", "bench", "latency", "--model", str(gguf), "--batch", "1,8",
        "--input-len", "128", "--output-len", "64", "--dtype", "float32",
        "--output-json", str(out / "latency_llmserve.json")], commands)


def bench_serve(label: str, url: str, gguf: Path, out: Path, commands: Path) -> None:
    sh(["llmserve", "bench", "serve", "--base-url", url, "--model", MODEL_ID,
        "--tokenizer-model", str(gguf), "--concurrency", CONCURRENCIES, *SERVE_ARGS,
        "--label", label, "--output-json", str(out / f"serve_{label}.json")], commands)


def run_serving(gguf: Path, out: Path, commands: Path, servers: list[str]) -> dict:
    startup = {}
    if "llama.cpp" in servers:
        port = free_port()
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
               "--model_alias", MODEL_ID, "--n_threads", str(THREADS),
               "--n_threads_batch", str(THREADS), "--n_ctx", "4096", "--host", "127.0.0.1",
               "--interrupt_requests", "False",  # else each new request cuts the running one
               "--port", str(port)]
        with server(cmd, f"http://127.0.0.1:{port}/v1/models", out / "llamacpp.log") as t:
            startup["llama.cpp"] = t
            bench_serve("llama.cpp", f"http://127.0.0.1:{port}", gguf, out, commands)
    if "llmserve" in servers:
        port = free_port()
        cmd = ["llmserve", "serve", "--model", str(gguf), "--served-model-name", MODEL_ID,
               "--port", str(port), "--dtype", "float32"]
        with server(cmd, f"http://127.0.0.1:{port}/health", out / "llmserve.log") as t:
            startup["llmserve"] = t
            bench_serve("llmserve", f"http://127.0.0.1:{port}", gguf, out, commands)
    files = [str(out / f"serve_{n}.json") for n in ("llama.cpp", "llmserve")
             if (out / f"serve_{n}.json").exists()]
    sh(["llmserve", "bench", "plot", *files, "--output", str(out / "serve.png")], commands)
    return startup


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--servers", default="llama.cpp,llmserve",
                        help="servers of the serving stage, comma-separated")
    parser.add_argument("--only", choices=("offline", "latency", "serving"), action="append")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    commands = args.out / "commands.txt"  # appended to: several sessions may fill one folder
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    stages = args.only or ["offline", "latency", "serving"]
    load = os.getloadavg()[0]
    print(f"load average at start: {load:.2f}", flush=True)
    if "offline" in stages:
        run_offline(args.gguf, args.out, commands)
    if "latency" in stages:
        run_latency(args.gguf, args.out, commands)
    startup = {}
    if "serving" in stages:
        startup = run_serving(args.gguf, args.out, commands, args.servers.split(","))
    meta_path = args.out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta.setdefault("sessions", []).append(
        {"stages": stages, "servers": args.servers, "date": time.strftime("%Y-%m-%d %H:%M"),
         "load_at_start": load, "load_at_end": os.getloadavg()[0]})
    meta["startup_s"] = {**meta.get("startup_s", {}), **startup}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    sh([sys.executable, str(HERE / "summarize.py"), str(args.out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
