"""Two ways of drafting with the shipped EAGLE head, A/B in one process: engines (none,
A, B) taking turns on `bench spec`'s workloads, batch 1, greedy 128 tokens, the ratio to
none taken run by run (median); every output checked equal to none's. Each step split as
spec_rounds.py splits it (forward, propose, the rest).

    python benchmarks/spec_engine_ab.py {chain,keep,k,fixed,floor} [--paths auto,float32]
        [--workloads chat,grounded] [--repeats 3] [--ks 4,6,8] [--out OUT.json]

chain: the head's drafting per op (A) or in one native call (B; the default: the first
    pass and the chain since session 45, the chain alone in session 44); each engine
    calibrated with its own.
keep: a draft the head made kept at `min_chance` (A: a step and a verification's
    break-even, as before session 44) or at `keep_chance` (B: its verification's alone;
    the default).
k: num_speculative_tokens at each of `--ks` (adaptive: the most drafts a round asks).
fixed: adaptive k (and the head's cut) at 4 against every round drafting k of `--ks`,
    uncut.
floor: adaptive k at 4 (A: k may fall to 0 for a request whose drafts have been
    failing) against k at least 1 wherever a draft fits (B: the head's own confidence
    the only cut, as EAGLE-2 drafts).
"""

import argparse
import json
import statistics

from spec_rounds import Meter, measure

from llmserve.bench.spec import WORKLOADS, chat_token_ids, engine_for
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams
from llmserve.spec_decode.eagle import EagleProposer


def variants(base: LLM, compare: str, ks: list[int]) -> dict:
    if compare == "k":
        return {f"k={k}": engine_for(base, "eagle", k) for k in ks}
    if compare == "floor":
        floored = engine_for(base, "eagle", 4)
        asked = floored.engine.speculator.num_drafts

        def at_least_one(request, room, batch_size=1):
            return max(asked(request, room, batch_size), min(1, room))

        floored.engine.speculator.num_drafts = at_least_one
        return {"adaptive": engine_for(base, "eagle", 4), "k at least 1": floored}
    if compare == "fixed":
        return {"adaptive k=4": engine_for(base, "eagle", 4),
                **{f"fixed k={k}": engine_for(base, "eagle", k, adaptive=False) for k in ks}}
    engines = {}
    for b in (False, True):
        if compare == "chain":
            EagleProposer.native_chain = b  # read at calibration, then pinned per engine
            llm = engine_for(base, "eagle", 4)
            llm.engine.executor.runner.proposer.native_chain = b
            EagleProposer.native_chain = True
            engines["native chain" if b else "per-op chain"] = llm
        else:
            llm = engine_for(base, "eagle", 4)
            spec = llm.engine.speculator
            if not b:
                spec.keep_chance = spec.min_chance
            engines["keep_chance" if b else "min_chance"] = llm
    return engines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("compare", choices=("chain", "keep", "k", "fixed", "floor"))
    parser.add_argument("--paths", default="auto,float32")
    parser.add_argument("--workloads", default="chat,grounded")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ks", default="4,6,8")
    parser.add_argument("--out")
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=128)
    result: dict = {}
    for dtype in args.paths.split(","):
        base = LLM("smollm2-135m", dtype=dtype, kv_cache_memory="1GiB")
        engines = {"none": engine_for(base, "none", 4), **variants(base, args.compare,
                                                            [int(k) for k in args.ks.split(",")])}
        meters = {name: Meter(llm) for name, llm in engines.items()}
        for workload in args.workloads.split(","):
            prompts = chat_token_ids(base, WORKLOADS[workload]())
            runs: dict[str, list] = {name: [] for name in engines}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    runs[name].append(measure(llm, meters[name], prompts, params))
            for name, done in runs.items():
                ratios = [r["tok_s"] / n["tok_s"] for r, n in zip(done, runs["none"],
                                                                  strict=True)]
                if any(r["outputs"] != n["outputs"] for r, n in zip(done, runs["none"],
                                                                    strict=True)):
                    raise SystemExit(f"{dtype} {workload} {name}: an output differs")

                def mid(key, done=done):
                    return statistics.median(r[key] for r in done)

                print(f"{dtype:8} {workload:9} {name:13} {mid('tok_s'):6.1f} tok/s "
                      f"{statistics.median(ratios):.3f}x ({' '.join(f'{r:.2f}' for r in ratios)})"
                      f" step {mid('ms_step'):5.2f} ms = fwd {mid('ms_forward'):5.2f} + "
                      f"propose {mid('ms_propose'):4.2f} + rest {mid('ms_rest'):4.2f}; "
                      f"tokens/step {mid('tokens_per_step'):.2f}", flush=True)
                result.setdefault(dtype, {}).setdefault(workload, {})[name] = {
                    "ratios": ratios, "median": statistics.median(ratios),
                    "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in done]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
