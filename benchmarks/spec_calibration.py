"""How well an EAGLE head's own confidence predicts its drafts being kept: on the held-out
answers of a saved dataset (the split `train-heads` makes), chains of `depth` drafted after
every answer position as the proposer drafts them; by bucket of the head's chance that the
chain is right through a draft (the product of its drafts' probabilities, what
`EagleProposer.min_confidence` cuts by), the share of chains that are.

    python benchmarks/spec_calibration.py HEAD_FOLDER DATASET.safetensors [--depth 4]
"""

import argparse

import torch

from llmserve.entrypoints.cli.train_heads import _embedding, _lm_head_weight
from llmserve.llm import LLM
from llmserve.spec_decode.eagle_training import chain_drafts, eagle_sequences, resume_eagle
from llmserve.spec_decode.training import load_answers, split_held_out

EDGES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("head")
    parser.add_argument("dataset")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--held-out", type=float, default=0.1)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM("smollm2-135m", dtype=args.dtype, kv_cache_memory="64MiB")
    lm_head = _lm_head_weight(llm)
    embed = _embedding(llm, lm_head)
    answers, _ = load_answers(args.dataset, llm.engine.loaded.config.hidden_size)
    _, held_out = split_held_out(answers, args.held_out)
    head, vocabulary = resume_eagle(args.head, llm.engine.loaded.config, lm_head, embed)
    head.eval()
    rights, chances = [], []
    for seq in eagle_sequences(held_out, embed):
        _, right, chance = chain_drafts(head, vocabulary, seq, args.depth)
        rights.append(torch.cumprod(right.int(), dim=1))
        chances.append(chance)
    right, chance = torch.cat(rights).flatten().float(), torch.cat(chances).flatten()
    print(f"{len(right) // args.depth} chains of {args.depth}; by the head's chance that "
          "the chain is right through a draft:")
    print(f"{'chance':>11} {'drafts':>7} {'right':>6}")
    for lo, hi in zip(EDGES, EDGES[1:], strict=False):
        inside = (chance >= lo) & (chance < hi)
        if inside.any():
            print(f"{lo:4.2f}-{min(hi, 1):4.2f} {int(inside.sum()):>7} "
                  f"{float(right[inside].mean()):>6.2f}")


if __name__ == "__main__":
    main()
