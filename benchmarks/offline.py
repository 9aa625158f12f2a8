"""Offline throughput side by side: the same chat prompts through `transformers` and llmserve.

    python benchmarks/offline.py --engine transformers --gguf F --output-json t.json
    python benchmarks/offline.py --engine llmserve --gguf F --output-json l.json   # default path
    python benchmarks/offline.py --engine llmserve --gguf F --dtype float32 --output-json x.json
    python benchmarks/offline.py --engine llmserve --gguf F --dtype float32 --enforce-eager

32 chat prompts (the model's chat template, token ids identical for both engines), 64 output
tokens each, greedy, EOS ignored, 2 threads. transformers runs them as one static batch
(`generate`, left padding, fp32) on the same GGUF file; llmserve as one continuous batch
(`LLM.generate`) on the path `--dtype`/`--quantization` pick: none given is llmserve's
default (a quantized GGUF stays on the int8 kernels), `--dtype float32` the exact path.
Each engine gets one warm-up call first. Run each engine in its own process so neither
inherits the other's threads. Each engine runs with the OpenMP wait policy its users get:
llmserve's CLI sets OMP_WAIT_POLICY=PASSIVE (unless set) before torch loads, and so does
this script for llmserve; transformers leaves OpenMP's default; the JSON records which.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.", "How do vaccines work?",
    "Give me three tips for learning to code.", "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?",
    "What is a prime number?", "Describe how a bicycle works.",
    "What are the benefits of regular exercise?", "How does a refrigerator keep food cold?",
    "Translate 'good morning' into Spanish and German.", "What is machine learning?",
    "List the planets of the solar system.", "How do bees make honey?",
    "What is the difference between weather and climate?", "Write a short poem about autumn.",
    "How does the internet work?", "What is the Pythagorean theorem?",
    "Suggest a name for a coffee shop.", "Why do cats purr?",
    "How do airplanes stay in the air?", "What is inflation in economics?",
    "Explain recursion to a child.", "What is the tallest mountain in the world?",
    "How should I prepare for a job interview?", "What is DNA?",
    "Give a recipe for pancakes.", "What is the speed of light?",
    "How do volcanoes form?", "Describe the water cycle.",
]
NUM_THREADS = 2


def chat_prompt_ids(gguf: Path, num_prompts: int) -> list[list[int]]:
    """Token ids of each question as a user turn in the model's chat template."""
    from llmserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(gguf)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(num_prompts)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
            for q in questions]


def run_transformers(gguf: Path, prompts: list[list[int]], output_len: int) -> float:
    """Seconds for one static batch through `generate`, fp32, greedy, exactly output_len."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    # left padding: every row's last prompt token sits in the same column
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def generate(n: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                  max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=pad)

    generate(2)  # warm-up
    start = time.perf_counter()
    out = generate(output_len)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == output_len, "transformers stopped early"
    return elapsed


def run_llmserve(gguf: Path, prompts: list[list[int]], output_len: int, dtype: str,
                 quantization: str | None,
                 enforce_eager: bool = False) -> tuple[float, dict[str, Any]]:
    """Seconds for one continuous batch through `LLM.generate`, greedy; the path it ran."""
    from llmserve import LLM
    from llmserve.bench.machine import path_info
    from llmserve.sampling_params import SamplingParams

    llm = LLM(str(gguf), dtype=dtype, quantization=quantization, num_threads=NUM_THREADS,
              enforce_eager=enforce_eager)
    items = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(items[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(items, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed, path_info(llm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("transformers", "llmserve"), required=True)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto",
                        help="llmserve only: auto (default: the fast path), float32 (exact)")
    parser.add_argument("--quantization", choices=("auto", "none", "int8"),
                        help="llmserve only (default: the engine's choice for --dtype)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="llmserve only: no torch.compile of the model step")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    if args.engine != "llmserve" and (args.quantization or args.dtype != "auto"
                                      or args.enforce_eager):
        parser.error("--dtype, --quantization and --enforce-eager apply to --engine llmserve "
                     "only")
    if args.engine == "llmserve":
        from llmserve.cpu_info import set_thread_policy

        set_thread_policy()  # OMP_WAIT_POLICY, before torch loads OpenMP
    import torch

    wait_policy = os.environ.get("OMP_WAIT_POLICY", "unset (OpenMP default)")
    torch.set_num_threads(NUM_THREADS)
    prompts = chat_prompt_ids(args.gguf, args.num_prompts)
    if args.engine == "transformers":
        elapsed = run_transformers(args.gguf, prompts, args.output_len)
        path = {"dtype": "float32", "quantization": None, "kv_cache_dtype": "float32",
                "device": "cpu"}
    else:
        elapsed, path = run_llmserve(args.gguf, prompts, args.output_len, args.dtype,
                                     args.quantization, args.enforce_eager)
        path["enforce_eager"] = args.enforce_eager
    output_tokens = args.output_len * len(prompts)
    result = {"engine": args.engine, **path, "num_prompts": len(prompts),
              "prompt_tokens": sum(len(p) for p in prompts), "output_len": args.output_len,
              "elapsed_s": elapsed, "output_tokens_per_s": output_tokens / elapsed,
              "requests_per_s": len(prompts) / elapsed, "num_threads": NUM_THREADS,
              "omp_wait_policy": wait_policy}
    eager = ", eager" if path.get("enforce_eager") else ""
    print(f"{args.engine} (dtype {path['dtype']}, quantization {path['quantization'] or 'none'}"
          f"{eager}): {len(prompts)} prompts x {args.output_len} tokens in {elapsed:.2f}s = "
          f"{result['output_tokens_per_s']:.1f} output tok/s")
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
