// The W8A8 int8 GEMM on packed weights (and the tied embedding's lookup of its rows), written
// once on simd.h's 16-lane values and built at every instruction-set level.

#include "gemm.h"

using namespace llmserve;
using namespace llmserve::gemm;

namespace {

// x ~ (hi + lo / 254) * scale with hi, lo in [-127, 127]: about 15 bits per activation, so
// an outlier channel does not wash out the rest of the token. Stored as u8 (value + 128);
// padding columns hold 128 (zero).
constexpr int64_t kQuantBlock = 64;  // K is padded to a multiple of this in packed weights

// Weights: for each block of 16 output channels, Kp/4 groups of [16 channels x 4
// consecutive k] bytes (64 bytes: one B64). A row's 4 activation bytes are broadcast and
// one dot4 adds the 4 products into each channel's int32: 16 outputs per step, no
// horizontal sums. With an unsigned-by-signed dot product (VNNI) the activations stay
// unsigned and the sum exceeds the true one by 128 * (row sum of w), subtracted once at the
// end; elsewhere they are made signed again (x ^ 0x80) and nothing is subtracted. The
// integers are the same either way.
#if defined(LLMSERVE_SIMD_U8S8_DOT)
constexpr int32_t kActivationOffset = 128;
#else
constexpr int32_t kActivationOffset = 0;
#endif
// Software prefetch distance of the int8 GEMM's weight streams. Measured on the default
// model's int8 head at batch 1 (49152 x 576, 2 threads, avx512): 0.65 ms with 4 blocks per
// tile and no prefetch, 0.51-0.58 ms with one block per tile and 1-2 KB ahead.
constexpr int64_t kInt8PrefetchBytes = 2048;

inline int64_t packed_index(int64_t n, int64_t k, int64_t Kp) {
  return ((n / kBlockN) * (Kp / 4) + k / 4) * (kBlockN * 4) + (n % kBlockN) * 4 + k % 4;
}

void quantize_row(const float* x, int64_t K, int64_t Kp, uint8_t* hi, uint8_t* lo,
                  float* scale_out) {
  F16 vmax = simd::zero();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) vmax = simd::max(vmax, simd::abs(simd::load(x + k)));
  float amax = simd::reduce_max(vmax);  // max is exact in any order
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float scale = std::max(amax, 1e-8f) / 127.f;
  // t = x / scale (a division, as the torch fallback computes it), hi = round(t),
  // lo = round((t - hi) * 254) clamped, both + 128
  const F16 vs = simd::set1(scale), c254 = simd::set1(254.f), limit = simd::set1(127.f);
  const I16 offset = simd::set1_i(128);
  for (k = 0; k + 16 <= K; k += 16) {
    const F16 t = simd::load(x + k) / vs;
    const F16 h = simd::round_even(t);
    F16 l = simd::round_even((t - h) * c254);
    l = simd::min(simd::max(l, simd::zero() - limit), limit);
    simd::store_u8(hi + k, simd::to_int(h) + offset);
    simd::store_u8(lo + k, simd::to_int(l) + offset);
  }
  for (; k < K; ++k) {
    const float t = x[k] / scale;
    const float h = std::nearbyint(t);
    const float l = std::nearbyint((t - h) * 254.f);
    hi[k] = static_cast<uint8_t>(static_cast<int>(h) + 128);
    lo[k] = static_cast<uint8_t>(static_cast<int>(std::clamp(l, -127.f, 127.f)) + 128);
  }
  for (k = K; k < Kp; ++k) hi[k] = lo[k] = 128;
  *scale_out = scale;
}

// MT rows (hi and lo parts) x NB blocks of 16 channels of y = W8A8(x) [+ bias].
template <int MT, int NB, bool kStream = false>
inline void int8_tile(const uint8_t* xq, const float* xs, int64_t m0, int64_t Kp,
                      const int8_t* w, const int32_t* wsum, const float* wscale,
                      const float* bias, int64_t nb0, int64_t N, float* y) {
  I16 acc[MT][2][NB];
  LLMSERVE_UNROLL
  for (int m = 0; m < MT; ++m)
    LLMSERVE_UNROLL
    for (int p = 0; p < 2; ++p)
      LLMSERVE_UNROLL
      for (int b = 0; b < NB; ++b) acc[m][p][b] = simd::zero_i();
  const int64_t block_bytes = (Kp / 4) * 64;
  for (int64_t k4 = 0; k4 < Kp / 4; ++k4) {
    simd::B64 wv[NB];
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b) {
      // one line ahead in each block's stream (past a block's end: the next block's start,
      // which a one-block tile reads next)
      prefetch_weights<kStream>(w + (nb0 + b) * block_bytes + k4 * 64 + kInt8PrefetchBytes);
      wv[b] = simd::load_bytes(w + (nb0 + b) * block_bytes + k4 * 64);
    }
    LLMSERVE_UNROLL
    for (int m = 0; m < MT; ++m)
      LLMSERVE_UNROLL
      for (int p = 0; p < 2; ++p) {
        uint32_t x4;
        std::memcpy(&x4, xq + ((m0 + m) * 2 + p) * Kp + k4 * 4, 4);
        LLMSERVE_UNROLL
        for (int b = 0; b < NB; ++b) {
#if defined(LLMSERVE_SIMD_U8S8_DOT)
          acc[m][p][b] = simd::dot4_u8s8(acc[m][p][b], x4, wv[b]);
#else
          acc[m][p][b] = simd::dot4_s8s8(acc[m][p][b], wv[b],
                                         static_cast<int32_t>(x4 ^ 0x80808080u));
#endif
        }
      }
  }
  // (hi + lo / 254) * x_scale * w_scale [+ bias], lane by lane without fused multiply-adds
  F16 out[MT][NB];
  LLMSERVE_UNROLL
  for (int b = 0; b < NB; ++b) {
    const int64_t n0 = (nb0 + b) * kBlockN;
    if (n0 >= N) break;
    const I16 offset = simd::shl<7>(load_part(wsum + n0, N - n0)) &
                       simd::set1_i(kActivationOffset ? -1 : 0);
    const F16 ws = load_part(wscale + n0, N - n0);
    LLMSERVE_UNROLL
    for (int m = 0; m < MT; ++m) {
      const F16 h = simd::to_float(acc[m][0][b] - offset);
      const F16 l = simd::to_float(acc[m][1][b] - offset);
      out[m][b] = ((h + l * simd::set1(1.f / 254.f)) * simd::set1(xs[m0 + m])) * ws;
    }
  }
  store_tile<MT, NB>(out, m0, nb0, N, bias, y);
}

// kStream: one pass over the weights (decode, one row): see prefetch_weights
template <bool kStream>
struct Int8Tiles {
  const uint8_t* xq;
  const float* xs;
  int64_t Kp;
  const int8_t* w;
  const int32_t* wsum;
  const float* wscale;
  const float* bias;
  int64_t N;
  float* y;
  template <int MT, int NB>
  void run(int64_t m, int64_t b) const {
    int8_tile<MT, NB, kStream>(xq, xs, m, Kp, w, wsum, wscale, bias, b, N, y);
  }
};

}  // namespace

extern "C" {

// Packs an int8 weight (N, K) into the dot4 layout (N_pad, Kp) (see `packed_index`),
// zero-padded; N_pad, Kp: multiples of 16 and 64.
void llmserve_pack_int8_weight(const int8_t* w, int64_t N, int64_t K, int8_t* packed) {
  const int64_t Kp = round_up(K, kQuantBlock), Np = round_up(N, kBlockN);
  std::memset(packed, 0, Np * Kp);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) packed[packed_index(n, k, Kp)] = w[n * K + k];
}

// y (M, N) = W8A8(x (M, K)) with a packed weight [+ bias]. `workspace` holds
// M * 2 * Kp bytes (quantized rows) plus M floats (their scales).
void llmserve_int8_linear(const float* x, int64_t M, int64_t K, const int8_t* w,
                          const int32_t* wsum, const float* wscale, const float* bias,
                          int64_t N, float* y, uint8_t* workspace) {
  const int64_t Kp = round_up(K, kQuantBlock);
  uint8_t* xq = workspace;
  float* xs = reinterpret_cast<float*>(workspace + M * 2 * Kp);
  parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row(x + m * K, K, Kp, xq + m * 2 * Kp, xq + m * 2 * Kp + Kp, xs + m);
  });
  const int64_t n_blocks = round_up(N, kBlockN) / kBlockN;
  constexpr int kRows = 2;
  // rows in blocks small enough to stay in L2 while a thread's weight blocks stream past
  const int64_t row_block = std::max<int64_t>(kRows, (256 * 1024 / (2 * Kp)) / kRows * kRows);
  // split over channel blocks; grain: a batch-1 call still splits across the threads
  if (M == 1) {  // decode: one stream per thread, prefetched across blocks
    const Int8Tiles<true> tile{xq, xs, Kp, w, wsum, wscale, bias, N, y};
    parallel_for(0, n_blocks, 4, [&](int64_t nb, int64_t ne) {
      for (int64_t b = nb; b < ne; ++b) tile.run<1, 1>(0, b);
    });
    return;
  }
  const Int8Tiles<false> tile{xq, xs, Kp, w, wsum, wscale, bias, N, y};
  parallel_for(0, n_blocks, 4, [&](int64_t nb, int64_t ne) {
    for_tiles<kRows, kInt8Wide>(tile, M, nb, ne, row_block);
  });
}

// out (T, K) = float(w[ids[t], k]) * scale[ids[t]]: rows of a packed int8 weight (N rows),
// dequantized (a tied embedding's lookup; one rounding, as torch's `rows.float() * scale`).
// Returns 1, writing nothing, if an id is outside [0, N).
int32_t llmserve_int8_embedding(const int8_t* packed, int64_t N, int64_t Kp, const int64_t* ids,
                                int64_t T, int64_t K, const float* scale, float* out) {
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= N) return 1;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = ids[t];
    const float s = scale[n];
    for (int64_t k = 0; k < K; ++k)
      out[t * K + k] = static_cast<float>(packed[packed_index(n, k, Kp)]) * s;
  }
  return 0;
}

}  // extern "C"
