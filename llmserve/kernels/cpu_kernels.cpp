// llmserve CPU kernels: W8A8 int8 linear with fused activation quantization, and paged
// attention that reads the KV cache in place (fp32, bf16 or int8 entries).
//
// Plain C ABI (called through ctypes with tensor data pointers), no dependency on torch.
// Threads come from our own spin-then-sleep pool (thread_pool.h). Built at first use with
// -march=native (one build per CPU-flag set).
//
// Every output row depends only on its own input row: integer dot products are exact, and
// the float epilogue is the same elementwise code whatever M is, so a request's results do
// not depend on what else is in the batch.

#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The pool kernels use. A replaced pool is retired, never destroyed: a kernel still
// running on another thread may hold it (pools are replaced rarely, when an engine asks
// for another thread count).
std::atomic<llmserve::ThreadPool*> g_pool{nullptr};
std::vector<std::unique_ptr<llmserve::ThreadPool>> g_pools;
std::mutex g_pools_mutex;

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  g_pool.load()->parallel_for(end - begin, grain,
                              [&](int64_t b, int64_t e) { fn(begin + b, begin + e); });
}

constexpr int64_t kQuantBlock = 64;  // K is padded to a multiple of this in packed weights

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- activation quantization -------------------------------------------------------------
// x ~ (hi + lo / 254) * scale with hi, lo in [-127, 127]: about 15 bits per activation, so
// an outlier channel does not wash out the rest of the token. Stored as u8 (value + 128) for
// VNNI's u8 x s8 dot product; padding columns hold 128 (zero).
void quantize_row(const float* x, int64_t K, int64_t Kp, uint8_t* hi, uint8_t* lo,
                  float* scale_out) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  float scale = std::max(amax, 1e-8f) / 127.f;
  for (int64_t k = 0; k < K; ++k) {
    float t = x[k] / scale;  // a division, as the torch fallback computes it
    float h = std::nearbyint(t);
    float l = std::nearbyint((t - h) * 254.f);
    hi[k] = static_cast<uint8_t>(static_cast<int>(h) + 128);
    lo[k] = static_cast<uint8_t>(static_cast<int>(std::clamp(l, -127.f, 127.f)) + 128);
  }
  for (int64_t k = K; k < Kp; ++k) hi[k] = lo[k] = 128;
  *scale_out = scale;
}

inline float epilogue(int32_t acc_hi, int32_t acc_lo, float x_scale, float w_scale) {
  return (static_cast<float>(acc_hi) + static_cast<float>(acc_lo) * (1.f / 254.f)) * x_scale *
         w_scale;
}

// ---- the int8 GEMM ------------------------------------------------------------------------
// Weights are packed for VNNI: for each block of 16 output channels, Kp/4 groups of
// [16 channels x 4 consecutive k] bytes (64 bytes, one zmm). A row's 4 activation bytes are
// broadcast to all 16 lanes and `vpdpbusd` adds the 4 products into each channel's int32:
// 16 outputs per instruction, no horizontal sums. Activations are u8 (value + 128), so the
// raw sum exceeds the true one by 128 * (row sum of w), subtracted once at the end.
constexpr int64_t kBlockN = 16;
// Software prefetch distance of the int8 GEMM's weight streams. Measured on the default
// model's int8 head at batch 1 (49152 x 576, 2 threads): 0.65 ms with 4 blocks per tile and
// no prefetch, 0.51-0.58 ms with one block per tile and 1-2 KB ahead.
constexpr int64_t kInt8PrefetchBytes = 2048;

// Prefetches one line of weights. A decode's single pass over them asks non-temporally
// (kStream), so that streaming ~100 MB of weights a token does not evict the caches' other
// contents: the KV cache, activations, the interpreter's own working set (measured at
// batch 1 on the default model: an engine step 3.84-3.88 -> 3.70-3.80 ms, most of it in
// the Python around the kernels). Passes whose tiles re-read a block keep it cached.
template <bool kStream>
inline void prefetch_weights(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), kStream ? _MM_HINT_NTA : _MM_HINT_T0);
}

inline int64_t packed_index(int64_t n, int64_t k, int64_t Kp) {
  return ((n / kBlockN) * (Kp / 4) + k / 4) * (kBlockN * 4) + (n % kBlockN) * 4 + k % 4;
}

// Accumulates MT rows (hi and lo parts) x NB blocks of 16 channels; acc[m][part][b][lane].
template <int MT, int NB, bool kStream = false>
inline void gemm_block(const uint8_t* xq, int64_t m0, int64_t Kp, const int8_t* w, int64_t nb0,
                       int32_t acc[MT][2][NB][kBlockN]) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  __m512i a[MT][2][NB];
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < 2; ++p)
      for (int b = 0; b < NB; ++b) a[m][p][b] = _mm512_setzero_si512();
  const int64_t block_bytes = (Kp / 4) * 64;
  for (int64_t k4 = 0; k4 < Kp / 4; ++k4) {
    __m512i wv[NB];
    for (int b = 0; b < NB; ++b) {
      // one line ahead in each block's stream (past a block's end: the next block's start,
      // which a one-block tile reads next)
      prefetch_weights<kStream>(w + (nb0 + b) * block_bytes + k4 * 64 + kInt8PrefetchBytes);
      wv[b] = _mm512_loadu_si512(w + (nb0 + b) * block_bytes + k4 * 64);
    }
    for (int m = 0; m < MT; ++m)
      for (int p = 0; p < 2; ++p) {
        int32_t x4;
        std::memcpy(&x4, xq + ((m0 + m) * 2 + p) * Kp + k4 * 4, 4);
        __m512i xb = _mm512_set1_epi32(x4);
        for (int b = 0; b < NB; ++b) a[m][p][b] = _mm512_dpbusd_epi32(a[m][p][b], xb, wv[b]);
      }
  }
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < 2; ++p)
      for (int b = 0; b < NB; ++b) _mm512_storeu_si512(acc[m][p][b], a[m][p][b]);
#else
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < 2; ++p)
      for (int b = 0; b < NB; ++b)
        for (int64_t j = 0; j < kBlockN; ++j) {
          int32_t sum = 0;
          const uint8_t* x = xq + ((m0 + m) * 2 + p) * Kp;
          for (int64_t k = 0; k < Kp; ++k)
            sum += static_cast<int32_t>(x[k]) * w[packed_index((nb0 + b) * kBlockN + j, k, Kp)];
          acc[m][p][b][j] = sum;
        }
#endif
}

template <int MT, int NB, bool kStream = false>
inline void gemm_tile(const uint8_t* xq, const float* xs, int64_t m0, int64_t Kp,
                      const int8_t* w, const int32_t* wsum, const float* wscale,
                      const float* bias, int64_t nb0, int64_t N, float* y) {
  alignas(64) int32_t acc[MT][2][NB][kBlockN];
  gemm_block<MT, NB, kStream>(xq, m0, Kp, w, nb0, acc);
#if defined(__AVX512F__)
  // the scalar epilogue's operations, 16 lanes at a time (no fused multiply-adds)
  const __m512 c = _mm512_set1_ps(1.f / 254.f);
  for (int b = 0; b < NB; ++b) {
    int64_t n0 = (nb0 + b) * kBlockN;
    if (n0 >= N) break;
    __mmask16 mask = N - n0 >= kBlockN ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1u);
    __m512i offset = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, wsum + n0), 7);
    __m512 ws = _mm512_maskz_loadu_ps(mask, wscale + n0);
    __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      __m512 h = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(acc[m][0][b]), offset));
      __m512 l = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(acc[m][1][b]), offset));
      __m512 v = _mm512_add_ps(h, _mm512_mul_ps(l, c));
      v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(xs[m0 + m])), ws);
      if (bias) v = _mm512_add_ps(v, bv);
      _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, mask, v);
    }
  }
  return;
#endif
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b)
      for (int64_t j = 0; j < kBlockN; ++j) {
        int64_t n = (nb0 + b) * kBlockN + j;
        if (n >= N) break;
        int32_t offset = 128 * wsum[n];
        float v = epilogue(acc[m][0][b][j] - offset, acc[m][1][b][j] - offset, xs[m0 + m],
                           wscale[n]);
        y[(m0 + m) * N + n] = bias ? v + bias[n] : v;
      }
}

#if defined(__AVX512F__)
// Stores MT rows x NB blocks of 16 outputs (+ bias), masking channels past N.
template <int MT, int NB>
inline void store_tile(const __m512 (&acc)[MT][NB], int64_t m0, int64_t nb0, int64_t N,
                       const float* bias, float* y) {
  for (int b = 0; b < NB; ++b) {
    const int64_t n0 = (nb0 + b) * kBlockN;
    if (n0 >= N) break;
    const __mmask16 mask =
        N - n0 >= kBlockN ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      __m512 v = bias ? _mm512_add_ps(acc[m][b], bv) : acc[m][b];
      _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, mask, v);
    }
  }
}
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

// ---- the int4 group GEMM ------------------------------------------------------------------
// Weights: 4-bit codes u in [0, 15] per group of 32 k, with an fp16 scale d and offset m per
// (channel, group): w = d * u + m, a GGUF Q4_1 block exactly. Activations: two int8 parts
// per group of 32 with one scale, x ~ (hi + lo / 254) * s (about 15 bits, as the int8 path:
// one 8-bit part per group moved greedy output off the float path on 2x as many prompts).
// Per row and channel, over the groups in order, with exact integer sums:
//   y += (d * (s / 254)) * (254 * (u . hi) + u . lo);  y += m * (s * sum(hi + lo / 254))
// The float sum runs over the groups in the same order whatever the batch, so a row's
// result does not depend on the other rows.
//
// Packed weights: for each block of 16 channels, one record of 320 bytes per group: 4 chunks
// of 64 code bytes (chunk j, lane c, byte b: low nibble k = 8j + b, high nibble k = 8j + 4 + b,
// so a nibble mask gives VNNI's [16 channels x 4 k] layout), 16 fp16 d, 16 fp16 m. One
// stream per block: a decode reads 5 bits per weight.
constexpr int64_t kGroup = 32;
constexpr int64_t kQ4Record = 256 + 64;
// Software prefetch distance in groups. Measured at batch 1 (the default model's 30 layers of
// linears, 3x over to defeat the L3, 2 threads): two blocks per tile and a prefetch that
// stopped at each block's end read 35-38 GB/s where a plain read loop over the same bytes
// read 44-49; one block per tile (one linear stream per thread) prefetched across blocks,
// 42-46 GB/s. 4, 8, 12 or 16 groups ahead: within the noise.
constexpr int64_t kQ4PrefetchGroups = 8;

inline float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { mant <<= 1; ++e; } while (!(mant & 0x400));
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3FF) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A row (K floats, K a multiple of 32) -> two int8 parts hi, lo (K each) and per group
// s / 254 and the group's dequantized sum s * sum(hi + lo / 254).
void quantize_row_groups(const float* x, int64_t K, int8_t* hi, int8_t* lo, float* s254,
                         float* sums) {
#if defined(__AVX512F__)
  // the scalar loop's operations, 16 lanes at a time (max is exact in any order, rounding
  // is to nearest even in both): the same bytes and floats
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 limit = _mm512_set1_ps(127.f), c254 = _mm512_set1_ps(254.f);
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m512i total = _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {
      const __m512 t = _mm512_mul_ps(half ? b : a, inv);
      const __m512 h = _mm512_roundscale_ps(t, kRound);
      __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(t, h), c254), kRound);
      l = _mm512_min_ps(_mm512_max_ps(l, _mm512_sub_ps(_mm512_setzero_ps(), limit)), limit);
      const __m512i hi32 = _mm512_cvtps_epi32(h), lo32 = _mm512_cvtps_epi32(l);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + g * kGroup + 16 * half),
                       _mm512_cvtepi32_epi8(hi32));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + g * kGroup + 16 * half),
                       _mm512_cvtepi32_epi8(lo32));
      total = _mm512_add_epi32(
          total, _mm512_add_epi32(_mm512_mullo_epi32(hi32, _mm512_set1_epi32(254)), lo32));
    }
    s254[g] = amax / 127.f / 254.f;
    sums[g] = s254[g] * static_cast<float>(_mm512_reduce_add_epi32(total));
  }
  return;
#endif
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float amax = 0.f;
    for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kGroup; ++i) {
      const float t = xg[i] * inv;
      const float h = std::nearbyint(t);
      const float l = std::clamp(std::nearbyint((t - h) * 254.f), -127.f, 127.f);
      hi[g * kGroup + i] = static_cast<int8_t>(h);
      lo[g * kGroup + i] = static_cast<int8_t>(l);
      sum += 254 * static_cast<int32_t>(h) + static_cast<int32_t>(l);
    }
    s254[g] = amax / 127.f / 254.f;
    sums[g] = s254[g] * static_cast<float>(sum);  // |sum| < 2^24: exact as a float
  }
}

// MT rows x NB blocks of 16 channels of y = Q4(w) . x [+ bias]; `a` holds each row's hi
// then lo parts (2K bytes per row).
template <int MT, int NB, bool kStream = false>
inline void q4_tile(const int8_t* a, const float* s254, const float* sums, int64_t m0,
                    int64_t K, const uint8_t* w, int64_t nb0, int64_t N, const float* bias,
                    float* y) {
  const int64_t G = K / kGroup, block_bytes = G * kQ4Record;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
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
    __m512i ihi[MT][NB], ilo[MT][NB];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b) ihi[m][b] = ilo[m][b] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i ulo[NB], uhi[NB];  // the codes of k = 8j + 0..3 and 8j + 4..7
      for (int b = 0; b < NB; ++b) {
        __m512i v = _mm512_loadu_si512(w + (nb0 + b) * block_bytes + g * kQ4Record + j * 64);
        ulo[b] = _mm512_and_si512(v, nibble);
        uhi[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
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
          ihi[m][b] = _mm512_dpbusd_epi32(ihi[m][b], ulo[b], _mm512_set1_epi32(h0));
          ihi[m][b] = _mm512_dpbusd_epi32(ihi[m][b], uhi[b], _mm512_set1_epi32(h1));
          ilo[m][b] = _mm512_dpbusd_epi32(ilo[m][b], ulo[b], _mm512_set1_epi32(l0));
          ilo[m][b] = _mm512_dpbusd_epi32(ilo[m][b], uhi[b], _mm512_set1_epi32(l1));
        }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint8_t* rec = w + (nb0 + b) * block_bytes + g * kQ4Record + 256;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
      const __m512 mo =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
      for (int m = 0; m < MT; ++m) {
        // 254 * hi + lo: exact in int32 and as a float (|.| < 2^24)
        const __m512i h = ihi[m][b];
        const __m512i t = _mm512_add_epi32(
            _mm512_sub_epi32(_mm512_slli_epi32(h, 8), _mm512_slli_epi32(h, 1)), ilo[m][b]);
        const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(s254[(m0 + m) * G + g]));
        acc[m][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), ds, acc[m][b]);
        acc[m][b] = _mm512_fmadd_ps(mo, _mm512_set1_ps(sums[(m0 + m) * G + g]), acc[m][b]);
      }
    }
  }
  store_tile<MT, NB>(acc, m0, nb0, N, bias, y);
#else
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b)
      for (int64_t c = 0; c < kBlockN; ++c) {
        const int64_t n = (nb0 + b) * kBlockN + c;
        if (n >= N) break;
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* rec = w + (nb0 + b) * block_bytes + g * kQ4Record;
          const int8_t* xh = a + (m0 + m) * 2 * K + g * kGroup;
          const int8_t* xl = xh + K;
          int32_t t = 0;
          for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = rec[j * 64 + c * 4 + i];
              const int32_t u0 = byte & 0x0F, u1 = byte >> 4;
              const int k0 = 8 * j + i, k1 = 8 * j + 4 + i;
              t += 254 * (u0 * xh[k0] + u1 * xh[k1]) + u0 * xl[k0] + u1 * xl[k1];
            }
          uint16_t dh, mh;
          std::memcpy(&dh, rec + 256 + 2 * c, 2);
          std::memcpy(&mh, rec + 288 + 2 * c, 2);
          const float ds = half_to_float(dh) * s254[(m0 + m) * G + g];
          acc = std::fma(static_cast<float>(t), ds, acc);
          acc = std::fma(half_to_float(mh), sums[(m0 + m) * G + g], acc);
        }
        y[(m0 + m) * N + n] = bias ? acc + bias[n] : acc;
      }
#endif
}

// ---- the float32 GEMM ----------------------------------------------------------------------
// The exact path's linears. Weights packed per block of 16 output channels as (K, 16) floats
// (one zmm per k); a row's 16 outputs accumulate with one fused multiply-add per k, in k
// order, whatever the tile, so a row's result does not depend on the other rows (torch's
// GEMM picks its blocking by M, which can move the last bits with the batch).
// `init` (M, N), when given, is where the accumulators start instead of zero: the partial
// sums of the k before this weight's (a tensor-parallel rank continuing the previous rank's
// chain gives the one-rank result bit for bit).
template <int MT, int NB>
inline void f32_tile(const float* x, int64_t m0, int64_t K, const float* w, int64_t nb0,
                     int64_t N, const float* bias, const float* init, float* y) {
#if defined(__AVX512F__)
  __m512 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) {
      const int64_t n0 = (nb0 + b) * kBlockN;
      if (init == nullptr || n0 >= N) {
        acc[m][b] = _mm512_setzero_ps();
        continue;
      }
      const __mmask16 mask =
          N - n0 >= kBlockN ? 0xFFFF : static_cast<__mmask16>((1u << (N - n0)) - 1u);
      acc[m][b] = _mm512_maskz_loadu_ps(mask, init + (m0 + m) * N + n0);
    }
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = _mm512_loadu_ps(w + ((nb0 + b) * K + k) * kBlockN);
    for (int m = 0; m < MT; ++m) {
      const __m512 xv = _mm512_set1_ps(x[(m0 + m) * K + k]);
      for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(xv, wv[b], acc[m][b]);
    }
  }
  store_tile<MT, NB>(acc, m0, nb0, N, bias, y);
#else
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b)
      for (int64_t c = 0; c < kBlockN; ++c) {
        const int64_t n = (nb0 + b) * kBlockN + c;
        if (n >= N) break;
        float acc = init ? init[(m0 + m) * N + n] : 0.f;
        for (int64_t k = 0; k < K; ++k)
          acc = std::fma(x[(m0 + m) * K + k], w[((nb0 + b) * K + k) * kBlockN + c], acc);
        y[(m0 + m) * N + n] = bias ? acc + bias[n] : acc;
      }
#endif
}

// The two GEMMs' tiles with their operands, for `for_tiles`.
struct Q4Tiles {
  const int8_t* a;
  const float* s254;
  const float* sums;
  int64_t K;
  const uint8_t* w;
  int64_t N;
  const float* bias;
  float* y;
  bool stream;  // one pass over the weights (decode): prefetch them non-temporally
  template <int MT, int NB>
  void run(int64_t m, int64_t b) const {
    if (stream)
      q4_tile<MT, NB, true>(a, s254, sums, m, K, w, b, N, bias, y);
    else
      q4_tile<MT, NB, false>(a, s254, sums, m, K, w, b, N, bias, y);
  }
};

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

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

enum KVDtype : int32_t { kF32 = 0, kBF16 = 1, kInt8 = 2 };

// Loads `D` entries of one cached key/value row as floats.
inline void load_row(const void* base, int64_t index, int64_t D, int32_t dtype,
                     const float* scales, float* dst) {
  if (dtype == kF32) {
    std::memcpy(dst, static_cast<const float*>(base) + index * D, D * sizeof(float));
  } else if (dtype == kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + index * D;
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16) {  // widen: the bf16 bits become a float's upper half
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
      _mm512_storeu_ps(dst + d,
                       _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
    }
#endif
    for (; d < D; ++d) dst[d] = bf16_to_float(src[d]);
  } else {
    const int8_t* src = static_cast<const int8_t*>(base) + index * D;
    const float s = scales[index];
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(s);
    for (; d + 16 <= D; d += 16) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
      _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), sv));
    }
#endif
    for (; d < D; ++d) dst[d] = static_cast<float>(src[d]) * s;
  }
}

// A cached row as fp32: the row itself for an fp32 cache, else widened into `buffer`.
inline const float* cached_row(const void* base, int64_t index, int64_t D, int32_t dtype,
                               const float* scales, float* buffer) {
  if (dtype == kF32) return static_cast<const float*>(base) + index * D;
  load_row(base, index, D, dtype, scales, buffer);
  return buffer;
}

#if defined(__AVX512F__)
// exp of 16 lanes: a Cephes-style polynomial after range reduction (~1 ulp); inputs below
// -87 give exp(-87), above ~88.7 infinity.
inline __m512 exp16(__m512 v) {
  v = _mm512_max_ps(v, _mm512_set1_ps(-87.0f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, k);
}
#endif

// exp(x[j]) for j < n (n <= 16), 0 for the other lanes; lane by lane the same arithmetic
// whatever n is.
inline void exp_block(const float* x, int64_t n, float* out) {
#if defined(__AVX512F__)
  __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
  _mm512_storeu_ps(out, _mm512_maskz_mov_ps(mask, exp16(_mm512_maskz_loadu_ps(mask, x))));
#else
  for (int64_t j = 0; j < 16; ++j) out[j] = j < n ? std::exp(x[j]) : 0.f;
#endif
}

#if defined(__AVX512F__)
// out[j] = scale * (the 16 lanes of a[j] summed) for j < n, 0 past n: one transpose-and-add
// tree, each lane summed in the same order whatever n is.
inline void store_key_sums(const __m512 (&a)[16], int64_t n, float scale, float* out) {
  __m512 t[4];
  for (int g = 0; g < 4; ++g) {
    __m512 b[2];
    for (int h = 0; h < 2; ++h) {
      __m512 x = a[4 * g + 2 * h], y = a[4 * g + 2 * h + 1];
      b[h] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[0]), _mm512_castps_pd(b[1]));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[0]), _mm512_castps_pd(b[1]));
    t[g] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x44),
                             _mm512_shuffle_f32x4(t[0], t[1], 0xEE));
  __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x44),
                             _mm512_shuffle_f32x4(t[2], t[3], 0xEE));
  __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88),
                           _mm512_shuffle_f32x4(u01, u23, 0xDD));
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  _mm512_storeu_ps(out, _mm512_maskz_mul_ps(valid, r, _mm512_set1_ps(scale)));
}

// out[j] = scale * (q . keys[j]) for j < n (n <= 16), D = 16 * chunks. With AVX-512: 16
// per-key vector accumulators reduced by one transpose-and-add tree, so each lane is summed
// in the same order whatever n is (lanes never mix); lanes past n compute on key 0 and are
// dropped. With `chunks` a compile-time constant (std::integral_constant) the loops unroll
// and the accumulators stay in registers; counted at run time they live on the stack and
// every multiply-add goes through memory (it was most of decode attention's time).
template <typename Chunks>
inline void scores_chunks(const float* q, const float* const* keys, int64_t n, float scale,
                          float* out, Chunks chunks) {
  const float* rows[16];
  for (int j = 0; j < 16; ++j) rows[j] = keys[j < n ? j : 0];
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512 qv = _mm512_loadu_ps(q + 16 * c);
    for (int j = 0; j < 16; ++j)
      a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[j] + 16 * c), a[j]);
  }
  store_key_sums(a, n, scale, out);
}

// acc (16 * chunks) += sum_j p[j] * values[j] for j < n, in key order (chunks <= 16; in
// registers when a compile-time constant, as above).
template <typename Chunks>
inline void accumulate_chunks(float* acc, const float* p, const float* const* values,
                              int64_t n, Chunks chunks) {
  __m512 a[16];
  for (int64_t c = 0; c < chunks; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int64_t c = 0; c < chunks; ++c)
      a[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(values[j] + 16 * c), a[c]);
  }
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
}

template <int64_t C>
using Chunks = std::integral_constant<int64_t, C>;
#endif

// out[j] = scale * (q . keys[j]) for j < n (n <= 16).
inline void scores_block(const float* q, const float* const* keys, int64_t n, int64_t D,
                         float scale, float* out) {
#if defined(__AVX512F__)
  switch (D) {  // the common head sizes unrolled
    case 32: return scores_chunks(q, keys, n, scale, out, Chunks<2>{});
    case 64: return scores_chunks(q, keys, n, scale, out, Chunks<4>{});
    case 80: return scores_chunks(q, keys, n, scale, out, Chunks<5>{});
    case 96: return scores_chunks(q, keys, n, scale, out, Chunks<6>{});
    case 128: return scores_chunks(q, keys, n, scale, out, Chunks<8>{});
    case 256: return scores_chunks(q, keys, n, scale, out, Chunks<16>{});
    default:
      if (D % 16 == 0) return scores_chunks(q, keys, n, scale, out, D / 16);
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    float sum = 0.f;
    for (int64_t d = 0; d < D; ++d) sum += q[d] * keys[j][d];
    out[j] = sum * scale;
  }
}

// acc (D) += sum_j p[j] * values[j] for j < n, in key order.
inline void accumulate_values(float* acc, const float* p, const float* const* values, int64_t n,
                              int64_t D) {
#if defined(__AVX512F__)
  switch (D) {
    case 32: return accumulate_chunks(acc, p, values, n, Chunks<2>{});
    case 64: return accumulate_chunks(acc, p, values, n, Chunks<4>{});
    case 80: return accumulate_chunks(acc, p, values, n, Chunks<5>{});
    case 96: return accumulate_chunks(acc, p, values, n, Chunks<6>{});
    case 128: return accumulate_chunks(acc, p, values, n, Chunks<8>{});
    case 256: return accumulate_chunks(acc, p, values, n, Chunks<16>{});
    default:
      if (D % 16 == 0 && D <= 256) return accumulate_chunks(acc, p, values, n, D / 16);
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * values[j][d];
}

inline void scale_row(float* y, float a, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] *= a;
}

}  // namespace

extern "C" {

int32_t llmserve_kernels_abi() { return 14; }

// Starts a pool of `num_threads` in all (the caller included) for the kernels that follow;
// idle workers spin for `spin_us` microseconds before they sleep.
void llmserve_set_num_threads(int32_t num_threads, int64_t spin_us) {
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  g_pools.push_back(std::make_unique<llmserve::ThreadPool>(std::max(1, num_threads), spin_us));
  g_pool.store(g_pools.back().get());
}

// out (T, C) = weight * x * rsqrt(mean(x^2) + eps), row by row (fp32, as HF Llama's RMSNorm).
void llmserve_rms_norm(const float* x, int64_t T, int64_t C, const float* weight, float eps,
                       float* out) {
  parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = x + t * C;
      float sum = 0.f;
      for (int64_t c = 0; c < C; ++c) sum += row[c] * row[c];
      float r = 1.f / std::sqrt(sum / static_cast<float>(C) + eps);
      float* o = out + t * C;
      for (int64_t c = 0; c < C; ++c) o[c] = weight[c] * (row[c] * r);
    }
  });
}

// Rotary embedding (rotate-half layout) in place on the q and k heads of a fused qkv row
// (T, row_stride): heads [0, num_heads) start at column 0, k heads follow, each D wide.
// cos/sin tables (max_position, D); the same products and sums as the torch formula.
void llmserve_rotary_inplace(float* qkv, int64_t T, int64_t row_stride, int64_t num_heads,
                             int64_t D, const int64_t* positions, const float* cos_table,
                             const float* sin_table) {
  const int64_t half = D / 2;
  parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    std::vector<float> tmp(D);
    for (int64_t t = b; t < e; ++t) {
      const float* c = cos_table + positions[t] * D;
      const float* s = sin_table + positions[t] * D;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x = qkv + t * row_stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          tmp[i] = x[i] * c[i] + (-x[i + half]) * s[i];
          tmp[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        std::memcpy(x, tmp.data(), D * sizeof(float));
      }
    }
  });
}

// out (T, I) = silu(gate) * up for gate_up (T, 2I) = [gate | up]: g / (1 + exp(-g)) * u,
// elementwise (the same bits however the work is split), split over rows and columns so a
// decode's one row uses every thread.
void llmserve_silu_and_mul(const float* gate_up, int64_t T, int64_t I, float* out) {
  parallel_for(0, T * I, 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e;) {
      const int64_t t = i / I, c = i % I, n = std::min(e - i, I - c);  // along one row
      const float* g = gate_up + t * 2 * I + c;
      const float* u = g + I;
      float* o = out + t * I + c;
      int64_t j = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; j + 16 <= n; j += 16) {
        const __m512 gv = _mm512_loadu_ps(g + j);
        const __m512 e16 = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        _mm512_storeu_ps(o + j, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e16)),
                                              _mm512_loadu_ps(u + j)));
      }
      for (; j < n; ++j) {  // the tail through the same lane arithmetic
        const __mmask16 one_lane = 1;
        const __m512 gv = _mm512_maskz_loadu_ps(one_lane, g + j);
        const __m512 e16 = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 v = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e16)),
                                       _mm512_maskz_loadu_ps(one_lane, u + j));
        _mm512_mask_storeu_ps(o + j, one_lane, v);
      }
#else
      for (; j < n; ++j) o[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
#endif
      i += n;
    }
  });
}

// Packs an int8 weight (N, K) into the VNNI layout (N_pad, Kp) (see `packed_index`),
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
  // split over channel blocks; grain: a batch-1 call still splits across the threads
  // rows in blocks small enough to stay in L2 while a thread's weight blocks stream past
  const int64_t row_block = std::max<int64_t>(2, (256 * 1024 / (2 * Kp)) / 2 * 2);
  parallel_for(0, n_blocks, 4, [&](int64_t nb, int64_t ne) {
    int64_t m = 0;
    for (int64_t r0 = 0; r0 + 2 <= M; r0 += row_block) {
      int64_t r1 = std::min(r0 + row_block, M / 2 * 2);
      int64_t b = nb;
      for (; b + 4 <= ne; b += 4)
        for (m = r0; m < r1; m += 2) gemm_tile<2, 4>(xq, xs, m, Kp, w, wsum, wscale, bias, b, N, y);
      for (; b < ne; ++b)
        for (m = r0; m < r1; m += 2) gemm_tile<2, 1>(xq, xs, m, Kp, w, wsum, wscale, bias, b, N, y);
    }
    for (m = M / 2 * 2; m < M; ++m) {
      int64_t b = nb;
      if (M == 1) {  // one stream per thread, prefetched across blocks (decode)
        for (; b < ne; ++b)
          gemm_tile<1, 1, true>(xq, xs, m, Kp, w, wsum, wscale, bias, b, N, y);
        break;
      }
      for (; b + 4 <= ne; b += 4) gemm_tile<1, 4>(xq, xs, m, Kp, w, wsum, wscale, bias, b, N, y);
      for (; b < ne; ++b) gemm_tile<1, 1>(xq, xs, m, Kp, w, wsum, wscale, bias, b, N, y);
    }
  });
}

// out (T, K) = float(w[ids[t], k]) * scale[ids[t]]: rows of a VNNI-packed int8 weight
// (N rows), dequantized (a tied embedding's lookup; one rounding, as torch's
// `rows.float() * scale`). Returns 1, writing nothing, if an id is outside [0, N).
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

// y (M, N) = Q4 weight . x (M, K) [+ bias], K a multiple of 32. `workspace` holds
// 2 * M * K bytes (the rows' two int8 parts) plus 2 * M * K / 32 floats (per group s / 254
// and the dequantized sum).
void llmserve_q4_linear(const float* x, int64_t M, int64_t K, const uint8_t* w,
                        const float* bias, int64_t N, float* y, uint8_t* workspace) {
  const int64_t G = K / kGroup;
  int8_t* a = reinterpret_cast<int8_t*>(workspace);
  float* s254 = reinterpret_cast<float*>(workspace + 2 * M * K);
  float* sums = s254 + M * G;
  parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row_groups(x + m * K, K, a + m * 2 * K, a + m * 2 * K + K, s254 + m * G,
                          sums + m * G);
  });
  const int64_t n_blocks = round_up(N, kBlockN) / kBlockN;
  constexpr int kRows = 4;
  // rows in blocks whose int8 parts stay in L2 while a thread's weight records stream past
  const int64_t row_block = std::max<int64_t>(kRows, (256 * 1024 / (2 * K)) / kRows * kRows);
  const Q4Tiles tile{a, s254, sums, K, w, N, bias, y, /*stream=*/M < kRows};
  parallel_for(0, n_blocks, 2, [&](int64_t nb, int64_t ne) {
    if (M < kRows)  // decode: one block per tile, so a thread reads one linear stream
      for_tiles<kRows, 1>(tile, M, nb, ne, row_block);
    else
      for_tiles<kRows, 2>(tile, M, nb, ne, row_block);
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
    for_tiles<kRows, 4>(tile, M, nb, ne, row_block);
  });
}

// y (M, N) = x (M, K) . W^T [+ bias] in float32 on a packed weight.
void llmserve_f32_linear(const float* x, int64_t M, int64_t K, const float* w,
                         const float* bias, int64_t N, float* y) {
  llmserve_f32_linear_from(x, M, K, w, bias, nullptr, N, y);
}

// Structured output: row rows[r] of x (N floats a row) gets -inf wherever bit n % 32 of
// words[r * ceil(N / 32) + n / 32] is clear (a grammar forbids token n). Rows in parallel;
// a word of 32 allowed tokens costs one compare.
void llmserve_apply_token_bitmask(float* x, int64_t N, const int32_t* words, int64_t R,
                                  const int64_t* rows) {
  const int64_t W = (N + 31) / 32;
  parallel_for(0, R, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* row = x + rows[r] * N;
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(words + r * W);
      for (int64_t w = 0; w < W; ++w) {
        const uint32_t forbidden = ~bits[w];
        if (forbidden == 0) continue;
        const int64_t base = w * 32;
#if defined(__AVX512F__)
        if (base + 32 <= N) {
          const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
          _mm512_mask_storeu_ps(row + base, static_cast<__mmask16>(forbidden & 0xFFFF),
                                neg_inf);
          _mm512_mask_storeu_ps(row + base + 16, static_cast<__mmask16>(forbidden >> 16),
                                neg_inf);
          continue;
        }
#endif
        for (int64_t i = 0; i < 32 && base + i < N; ++i) {
          if (forbidden >> i & 1u) row[base + i] = -INFINITY;
        }
      }
    }
  });
}

// out[m] = the index of row m's largest value (the first of equal ones, as torch.argmax),
// or -1 when the row holds a NaN (the caller asks torch then). Rows in parallel.
void llmserve_argmax_rows(const float* x, int64_t M, int64_t N, int64_t* out) {
  parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const float* row = x + m * N;
      float best = -INFINITY;
      int64_t arg = 0;
      bool nan = false;
      int64_t n = 0;
#if defined(__AVX512F__)
      if (N >= 16) {  // per lane: the largest value and its first index
        __m512 vmax = _mm512_loadu_ps(row);
        __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i idx = vidx;
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 unordered = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
        for (n = 16; n + 16 <= N; n += 16) {  // N < 2^31: int32 indices
          idx = _mm512_add_epi32(idx, step);
          const __m512 v = _mm512_loadu_ps(row + n);
          unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
          const __mmask16 greater = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
          vmax = _mm512_mask_blend_ps(greater, vmax, v);
          vidx = _mm512_mask_blend_epi32(greater, vidx, idx);
        }
        nan = unordered != 0;
        alignas(64) float lane_max[16];
        alignas(64) int32_t lane_idx[16];
        _mm512_store_ps(lane_max, vmax);
        _mm512_store_si512(lane_idx, vidx);
        arg = lane_idx[0];
        best = lane_max[0];
        for (int l = 1; l < 16; ++l)
          if (lane_max[l] > best || (lane_max[l] == best && lane_idx[l] < arg)) {
            best = lane_max[l];
            arg = lane_idx[l];
          }
      }
#endif
      for (; n < N; ++n) {
        const float v = row[n];
        if (std::isnan(v)) {
          nan = true;
        } else if (v > best) {
          best = v;
          arg = n;
        }
      }
      out[m] = nan ? -1 : arg;
    }
  });
}

// Writes new keys and values (T, Hkv, D) fp32 (rows `kv_stride` floats apart) into the
// paged cache at `slot_mapping`,
// converting to the cache's dtype (int8: one scale per token and head).
void llmserve_kv_cache_write(const float* k, const float* v, int64_t kv_stride, int64_t T,
                             int64_t Hkv, int64_t D, const int64_t* slot_mapping, void* k_cache,
                             void* v_cache, float* k_scales, float* v_scales, int32_t dtype) {
  parallel_for(0, T * Hkv, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      int64_t t = i / Hkv, h = i % Hkv;
      int64_t dst = slot_mapping[t] * Hkv + h;
      for (int which = 0; which < 2; ++which) {
        const float* src = (which ? v : k) + t * kv_stride + h * D;
        void* cache = which ? v_cache : k_cache;
        if (dtype == kF32) {
          std::memcpy(static_cast<float*>(cache) + dst * D, src, D * sizeof(float));
        } else if (dtype == kBF16) {
          uint16_t* out = static_cast<uint16_t*>(cache) + dst * D;
          for (int64_t d = 0; d < D; ++d) out[d] = float_to_bf16(src[d]);
        } else {
          float amax = 0.f;
          for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(src[d]));
          float s = std::max(amax, 1e-8f) / 127.f;
          int8_t* out = static_cast<int8_t*>(cache) + dst * D;
          for (int64_t d = 0; d < D; ++d)
            out[d] = static_cast<int8_t>(std::nearbyint(std::clamp(src[d] / s, -127.f, 127.f)));
          (which ? v_scales : k_scales)[dst] = s;
        }
      }
    }
  });
}

// Paged attention for a flat batch of B sequences. Sequence b owns queries
// [query_start[b], query_start[b + 1]) at positions context_lens[b] + i, and attends
// causally to its cached keys 0 .. context_lens[b] + i through its row of block_tables
// (B, max_blocks). q: (T, H, D) fp32 with rows `q_stride` floats apart; out: (T, H, D)
// contiguous; cache: (num_blocks, block_size, Hkv, D). With `window` > 0 a query at
// position p sees only keys p - window + 1 .. p (sliding-window layers); with `softcap`
// > 0 each score s becomes softcap * tanh(s / softcap).
//
// Work items are (sequence, kv head, tile of queries): a block of keys and values is read
// (and widened) once for every query head of the group and every query of the tile. Each
// query then runs the same arithmetic whatever its tile, chunk or batch: keys in cache
// blocks from position 0, an online softmax per block. So a query's output depends only on
// its q and keys, and chunked prefill, prefix-cache hits and batching change no bits.
void llmserve_paged_attention(const float* q, int64_t q_stride, int64_t H, int64_t D,
                              const void* k_cache,
                              const void* v_cache, const float* k_scales,
                              const float* v_scales, int32_t dtype, int64_t block_size,
                              int64_t Hkv, const int32_t* block_tables, int64_t max_blocks,
                              const int32_t* query_start, const int32_t* context_lens,
                              int64_t B, float scale, int64_t window, float softcap,
                              float* out) {
  constexpr int64_t kTile = 8;
  const int64_t group = H / Hkv;
  std::vector<int64_t> item_start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    int64_t tiles = (query_start[b + 1] - query_start[b] + kTile - 1) / kTile;
    item_start[b + 1] = item_start[b] + tiles * Hkv;
  }
  parallel_for(0, item_start[B], 1, [&](int64_t ib, int64_t ie) {
    const int64_t rows = kTile * group;
    std::vector<float> keys(block_size * D), values(block_size * D), scores(block_size + 16);
    std::vector<const float*> key_rows(block_size), value_rows(block_size);
    float shifted[16], probs[16];
    std::vector<float> acc(rows * D), running_max(rows), denom(rows);
    int64_t b = std::upper_bound(item_start.begin(), item_start.end(), ib) - item_start.begin() - 1;
    for (int64_t item = ib; item < ie; ++item) {
      while (item >= item_start[b + 1]) ++b;
      int64_t local = item - item_start[b];
      int64_t tile = local / Hkv, kvh = local % Hkv;
      int64_t q0 = tile * kTile;
      int64_t nq = std::min(kTile, static_cast<int64_t>(query_start[b + 1] - query_start[b]) - q0);
      int64_t context = context_lens[b];
      int64_t last_key = context + q0 + nq;  // keys the tile's last query sees
      // the block holding the first key the tile's first query sees
      int64_t first_block = window > 0 ? std::max<int64_t>(0, context + q0 + 1 - window) /
                                             block_size : 0;
      const int32_t* table = block_tables + b * max_blocks;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(running_max.begin(), running_max.end(), -INFINITY);
      std::fill(denom.begin(), denom.end(), 0.f);
      for (int64_t k0 = first_block * block_size; k0 < last_key; k0 += block_size) {
        int64_t n = std::min(block_size, last_key - k0);
        int64_t base = static_cast<int64_t>(table[k0 / block_size]) * block_size;
        for (int64_t j = 0; j < n; ++j) {
          key_rows[j] = cached_row(k_cache, (base + j) * Hkv + kvh, D, dtype, k_scales,
                                   &keys[j * D]);
          value_rows[j] = cached_row(v_cache, (base + j) * Hkv + kvh, D, dtype, v_scales,
                                     &values[j * D]);
        }
        for (int64_t i = 0; i < nq; ++i) {
          int64_t pos = context + q0 + i;
          // keys [lo, visible) of the block: causal, and inside the window if any
          int64_t visible = std::min(n, pos + 1 - k0);
          int64_t lo = window > 0 ? std::max<int64_t>(0, pos + 1 - window - k0) : 0;
          if (visible <= lo) continue;
          int64_t token = query_start[b] + q0 + i;
          for (int64_t g = 0; g < group; ++g) {
            int64_t h = kvh * group + g, r = i * group + g;
            const float* qv = q + token * q_stride + h * D;
            float block_max = -INFINITY;
            for (int64_t j0 = lo; j0 < visible; j0 += 16)
              scores_block(qv, &key_rows[j0], std::min<int64_t>(16, visible - j0), D, scale,
                           &scores[j0]);
            if (softcap > 0.f)
              for (int64_t j = lo; j < visible; ++j)
                scores[j] = softcap * std::tanh(scores[j] / softcap);
            for (int64_t j = lo; j < visible; ++j) block_max = std::max(block_max, scores[j]);
            float* a = &acc[r * D];
            if (block_max > running_max[r]) {
              float correction;
              float delta = running_max[r] - block_max;
              exp_block(&delta, 1, &correction);
              scale_row(a, correction, D);
              denom[r] *= correction;
              running_max[r] = block_max;
            }
            for (int64_t j0 = lo; j0 < visible; j0 += 16) {
              int64_t m = std::min<int64_t>(16, visible - j0);
              for (int64_t j = 0; j < m; ++j) shifted[j] = scores[j0 + j] - running_max[r];
              exp_block(shifted, m, probs);
              for (int64_t j = 0; j < m; ++j) denom[r] += probs[j];
              accumulate_values(a, probs, &value_rows[j0], m, D);
            }
          }
        }
      }
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < group; ++g) {
          int64_t token = query_start[b] + q0 + i, h = kvh * group + g, r = i * group + g;
          float* o = out + (token * H + h) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] / denom[r];
        }
    }
  });
}

}  // extern "C"
