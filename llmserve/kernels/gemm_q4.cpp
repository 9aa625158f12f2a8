// The int4 group GEMM (GGUF Q4_1 blocks) on packed weights, written once on simd.h's 16-lane
// values and built at every instruction-set level.

#include "gemm.h"

using namespace llmserve;
using namespace llmserve::gemm;

namespace {

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
  LLMSERVE_UNROLL
  for (int m = 0; m < MT; ++m)
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b) acc[m][b] = simd::zero();
  for (int64_t g = 0; g < G; ++g) {
    {  // the record kQ4PrefetchGroups groups on in each block's stream; past a block's
       // end, the next tile's (a thread's tiles are consecutive blocks: with one block per
       // tile, its weights are one linear stream)
      const int64_t ahead = g + kQ4PrefetchGroups;
      const int64_t nb1 = ahead < G ? nb0 : nb0 + NB, g1 = ahead < G ? ahead : ahead - G;
      LLMSERVE_UNROLL
      for (int b = 0; b < NB; ++b) {
        const char* next =
            reinterpret_cast<const char*>(w + (nb1 + b) * block_bytes + g1 * kQ4Record);
        for (int line = 0; line < kQ4Record / 64; ++line)
          prefetch_weights<kStream>(next + 64 * line);
      }
    }
    simd::P32 ihi[MT][NB], ilo[MT][NB];  // 8 steps a group: within dot4_nibbles' bound
    LLMSERVE_UNROLL
    for (int m = 0; m < MT; ++m)
      LLMSERVE_UNROLL
      for (int b = 0; b < NB; ++b) ihi[m][b] = ilo[m][b] = simd::zero_pairs();
    LLMSERVE_UNROLL
    for (int j = 0; j < 4; ++j) {
      simd::B64 ulo[NB], uhi[NB];  // the codes of k = 8j + 0..3 and 8j + 4..7
      LLMSERVE_UNROLL
      for (int b = 0; b < NB; ++b) {
        const simd::B64 v =
            simd::load_bytes(w + (nb0 + b) * block_bytes + g * kQ4Record + j * 64);
        ulo[b] = simd::low_nibbles(v);
        uhi[b] = simd::high_nibbles(v);
      }
      LLMSERVE_UNROLL
      for (int m = 0; m < MT; ++m) {
        const int8_t* xh = a + (m0 + m) * 2 * K + g * kGroup + 8 * j;
        const int8_t* xl = xh + K;
        int32_t h0, h1, l0, l1;
        std::memcpy(&h0, xh, 4);
        std::memcpy(&h1, xh + 4, 4);
        std::memcpy(&l0, xl, 4);
        std::memcpy(&l1, xl + 4, 4);
        LLMSERVE_UNROLL
        for (int b = 0; b < NB; ++b) {
          ihi[m][b] = simd::dot4_nibbles(simd::dot4_nibbles(ihi[m][b], ulo[b], h0), uhi[b], h1);
          if (kFine)
            ilo[m][b] = simd::dot4_nibbles(simd::dot4_nibbles(ilo[m][b], ulo[b], l0), uhi[b], l1);
        }
      }
    }
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b) {
      const uint8_t* rec = w + (nb0 + b) * block_bytes + g * kQ4Record + 256;
      const F16 d = simd::load_half(reinterpret_cast<const uint16_t*>(rec));
      const F16 mo = simd::load_half(reinterpret_cast<const uint16_t*>(rec + 32));
      LLMSERVE_UNROLL
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

// kStream: one pass over the weights (decode, fewer than 4 rows): see prefetch_weights
template <bool kStream>
struct Q4Tiles {
  const int8_t* a;
  const float* unit;
  const float* sums;
  int64_t K;
  const uint8_t* w;
  int64_t N;
  const float* bias;
  float* y;
  bool fine;  // 15-bit activations (else 8)
  template <int MT, int NB>
  void run(int64_t m, int64_t b) const {
    fine ? q4_tile<MT, NB, kStream, true>(a, unit, sums, m, K, w, b, N, bias, y)
         : q4_tile<MT, NB, kStream, false>(a, unit, sums, m, K, w, b, N, bias, y);
  }
};

// float -> IEEE half bits, rounded to nearest even as torch's `.half()` (subnormals, and
// overflow to infinity, included; finite inputs only: weights)
inline uint16_t float_to_half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  x &= 0x7FFFFFFF;
  if (x >= 0x477FF000) return sign | 0x7C00;  // 65520 and up round to infinity
  if (x < 0x38800000)  // under 2^-14: a subnormal half, in units of 2^-24 (exact scaling)
    return sign | static_cast<uint16_t>(std::nearbyint(std::fabs(f) * 16777216.f));
  uint32_t h = (x - 0x38000000) >> 13;  // rebias the exponent, keep 10 mantissa bits
  const uint32_t rest = x & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return sign | static_cast<uint16_t>(h);
}

// A group of 32 that is a GGUF Q4_0 block (x = d (u - 8), d its value of largest magnitude
// over -8, an fp16): its own codes u, d and m = -8 d (exact in fp16); false otherwise.
bool q4_0_block(const float* x, uint8_t* codes, uint16_t* d, uint16_t* m) {
  int first_largest = 0;
  for (int i = 1; i < kGroup; ++i)
    if (std::fabs(x[i]) > std::fabs(x[first_largest])) first_largest = i;
  const float scale = x[first_largest] / -8.f, offset = -8.f * scale;
  const uint16_t d_bits = float_to_half_bits(scale), m_bits = float_to_half_bits(offset);
  if (scale == 0.f || simd::half_bits_to_float(d_bits) != scale ||
      simd::half_bits_to_float(m_bits) != offset)
    return false;
  uint8_t u[kGroup];
  for (int i = 0; i < kGroup; ++i) {
    const float code = std::nearbyint(x[i] / scale) + 8.f;
    if (!(code >= 0.f && code <= 15.f) || scale * (code - 8.f) != x[i]) return false;
    u[i] = static_cast<uint8_t>(code);
  }
  std::memcpy(codes, u, kGroup);
  *d = d_bits;
  *m = m_bits;
  return true;
}

// One row's groups of 32 (K a multiple of 32) -> codes, d, m as int4.py's quantize_groups
// computes them in torch ops, bit for bit: d = half((max - min) / 15), m = half(min),
// code = clamp(round((x - m) * (1 / d)), 0, 15) (0 where d is 0); where those do not give
// the group back exactly and it is a Q4_0 block, the block's own (q4_0_block).
void quantize_q4_row(const float* w, int64_t K, uint8_t* codes, uint16_t* d, uint16_t* m) {
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const F16 a = simd::load(w + g * kGroup), b = simd::load(w + g * kGroup + 16);
    const float lo = -simd::reduce_max(simd::max(simd::zero() - a, simd::zero() - b));
    const float hi = simd::reduce_max(simd::max(a, b));
    d[g] = float_to_half_bits((hi - lo) / 15.f);
    m[g] = float_to_half_bits(lo);
    const float step = simd::half_bits_to_float(d[g]);
    const F16 inverse = simd::set1(step > 0.f ? 1.f / step : 0.f);
    const F16 offset = simd::set1(simd::half_bits_to_float(m[g]));
    for (int half = 0; half < 2; ++half) {
      const F16 t = simd::round_even(((half ? b : a) - offset) * inverse);
      const F16 code = simd::min(simd::max(t, simd::zero()), simd::set1(15.f));
      simd::store_u8(codes + g * kGroup + 16 * half, simd::to_int(code));
    }
    const float* x = w + g * kGroup;
    const float scale = simd::half_bits_to_float(d[g]), low = simd::half_bits_to_float(m[g]);
    bool exact = true;
    for (int i = 0; i < kGroup && exact; ++i)
      exact = scale * static_cast<float>(codes[g * kGroup + i]) + low == x[i];
    if (!exact) q4_0_block(x, codes + g * kGroup, d + g, m + g);
  }
}

}  // namespace

extern "C" {

// Quantizes a float weight (N, K), K a multiple of 32, into 4-bit codes (N, K) with fp16
// scales d and offsets m (N, K / 32): one pass, where the same in torch ops made five over
// every weight (a fifth of a warm start).
void llmserve_quantize_q4(const float* w, int64_t N, int64_t K, uint8_t* codes, uint16_t* d,
                          uint16_t* m) {
  const int64_t G = K / kGroup;
  parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n)
      quantize_q4_row(w + n * K, K, codes + n * K, d + n * G, m + n * G);
  });
}

// Packs 4-bit codes (N, K) (one per byte, K a multiple of 32) with fp16 scales d and
// offsets m (N, K / 32) into the records `q4_tile` reads: (N_pad / 16, K / 32, 320) bytes,
// padding channels zero.
// (GCC's vectorizer spent 9 s of a first start's kernel build on this loop, run once per
// weight at load: left scalar)
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
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
  // rows in blocks whose int8 parts stay in L2 while a thread's weight records stream past
  const int64_t row_block =
      std::max<int64_t>(kQ4Rows, (256 * 1024 / (2 * K)) / kQ4Rows * kQ4Rows);
  run_gemm<kQ4Rows, kQ4Wide>(Q4Tiles<true>{a, unit, sums, K, w, N, bias, y, fine},
                             Q4Tiles<false>{a, unit, sums, K, w, N, bias, y, fine}, M, N,
                             row_block);
}

}  // extern "C"
