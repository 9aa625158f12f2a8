"""Where one EAGLE head pass goes at batch 1 (one sequence, one position), each part timed
hot (run again and again: its weights in the caches) and after the target's LM head has
streamed past (five passes of the target's own LM head on the native pool, as a
verification leaves the caches for the head's first pass of a round). Medians of --runs.

    python benchmarks/head_pass.py [--path float32|auto] [--head FOLDER] [--runs 100]
"""

import argparse
import statistics
import time

import numpy as np
import torch

from llmserve.layers.attention.backend import AttentionMetadata
from llmserve.llm import LLM
from llmserve.worker.sampler import argmax


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", default="float32")
    parser.add_argument("--head", help="a head folder (default: the shipped one)")
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    spec = {"method": "eagle"} | ({"model": args.head} if args.head else {})
    llm = LLM(model="smollm2-135m", dtype=args.path, kv_cache_memory="256MiB",
              speculative_config=spec)
    proposer = llm.engine.executor.runner.proposer
    head, target = proposer.head, proposer.target
    torch.inference_mode().__enter__()
    width = head.config.hidden_size
    seqs = [(np.arange(0, 4, dtype=np.int32), 40, [1])]
    hidden, x, row = torch.randn(1, width), torch.randn(1, width), torch.randn(1, width)
    table = seqs[0][0][None, :].copy()
    positions = np.arange(40, 41)
    meta = AttentionMetadata.from_block_table(table, np.arange(1), [1], [40], positions,
                                              proposer.block_size, proposer.device,
                                              proposer.attention)
    logits = head.lm_head(x)

    def stream() -> None:
        for _ in range(5):
            target.compute_logits(row)

    parts = {
        "the whole pass (_run, then _draft)": lambda: proposer._draft(
            proposer._run(seqs, [1], hidden)[0]),
        "  attention metadata": lambda: AttentionMetadata.from_block_table(
            table, np.arange(1), [1], [40], positions, proposer.block_size, proposer.device,
            proposer.attention),
        "  token embedding": lambda: proposer._embed([1]),
        "  fc (int8, 2H -> H)": lambda: head.fc(torch.cat([x, hidden], -1)),
        "  the decoder layer (one native call)": lambda: head.native.forward(
            x, torch.from_numpy(positions), proposer.kv_cache, meta, norm=False),
        "  draft LM head (int8, 8192 x H)": lambda: head.lm_head(x),
        "  argmax, ids": lambda: head.draft_ids[argmax(logits)].tolist(),
        "  the draft's chance (softmax)": lambda: torch.softmax(logits, -1).amax(-1).tolist(),
    }

    def median_ms(fn, cold: bool) -> float:
        for _ in range(10):
            fn()
        times = []
        for _ in range(args.runs):
            if cold:
                stream()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    print(f"{args.path}: {'part':40} {'hot ms':>8} {'after the stream':>17}")
    for name, fn in parts.items():
        print(f"{args.path}: {name:40} {median_ms(fn, False):8.3f} {median_ms(fn, True):17.3f}",
              flush=True)
    start = time.perf_counter()
    stream()
    one = (time.perf_counter() - start) * 200  # ms, of the five
    print(f"{args.path}: the target's LM head, one pass {one:.2f} ms")


if __name__ == "__main__":
    main()
