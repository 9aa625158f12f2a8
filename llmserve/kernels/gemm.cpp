// The linear layers' GEMMs on packed weights: W8A8 int8, int4 groups (GGUF Q4_1 blocks) and
// float32, each written once on simd.h's 16-lane values (one block of 16 output channels)
// and built at every instruction-set level.
//
// Every output row depends only on its own input row: integer dot products are exact, and
// the float epilogue is the same lane arithmetic whatever M, the tile or the level is, so a
// request's results do not depend on what else is in the batch (nor, for these GEMMs, on
// the instruction-set level).

#include "common.h"

using namespace llmserve;
using simd::F16;
using simd::I16;

namespace {

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

// Stores MT rows x NB blocks of 16 outputs (+ bias), dropping channels past N.
template <int MT, int NB>
inline void store_tile(const F16 (&acc)[MT][NB], int64_t m0, int64_t nb0, int64_t N,
                       const float* bias, float* y) {
  for (int b = 0; b < NB; ++b) {
    const int64_t n0 = (nb0 + b) * kBlockN;
    if (n0 >= N) break;
    const F16 bv = bias ? load_part(bias + n0, N - n0) : simd::zero();
    for (int m = 0; m < MT; ++m)
      store_part(y + (m0 + m) * N + n0, bias ? acc[m][b] + bv : acc[m][b], N - n0);
  }
}

// ---- the int8 GEMM ------------------------------------------------------------------------
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
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < 2; ++p)
      for (int b = 0; b < NB; ++b) acc[m][p][b] = simd::zero_i();
  const int64_t block_bytes = (Kp / 4) * 64;
  for (int64_t k4 = 0; k4 < Kp / 4; ++k4) {
    simd::B64 wv[NB];
    for (int b = 0; b < NB; ++b) {
      // one line ahead in each block's stream (past a block's end: the next block's start,
      // which a one-block tile reads next)
      prefetch_weights<kStream>(w + (nb0 + b) * block_bytes + k4 * 64 + kInt8PrefetchBytes);
      wv[b] = simd::load_bytes(w + (nb0 + b) * block_bytes + k4 * 64);
    }
    for (int m = 0; m < MT; ++m)
      for (int p = 0; p < 2; ++p) {
        uint32_t x4;
        std::memcpy(&x4, xq + ((m0 + m) * 2 + p) * Kp + k4 * 4, 4);
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
  for (int b = 0; b < NB; ++b) {
    const int64_t n0 = (nb0 + b) * kBlockN;
    if (n0 >= N) break;
    const I16 offset = simd::shl<7>(load_part(wsum + n0, N - n0)) &
                       simd::set1_i(kActivationOffset ? -1 : 0);
    const F16 ws = load_part(wscale + n0, N - n0);
    for (int m = 0; m < MT; ++m) {
      const F16 h = simd::to_float(acc[m][0][b] - offset);
      const F16 l = simd::to_float(acc[m][1][b] - offset);
      out[m][b] = ((h + l * simd::set1(1.f / 254.f)) * simd::set1(xs[m0 + m])) * ws;
    }
  }
  store_tile<MT, NB>(out, m0, nb0, N, bias, y);
}

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
  bool stream;  // one pass over the weights (decode): see prefetch_weights
  template <int MT, int NB>
  void run(int64_t m, int64_t b) const {
    if (stream)
      int8_tile<MT, NB, true>(xq, xs, m, Kp, w, wsum, wscale, bias, b, N, y);
    else
      int8_tile<MT, NB, false>(xq, xs, m, Kp, w, wsum, wscale, bias, b, N, y);
  }
};

// ---- the int4 group GEMM ------------------------------------------------------------------
// Weights: 4-bit codes u in [0, 15] per group of 32 k, with an fp16 scale d and offset m per
// (channel, group): w = d * u + m, a GGUF Q4_1 block exactly. Activations: per group of 32
// with one scale s, at one of two precisions:
// * 15 bits: two int8 parts, x ~ (hi + lo / 254) * s (one 8-bit part moved greedy output
//   off the float path on 2x as many prompts). Per row and channel, over the groups in order,
//   with exact integer sums:
//     y += (d * (s / 254)) * (254 * (u . hi) + u . lo);  y += m * (s * sum(hi + lo / 254))
// * 8 bits: hi alone, x ~ hi * s (llama.cpp's Q8 activations): half the integer work, for
//   CPUs without a one-instruction int8 dot product, where the second part makes int4 at a
//   serving batch cost what float32 does (kernel_choice.py chooses by timing):
//     y += (d * s) * (u . hi);  y += m * (s * sum(hi))
// The float sum runs over the groups in the same order whatever the batch, so a row's
// result does not depend on the other rows.
//
// Packed weights: for each block of 16 channels, one record of 320 bytes per group: 4 chunks
// of 64 code bytes (chunk j, lane c, byte b: low nibble k = 8j + b, high nibble k = 8j + 4 + b,
// so a nibble mask gives the [16 channels x 4 k] layout of dot4), 16 fp16 d, 16 fp16 m. One
// stream per block: a decode reads 5 bits per weight.
constexpr int64_t kGroup = 32;
constexpr int64_t kQ4Record = 256 + 64;
// Software prefetch distance in groups. Measured at batch 1 (the default model's 30 layers of
// linears, 3x over to defeat the L3, 2 threads, avx512): two blocks per tile and a prefetch
// that stopped at each block's end read 35-38 GB/s where a plain read loop over the same
// bytes read 44-49; one block per tile (one linear stream per thread) prefetched across
// blocks, 42-46 GB/s. 4, 8, 12 or 16 groups ahead: within the noise.
constexpr int64_t kQ4PrefetchGroups = 8;

// A row (K floats, K a multiple of 32) -> int8 parts hi, lo (K each; lo only if `fine`)
// and per group the unit of the integer sums (s / 254, or s) and the group's dequantized sum
// s * sum(hi + lo / 254) (or s * sum(hi)).
void quantize_row_groups(const float* x, int64_t K, int8_t* hi, int8_t* lo, float* unit,
                         float* sums, bool fine) {
  const F16 limit = simd::set1(127.f), c254 = simd::set1(254.f);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    const F16 a = simd::load(xg), b = simd::load(xg + 16);
    const float amax = simd::reduce_max(simd::max(simd::abs(a), simd::abs(b)));
    const F16 inv = simd::set1(amax > 0.f ? 127.f / amax : 0.f);
    I16 total = simd::zero_i();
    for (int half = 0; half < 2; ++half) {
      const F16 t = (half ? b : a) * inv;
      const F16 h = simd::round_even(t);
      if (!fine) {
        const I16 hi32 = simd::to_int(h);
        simd::store_s8(hi + g * kGroup + 16 * half, hi32);
        total = total + hi32;
        continue;
      }
      F16 l = simd::round_even((t - h) * c254);
      l = simd::min(simd::max(l, simd::zero() - limit), limit);
      const I16 hi32 = simd::to_int(h), lo32 = simd::to_int(l);
      simd::store_s8(hi + g * kGroup + 16 * half, hi32);
      simd::store_s8(lo + g * kGroup + 16 * half, lo32);
      total = total + (simd::shl<8>(hi32) - simd::shl<1>(hi32)) + lo32;  // 254 * hi + lo
    }
    unit[g] = fine ? amax / 127.f / 254.f : amax / 127.f;
    sums[g] = unit[g] * static_cast<float>(simd::reduce_add(total));  // |sum| < 2^24: exact
  }
}

// MT rows x NB blocks of 16 channels of y = Q4(w) . x [+ bias]; `a` holds each row's hi
// then lo parts (2K bytes per row; lo read only if kFine: 15-bit activations).
template <int MT, int NB, bool kStream, bool kFine>
inline void q4_tile(const int8_t* a, const float* unit, const float* sums, int64_t m0,
                    int64_t K, const uint8_t* w, int64_t nb0, int64_t N, const float* bias,
                    float* y) {
  const int64_t G = K / kGroup, block_bytes = G * kQ4Record;
  F16 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = simd::zero();
  for (int64_t g = 0; g < G; ++g) {
    {  // the record kQ4PrefetchGroups groups on in each block's stream; past a block's
       // end, the next tile's (a thread's tiles are consecutive blocks: with one block per
       // tile, its weights are one linear stream)
      const int64_t ahead = g + kQ4PrefetchGroups;
      const int64_t nb1 = ahead < G ? nb0 : nb0 + NB, g1 = ahead < G ? ahead : ahead - G;
      for (int b = 0; b < NB; ++b) {
        const char* next =
            reinterpret_cast<const char*>(w + (nb1 + b) * block_bytes + g1 * kQ4Record);
        for (int line = 0; line < kQ4Record / 64; ++line)
          prefetch_weights<kStream>(next + 64 * line);
      }
    }
    simd::P32 ihi[MT][NB], ilo[MT][NB];  // 8 steps a group: within dot4_nibbles' bound
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b) ihi[m][b] = ilo[m][b] = simd::zero_pairs();
    for (int j = 0; j < 4; ++j) {
      simd::B64 ulo[NB], uhi[NB];  // the codes of k = 8j + 0..3 and 8j + 4..7
      for (int b = 0; b < NB; ++b) {
        const simd::B64 v =
            simd::load_bytes(w + (nb0 + b) * block_bytes + g * kQ4Record + j * 64);
        ulo[b] = simd::low_nibbles(v);
        uhi[b] = simd::high_nibbles(v);
      }
      for (int m = 0; m < MT; ++m) {
        const int8_t* xh = a + (m0 + m) * 2 * K + g * kGroup + 8 * j;
        const int8_t* xl = xh + K;
        int32_t h0, h1, l0, l1;
        std::memcpy(&h0, xh, 4);
        std::memcpy(&h1, xh + 4, 4);
        std::memcpy(&l0, xl, 4);
        std::memcpy(&l1, xl + 4, 4);
        for (int b = 0; b < NB; ++b) {
          ihi[m][b] = simd::dot4_nibbles(simd::dot4_nibbles(ihi[m][b], ulo[b], h0), uhi[b], h1);
          if (kFine)
            ilo[m][b] = simd::dot4_nibbles(simd::dot4_nibbles(ilo[m][b], ulo[b], l0), uhi[b], l1);
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint8_t* rec = w + (nb0 + b) * block_bytes + g * kQ4Record + 256;
      const F16 d = simd::load_half(reinterpret_cast<const uint16_t*>(rec));
      const F16 mo = simd::load_half(reinterpret_cast<const uint16_t*>(rec + 32));
      for (int m = 0; m < MT; ++m) {
        // 254 * hi + lo (15 bits): exact in int32 and as a float (|.| < 2^24)
        const I16 h = simd::widen_pairs(ihi[m][b]);
        const I16 t =
            kFine ? simd::shl<8>(h) - simd::shl<1>(h) + simd::widen_pairs(ilo[m][b]) : h;
        const F16 ds = d * simd::set1(unit[(m0 + m) * G + g]);
        acc[m][b] = simd::fmadd(simd::to_float(t), ds, acc[m][b]);
        acc[m][b] = simd::fmadd(mo, simd::set1(sums[(m0 + m) * G + g]), acc[m][b]);
      }
    }
  }
  store_tile<MT, NB>(acc, m0, nb0, N, bias, y);
}

struct Q4Tiles {
  const int8_t* a;
  const float* unit;
  const float* sums;
  int64_t K;
  const uint8_t* w;
  int64_t N;
  const float* bias;
  float* y;
  bool stream;  // one pass over the weights (decode): see prefetch_weights
  bool fine;    // 15-bit activations (else 8)
  template <int MT, int NB>
  void run(int64_t m, int64_t b) const {
    if (stream)
      fine ? q4_tile<MT, NB, true, true>(a, unit, sums, m, K, w, b, N, bias, y)
           : q4_tile<MT, NB, true, false>(a, unit, sums, m, K, w, b, N, bias, y);
    else
      fine ? q4_tile<MT, NB, false, true>(a, unit, sums, m, K, w, b, N, bias, y)
           : q4_tile<MT, NB, false, false>(a, unit, sums, m, K, w, b, N, bias, y);
  }
};

// ---- the float32 GEMM ----------------------------------------------------------------------
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

template <int MT, int NB>
inline void f32_tile(const float* x, int64_t m0, int64_t K, const float* w, int64_t nb0,
                     int64_t N, const float* bias, const float* init, float* y) {
  F16 total[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) {
      const int64_t n0 = (nb0 + b) * kBlockN;
      total[m][b] = init == nullptr || n0 >= N ? simd::zero()
                                               : load_part(init + (m0 + m) * N + n0, N - n0);
    }
  for (int64_t k0 = 0; k0 < K; k0 += kF32RunK) {
    F16 acc[MT][NB];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b) acc[m][b] = simd::zero();
    for (int64_t k = k0; k < std::min(K, k0 + kF32RunK); ++k) {
      F16 wv[NB];
      for (int b = 0; b < NB; ++b) wv[b] = simd::load(w + ((nb0 + b) * K + k) * kBlockN);
      for (int m = 0; m < MT; ++m) {
        const F16 xv = simd::set1(x[(m0 + m) * K + k]);
        for (int b = 0; b < NB; ++b) acc[m][b] = simd::fmadd(xv, wv[b], acc[m][b]);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b) total[m][b] = total[m][b] + acc[m][b];
  }
  store_tile<MT, NB>(total, m0, nb0, N, bias, y);
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
  const Int8Tiles tile{xq, xs, Kp, w, wsum, wscale, bias, N, y, /*stream=*/M == 1};
  // split over channel blocks; grain: a batch-1 call still splits across the threads
  parallel_for(0, n_blocks, 4, [&](int64_t nb, int64_t ne) {
    if (M == 1)  // decode: one stream per thread, prefetched across blocks
      for_tiles<kRows, 1>(tile, M, nb, ne, row_block);
    else
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

// Packs 4-bit codes (N, K) (one per byte, K a multiple of 32) with fp16 scales d and
// offsets m (N, K / 32) into the records `q4_tile` reads: (N_pad / 16, K / 32, 320) bytes,
// padding channels zero.
void llmserve_pack_q4_weight(const uint8_t* codes, const uint16_t* d, const uint16_t* m,
                             int64_t N, int64_t K, uint8_t* packed) {
  const int64_t G = K / kGroup, Np = round_up(N, kBlockN);
  std::memset(packed, 0, (Np / kBlockN) * G * kQ4Record);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t block = n / kBlockN, c = n % kBlockN;
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* rec = packed + (block * G + g) * kQ4Record;
      const uint8_t* u = codes + n * K + g * kGroup;
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i)
          rec[j * 64 + c * 4 + i] = static_cast<uint8_t>((u[8 * j + i] & 0x0F) |
                                                         (u[8 * j + 4 + i] & 0x0F) << 4);
      std::memcpy(rec + 256 + 2 * c, d + n * G + g, 2);
      std::memcpy(rec + 288 + 2 * c, m + n * G + g, 2);
    }
  }
}

// y (M, N) = Q4 weight . x (M, K) [+ bias], K a multiple of 32, with activations at
// `activation_bits` 15 or 8 (see above). `workspace` holds 2 * M * K bytes (the rows' int8
// parts) plus 2 * M * K / 32 floats (per group the unit and the dequantized sum).
void llmserve_q4_linear(const float* x, int64_t M, int64_t K, const uint8_t* w,
                        const float* bias, int64_t N, float* y, uint8_t* workspace,
                        int32_t activation_bits) {
  const int64_t G = K / kGroup;
  const bool fine = activation_bits != 8;
  int8_t* a = reinterpret_cast<int8_t*>(workspace);
  float* unit = reinterpret_cast<float*>(workspace + 2 * M * K);
  float* sums = unit + M * G;
  parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row_groups(x + m * K, K, a + m * 2 * K, a + m * 2 * K + K, unit + m * G,
                          sums + m * G, fine);
  });
  const int64_t n_blocks = round_up(N, kBlockN) / kBlockN;
  // rows in blocks whose int8 parts stay in L2 while a thread's weight records stream past
  const int64_t row_block =
      std::max<int64_t>(kQ4Rows, (256 * 1024 / (2 * K)) / kQ4Rows * kQ4Rows);
  const Q4Tiles tile{a, unit, sums, K, w, N, bias, y, /*stream=*/M < 4, fine};
  parallel_for(0, n_blocks, 2, [&](int64_t nb, int64_t ne) {
    if (M < 4)  // decode: one block per tile, so a thread reads one linear stream
      for_tiles<kQ4Rows, 1>(tile, M, nb, ne, row_block);
    else
      for_tiles<kQ4Rows, kQ4Wide>(tile, M, nb, ne, row_block);
  });
}

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
  constexpr int kRows = 4;
  // rows in blocks that stay in L2 while a thread's weight blocks stream past
  const int64_t row_block = std::max<int64_t>(kRows, (256 * 1024 / (4 * K)) / kRows * kRows);
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
