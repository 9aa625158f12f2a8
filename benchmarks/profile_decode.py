"""Where a decode step's time goes: torch profiler over steady-state `Engine.step()` calls.

    python benchmarks/profile_decode.py [--gguf FILE] [--batch 1] [--steps 20]

Starts `batch` requests, runs until every one is decoding, then profiles `steps` steps and
prints (a) wall time per step split into the model runner, and the rest (scheduler,
detokenizer, Python), and (b) the top operators by self CPU time.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from llmserve import LLM
from llmserve.bench.throughput import synthetic_prompts
from llmserve.cpu_info import set_thread_policy
from llmserve.sampling_params import SamplingParams

DEFAULT_GGUF = Path.home() / ".cache/llmserve/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> int:
    set_thread_policy()  # as llmserve's CLI does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(str(args.gguf), dtype=args.dtype, quantization=args.quantization)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for prompt in synthetic_prompts(llm, args.batch, args.input_len, seed=0):
        engine.add_request(prompt, params)
    for _ in range(4):  # prefill, then a few decode steps to warm up
        engine.step()
    runner_time = 0.0
    execute = engine.executor.execute_model

    def timed_execute(out, *rest):  # noqa: ANN001, ANN202 - a transparent wrapper
        nonlocal runner_time
        start = time.perf_counter()
        result = execute(out, *rest)
        runner_time += time.perf_counter() - start
        return result

    engine.executor.execute_model = timed_execute
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - start
    per_step = wall / args.steps
    print(f"batch {args.batch}: {1000 * per_step:.2f} ms per decode step (under the profiler), "
          f"model runner {100 * runner_time / wall:.0f}%, rest of step "
          f"{100 * (1 - runner_time / wall):.0f}%; torch threads {torch.get_num_threads()}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
