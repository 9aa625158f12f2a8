// Paged attention over the KV cache in place (fp32, bf16 or int8 entries) and the cache
// write, on simd.h's 16-lane values at every instruction-set level.

#include "common.h"

#include <type_traits>
#include <vector>

using namespace llmserve;
using simd::F16;
using simd::I16;

namespace {

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// 16 floats -> bf16 bits, as float_to_bf16 lane by lane (NaN -> 0x7fc0)
inline void store_bf16(uint16_t* out, F16 v) {
  const I16 bits = simd::as_int(v);
  const I16 rounded = simd::shr<16>(bits + simd::set1_i(0x7fff) +
                                    (simd::shr<16>(bits) & simd::set1_i(1)));
  simd::store_u16(out, simd::select(simd::is_nan(v), simd::set1_i(0x7fc0), rounded));
}

// Loads `D` entries of one cached key/value row as floats.
inline void load_row(const void* base, int64_t index, int64_t D, int32_t dtype,
                     const float* scales, float* dst) {
  if (dtype == kF32) {
    std::memcpy(dst, static_cast<const float*>(base) + index * D, D * sizeof(float));
  } else if (dtype == kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(base) + index * D;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16)  // widen: the bf16 bits become a float's upper half
      simd::store(dst + d, simd::as_float(simd::shl<16>(simd::load_u16(src + d))));
    for (; d < D; ++d) {
      const uint32_t bits = static_cast<uint32_t>(src[d]) << 16;
      std::memcpy(dst + d, &bits, 4);
    }
  } else {
    const int8_t* src = static_cast<const int8_t*>(base) + index * D;
    const float s = scales[index];
    int64_t d = 0;
    const F16 sv = simd::set1(s);
    for (; d + 16 <= D; d += 16)
      simd::store(dst + d, simd::to_float(simd::load_s8(src + d)) * sv);
    for (; d < D; ++d) dst[d] = static_cast<float>(src[d]) * s;
  }
}

// Prefetches key and value rows [base, base + n), `bytes` from kv head `kvh0` on in each row,
// into the caches: the blocks are scattered, so the hardware prefetcher does not find them.
// Measured (default model, 32 streams decoding at context 128-430, avx512): the loads of the
// rows were 60 % of attention's time without it.
inline void prefetch_rows(const void* k_cache, const void* v_cache, int64_t base, int64_t n,
                          int64_t Hkv, int64_t kvh0, int64_t bytes, int64_t row_bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t offset = ((base + j) * Hkv + kvh0) * row_bytes;
    for (int64_t line = 0; line < bytes; line += 64) {
      simd::prefetch<false>(static_cast<const char*>(k_cache) + offset + line);
      simd::prefetch<false>(static_cast<const char*>(v_cache) + offset + line);
    }
  }
}

// A cached row as fp32: the row itself for an fp32 cache, else widened into `buffer`.
inline const float* cached_row(const void* base, int64_t index, int64_t D, int32_t dtype,
                               const float* scales, float* buffer) {
  if (dtype == kF32) return static_cast<const float*>(base) + index * D;
  load_row(base, index, D, dtype, scales, buffer);
  return buffer;
}

// exp(x[j]) for j < n (n <= 16); lane by lane the same arithmetic whatever n is.
inline void exp_block(const float* x, int64_t n, float* out) {
  simd::store_first(out, simd::exp(simd::load_first(x, n)), n);
}

template <int64_t C>
using Chunks = std::integral_constant<int64_t, C>;

#if defined(LLMSERVE_SIMD_AVX512)
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

// out[j] = scale * (q . keys[j]) for j < n (n <= 16), D = 16 * chunks: 16 per-key vector
// accumulators reduced by one transpose-and-add tree (on avx512 the 16 accumulators fit the
// registers; the tree costs 2 instructions a key where a sum per key costs 8). Lanes past n
// compute on key 0 and are dropped. With `chunks` a compile-time constant the loops unroll
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
#elif defined(LLMSERVE_SIMD_AVX2)
// The 8 sums of eight 8-lane accumulators (lane j: a[j] summed), by one transpose-and-add
// tree of horizontal adds: 7 instructions for 8 keys, where a sum per key costs 8.
inline __m256 sum_8x8(const __m256 (&a)[8]) {
  // lanes: [a0 01, a0 23, a1 01, a1 23 | a0 45, a0 67, a1 45, a1 67], and so on
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  // [a0 0-3, a1 0-3, a2 0-3, a3 0-3 | a0 4-7, a1 4-7, a2 4-7, a3 4-7]
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// out[j] = scale * (q . keys[j]) for j < n (n <= 16), D = 16 * chunks: eight keys at a time,
// an 8-lane accumulator each (8 of the 16 ymm registers), summed by sum_8x8; lanes past n
// compute on key 0 and are dropped. Each key's sum has the same order whatever n is.
template <typename Chunks>
inline void scores_chunks(const float* q, const float* const* keys, int64_t n, float scale,
                          float* out, Chunks chunks) {
  alignas(32) float sums[8];
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const float* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = keys[j0 + j < n ? j0 + j : 0];
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < 2 * chunks; ++c) {
      const __m256 qv = _mm256_loadu_ps(q + 8 * c);
      for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[j] + 8 * c), a[j]);
    }
    _mm256_store_ps(sums, _mm256_mul_ps(sum_8x8(a), _mm256_set1_ps(scale)));
    for (int j = 0; j < 8 && j0 + j < n; ++j) out[j0 + j] = sums[j];
  }
}
#else
// out[j] = scale * (q . keys[j]) for j < n (n <= 16), D = 16 * chunks: four keys at a
// time, each a 16-lane accumulator summed by simd.h's lane tree (16 accumulators at once
// would not fit 32 q registers).
template <typename Chunks>
inline void scores_chunks(const float* q, const float* const* keys, int64_t n, float scale,
                          float* out, Chunks chunks) {
  for (int64_t j0 = 0; j0 < n; j0 += 4) {
    const float* rows[4];
    for (int j = 0; j < 4; ++j) rows[j] = keys[j0 + j < n ? j0 + j : j0];
    F16 a[4] = {simd::zero(), simd::zero(), simd::zero(), simd::zero()};
    for (int64_t c = 0; c < chunks; ++c) {
      const F16 qv = simd::load(q + 16 * c);
      for (int j = 0; j < 4; ++j) a[j] = simd::fmadd(qv, simd::load(rows[j] + 16 * c), a[j]);
    }
    for (int j = 0; j < 4 && j0 + j < n; ++j) out[j0 + j] = simd::sum_tree(a[j]) * scale;
  }
}
#endif

// acc (16 * chunks) += sum_j p[j] * values[j] for j < n, in key order (chunks <= 16; in
// registers when a compile-time constant, as above).
template <typename Chunks>
inline void accumulate_chunks(float* acc, const float* p, const float* const* values,
                              int64_t n, Chunks chunks) {
  F16 a[16];
  for (int64_t c = 0; c < chunks; ++c) a[c] = simd::load(acc + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    const F16 pj = simd::set1(p[j]);
    for (int64_t c = 0; c < chunks; ++c)
      a[c] = simd::fmadd(pj, simd::load(values[j] + 16 * c), a[c]);
  }
  for (int64_t c = 0; c < chunks; ++c) simd::store(acc + 16 * c, a[c]);
}

// out[j] = scale * (q . keys[j]) for j < n (n <= 16).
inline void scores_block(const float* q, const float* const* keys, int64_t n, int64_t D,
                         float scale, float* out) {
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
  for (int64_t j = 0; j < n; ++j) {  // head sizes not a multiple of 16
    float sum = 0.f;
    for (int64_t d = 0; d < D; ++d) sum += q[d] * keys[j][d];
    out[j] = sum * scale;
  }
}

// acc (D) += sum_j p[j] * values[j] for j < n, in key order.
inline void accumulate_values(float* acc, const float* p, const float* const* values, int64_t n,
                              int64_t D) {
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
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * values[j][d];
}

// max of x[0, n): exact in any order (one compare chain a key was 8 % of decode attention)
inline float max_of(const float* x, int64_t n) {
  int64_t j = 0;
  F16 v = simd::set1(-INFINITY);
  for (; j + 16 <= n; j += 16) v = simd::max(v, simd::load(x + j));
  float m = simd::reduce_max(v);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

inline void scale_row(float* y, float a, int64_t D) {
  for (int64_t d = 0; d < D; ++d) y[d] *= a;
}

// One cached row (D floats) in the cache's dtype; int8: one scale per row.
inline void write_row(const float* src, int64_t D, int32_t dtype, void* cache, int64_t dst,
                      float* scales) {
  if (dtype == kF32) {
    std::memcpy(static_cast<float*>(cache) + dst * D, src, D * sizeof(float));
    return;
  }
  int64_t d = 0;
  if (dtype == kBF16) {
    uint16_t* out = static_cast<uint16_t*>(cache) + dst * D;
    for (; d + 16 <= D; d += 16) store_bf16(out + d, simd::load(src + d));
    for (; d < D; ++d) out[d] = float_to_bf16(src[d]);
    return;
  }
  F16 vmax = simd::zero();
  for (; d + 16 <= D; d += 16) vmax = simd::max(vmax, simd::abs(simd::load(src + d)));
  float amax = simd::reduce_max(vmax);
  for (; d < D; ++d) amax = std::max(amax, std::fabs(src[d]));
  const float s = std::max(amax, 1e-8f) / 127.f;
  int8_t* out = static_cast<int8_t*>(cache) + dst * D;
  const F16 sv = simd::set1(s), limit = simd::set1(127.f);
  for (d = 0; d + 16 <= D; d += 16) {
    const F16 t = simd::min(simd::max(simd::load(src + d) / sv, simd::zero() - limit), limit);
    simd::store_s8(out + d, simd::to_int(t));
  }
  for (; d < D; ++d)
    out[d] = static_cast<int8_t>(std::nearbyint(std::clamp(src[d] / s, -127.f, 127.f)));
  scales[dst] = s;
}

}  // namespace

extern "C" {

// Writes new keys and values (T, Hkv, D) fp32 (rows `kv_stride` floats apart) into the
// paged cache at `slot_mapping`, converting to the cache's dtype (int8: one scale per token
// and head).
void llmserve_kv_cache_write(const float* k, const float* v, int64_t kv_stride, int64_t T,
                             int64_t Hkv, int64_t D, const int64_t* slot_mapping, void* k_cache,
                             void* v_cache, float* k_scales, float* v_scales, int32_t dtype) {
  parallel_for(0, T * Hkv, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / Hkv, h = i % Hkv;
      const int64_t dst = slot_mapping[t] * Hkv + h;
      write_row(k + t * kv_stride + h * D, D, dtype, k_cache, dst, k_scales);
      write_row(v + t * kv_stride + h * D, D, dtype, v_cache, dst, v_scales);
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
// Work items are (sequence, tile of queries, range of kv heads): a block of keys and values
// is read (and widened) once for every query head of the group and every query of the tile.
// With enough sequences and tiles to share out, an item takes every kv head, so it reads a
// cache block's rows (all heads side by side) as one stretch of memory; otherwise one kv head,
// so a few long sequences still spread over the threads. Each query runs the same arithmetic
// whatever its item, tile, chunk or batch: keys in cache blocks from position 0, an online
// softmax per block. So a query's output depends only on its q and keys, and chunked prefill,
// prefix-cache hits and batching change no bits.
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
  int64_t total_tiles = 0;
  for (int64_t b = 0; b < B; ++b)
    total_tiles += (query_start[b + 1] - query_start[b] + kTile - 1) / kTile;
  const int64_t head_ranges = total_tiles >= 4 * current_pool()->size() ? 1 : Hkv;
  const int64_t heads = Hkv / head_ranges;
  std::vector<int64_t> item_start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    int64_t tiles = (query_start[b + 1] - query_start[b] + kTile - 1) / kTile;
    item_start[b + 1] = item_start[b] + tiles * head_ranges;
  }
  const int64_t row_bytes = D * (dtype == kF32 ? 4 : dtype == kBF16 ? 2 : 1);
  parallel_for(0, item_start[B], 1, [&](int64_t ib, int64_t ie) {
    const int64_t rows = kTile * group * heads;
    std::vector<float> keys(block_size * D), values(block_size * D), scores(block_size + 16);
    std::vector<const float*> key_rows(block_size), value_rows(block_size);
    float shifted[16], probs[16];
    std::vector<float> acc(rows * D), running_max(rows), denom(rows);
    int64_t b = std::upper_bound(item_start.begin(), item_start.end(), ib) - item_start.begin() - 1;
    for (int64_t item = ib; item < ie; ++item) {
      while (item >= item_start[b + 1]) ++b;
      int64_t local = item - item_start[b];
      int64_t tile = local / head_ranges, kvh0 = (local % head_ranges) * heads;
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
        if (k0 + block_size < last_key)  // the scattered blocks defeat hardware prefetch
          prefetch_rows(k_cache, v_cache, static_cast<int64_t>(table[k0 / block_size + 1]) *
                                              block_size,
                        std::min(block_size, last_key - k0 - block_size), Hkv, kvh0,
                        heads * row_bytes, row_bytes);
        for (int64_t hh = 0; hh < heads; ++hh) {
          const int64_t kvh = kvh0 + hh;
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
              int64_t h = kvh * group + g, r = (hh * kTile + i) * group + g;
              const float* qv = q + token * q_stride + h * D;
              float block_max;
              for (int64_t j0 = lo; j0 < visible; j0 += 16)
                scores_block(qv, &key_rows[j0], std::min<int64_t>(16, visible - j0), D, scale,
                             &scores[j0]);
              if (softcap > 0.f)
                for (int64_t j = lo; j < visible; ++j)
                  scores[j] = softcap * std::tanh(scores[j] / softcap);
              block_max = max_of(&scores[lo], visible - lo);
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
                denom[r] += simd::sum_tree(simd::load_first(probs, m));
                accumulate_values(a, probs, &value_rows[j0], m, D);
              }
            }
          }
        }
      }
      for (int64_t hh = 0; hh < heads; ++hh)
        for (int64_t i = 0; i < nq; ++i)
          for (int64_t g = 0; g < group; ++g) {
            int64_t token = query_start[b] + q0 + i, h = (kvh0 + hh) * group + g;
            int64_t r = (hh * kTile + i) * group + g;
            float* o = out + (token * H + h) * D;
            for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] / denom[r];
          }
    }
  });
}

}  // extern "C"
