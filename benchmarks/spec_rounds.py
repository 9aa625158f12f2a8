"""Where a speculative round's time goes, batch 1, on `bench spec`'s chat workload: the
engine step split into the proposer (the head's passes), the target's forward and the
rest, with the k the speculator asked for and the tokens each round kept; none and the
method side by side in one process, on both paths.

    python benchmarks/spec_rounds.py HEAD_FOLDER [--method eagle] [--paths float32,auto]
                                     [--min-confidence X] [--k 4] [--out OUT.json]
"""

import argparse
import json
import time
from collections import Counter

from llmserve.bench.spec import CHAT_PROMPTS, chat_token_ids, engine_for, run_workload
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams


class Timed:
    """Wraps a bound method on its instance, adding up its seconds and calls."""

    def __init__(self, owner, name: str) -> None:
        self.seconds, self.calls = 0.0, 0
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(owner, name, timed)


def measure(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    engine = llm.engine
    runner = engine.executor.runner
    step = Timed(engine, "step")
    forward = Timed(runner.model, "forward")  # the target's forward
    asked: Counter = Counter()
    propose = None
    if runner.proposer is not None:
        propose = Timed(runner.proposer, "propose")
        num_drafts = engine.speculator.num_drafts

        def counted(request, room, batch_size=1):
            k = num_drafts(request, room, batch_size)
            asked[k] += 1
            return k

        engine.speculator.num_drafts = counted
    seconds, outputs, (drafts, accepted, rounds) = run_workload(llm, prompts, params, 1)
    tokens = sum(len(o) for o in outputs)
    steps = step.calls
    return {"tok_s": tokens / seconds, "tokens": tokens, "steps": steps,
            "ms_step": 1e3 * step.seconds / steps,
            "ms_forward": 1e3 * forward.seconds / steps,
            "ms_propose": 1e3 * propose.seconds / steps if propose else 0.0,
            "ms_rest": 1e3 * (step.seconds - forward.seconds
                              - (propose.seconds if propose else 0.0)) / steps,
            "tokens_per_step": tokens / steps, "k_asked": dict(sorted(asked.items())),
            "drafts": drafts, "accepted": accepted, "rounds": rounds,
            "tokens_per_round": 1 + accepted / max(rounds, 1), "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("head")
    parser.add_argument("--method", default="eagle")
    parser.add_argument("--paths", default="float32,auto")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--min-confidence", type=float)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.min_confidence is not None:
        from llmserve.spec_decode.eagle import EagleProposer
        EagleProposer.min_confidence = args.min_confidence
    params = SamplingParams(temperature=0, max_tokens=128)
    result = {}
    for dtype in args.paths.split(","):
        base = LLM("smollm2-135m", dtype=dtype, kv_cache_memory="1GiB")
        prompts = chat_token_ids(base, list(CHAT_PROMPTS))
        engines = {"none": engine_for(base, "none", args.k),
                   args.method: engine_for(base, args.method, args.k, heads=args.head)}
        for llm in engines.values():
            run_workload(llm, prompts[:1], params, 1)  # warm-up
        rows = {name: measure(llm, prompts, params) for name, llm in engines.items()}
        assert rows["none"].pop("outputs") == rows[args.method].pop("outputs")
        result[dtype] = rows
        for name, r in rows.items():
            print(f"{dtype:8} {name:6} {r['tok_s']:6.1f} tok/s  step {r['ms_step']:6.2f} ms = "
                  f"forward {r['ms_forward']:6.2f} + propose {r['ms_propose']:5.2f} + rest "
                  f"{r['ms_rest']:5.2f}  tokens/step {r['tokens_per_step']:.2f}  "
                  f"k asked {r['k_asked']}", flush=True)
        print(f"{dtype:8} ratio {rows[args.method]['tok_s'] / rows['none']['tok_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
