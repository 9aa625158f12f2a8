// The float32 GEMM on packed weights (the exact path's linears), written once on simd.h's
// 16-lane values and built at every instruction-set level.

#include "gemm.h"

using namespace llmserve;
using namespace llmserve::gemm;

namespace {

// The exact path's linears. Weights packed per block of 16 output channels as (K, 16) floats;
// a row's 16 outputs accumulate with one fused multiply-add per k, in k order, whatever the
// tile, so a row's result does not depend on the other rows (torch's GEMM picks its
// blocking by M, which can move the last bits with the batch).
// The sum runs in two levels: each run of kF32RunK consecutive k into a partial, and the
// partials, in order, into the total. A single chain over K loses about K roundings' worth
// of precision where this loses K / 16 + 16: on Gemma-3-270M's float32 path the logits' worst
// error against float64 fell from 5.4e-3 (5x transformers' float32 error) to that of
// transformers' own float32.
// `init` (M, N), when given, is where the total starts instead of zero: the partial sums of
// the k before this weight's (a tensor-parallel rank continuing the previous rank's chain
// gives the one-rank result bit for bit when the ranks split K at multiples of kF32RunK:
// heads of 16 or more, MLP channels in units of 32).
constexpr int64_t kF32RunK = 16;
// Software prefetch distance of each weight stream, into the caches (past a block's end: the
// next block's start). The hardware prefetcher alone left the exact path's weight pass well
// short of the memory's speed: SmolLM2-135M's linears (540 MB), alternated twice on a 2-core
// Zen 5 VM (benchmarks/f32_gemm_rows.py): 1 row 18.9 / 15.9 ms without, 16.1 / 15.4 ms with
// 2 KB ahead; 5 rows 24.8 / 24.9 -> 16.6 / 18.7 ms; 9 rows 26.9 / 26.6 -> 18.8 / 19.2 ms.
constexpr int64_t kF32PrefetchBytes = 2048;

// One run of kF32RunK k's from k0 for MT rows x NB blocks: acc = the run's fused
// multiply-adds, in k order, from zero (`prefetch`: the weight lines ahead too).
template <int MT, int NB>
inline void f32_run_sums(const float* x, int64_t m0, int64_t K, int64_t k0, const float* w,
                         int64_t nb0, bool prefetch, F16 (&acc)[MT][NB]) {
  LLMSERVE_UNROLL
  for (int m = 0; m < MT; ++m)
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b) acc[m][b] = simd::zero();
  for (int64_t k = k0; k < std::min(K, k0 + kF32RunK); ++k) {
    F16 wv[NB];
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b) {
      const float* line = w + ((nb0 + b) * K + k) * kBlockN;
      if (prefetch)
        prefetch_weights<false>(reinterpret_cast<const char*>(line) + kF32PrefetchBytes);
      wv[b] = simd::load(line);
    }
    LLMSERVE_UNROLL
    for (int m = 0; m < MT; ++m) {
      const F16 xv = simd::set1(x[(m0 + m) * K + k]);
      LLMSERVE_UNROLL
      for (int b = 0; b < NB; ++b) acc[m][b] = simd::fmadd(xv, wv[b], acc[m][b]);
    }
  }
}

template <int MT, int NB>
inline void f32_tile(const float* x, int64_t m0, int64_t K, const float* w, int64_t nb0,
                     int64_t N, const float* bias, const float* init, float* y) {
  F16 total[MT][NB];
  LLMSERVE_UNROLL
  for (int m = 0; m < MT; ++m)
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b) {
      const int64_t n0 = (nb0 + b) * kBlockN;
      total[m][b] = init == nullptr || n0 >= N ? simd::zero()
                                               : load_part(init + (m0 + m) * N + n0, N - n0);
    }
  for (int64_t k0 = 0; k0 < K; k0 += kF32RunK) {
    F16 acc[MT][NB];
    f32_run_sums<MT, NB>(x, m0, K, k0, w, nb0, true, acc);
    LLMSERVE_UNROLL
    for (int m = 0; m < MT; ++m)
      LLMSERVE_UNROLL
      for (int b = 0; b < NB; ++b) total[m][b] = total[m][b] + acc[m][b];
  }
  store_tile<MT, NB>(total, m0, nb0, N, bias, y);
}

// A few rows (a verification's k + 1 tokens, a small batch: kF32TileRows < M <=
// kF32FewRows) against one block of channels at a time: each run of kF32RunK k's goes through
// every tile of rows before the next run starts, so the run's weights (kF32RunK x 16 floats
// per block, 1 KB) are in L1 for every tile after the first and the weights stream past once.
// In tiles of kF32TileRows rows a 7-token verification read its weights twice (the second
// time from L2: a block's K x 16 floats outgrow L1) and the exact path's linears took
// 1.15-1.4x a one-row pass at 5-8 rows on a 2-core Zen 3 (benchmarks/f32_gemm_rows.py).
// The totals wait in memory between runs (one load and store per kF32RunK fused
// multiply-adds), which frees the registers for taller tiles; the arithmetic is f32_tile's.
constexpr int64_t kF32FewRows = 48;
#if defined(LLMSERVE_SIMD_AVX512)
constexpr int kF32FewTile = 8;  // 16 zmm accumulators (2 blocks), 2 weights, a broadcast
#elif defined(LLMSERVE_SIMD_GENERIC)
constexpr int kF32FewTile = 4;  // its values are arrays in memory anyway
#else
constexpr int kF32FewTile = 6;  // avx2: 12 of 16 ymm; neon: 24 of 32 q
#endif
constexpr int kF32TileRows = 4;  // the tiles of f32_tile (for_tiles' kRows)

template <int MT, int NB>
inline void f32_run(const float* x, int64_t m0, int64_t K, int64_t k0, const float* w,
                    int64_t nb0, bool prefetch, float (*total)[NB][kBlockN]) {
  F16 acc[MT][NB];
  f32_run_sums<MT, NB>(x, m0, K, k0, w, nb0, prefetch, acc);
  LLMSERVE_UNROLL
  for (int m = 0; m < MT; ++m)
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b)
      simd::store(total[m0 + m][b], simd::load(total[m0 + m][b]) + acc[m][b]);
}

template <int NB>
inline void f32_run_rest(const float* x, int64_t m0, int64_t rest, int64_t K, int64_t k0,
                         const float* w, int64_t nb0, bool prefetch,
                         float (*total)[NB][kBlockN]) {
  static_assert(kF32FewTile <= 8, "the cases below go up to 7 rows");
  switch (rest) {
    case 1: f32_run<1, NB>(x, m0, K, k0, w, nb0, prefetch, total); break;
    case 2: f32_run<2, NB>(x, m0, K, k0, w, nb0, prefetch, total); break;
    case 3: f32_run<3, NB>(x, m0, K, k0, w, nb0, prefetch, total); break;
    case 4: f32_run<std::min(4, kF32FewTile), NB>(x, m0, K, k0, w, nb0, prefetch, total); break;
    case 5: f32_run<std::min(5, kF32FewTile), NB>(x, m0, K, k0, w, nb0, prefetch, total); break;
    case 6: f32_run<std::min(6, kF32FewTile), NB>(x, m0, K, k0, w, nb0, prefetch, total); break;
    case 7: f32_run<std::min(7, kF32FewTile), NB>(x, m0, K, k0, w, nb0, prefetch, total); break;
    default: break;
  }
}

template <int NB>
inline void f32_few_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t nb0,
                         int64_t N, const float* bias, const float* init, float* y) {
  alignas(64) float total[kF32FewRows][NB][kBlockN];
  for (int64_t m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b) {
      const int64_t n0 = (nb0 + b) * kBlockN;
      simd::store(total[m][b], init == nullptr || n0 >= N
                                   ? simd::zero()
                                   : load_part(init + m * N + n0, N - n0));
    }
  const int64_t full = M / kF32FewTile * kF32FewTile;
  for (int64_t k0 = 0; k0 < K; k0 += kF32RunK) {
    for (int64_t m = 0; m < full; m += kF32FewTile)
      f32_run<kF32FewTile, NB>(x, m, K, k0, w, nb0, m == 0, total);
    f32_run_rest<NB>(x, full, M - full, K, k0, w, nb0, full == 0, total);
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t n0 = (nb0 + b) * kBlockN;
    if (n0 >= N) break;
    const F16 bv = bias ? load_part(bias + n0, N - n0) : simd::zero();
    for (int64_t m = 0; m < M; ++m) {
      const F16 t = simd::load(total[m][b]);
      store_part(y + m * N + n0, bias ? t + bv : t, N - n0);
    }
  }
}

struct F32Tiles {
  const float* x;
  int64_t K;
  const float* w;
  int64_t N;
  const float* bias;
  const float* init;
  float* y;
  template <int MT, int NB>
  void run(int64_t m, int64_t b) const { f32_tile<MT, NB>(x, m, K, w, b, N, bias, init, y); }
};

}  // namespace

extern "C" {

// Packs a float weight (N, K) into blocks of 16 channels, (N_pad / 16, K, 16), padding
// channels zero.
void llmserve_pack_f32_weight(const float* w, int64_t N, int64_t K, float* packed) {
  const int64_t Np = round_up(N, kBlockN);
  std::memset(packed, 0, Np * K * sizeof(float));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      packed[((n / kBlockN) * K + k) * kBlockN + n % kBlockN] = w[n * K + k];
}

// y (M, N) = [init +] x (M, K) . W^T [+ bias] in float32 on a packed weight; the
// multiply-adds continue from `init` (see f32_tile).
void llmserve_f32_linear_from(const float* x, int64_t M, int64_t K, const float* w,
                              const float* bias, const float* init, int64_t N, float* y) {
  const int64_t n_blocks = round_up(N, kBlockN) / kBlockN;
  constexpr int kRows = kF32TileRows;
  // rows in blocks that stay in L2 while a thread's weight blocks stream past
  const int64_t row_block = std::max<int64_t>(kRows, (256 * 1024 / (4 * K)) / kRows * kRows);
  if (M > kF32TileRows && M <= kF32FewRows) {
    parallel_for(0, n_blocks, 4, [&](int64_t nb, int64_t ne) {
      int64_t b = nb;
      for (; b + kF32Wide <= ne; b += kF32Wide)
        f32_few_rows<kF32Wide>(x, M, K, w, b, N, bias, init, y);
      for (; b < ne; ++b) f32_few_rows<1>(x, M, K, w, b, N, bias, init, y);
    });
    return;
  }
  const F32Tiles tile{x, K, w, N, bias, init, y};
  parallel_for(0, n_blocks, 4, [&](int64_t nb, int64_t ne) {
    for_tiles<kRows, kF32Wide>(tile, M, nb, ne, row_block);
  });
}

// y (M, N) = x (M, K) . W^T [+ bias] in float32 on a packed weight.
void llmserve_f32_linear(const float* x, int64_t M, int64_t K, const float* w,
                         const float* bias, int64_t N, float* y) {
  llmserve_f32_linear_from(x, M, K, w, bias, nullptr, N, y);
}

}  // extern "C"
