"""The float32 GEMM (the exact path's linears) at 1-48 rows over SmolLM2-135M's shapes (30
layers' linears and the LM head, 540 MB, random weights): the best of 7 passes each, as
read bandwidth and arithmetic rate. A verification of k drafts is a pass of k + 1 rows.
`--against LIB.so` (another build of the kernel library, e.g. from an older commit, out of
`~/.cache/llmserve/kernels`): both in this process, alternated pass by pass, their outputs
compared bit for bit, and the ratio of their best times per row count.

    python benchmarks/f32_gemm_rows.py [--rows 1,4,5,8,16] [--against LIB.so]
"""

import argparse
import ctypes
import time

import torch

from llmserve.kernels import native, ptr
from llmserve.kernels.binding import Kernels
from llmserve.quantization.packed_float import PackedFloatWeight

HIDDEN, MLP, VOCAB = 576, 1536, 49152
SHAPES = ([(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)] * 30
          + [(VOCAB, HIDDEN)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,12,16,17,24,32,48")
    parser.add_argument("--against", help="another build of the kernel library")
    args = parser.parse_args()
    libs = {"this": native()}
    if args.against:
        libs["other"] = Kernels(ctypes.CDLL(args.against), args.against)
        libs["other"].set_num_threads(torch.get_num_threads(), 1000)
    weights = [PackedFloatWeight(torch.randn(n, k) * 0.02) for n, k in SHAPES]
    total = sum(n * k for n, k in SHAPES) * 4

    def one_pass(lib: Kernels, rows: int, xs: dict, ys: list) -> float:
        start = time.perf_counter()
        for (n, k), w, y in zip(SHAPES, weights, ys, strict=True):
            lib.f32_linear(ptr(xs[k]), rows, k, ptr(w.packed), None, n, ptr(y))
        return time.perf_counter() - start

    one = None
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (HIDDEN, MLP)}
        outputs = {name: [torch.empty(rows, n) for n, _ in SHAPES] for name in libs}
        best = dict.fromkeys(libs, float("inf"))
        for _ in range(7):
            for name, lib in libs.items():
                best[name] = min(best[name], one_pass(lib, rows, xs, outputs[name]))
        if args.against:
            same = all(torch.equal(a, b) for a, b in zip(*outputs.values(), strict=True))
            print(f"rows {rows:2d}: {best['this'] * 1e3:6.2f} ms, the other "
                  f"{best['other'] * 1e3:6.2f} ms, this / other "
                  f"{best['this'] / best['other']:.3f}, same bits: {same}", flush=True)
            continue
        s = best["this"]
        one = one or s
        print(f"rows {rows:2d}: {s * 1e3:6.2f} ms ({s / one:.2f}x one row), "
              f"{total / s / 1e9:5.1f} GB/s, {2 * rows * total / 4 / s / 1e9:6.1f} GFLOP/s",
              flush=True)


if __name__ == "__main__":
    main()
