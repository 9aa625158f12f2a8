"""none against eagle on `bench spec`'s chat workload, alternated in one process (the
machine's speed drifts between runs): the ratio pair by pair and its median.

    python benchmarks/spec_paired.py HEAD_FOLDER PAIRS [OUT.json]
"""

import json
import statistics
import sys

from llmserve.bench.spec import CHAT_PROMPTS, chat_token_ids, engine_for, run_workload
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams


def main() -> None:
    head, pairs = sys.argv[1], int(sys.argv[2])
    params = SamplingParams(temperature=0, max_tokens=128)
    out = {}
    for dtype in ("float32", "auto"):
        base = LLM("smollm2-135m", dtype=dtype, kv_cache_memory="1GiB")
        prompts = chat_token_ids(base, list(CHAT_PROMPTS))
        plain, eagle = engine_for(base, "none", 4), engine_for(base, "eagle", 4, heads=head)
        for engine in (plain, eagle):  # warm-up
            run_workload(engine, prompts[:1], params, 1)
        ratios, rates = [], []
        for i in range(pairs):
            s0, o0, _ = run_workload(plain, prompts, params, 1)
            s1, o1, (_, accepted, rounds) = run_workload(eagle, prompts, params, 1)
            assert o0 == o1, "speculative output differs"
            n = sum(len(o) for o in o0)
            per_round = 1 + accepted / max(rounds, 1)
            ratios.append(s0 / s1)
            rates.append((n / s0, n / s1, per_round))
            print(f"{dtype} pair {i}: none {n / s0:.1f}, eagle {n / s1:.1f} tok/s -> "
                  f"{s0 / s1:.2f}x, tokens a round {per_round:.2f}", flush=True)
        median = statistics.median(ratios)
        print(f"{dtype} median {median:.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})")
        out[dtype] = {"ratios": ratios, "tok_s_none_eagle_round": rates, "median": median}
    with open(sys.argv[3] if len(sys.argv) > 3 else "paired.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
