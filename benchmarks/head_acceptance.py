"""Tokens a round of EAGLE heads on chat prompts none of their training data holds: k drafts
every round, no cut, greedy, so each figure depends on the head and the path only, not on
the machine's speed or load (a head's A/B that a noisy machine cannot flip). Each head on
each path over the bench's 4 chat prompts (`llmserve bench spec`'s) and 8 others; the
share of rounds that kept draft j, j = 1..k, beside.

    python benchmarks/head_acceptance.py HEAD[,HEAD...] [--paths float32,auto] [--k 4]
        [--max-tokens 128] [--out OUT.json]
"""

import argparse
import json

from llmserve.bench.spec import CHAT_PROMPTS, chat_token_ids, engine_for, run_workload
from llmserve.llm import LLM
from llmserve.sampling_params import SamplingParams

# chats none of the built-in training prompts (spec_decode/data/train_prompts.txt) is
OTHER_CHATS = (
    "How do I make a good cup of coffee at home without a machine?",
    "What should I think about before adopting a rescue cat?",
    "Write a short story about a fisherman who finds a golden key.",
    "Explain how a car engine turns fuel into motion.",
    "Give me a simple plan to save money for a holiday.",
    "Why do leaves change colour in the autumn?",
    "Write an email to my landlord asking to fix a leaking tap.",
    "What are some fun things to do in a big city on a rainy day?",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("heads", help="head folders, comma-separated")
    parser.add_argument("--paths", default="float32,auto")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out")
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    result: dict[str, dict] = {}
    for path in args.paths.split(","):
        base = LLM("smollm2-135m", dtype=path, kv_cache_memory="1GiB")
        sets = {"bench chat (4)": chat_token_ids(base, list(CHAT_PROMPTS)),
                "other chats (8)": chat_token_ids(base, list(OTHER_CHATS))}
        for head in args.heads.split(","):
            llm = engine_for(base, "eagle", args.k, adaptive=False, heads=head)
            stats = llm.engine.speculator.stats
            for name, prompts in sets.items():
                rounds, kept = stats.num_drafts, list(stats.accepted_per_position)
                _, _, (_, accepted, num_rounds) = run_workload(llm, prompts, params, 1)
                depth = [(a - b) / num_rounds for a, b in
                         zip(stats.accepted_per_position, kept, strict=True)]
                assert stats.num_drafts - rounds == num_rounds
                row = {"tokens_per_round": round(1 + accepted / num_rounds, 3),
                       "rounds_keeping_draft": [round(d, 3) for d in depth],
                       "rounds": num_rounds}
                result.setdefault(path, {}).setdefault(head, {})[name] = row
                print(f"{path:7} {head} {name:15} {row['tokens_per_round']:.3f} tokens a round; "
                      f"kept draft j in {', '.join(f'{d:.2f}' for d in depth)} of rounds",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
