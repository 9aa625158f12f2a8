// What the GEMMs share (gemm_int8.cpp, gemm_q4.cpp, gemm_f32.cpp: one file per weight format,
// compiled in parallel; as one file their build took 13 s of a first start): tile sizes per
// level, the loop over tiles and the store of a tile.
//
// Every output row depends only on its own input row: integer dot products are exact, and
// the float epilogue is the same lane arithmetic whatever M, the tile or the level is, so a
// request's results do not depend on what else is in the batch (nor, for these GEMMs, on
// the instruction-set level).
#pragma once

#include "common.h"

namespace llmserve::gemm {

using simd::F16;
using simd::I16;

// Tiles (rows x blocks of 16 channels) that keep a level's accumulators in its registers:
// 32 zmm on avx512, 16 ymm on avx2 (a 16-lane value is two), 32 q on neon (four).
#if defined(LLMSERVE_SIMD_AVX512)
constexpr int kInt8Wide = 4, kQ4Rows = 4, kQ4Wide = 2, kF32Wide = 2;
#else
// int4 at avx2: tiles of 4 rows spill some accumulators but decode each weight block for
// twice the rows of 2 (measured, 3072x576 at batch 32: 0.61 ms with 4 rows, 0.67 with 2)
constexpr int kInt8Wide = 1, kQ4Rows = 4, kQ4Wide = 1, kF32Wide = 1;
#endif

// Runs `tile.template run<MT, NB>(m0, nb0)` over rows [0, M) and channel blocks
// [nb, ne): rows in tiles of kRows x kWide blocks, in row blocks of `row_block` rows that
// stay in L2 while the weight blocks stream past. The M % kRows rows past the last full
// tile ride along with the last row block as one smaller tile, so the weights stream past
// once for them too (a 5-token step, as speculative decoding verifies, measured 8.4 ms at
// batch 1 with them in a pass of their own, vs 3.9 ms for one token). Every output gets
// the same arithmetic whatever its tile.
template <int kWide, typename Tile>
inline void run_rest(const Tile& tile, int64_t m0, int64_t rest, int64_t b) {
  switch (rest) {
    case 1: tile.template run<1, kWide>(m0, b); break;
    case 2: tile.template run<2, kWide>(m0, b); break;
    case 3: tile.template run<3, kWide>(m0, b); break;
    default: break;
  }
}

template <int kRows, int kWide, typename Tile>
inline void for_tiles(const Tile& tile, int64_t M, int64_t nb, int64_t ne, int64_t row_block) {
  static_assert(kRows <= 4, "run_rest handles up to 3 rows past the full tiles");
  const int64_t full = M / kRows * kRows, rest = M - full;
  for (int64_t r0 = 0;; r0 += row_block) {
    const int64_t r1 = std::min(r0 + row_block, full);
    const bool last = r1 == full;
    int64_t b = nb;
    for (; b + kWide <= ne; b += kWide) {
      for (int64_t m = r0; m < r1; m += kRows) tile.template run<kRows, kWide>(m, b);
      if (last) run_rest<kWide>(tile, full, rest, b);
    }
    for (; b < ne; ++b) {
      for (int64_t m = r0; m < r1; m += kRows) tile.template run<kRows, 1>(m, b);
      if (last) run_rest<1>(tile, full, rest, b);
    }
    if (last) break;
  }
}

// y for M rows over N channels with a tile family: `stream` (one block per tile, so a
// thread's weights are one linear stream, prefetched across blocks) for a decode of fewer
// than 4 rows, else `tile` in kRows x kWide tiles and row blocks of `row_block` rows.
template <int kRows, int kWide, typename StreamTile, typename Tile>
inline void run_gemm(const StreamTile& stream, const Tile& tile, int64_t M, int64_t N,
                     int64_t row_block) {
  const int64_t n_blocks = round_up(N, kBlockN) / kBlockN;
  if (M < 4) {
    parallel_for(0, n_blocks, 2, [&](int64_t nb, int64_t ne) {
      for (int64_t b = nb; b < ne; ++b) run_rest<1>(stream, 0, M, b);
    });
    return;
  }
  parallel_for(0, n_blocks, 2, [&](int64_t nb, int64_t ne) {
    for_tiles<kRows, kWide>(tile, M, nb, ne, row_block);
  });
}

// Stores MT rows x NB blocks of 16 outputs (+ bias), dropping channels past N.
template <int MT, int NB>
inline void store_tile(const F16 (&acc)[MT][NB], int64_t m0, int64_t nb0, int64_t N,
                       const float* bias, float* y) {
  LLMSERVE_UNROLL
  for (int b = 0; b < NB; ++b) {
    const int64_t n0 = (nb0 + b) * kBlockN;
    if (n0 >= N) break;
    const F16 bv = bias ? load_part(bias + n0, N - n0) : simd::zero();
    LLMSERVE_UNROLL
    for (int m = 0; m < MT; ++m)
      store_part(y + (m0 + m) * N + n0, bias ? acc[m][b] + bv : acc[m][b], N - n0);
  }
}

}  // namespace llmserve::gemm
