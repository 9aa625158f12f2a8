"""LoRA: a decode step with adapters against one without, at 1 and 32 streams, in one run.

    python benchmarks/lora.py [--model smollm2-135m] [--rank 16] [--out DIR]

Four random PEFT-format adapters (every linear, rank --rank) are written for the model's
shapes; then, one engine at a time, 2 threads, the default path:
* `base`: the model alone (no --enable-lora), base requests;
* `lora, base requests`: --enable-lora --max-loras 4, requests without adapters;
* `lora, 4 adapters`: the same engine, requests spread over the 4 adapters (one stream:
  one adapter).
Each cell is the decode TPOT (median of --repeats runs, 3 by default, of 64 tokens after a
128-token prompt) and its ratio to `base` at the same batch. The table prints; JSON goes
to --out/lora.json with the CPU flags and kernel level.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.bench.machine import machine_info
from llmserve.bench.throughput import synthetic_prompts

HERE = Path(__file__).resolve().parent
BATCHES = (1, 32)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(llm: LLM, folder: Path, count: int, rank: int) -> list[LoRARequest]:
    """`count` adapters on every linear of `llm`'s model: random A and B (small enough to
    keep the outputs text-like), saved as PEFT saves them."""
    config = llm.engine.loaded.config
    hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    shapes = {"q_proj": (config.num_attention_heads * d, hidden),
              "k_proj": (config.num_key_value_heads * d, hidden),
              "v_proj": (config.num_key_value_heads * d, hidden),
              "o_proj": (hidden, config.num_attention_heads * d),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    requests = []
    for i in range(count):
        path = folder / f"adapter{i}"
        path.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for name, (out, inp) in shapes.items():
                part = "self_attn" if name in TARGETS[:4] else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, inp,
                                                                 generator=generator) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank,
                                                                 generator=generator) * 0.02
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
             "target_modules": list(TARGETS), "bias": "none"}))
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    return requests


def tpot(llm: LLM, batch: int, loras: list[LoRARequest | None], repeats: int = 3) -> float:
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    runs = []
    for r in range(repeats):
        prompts = synthetic_prompts(llm, batch, 128, seed=r + 1)
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        runs.append(statistics.mean(o.metrics.time_per_output_token for o in outputs))
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="decode runs a cell (median)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lora")
    parser.add_argument("--adapters", type=Path,
                        default=Path.home() / ".cache/llmserve/bench-lora",
                        help="where the random adapters are written (80 MB; not the repo)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    results: dict = {"model": args.model, "rank": args.rank, "ms": {}}
    base = LLM(args.model, kv_cache_memory="1GiB")
    results["machine"] = machine_info()
    results["ms"]["base"] = {b: 1e3 * tpot(base, b, [None] * b, args.repeats) for b in BATCHES}
    quantization = base.engine.loaded.quantization
    del base
    lora = LLM(args.model, kv_cache_memory="1GiB", enable_lora=True, max_loras=4,
               max_lora_rank=args.rank)
    adapters = write_adapters(lora, args.adapters, 4, args.rank)
    results["ms"]["lora, base requests"] = {b: 1e3 * tpot(lora, b, [None] * b, args.repeats)
                                            for b in BATCHES}
    results["ms"]["lora, 4 adapters"] = {
        b: 1e3 * tpot(lora, b, [adapters[i % 4] for i in range(b)], args.repeats) for b in BATCHES}
    results["quantization"] = quantization
    (args.out / "lora.json").write_text(json.dumps(results, indent=1) + "\n")
    machine = results["machine"]
    print(f"CPU {machine['cpu']}; flags {' '.join(machine['cpu_flags'])}; kernel level "
          f"{machine['kernel_level']}; 2 threads; {args.model} ({quantization}), rank "
          f"{args.rank}")
    print(f"{'engine':<24}" + "".join(f"{'TPOT b' + str(b) + ' ms':>14}{'vs base':>9}"
                                      for b in BATCHES))
    for name, cells in results["ms"].items():
        print(f"{name:<24}" + "".join(
            f"{cells[b]:>14.2f}{cells[b] / results['ms']['base'][b]:>8.2f}x" for b in BATCHES))


if __name__ == "__main__":
    sys.exit(main())
