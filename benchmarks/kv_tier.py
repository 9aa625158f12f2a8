"""The KV tier (`--kv-offload-dir`), in one run: what it saves, what it costs.

    python benchmarks/kv_tier.py [--model smollm2-135m] [--prefix-tokens 2000] [--out DIR]
                                 [--only ttft|write|chat] [--llama-server PATH]

1. TTFT of a long shared prefix (--prefix-tokens of a document, then a short question),
   each server alone, 2 threads, streamed `/v1/completions`, three documents each:
   * llmserve, cold: a fresh server with an empty tier (every block computed);
   * llmserve, warm tier: the same server restarted on the same tier folder (memory empty,
     the blocks read from disk);
   * llama.cpp's `llama-server`, fresh (no tier: it computes the prompt).
2. The cost of writing blocks out: the same prefill-heavy offline batch (32 distinct
   prompts of 512 tokens, 16 tokens out) with a tier (an empty folder each run) and
   without, alternating, --repeats runs each (5); wall time ratio (target <= 1.05), the
   engine thread's time copying blocks out and the writer thread's CPU time.
3. A chat workload whose working set is 4x the in-memory KV cache: 12 conversations, each
   about a document of its own, 3 turns each, taken round-robin (a conversation comes back
   after the other 11 evicted it from memory); one request at a time; prefix-cache hit
   rate (memory and tier) and TTFT, without and with the tier.

The machine's CPU flags and kernel level, the load seen during each part (benchmarks/
monitor.py), and every figure go to --out/kv_tier.json; the tables print.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from monitor import LoadMonitor, warning
from run_all import ANCHORS, free_port, server

from llmserve import LLM, SamplingParams
from llmserve.bench.machine import machine_info
from llmserve.bench.throughput import synthetic_prompts
from llmserve.loader.catalog import resolve_model

HERE = Path(__file__).resolve().parent
THREADS = 2
MODEL_ID = "model"
QUESTION = "\n\nQuestion: what is the main point of the text above? Answer:"


def document(i: int, num_tokens: int, llm: LLM) -> str:
    """A text of about `num_tokens` tokens, different from the first word on for each i."""
    sentences, text = [], ""
    n = 0
    while len(llm.tokenizer.encode(text)) < num_tokens:
        sentences.append(f"Record {i}.{n}: the committee of district {i} reviewed item {n} "
                         f"and noted {['rain', 'wheat', 'roads', 'tax', 'schools'][n % 5]}.")
        n += 1
        text = " ".join(sentences)
    return text


def first_token_seconds(port: int, prompt: str) -> tuple[float, int]:
    """Seconds from sending a streamed completion to its first text chunk; prompt tokens."""
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, prompt_tokens = None, 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                      timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    return ttft, prompt_tokens


def ttft_part(args, llm: LLM, out: Path, monitors: dict) -> dict:
    gguf = str(resolve_model(args.model).path)
    docs = [document(i, args.prefix_tokens, llm) + QUESTION for i in range(3)]
    tier = Path(tempfile.mkdtemp(prefix="kv-tier-bench-"))
    llmserve = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--model", gguf,
                "--served-model-name", MODEL_ID, "--threads", str(THREADS),
                "--kv-offload-dir", str(tier)]
    rows: dict[str, list[float]] = {}
    tokens = []

    def measure(label: str, cmd: list[str], port: int, env: dict | None = None) -> None:
        log = out / f"{label.replace(' ', '-')}.log"
        with LoadMonitor() as monitor, server(cmd, port, log, monitor, env):
            rows[label] = []
            for prompt in docs:
                ttft, n = first_token_seconds(port, prompt)
                rows[label].append(ttft)
                tokens.append(n)
        monitors[f"ttft:{label}"] = monitor.summary()

    port = free_port()
    measure("llmserve cold", [*llmserve, "--port", str(port)], port)
    port = free_port()
    measure("llmserve warm tier", [*llmserve, "--port", str(port)], port)
    llama = args.llama_server
    if llama.is_file():
        port = free_port()
        measure("llama.cpp", [str(llama), "-m", gguf, "--host", "127.0.0.1", "--port",
                              str(port), "-a", MODEL_ID, "-t", str(THREADS), "-tb",
                              str(THREADS), "-c", "4096", "--no-webui"], port,
                {"LD_LIBRARY_PATH": str(llama.parent)})
    shutil.rmtree(tier, ignore_errors=True)
    cold = statistics.median(rows["llmserve cold"])
    print(f"\n1. TTFT of a {args.prefix_tokens}-token prefix + question "
          f"({min(tokens)}-{max(tokens)} prompt tokens), seconds, 3 documents:")
    print("| server | doc 1 | doc 2 | doc 3 | median | vs llmserve cold |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, ttfts in rows.items():
        median = statistics.median(ttfts)
        print(f"| {label} | " + " | ".join(f"{t:.3f}" for t in ttfts)
              + f" | {median:.3f} | {median / cold:.3f}x |")
    return {"prompt_tokens": tokens, "ttft_s": rows}


def write_cost_part(args, monitors: dict) -> dict:
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    times: dict[str, list[float]] = {"no tier": [], "tier": []}
    written, copy_s, writer_cpu_s = [], [], []
    with LoadMonitor() as monitor:
        for _ in range(args.repeats):
            for label in ("no tier", "tier"):
                tier = tempfile.mkdtemp(prefix="kv-tier-cost-")
                options = {"kv_offload_dir": tier} if label == "tier" else {}
                llm = LLM(args.model, num_threads=THREADS, **options)
                prompts = synthetic_prompts(llm, 32, 512, seed=len(times[label]))
                llm.generate(prompts[:2], sp, use_tqdm=False)  # warm-up, other tokens
                start = time.perf_counter()
                llm.generate(prompts[2:], sp, use_tqdm=False)
                times[label].append(time.perf_counter() - start)
                if llm.engine.kv_tier is not None:
                    llm.engine.kv_tier.flush()
                    stats = llm.engine.kv_tier.stats
                    written.append(stats.bytes_written)
                    copy_s.append(stats.copy_seconds)
                    writer_cpu_s.append(stats.write_cpu_seconds)
                llm.engine.shutdown()
                del llm
                shutil.rmtree(tier, ignore_errors=True)
    monitors["write cost"] = monitor.summary()
    base, tiered = statistics.median(times["no tier"]), statistics.median(times["tier"])
    print(f"\n2. Writing blocks out: 30 prompts x 512 tokens, 16 out, wall seconds "
          f"({args.repeats} runs each, alternating):")
    print("| engine | runs | median | vs no tier |")
    print("|---|---|---:|---:|")
    for label, ts in times.items():
        print(f"| {label} | {', '.join(f'{t:.2f}' for t in ts)} | {statistics.median(ts):.2f}"
              f" | {statistics.median(ts) / base:.3f}x |")
    print(f"(the tier wrote {statistics.median(written) / 2**20:.1f} MiB a run; the engine "
          f"thread spent {statistics.median(copy_s):.3f} s copying blocks out "
          f"({statistics.median(copy_s) / tiered:.2%} of the run), the writer thread "
          f"{statistics.median(writer_cpu_s):.2f} s of CPU at idle priority "
          f"({statistics.median(writer_cpu_s) / tiered:.1%}))")
    return {"seconds": times, "ratio": tiered / base, "bytes_written": written,
            "copy_seconds": copy_s, "writer_cpu_seconds": writer_cpu_s}


def chat_part(args, llm_probe: LLM, monitors: dict) -> dict:
    num_conv, turns, doc_tokens = 12, 3, 500
    docs = [document(100 + i, doc_tokens, llm_probe) for i in range(num_conv)]
    questions = ["Summarize it in one sentence.", "Which item came first?",
                 "What did the committee note most often?"]
    # per conversation ~doc + 3 x (question + 24 answer tokens): the working set, in tokens
    working_set = num_conv * (doc_tokens + 60 + turns * 50)
    per_token = llm_probe.engine.kv_plan.total_bytes // llm_probe.engine.kv_plan.num_tokens
    memory_tokens = working_set // 4
    sp = SamplingParams(max_tokens=24, temperature=0)
    results = {}
    for label in ("no tier", "tier"):
        tier = tempfile.mkdtemp(prefix="kv-tier-chat-")
        options = {"kv_offload_dir": tier} if label == "tier" else {}
        llm = LLM(args.model, num_threads=THREADS, kv_cache_memory=memory_tokens * per_token,
                  **options)
        history = [[{"role": "system", "content": f"Read this record.\n\n{d}"}] for d in docs]
        ttfts, prompt_tokens, memory_hits, tier_hits, replies = [], 0, 0, 0, []
        with LoadMonitor() as monitor:
            for turn in range(turns):
                for c in range(num_conv):
                    history[c].append({"role": "user", "content": questions[turn]})
                    (out,) = llm.chat(history[c], sp, use_tqdm=False)
                    history[c].append({"role": "assistant", "content": out.outputs[0].text})
                    replies.append(out.outputs[0].token_ids)
                    ttfts.append(out.metrics.time_to_first_token)
                    prompt_tokens += len(out.prompt_token_ids)
                    tier_hits += out.metrics.num_tier_cached_tokens
                    memory_hits += out.num_cached_tokens - out.metrics.num_tier_cached_tokens
        monitors[f"chat:{label}"] = monitor.summary()
        results[label] = {
            "kv_cache_tokens": llm.engine.kv_plan.num_tokens, "requests": len(ttfts),
            "prompt_tokens": prompt_tokens, "memory_hit_tokens": memory_hits,
            "tier_hit_tokens": tier_hits, "ttft_s": ttfts, "replies": replies}
        llm.engine.shutdown()
        del llm
        shutil.rmtree(tier, ignore_errors=True)
    same = results["tier"]["replies"] == results["no tier"]["replies"]
    print(f"\n3. Chat: {num_conv} conversations x {turns} turns round-robin, documents of "
          f"{doc_tokens} tokens; working set ~{working_set} tokens, in-memory KV cache "
          f"{results['tier']['kv_cache_tokens']} tokens; one request at a time:")
    print("| engine | hit rate (memory + tier) | of which tier | TTFT mean s | TTFT p50 s |")
    print("|---|---:|---:|---:|---:|")
    for label, r in results.items():
        hits = r["memory_hit_tokens"] + r["tier_hit_tokens"]
        print(f"| {label} | {hits / r['prompt_tokens']:.1%} | "
              f"{r['tier_hit_tokens'] / r['prompt_tokens']:.1%} | "
              f"{statistics.mean(r['ttft_s']):.3f} | {statistics.median(r['ttft_s']):.3f} |")
    print(f"replies identical with and without the tier (greedy): {same}")
    return {**results, "replies_identical": same, "working_set_tokens": working_set}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "kv_tier")
    parser.add_argument("--only", choices=("ttft", "write", "chat"), action="append")
    parser.add_argument("--llama-server", type=Path, default=ANCHORS / "bin" / "llama-server",
                        help="llama.cpp's server for part 1 (with LLMSERVE_CPU_ISA=avx2: "
                             "its AVX2-only build, bin-avx2/)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    parts = args.only or ["ttft", "write", "chat"]
    probe = LLM(args.model, num_threads=THREADS)
    info = machine_info()
    print(f"CPU: {info['cpu']}; flags: {' '.join(info['cpu_flags'])}; kernel level: "
          f"{info['kernel_level']}; torch {info['torch_version']}; {THREADS} threads")
    results, monitors = {"machine": info, "date": time.strftime("%Y-%m-%d %H:%M")}, {}
    if "ttft" in parts:
        results["ttft"] = ttft_part(args, probe, args.out, monitors)
    if "chat" in parts:
        results["chat"] = chat_part(args, probe, monitors)
    del probe
    if "write" in parts:
        results["write_cost"] = write_cost_part(args, monitors)
    results["load"] = monitors
    for stage, summary in monitors.items():
        if note := warning(stage, summary):
            print(note)
    print("\nmachine load per part (other processes, cores mean / max): " + "; ".join(
        f"{k} {v['other_cores']['mean']:.2f} / {v['other_cores']['max']:.2f}"
        for k, v in monitors.items()))
    (args.out / "kv_tier.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out / 'kv_tier.json'}")


if __name__ == "__main__":
    main()
