"""Speculation side by side: llmserve and llama.cpp's llama-server, one run.

    python benchmarks/spec_vs_llamacpp.py [--gguf FILE] [--out DIR] [--repeats 2]
        [--eagle FOLDER] [--medusa FOLDER] [--float32]

Each server alone on the machine (2 threads; llama.cpp with 4 parallel slots and continuous
batching), with and without n-gram speculation, answers the `llmserve bench spec`
workloads (grounded: copy, edit, summarise a shipped passage, document shipped code; chat:
four open questions) one request at a time, greedy, 128 tokens at most, through
`/v1/chat/completions`. Output tok/s = completion tokens / wall time over the workload. The
configurations are alternated `--repeats` times (the machine drifts by 10-20 % over
minutes); the machine's load is sampled during each. Prints the medians, each server's
speedup over itself without speculation, and whether its speculative replies equal its own
plain ones. `--eagle` / `--medusa` add llmserve with heads `llmserve train-heads` wrote;
`--float32` adds llmserve's exact path (`--dtype float32`), plain and with each method.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from monitor import LoadMonitor, warning
from run_all import ANCHORS, DEFAULT_GGUF, MODEL_ID, THREADS, free_port, server

MAX_TOKENS = 128
# llmserve is never imported here, so this process's environment, which llama-server
# inherits, stays as the user started it (llmserve's OMP_WAIT_POLICY=PASSIVE measured
# llama-server's batch-1 decode at a third of its speed). The workloads and the machine
# line come from a child process.
_CHILD = """
import json
from llmserve.bench.machine import format_machine
from llmserve.bench.spec import CHAT_PROMPTS, grounded_prompts
print(json.dumps({"machine": format_machine(),
                  "workloads": {"grounded": grounded_prompts(), "chat": list(CHAT_PROMPTS)}}))
"""


def workloads_and_machine() -> tuple[dict[str, list[str]], str]:
    out = json.loads(subprocess.run([sys.executable, "-c", _CHILD], check=True,
                                    capture_output=True, text=True).stdout)
    return out["workloads"], out["machine"]


def configs(gguf: Path, llama_server: Path, heads: dict[str, Path | None],
            float32: bool) -> dict[str, tuple[list[str], dict | None]]:
    llmserve = str(Path(sys.executable).with_name("llmserve"))
    ours = [llmserve, "serve", "--model", str(gguf), "--served-model-name", MODEL_ID,
            "--threads", str(THREADS)]
    peer = [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "-a", MODEL_ID,
            "-t", str(THREADS), "-tb", str(THREADS), "-np", "4", "-cb", "-c", "8192",
            "--no-webui"]
    env = {"LD_LIBRARY_PATH": str(llama_server.parent)}
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    ours_spec = {"ngram": spec} | {
        method: json.dumps({"method": method, "model": str(folder),
                            "num_speculative_tokens": 4})
        for method, folder in heads.items() if folder is not None}
    mine = {"llmserve": (ours, None)} | {
        f"llmserve {m}": ([*ours, "--speculative-config", s], None)
        for m, s in ours_spec.items()}
    if float32:
        exact = [*ours, "--dtype", "float32"]
        mine |= {"llmserve float32": (exact, None)} | {
            f"llmserve float32 {m}": ([*exact, "--speculative-config", s], None)
            for m, s in ours_spec.items()}
    return mine | {
        "llama.cpp": (peer, env),
        "llama.cpp ngram-simple (defaults: n 12, m 48)": ([*peer, "--spec-type", "ngram-simple"],
                                                          env),
        "llama.cpp ngram-simple (n 2, m 4)": ([*peer, "--spec-type", "ngram-simple",
                                               "--spec-ngram-simple-size-n", "2",
                                               "--spec-ngram-simple-size-m", "4"], env),
        "llama.cpp ngram-mod (defaults)": ([*peer, "--spec-type", "ngram-mod"], env),
        "llama.cpp ngram-map-k (defaults)": ([*peer, "--spec-type", "ngram-map-k"], env),
    }


def run_workload(port: int, prompts: list[str]) -> tuple[int, float, list[str]]:
    """Completion tokens, seconds and replies, one request at a time."""
    tokens, texts = 0, []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
        client.post("/v1/chat/completions", json={  # warm-up
            "model": MODEL_ID, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}]}).raise_for_status()
        start = time.perf_counter()
        for prompt in prompts:
            resp = client.post("/v1/chat/completions", json={
                "model": MODEL_ID, "max_tokens": MAX_TOKENS, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]})
            resp.raise_for_status()
            body = resp.json()
            tokens += body["usage"]["completion_tokens"]
            texts.append(body["choices"][0]["message"]["content"])
        return tokens, time.perf_counter() - start, texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--llama-server", type=Path, default=ANCHORS / "bin" / "llama-server")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/spec"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--eagle", type=Path, help="an EAGLE head's folder")
    parser.add_argument("--medusa", type=Path, help="Medusa heads' folder")
    parser.add_argument("--float32", action="store_true", help="llmserve's exact path too")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workloads, machine = workloads_and_machine()
    print(machine, flush=True)
    rates: dict[tuple[str, str], list[float]] = {}
    replies: dict[tuple[str, str], list[str]] = {}
    loads: dict[str, list] = {}
    for repeat in range(args.repeats):
        for name, (cmd, env) in configs(args.gguf, args.llama_server,
                                        {"eagle": args.eagle, "medusa": args.medusa},
                                        args.float32).items():
            port = free_port()
            log = args.out / "server.log"
            with LoadMonitor() as monitor, server([*cmd, "--port", str(port)], port, log,
                                                  monitor, env):
                for workload, prompts in workloads.items():
                    tokens, seconds, texts = run_workload(port, prompts)
                    rates.setdefault((name, workload), []).append(tokens / seconds)
                    replies[(name, workload)] = texts
                    print(f"run {repeat + 1} {name} {workload}: {tokens} tokens, "
                          f"{tokens / seconds:.1f} tok/s", flush=True)
            log.unlink()
            load = monitor.summary()
            loads.setdefault(name, []).append(load.get("other_cores"))
            note = warning(name, load)
            if note:
                print(note)
    rows = []
    print("\n| server | workload | output tok/s (median) | speedup over itself | "
          "replies equal to its plain ones |")
    print("|---|---|---|---|---|")
    for (name, workload), values in rates.items():
        plain = ("llama.cpp" if name.startswith("llama.cpp") else
                 "llmserve float32" if name.startswith("llmserve float32") else "llmserve")
        median = statistics.median(values)
        speedup = median / statistics.median(rates[(plain, workload)])
        same = replies[(name, workload)] == replies[(plain, workload)]
        rows.append({"server": name, "workload": workload, "tok_s": values,
                     "median_tok_s": median, "speedup": speedup, "same_replies": same})
        print(f"| {name} | {workload} | {median:.1f} | {speedup:.2f}x | "
              f"{'yes' if same else 'no'} |")
    for workload in workloads:
        best_peer = max(statistics.median(v) for (n, w), v in rates.items()
                        if w == workload and n.startswith("llama.cpp"))
        for (name, w), values in rates.items():
            if w == workload and name.startswith("llmserve "):
                print(f"{workload}: {name} / best llama.cpp configuration: "
                      f"{statistics.median(values) / best_peer:.2f}x")
    (args.out / "vs_llamacpp.json").write_text(json.dumps(
        {"machine": machine, "rows": rows, "load_other_cores": loads,
         "max_tokens": MAX_TOKENS}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
