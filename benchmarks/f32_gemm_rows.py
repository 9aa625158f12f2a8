"""The float32 GEMM (the exact path's linears) at 1-17 rows over SmolLM2-135M's shapes (30
layers' linears and the LM head, 540 MB, random weights): the best of 7 passes each, as
read bandwidth and arithmetic rate. A verification of k drafts is a pass of k + 1 rows.

    python benchmarks/f32_gemm_rows.py
"""

import time

import torch

from llmserve.kernels import native, ptr
from llmserve.quantization.packed_float import PackedFloatWeight

HIDDEN, MLP, VOCAB = 576, 1536, 49152
SHAPES = ([(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)] * 30
          + [(VOCAB, HIDDEN)])


def main() -> None:
    lib = native()
    weights = [PackedFloatWeight(torch.randn(n, k) * 0.02) for n, k in SHAPES]
    total = sum(n * k for n, k in SHAPES) * 4

    def best(rows: int) -> float:
        xs = {k: torch.randn(rows, k) for k in (HIDDEN, MLP)}
        ys = [torch.empty(rows, n) for n, _ in SHAPES]
        seconds = float("inf")
        for _ in range(7):
            start = time.perf_counter()
            for (n, k), w, y in zip(SHAPES, weights, ys, strict=True):
                lib.f32_linear(ptr(xs[k]), rows, k, ptr(w.packed), None, n, ptr(y))
            seconds = min(seconds, time.perf_counter() - start)
        return seconds

    one = best(1)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17):
        s = best(rows)
        print(f"rows {rows:2d}: {s * 1e3:6.2f} ms ({s / one:.2f}x one row), "
              f"{total / s / 1e9:5.1f} GB/s, {2 * rows * total / 4 / s / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
