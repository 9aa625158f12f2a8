"""Where a speculative round's time goes, batch 1, on `bench spec`'s chat workload: the
engine step split into the proposer (the head's passes), the target's forward and the
rest, with the k the speculator asked for and the tokens each step emitted; none and
EAGLE variants (min_confidence / go_on_confidence) taking turns `--repeats` times in one
process, the ratio to none taken run by run (median), on each path.

    python benchmarks/spec_rounds.py HEAD_FOLDER [--paths float32,auto]
        [--variants 0.3/-,0.1/0.5,0.1/-/fixed,auto/-/max,auto/-@OTHER_HEAD] [--repeats 3] [--k 4]
        [--out OUT.json]
"""

import argparse
import json
import statistics
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


class Meter:
    """The timers of one engine, read as differences between runs."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        runner = engine.executor.runner
        self.step = Timed(engine, "step")
        self.forward = Timed(runner.model, "forward")  # the target's forward
        self.propose = Timed(runner.proposer, "propose") if runner.proposer else None
        self.asked: Counter = Counter()
        if engine.speculator is not None:
            num_drafts = engine.speculator.num_drafts

            def counted(request, room, batch_size=1):
                k = num_drafts(request, room, batch_size)
                self.asked[k] += 1
                return k

            engine.speculator.num_drafts = counted

    def read(self) -> tuple:
        return (self.step.seconds, self.step.calls, self.forward.seconds,
                self.propose.seconds if self.propose else 0.0, Counter(self.asked))


def measure(llm: LLM, meter: Meter, prompts: list, params: SamplingParams) -> dict:
    before = meter.read()
    seconds, outputs, (drafts, accepted, rounds) = run_workload(llm, prompts, params, 1)
    after = meter.read()
    step_s, steps, forward_s, propose_s = (a - b for a, b in zip(after[:4], before[:4],
                                                                  strict=True))
    tokens = sum(len(o) for o in outputs)
    return {"seconds": seconds, "tok_s": tokens / seconds, "tokens": tokens, "steps": steps,
            "ms_step": 1e3 * step_s / steps, "ms_forward": 1e3 * forward_s / steps,
            "ms_propose": 1e3 * propose_s / steps,
            "ms_rest": 1e3 * (step_s - forward_s - propose_s) / steps,
            "tokens_per_step": tokens / steps,
            "k_asked": dict(sorted((after[4] - before[4]).items())),
            "tokens_per_round": 1 + accepted / max(rounds, 1), "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("head")
    parser.add_argument("--paths", default="float32,auto")
    parser.add_argument("--variants", default="0.3/-",
                        help="min_confidence/go_on_confidence[/fixed] per EAGLE engine "
                             "('auto': the speculator's cut from the measured costs; '-': "
                             "None; /fixed: k always --k, not adaptive; /max: k always --k, the "
                             "speculator's cut as adaptive k has it; @FOLDER: this head, "
                             "not HEAD)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=128)
    result = {}
    for dtype in args.paths.split(","):
        base = LLM("smollm2-135m", dtype=dtype, kv_cache_memory="1GiB")
        prompts = chat_token_ids(base, list(CHAT_PROMPTS))
        engines = {"none": engine_for(base, "none", args.k)}
        for variant in args.variants.split(","):
            settings, _, head = variant.partition("@")
            keep, go_on, *mode = settings.split("/")
            llm = engine_for(base, "eagle", args.k, heads=head or args.head,
                             adaptive=mode != ["fixed"])
            if mode == ["max"]:  # k drafts asked every round, the speculator's cut kept
                k = args.k
                llm.engine.speculator.num_drafts = \
                    lambda request, room, batch_size=1, k=k: max(0, min(k, room))
            proposer = llm.engine.executor.runner.proposer
            proposer.min_confidence = None if keep == "auto" else float(keep)
            proposer.go_on_confidence = None if go_on == "-" else float(go_on)
            engines[f"eagle {variant}"] = llm
            costs = llm.engine.speculator.costs.by_batch
            print(f"{dtype} eagle {variant}: a draft token's calibrated share of a step "
                  f"{ {b: round(c, 3) for b, c in costs.items()} }", flush=True)
        meters = {name: Meter(llm) for name, llm in engines.items()}
        for llm in engines.values():
            run_workload(llm, prompts[:1], params, 1)  # warm-up
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                runs[name].append(measure(llm, meters[name], prompts, params))
        reference = runs["none"][0]["outputs"]
        rows = {}
        for name, done in runs.items():
            assert all(r.pop("outputs") == reference for r in done), name
            ratios = [n["seconds"] / r["seconds"] for n, r in zip(runs["none"], done,
                                                                    strict=True)]
            mid = sorted(done, key=lambda r: r["seconds"])[len(done) // 2]
            rows[name] = {"runs": done, "ratios": ratios, "median": statistics.median(ratios)}
            print(f"{dtype:7} {name:14} {mid['tok_s']:6.1f} tok/s  x{rows[name]['median']:.2f} "
                  f"({', '.join(f'{x:.2f}' for x in ratios)})  step {mid['ms_step']:5.2f} ms"
                  f" = fwd {mid['ms_forward']:5.2f} + propose {mid['ms_propose']:4.2f} + rest "
                  f"{mid['ms_rest']:4.2f}; tokens/step {mid['tokens_per_step']:.2f}, "
                  f"/round {mid['tokens_per_round']:.2f}; k {mid['k_asked']}", flush=True)
        result[dtype] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
