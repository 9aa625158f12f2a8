"""The decode stream's prefetch, non-temporal against into the caches, judged by whole
engine runs (the start-up choice, `kernel_choice.choose_stream_prefetch`, judges it by the
stream's own time): no speculation and EAGLE on `bench spec`'s chat workload (batch 1,
greedy, 128 tokens), the library's prefetch switched between runs in one process, each
setting `repeats` times, taking turns.

    python benchmarks/stream_prefetch_ab.py [--path auto|float32] [--repeats 4]

(The float32 GEMM prefetches into the caches whatever the setting; to try it non-temporally,
its `prefetch_weights<false>` in kernels/gemm_f32.cpp becomes `prefetch_weights<true>`.)
"""

import argparse
import statistics

from llmserve.bench.spec import CHAT_PROMPTS, chat_token_ids, engine_for, run_workload
from llmserve.kernels import native
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", default="auto")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    base = LLM("smollm2-135m", dtype=args.path, kv_cache_memory="1GiB")
    prompts = chat_token_ids(base, list(CHAT_PROMPTS))
    params = SamplingParams(temperature=0, max_tokens=128)
    engines = {"none": engine_for(base, "none", 4), "eagle": engine_for(base, "eagle", 4)}
    for llm in engines.values():
        run_workload(llm, prompts[:1], params, 1)  # warm-up
    lib = native()
    speeds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.repeats):
        for setting, nontemporal in (("cached", 0), ("non-temporal", 1)):
            lib.set_stream_prefetch(nontemporal)
            for name, llm in engines.items():
                seconds, outputs, _ = run_workload(llm, prompts, params, 1)
                speeds.setdefault((name, setting), []).append(
                    sum(len(o) for o in outputs) / seconds)
    for (name, setting), runs in speeds.items():
        print(f"{args.path} {name:6} {setting:13} tok/s {', '.join(f'{s:.1f}' for s in runs)}"
              f" (median {statistics.median(runs):.1f})")
    for setting in ("cached", "non-temporal"):
        ratios = [e / n for e, n in zip(speeds[("eagle", setting)], speeds[("none", setting)],
                                        strict=True)]
        print(f"{args.path} eagle/none {setting:13} {', '.join(f'{r:.2f}' for r in ratios)}"
              f" (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
