// The GEMM on a GGUF file's own blocks (kquant.h describes them): the K-quants and the
// legacy types on packed weights, written once on simd.h's 16-lane values and built at
// every level; where AMX tiles are granted, rows in tiles of 16 run there
// (gemm_kquant_amx.cpp) with the same integer sums and float epilogue.

#include "kquant.h"

#include <type_traits>
#include <vector>

using namespace llmserve;
using namespace llmserve::gemm;
using namespace llmserve::kquant;

namespace {


// A row (K floats, K a multiple of 256) -> int8 q (K), per super-block the scale s, and
// per 16 k the sum of q.
void quantize_row_super(const float* x, int64_t K, int8_t* q, float* scale, int32_t* sums16) {
  for (int64_t g = 0; g < K / kSuper; ++g) {
    const float* xg = x + g * kSuper;
    F16 vmax = simd::zero();
    for (int i = 0; i < kSuper; i += 16) vmax = simd::max(vmax, simd::abs(simd::load(xg + i)));
    const float amax = simd::reduce_max(vmax);
    const F16 inv = simd::set1(amax > 0.f ? 127.f / amax : 0.f);
    for (int i = 0; i < kSuper; i += 16) {
      const I16 v = simd::to_int(simd::round_even(simd::load(xg + i) * inv));
      simd::store_s8(q + g * kSuper + i, v);
      sums16[g * (kSuper / 16) + i / 16] = simd::reduce_add(v);
    }
    scale[g] = amax / 127.f;
  }
}

// A decode whose weights stream into the caches (prefetch_weights) prefetches the next
// record a line or two a chunk of codes, spread over the record's work, and the same lines
// kFarRecords records further into L2 (with one block per tile a thread's weights are one
// linear stream). Measured on the AVX-512 Xeon VM (2 threads, 40 matrices of 8192 x 3072,
// 1 GiB; a plain read loop 24.6 GB/s), against a sub-block's share at each sub-block's
// start: Q4_K 17.4-18.8 -> 22.3-22.4 GB/s, Q6_K 17.6-18.0 -> 20.9-21.0, Q8_0 23.8-25.9 ->
// 29.2-29.3, Q4_0 19.3-19.5 -> 23.5-23.6 (avx2: Q4_K 18.1 -> 20.5, Q6_K 17.2 -> 20.6); 3 or
// 4 records ahead the same, 6 or 8 slower. Spread without the far lines: as before; a
// non-temporal stream spread: slower (Q4_K 14.8 -> 12.9), so it keeps its bursts.
constexpr int kFarRecords = 2;

// Prefetches piece p of kPieces (a sub-block's or a chunk's share) of the lines of record
// g1 of blocks nb1 .. nb1 + NB - 1 (the next super-block's records in each block's
// stream; past a block's end, the next tile's); kFar (a cached decode): into the caches,
// and those lines kFarRecords records further into L2.
template <int kType, int NB, bool kStream, int kPieces, bool kFar>
inline void prefetch_share(const uint8_t* w, int64_t nb1, int64_t g1, int64_t block_bytes,
                           int p) {
  using L = Layout<kType>;
  constexpr int kLines = (L::kRecord + 63) / 64;
  LLMSERVE_UNROLL
  for (int b = 0; b < NB; ++b) {
    const char* next = reinterpret_cast<const char*>(w + (nb1 + b) * block_bytes +
                                                     g1 * L::kRecord);
    for (int line = p * kLines / kPieces; line < (p + 1) * kLines / kPieces; ++line) {
      if constexpr (kFar) {
        simd::prefetch<false>(next + 64 * line);
        simd::prefetch_l2(next + kFarRecords * L::kRecord + 64 * line);
      } else {
        prefetch_weights<kStream>(next + 64 * line);
      }
    }
  }
}

// The prefetches of a tile: a sub-block's share at each sub-block, or for a cached decode
// a chunk's share at each chunk (kFarRecords).
template <int kType, int NB, bool kStream>
struct TilePrefetch {
  using L = Layout<kType>;
  static constexpr int kChunks = L::kCodeBytes / 64;
  const uint8_t* w;
  int64_t block_bytes;
  bool spread = kStream && !stream_nontemporal();
  void sub_block(int64_t nb1, int64_t g1, int s) const {
    if (!spread) prefetch_share<kType, NB, kStream, L::kSubs, false>(w, nb1, g1, block_bytes, s);
  }
  void chunk(int64_t nb1, int64_t g1, int j) const {
    if constexpr (kStream)
      if (spread) prefetch_share<kType, NB, kStream, kChunks, true>(w, nb1, g1, block_bytes, j);
  }
};

// MT rows x NB blocks of 16 channels of y = KQ(w) . x [+ bias].
template <int kType, int MT, int NB, bool kStream>
inline void kq_tile(const int8_t* q, const float* xscale, const int32_t* sums16, int64_t m0,
                    int64_t K, const uint8_t* w, int64_t nb0, int64_t N, const float* bias,
                    float* y) {
  using L = Layout<kType>;
  const int64_t G = K / kSuper, block_bytes = G * L::kRecord;
  const TilePrefetch<kType, NB, kStream> prefetch{w, block_bytes};
  F16 acc[MT][NB];
  LLMSERVE_UNROLL
  for (int m = 0; m < MT; ++m)
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b) acc[m][b] = simd::zero();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t nb1 = g + 1 < G ? nb0 : nb0 + NB, g1 = g + 1 < G ? g + 1 : 0;
    I16 a_int[MT][NB];
    LLMSERVE_UNROLL
    for (int m = 0; m < MT; ++m)
      LLMSERVE_UNROLL
      for (int b = 0; b < NB; ++b) a_int[m][b] = simd::zero_i();
    for (int s = 0; s < L::kSubs; ++s) {
      prefetch.sub_block(nb1, g1, s);
      I16 sc[NB];
      LLMSERVE_UNROLL
      for (int b = 0; b < NB; ++b)
        sc[b] = simd::load_s8(reinterpret_cast<const int8_t*>(
            w + (nb0 + b) * block_bytes + g * L::kRecord + L::kScales + 16 * s));
      constexpr int kSteps = L::kSubK / 4;  // dot4 steps in a sub-block
      // the codes' offset (Q6_K, Q3_K: u - offset; IQ4_XS: the levels' kSignedBias) is taken
      // off once a sub-block, then its scale applied: exact int32 sums (|A| < 2^28); with
      // no offset and one widening a sub-block (Q4_K, Q5_K), at that widening
      constexpr int kSubOffset = L::kSigned ? L::kCodeOffset
                                 : kType == kIQ4XS ? kSignedBias : 0;
      constexpr bool kDirect =
          kType != kIQ4XS && kSubOffset == 0 && L::kStepsPerWiden == kSteps;
      simd::P32 pairs[MT][NB];  // the dot products since the last widening
      I16 sub[MT][NB];  // the sub-block's u . q (IQ4_XS: its levels' . q), in int32
      LLMSERVE_UNROLL
      for (int m = 0; m < MT; ++m)
        LLMSERVE_UNROLL
        for (int b = 0; b < NB; ++b) {
          pairs[m][b] = simd::zero_pairs();
          sub[m][b] = simd::zero_i();
        }
      for (int step = 0; step < kSteps; step += 2) {
        const int j = (s * L::kSubK) / 8 + step / 2;  // the chunk: two steps
        prefetch.chunk(nb1, g1, j);
        simd::B64 ulo[NB], uhi[NB];
        LLMSERVE_UNROLL
        for (int b = 0; b < NB; ++b) {
          chunk_codes<kType>(w + (nb0 + b) * block_bytes + g * L::kRecord, j, ulo[b], uhi[b]);
          if constexpr (kType == kIQ4XS) {  // codes -> their levels (+ kSignedBias)
            ulo[b] = simd::lookup16(ulo[b], kIQ4Codes.v);
            uhi[b] = simd::lookup16(uhi[b], kIQ4Codes.v);
          }
        }
        LLMSERVE_UNROLL
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = q + (m0 + m) * K + g * kSuper + 8 * j;
          int32_t x0, x1;
          std::memcpy(&x0, xq, 4);
          std::memcpy(&x1, xq + 4, 4);
          LLMSERVE_UNROLL
          for (int b = 0; b < NB; ++b) {
            if constexpr (kType == kIQ4XS)
              sub[m][b] = dot4_biased(dot4_biased(sub[m][b], ulo[b], x0), uhi[b], x1);
            else
              pairs[m][b] = simd::dot4_nibbles(simd::dot4_nibbles(pairs[m][b], ulo[b], x0),
                                               uhi[b], x1);
          }
        }
        if constexpr (kType != kIQ4XS)
          if ((step + 2) % L::kStepsPerWiden == 0)
            LLMSERVE_UNROLL
            for (int m = 0; m < MT; ++m)
              LLMSERVE_UNROLL
              for (int b = 0; b < NB; ++b) {
                // Q4_K and Q5_K scaled here, not through sub (avx2's 16 registers: Q4_K at
                // batch 32 11 % slower through it)
                if constexpr (kDirect)
                  a_int[m][b] =
                      a_int[m][b] + simd::mul_lo(simd::widen_pairs(pairs[m][b]), sc[b]);
                else if constexpr (L::kStepsPerWiden == kSteps)
                  sub[m][b] = simd::widen_pairs(pairs[m][b]);
                else
                  sub[m][b] = sub[m][b] + simd::widen_pairs(pairs[m][b]);
                pairs[m][b] = simd::zero_pairs();
              }
      }
      if constexpr (kDirect) continue;  // scaled at the widening already
      LLMSERVE_UNROLL
      for (int m = 0; m < MT; ++m) {
        int32_t qsum = 0;
        if constexpr (kSubOffset != 0) {
          const int32_t* qs = sums16 + ((m0 + m) * G + g) * (kSuper / 16);
          qsum = L::kSubK == 16 ? qs[s] : qs[2 * s] + qs[2 * s + 1];
        }
        LLMSERVE_UNROLL
        for (int b = 0; b < NB; ++b) {
          I16 t = sub[m][b];
          if constexpr (kSubOffset != 0) t = t - simd::set1_i(kSubOffset * qsum);
          a_int[m][b] = a_int[m][b] + simd::mul_lo(t, sc[b]);
        }
      }
    }
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b) {
      const uint8_t* rec = w + (nb0 + b) * block_bytes + g * L::kRecord;
      const F16 d = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kHalves));
      LLMSERVE_UNROLL
      for (int m = 0; m < MT; ++m) {
        const F16 xs = simd::set1(xscale[(m0 + m) * G + g]);
        acc[m][b] = simd::fmadd(simd::to_float(a_int[m][b]), d * xs, acc[m][b]);
      }
      if constexpr (L::kNoMins) continue;  // Q6_K, Q3_K, IQ4_XS: in A already
      const F16 dmin = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kHalves + 32));
      const int8_t* mins = reinterpret_cast<const int8_t*>(rec + L::kMins);
      LLMSERVE_UNROLL
      for (int m = 0; m < MT; ++m) {
        // B = sum of m * (sum of q) over the sub-blocks: |B| < 2^24, exact as a float
        const int32_t* qs = sums16 + ((m0 + m) * G + g) * (kSuper / 16);
        I16 b_int = simd::zero_i();
        for (int s = 0; s < L::kSubs; ++s)
          b_int = b_int + simd::mul_lo(simd::load_s8(mins + 16 * s),
                                       simd::set1_i(qs[2 * s] + qs[2 * s + 1]));
        const F16 xs = simd::set1(xscale[(m0 + m) * G + g]);
        acc[m][b] = simd::fnmadd(simd::to_float(b_int), dmin * xs, acc[m][b]);
      }
    }
  }
  store_tile<MT, NB>(acc, m0, nb0, N, bias, y);
}

// MT rows x NB blocks of 16 channels of y = W . x [+ bias] for a legacy type: per block of
// 32 k an exact integer sum, scaled by the block's d (and its m times the sum of q).
template <int kType, int MT, int NB, bool kStream>
inline void legacy_tile(const int8_t* q, const float* xscale, const int32_t* sums16,
                        int64_t m0, int64_t K, const uint8_t* w, int64_t nb0, int64_t N,
                        const float* bias, float* y) {
  using L = Layout<kType>;
  const int64_t G = K / kSuper, block_bytes = G * L::kRecord;
  const TilePrefetch<kType, NB, kStream> prefetch{w, block_bytes};
  // 64-byte chunks of codes per block of 32 k: 8 of 4 k (Q8_0), else 4 of 8 k
  constexpr int kChunks = L::kCodeBytes / 64 / L::kSubs;
  F16 acc[MT][NB];
  LLMSERVE_UNROLL
  for (int m = 0; m < MT; ++m)
    LLMSERVE_UNROLL
    for (int b = 0; b < NB; ++b) acc[m][b] = simd::zero();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t nb1 = g + 1 < G ? nb0 : nb0 + NB, g1 = g + 1 < G ? g + 1 : 0;
    for (int s = 0; s < L::kSubs; ++s) {
      prefetch.sub_block(nb1, g1, s);
      I16 sum[MT][NB];  // u . q (Q8_0: v . q)
      simd::P32 pairs[MT][NB];
      LLMSERVE_UNROLL
      for (int m = 0; m < MT; ++m)
        LLMSERVE_UNROLL
        for (int b = 0; b < NB; ++b) {
          sum[m][b] = simd::zero_i();
          pairs[m][b] = simd::zero_pairs();
        }
      if constexpr (kType == kQ8_0) {
        for (int j = s * kChunks; j < (s + 1) * kChunks; ++j) {
          prefetch.chunk(nb1, g1, j);
          simd::B64 v[NB];
          LLMSERVE_UNROLL
          for (int b = 0; b < NB; ++b)
            v[b] = biased(
                simd::load_bytes(w + (nb0 + b) * block_bytes + g * L::kRecord + 64 * j));
          LLMSERVE_UNROLL
          for (int m = 0; m < MT; ++m) {
            int32_t x0;
            std::memcpy(&x0, q + (m0 + m) * K + g * kSuper + 4 * j, 4);
            LLMSERVE_UNROLL
            for (int b = 0; b < NB; ++b) sum[m][b] = dot4_biased(sum[m][b], v[b], x0);
          }
        }
      } else {
        // unrolled, so that each chunk's high-bit shifts are constants (Q5_0 at batch 1 on
        // the 1B shape: 58 ms a step's linears, 79 as a loop)
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) {
          const int j = s * kChunks + c;
          prefetch.chunk(nb1, g1, j);
          simd::B64 ulo[NB], uhi[NB];
          LLMSERVE_UNROLL
          for (int b = 0; b < NB; ++b)
            chunk_codes<kType>(w + (nb0 + b) * block_bytes + g * L::kRecord, j, ulo[b], uhi[b]);
          LLMSERVE_UNROLL
          for (int m = 0; m < MT; ++m) {
            const int8_t* xq = q + (m0 + m) * K + g * kSuper + 8 * j;
            int32_t x0, x1;
            std::memcpy(&x0, xq, 4);
            std::memcpy(&x1, xq + 4, 4);
            LLMSERVE_UNROLL
            for (int b = 0; b < NB; ++b)
              pairs[m][b] = simd::dot4_nibbles(simd::dot4_nibbles(pairs[m][b], ulo[b], x0),
                                               uhi[b], x1);
          }
          if (((c + 1) * 2) % L::kStepsPerWiden == 0)
            LLMSERVE_UNROLL
            for (int m = 0; m < MT; ++m)
              LLMSERVE_UNROLL
              for (int b = 0; b < NB; ++b) {
                sum[m][b] = sum[m][b] + simd::widen_pairs(pairs[m][b]);
                pairs[m][b] = simd::zero_pairs();
              }
        }
      }
      LLMSERVE_UNROLL
      for (int b = 0; b < NB; ++b) {
        const uint8_t* rec = w + (nb0 + b) * block_bytes + g * L::kRecord;
        const F16 d = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kD + 32 * s));
        F16 mins = simd::zero();
        if constexpr (L::kLegacyMin)
          mins = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kM + 32 * s));
        LLMSERVE_UNROLL
        for (int m = 0; m < MT; ++m) {
          const int32_t* qs = sums16 + ((m0 + m) * G + g) * (kSuper / 16) + 2 * s;
          const int32_t qsum = qs[0] + qs[1];
          const float xs = xscale[(m0 + m) * G + g];
          I16 dot = sum[m][b];
          constexpr int kOffset = kType == kQ8_0 ? kSignedBias : L::kOffset;
          if constexpr (kOffset != 0) dot = dot - simd::set1_i(kOffset * qsum);
          acc[m][b] = simd::fmadd(simd::to_float(dot), d * simd::set1(xs), acc[m][b]);
          if constexpr (L::kLegacyMin)
            acc[m][b] = simd::fmadd(mins, simd::set1(static_cast<float>(qsum) * xs), acc[m][b]);
        }
      }
    }
  }
  store_tile<MT, NB>(acc, m0, nb0, N, bias, y);
}

template <int kType, bool kStream>
struct KQTiles {
  const int8_t* q;
  const float* xscale;
  const int32_t* sums16;
  int64_t K;
  const uint8_t* w;
  int64_t N;
  const float* bias;
  float* y;
  template <int MT, int NB>
  void run(int64_t m, int64_t b) const {
    if constexpr (Layout<kType>::kLegacy)
      legacy_tile<kType, MT, NB, kStream>(q, xscale, sums16, m, K, w, b, N, bias, y);
    else
      kq_tile<kType, MT, NB, kStream>(q, xscale, sums16, m, K, w, b, N, bias, y);
  }
};

template <int kType>
void kq_gemm(const int8_t* q, const float* xscale, const int32_t* sums16, int64_t M,
             int64_t K, const uint8_t* w, const float* bias, int64_t N, float* y) {
  // rows in tiles of 16 on AMX where it is enabled, the rest (or all) here: the same bits
  if (const int64_t done = amx_gemm(kType, q, xscale, sums16, M, K, w, bias, N, y)) {
    const int64_t G = K / kSuper;
    q += done * K, xscale += done * G, sums16 += done * G * (kSuper / 16), y += done * N;
    if ((M -= done) == 0) return;
  }
  // rows in blocks whose int8 rows stay in L2 while a thread's weight records stream past
  const int64_t row_block = std::max<int64_t>(kQ4Rows, (256 * 1024 / K) / kQ4Rows * kQ4Rows);
  run_gemm<kQ4Rows, kQ4Wide>(KQTiles<kType, true>{q, xscale, sums16, K, w, N, bias, y},
                             KQTiles<kType, false>{q, xscale, sums16, K, w, N, bias, y}, M, N,
                             row_block);
}

inline uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One GGUF block run of 256 weights -> codes u, per sub-block sc and m (m: Q4_K, Q5_K),
// d and dmin as fp16 bits (the K-quants), or per block of 32 d and m as fp16 bits (the
// legacy types: 8 GGUF blocks), as llama.cpp's ggml-quants.c lays them out.
struct Unpacked {
  uint8_t u[kSuper];
  int8_t sc[16];
  uint8_t m[8];
  uint16_t d, dmin;
  uint16_t d32[8], m32[8];
};

void unpack_legacy(int32_t type, const uint8_t* blk, Unpacked& out) {
  for (int s = 0; s < 8; ++s) {
    uint8_t* u = out.u + 32 * s;
    if (type == kQ8_0) {  // d, qs[32] (int8)
      const uint8_t* b = blk + 34 * s;
      out.d32[s] = read_u16(b);
      for (int l = 0; l < 32; ++l)  // -128, which ggml never writes, as -127
        u[l] = static_cast<uint8_t>(std::max<int>(static_cast<int8_t>(b[2 + l]), -127));
      continue;
    }
    // Q4_0: d, qs[16]; Q4_1: d, m, qs[16]; Q5_0: d, qh[4], qs[16]; Q5_1: d, m, qh[4], qs[16]
    const bool has_min = type == kQ4_1 || type == kQ5_1, five = type == kQ5_0 || type == kQ5_1;
    const int size = 18 + (has_min ? 2 : 0) + (five ? 4 : 0);
    const uint8_t* b = blk + size * s;
    out.d32[s] = read_u16(b);
    out.m32[s] = has_min ? read_u16(b + 2) : 0;
    uint32_t qh = 0;
    if (five) std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
    const uint8_t* qs = b + size - 16;
    for (int l = 0; l < 16; ++l) {
      u[l] = static_cast<uint8_t>((qs[l] & 0xF) | ((qh >> l) & 1) << 4);
      u[l + 16] = static_cast<uint8_t>((qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4);
    }
  }
}

void unpack_block(int32_t type, const uint8_t* blk, Unpacked& out) {
  if (type >= kQ4_0 && type <= kQ8_0) {
    unpack_legacy(type, blk, out);
    return;
  }
  if (type == kIQ4XS) {  // d, scales_h (u16), scales_l[4], qs[128]
    out.d = read_u16(blk);
    out.dmin = 0;
    const uint16_t high = read_u16(blk + 2);
    for (int s = 0; s < 8; ++s) {
      const int ls = ((blk[4 + s / 2] >> (4 * (s % 2))) & 0xF) | ((high >> (2 * s)) & 3) << 4;
      out.sc[s] = static_cast<int8_t>(ls - 32);
      for (int j = 0; j < 16; ++j) {
        out.u[32 * s + j] = blk[8 + 16 * s + j] & 0xF;
        out.u[32 * s + 16 + j] = blk[8 + 16 * s + j] >> 4;
      }
    }
    return;
  }
  if (type == kQ3K) {  // hmask[32], qs[64], scales[12] (16 6-bit, packed), d
    const uint8_t *hm = blk, *qs = blk + 32, *p = blk + 96;
    for (int j = 0; j < 16; ++j) {  // scale j: low 4 bits, then 2 high bits (ggml's aux)
      const int low = j < 8 ? p[j] & 0xF : p[j - 8] >> 4;
      const int high = (p[8 + j % 4] >> (2 * (j / 4))) & 3;
      out.sc[j] = static_cast<int8_t>((low | high << 4) - 32);
    }
    for (int h = 0; h < 2; ++h)  // 128 k each: 4 shifts x 32 of qs, high bit m = 1 << (4h + j)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l)
          out.u[128 * h + 32 * j + l] = static_cast<uint8_t>(
              ((qs[32 * h + l] >> (2 * j)) & 3) | ((hm[l] >> (4 * h + j)) & 1) << 2);
    out.d = read_u16(blk + 108);
    out.dmin = 0;
    return;
  }
  if (type == kQ6K) {  // ql[128], qh[64], scales[16] (int8), d
    const uint8_t *ql = blk, *qh = blk + 128;
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t* a = ql + 64 * h;
        const uint8_t hb = qh[32 * h + l];
        uint8_t* u = out.u + 128 * h;
        u[l] = static_cast<uint8_t>((a[l] & 0xF) | (hb & 3) << 4);
        u[l + 32] = static_cast<uint8_t>((a[l + 32] & 0xF) | ((hb >> 2) & 3) << 4);
        u[l + 64] = static_cast<uint8_t>((a[l] >> 4) | ((hb >> 4) & 3) << 4);
        u[l + 96] = static_cast<uint8_t>((a[l + 32] >> 4) | ((hb >> 6) & 3) << 4);
      }
    std::memcpy(out.sc, blk + 192, 16);
    out.d = read_u16(blk + 208);
    out.dmin = 0;
    return;
  }
  // Q4_K: d, dmin, scales[12], qs[128]; Q5_K: d, dmin, scales[12], qh[32], qs[128]
  out.d = read_u16(blk);
  out.dmin = read_u16(blk + 2);
  const uint8_t* s = blk + 4;
  for (int j = 0; j < 8; ++j) {  // 6-bit scales and mins (get_scale_min_k4)
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | (s[j - 4] >> 6) << 4;
    const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    out.sc[j] = static_cast<int8_t>(sc);
    out.m[j] = static_cast<uint8_t>(mn);
  }
  const uint8_t* qh = type == kQ5K ? blk + 16 : nullptr;
  const uint8_t* qs = blk + (type == kQ5K ? 48 : 16);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      const int lo_bit = qh ? (qh[l] >> (2 * c)) & 1 : 0;
      const int hi_bit = qh ? (qh[l] >> (2 * c + 1)) & 1 : 0;
      out.u[64 * c + l] = static_cast<uint8_t>((qs[32 * c + l] & 0xF) | lo_bit << 4);
      out.u[64 * c + 32 + l] = static_cast<uint8_t>((qs[32 * c + l] >> 4) | hi_bit << 4);
    }
}

// Bytes of the GGUF blocks of one type that hold 256 weights of a row.
int64_t gguf_block_bytes(int32_t type) {
  switch (type) {
    case kQ4K: return 144;
    case kQ5K: return 176;
    case kQ6K: return 210;
    case kQ3K: return 110;
    case kIQ4XS: return 136;
    case kQ4_0: return 8 * 18;
    case kQ4_1: return 8 * 20;
    case kQ5_0: return 8 * 22;
    case kQ5_1: return 8 * 24;
    default: return 8 * 34;
  }
}

template <int kType>
void write_record(const Unpacked& v, int c, uint8_t* rec) {
  using L = Layout<kType>;
  if constexpr (kType == kQ8_0) {
    for (int k = 0; k < kSuper; ++k) rec[64 * (k / 4) + 4 * c + k % 4] = v.u[k];
  } else {
    for (int j = 0; j < 32; ++j)
      for (int i = 0; i < 4; ++i)
        rec[64 * j + 4 * c + i] =
            static_cast<uint8_t>((v.u[8 * j + i] & 0xF) | (v.u[8 * j + 4 + i] & 0xF) << 4);
  }
  if constexpr (L::kFive) {
    for (int s = 0; s < 8; ++s)
      for (int i = 0; i < 4; ++i) {
        uint8_t bits = 0;
        for (int p = 0; p < 4; ++p) {
          const int j = 4 * s + p;
          bits |= static_cast<uint8_t>(((v.u[8 * j + i] >> 4) & 1) << (2 * p) |
                                       ((v.u[8 * j + 4 + i] >> 4) & 1) << (2 * p + 1));
        }
        rec[kNibbleBytes + 64 * s + 4 * c + i] = bits;
      }
  } else if constexpr (kType == kQ6K) {
    for (int s = 0; s < 16; ++s)
      for (int i = 0; i < 4; ++i) {
        const int j0 = 2 * s, j1 = 2 * s + 1;
        rec[kNibbleBytes + 64 * s + 4 * c + i] = static_cast<uint8_t>(
            (v.u[8 * j0 + i] >> 4) | (v.u[8 * j0 + 4 + i] >> 4) << 2 |
            (v.u[8 * j1 + i] >> 4) << 4 | (v.u[8 * j1 + 4 + i] >> 4) << 6);
      }
  }
  if constexpr (L::kLegacy) {
    for (int s = 0; s < L::kSubs; ++s) {
      std::memcpy(rec + L::kD + 32 * s + 2 * c, &v.d32[s], 2);
      if constexpr (L::kLegacyMin) std::memcpy(rec + L::kM + 32 * s + 2 * c, &v.m32[s], 2);
    }
  } else {
    for (int s = 0; s < L::kSubs; ++s) {
      rec[L::kScales + 16 * s + c] = static_cast<uint8_t>(v.sc[s]);
      if constexpr (!L::kNoMins) rec[L::kMins + 16 * s + c] = v.m[s];
    }
    std::memcpy(rec + L::kHalves + 2 * c, &v.d, 2);
    if constexpr (!L::kNoMins) std::memcpy(rec + L::kHalves + 32 + 2 * c, &v.dmin, 2);
  }
}

// The code u of weight k of channel c in a packed record.
template <int kType>
int record_code(const uint8_t* rec, int c, int k) {
  if constexpr (kType == kQ8_0) return static_cast<int8_t>(rec[64 * (k / 4) + 4 * c + k % 4]);
  const int j = k / 8, b = k % 8;
  const uint8_t byte = rec[64 * j + 4 * c + b % 4];
  int u = b < 4 ? byte & 0xF : byte >> 4;
  if constexpr (Layout<kType>::kFive) {
    const uint8_t h = rec[kNibbleBytes + 64 * (j / 4) + 4 * c + b % 4];
    u |= ((h >> (2 * (j % 4) + (b >= 4))) & 1) << 4;
  } else if constexpr (kType == kQ6K) {
    const uint8_t h = rec[kNibbleBytes + 64 * (j / 2) + 4 * c + b % 4];
    u |= ((h >> (4 * (j % 2) + 2 * (b >= 4))) & 3) << 4;
  }
  return u;
}

// One channel's 256 k of a packed record -> floats, as llama.cpp dequantizes:
// (d * sc) * u - (dmin * m) and (d * sc) * (u - 32) for the K-quants, d * (u - o) and
// d * u + m for the legacy types.
template <int kType>
void dequantize_record(const uint8_t* rec, int c, float* out) {
  using L = Layout<kType>;
  for (int k = 0; k < kSuper; ++k) {
    const int u = record_code<kType>(rec, c, k), s = k / L::kSubK;
    if constexpr (L::kLegacy) {
      const float d = simd::half_bits_to_float(read_u16(rec + L::kD + 32 * s + 2 * c));
      if constexpr (L::kLegacyMin)
        out[k] = d * static_cast<float>(u) +
                 simd::half_bits_to_float(read_u16(rec + L::kM + 32 * s + 2 * c));
      else
        out[k] = d * static_cast<float>(u - L::kOffset);
      continue;
    }
    const float d = simd::half_bits_to_float(read_u16(rec + L::kHalves + 2 * c));
    const float sc = static_cast<float>(static_cast<int8_t>(rec[L::kScales + 16 * s + c]));
    if constexpr (kType == kIQ4XS) {
      out[k] = (d * sc) * static_cast<float>(kIQ4Levels[u]);
    } else if constexpr (L::kSigned) {
      out[k] = (d * sc) * static_cast<float>(u - L::kCodeOffset);
    } else {
      const float dmin = simd::half_bits_to_float(read_u16(rec + L::kHalves + 32 + 2 * c));
      const float m = static_cast<float>(rec[L::kMins + 16 * s + c]);
      out[k] = (d * sc) * static_cast<float>(u) - dmin * m;
    }
  }
}

}  // namespace

extern "C" {

// Bytes of one record (16 channels x 256 k) of a packed weight of `type` (KQuantType).
int64_t llmserve_kquant_record_bytes(int32_t type) { return record_bytes(type); }

// Packs a GGUF tensor (N rows of K / 256 runs of blocks of `type`, a KQuantType) into the
// records the tiles read: (N_pad / 16, K / 256, record) bytes, padding channels zero.
void llmserve_pack_kquant(const uint8_t* blocks, int32_t type, int64_t N, int64_t K,
                          uint8_t* packed) {
  const int64_t G = K / kSuper, Np = round_up(N, kBlockN), rec = record_bytes(type);
  std::memset(packed, 0, (Np / kBlockN) * G * rec);
  with_type(type, [&](auto t) {
    constexpr int kType = decltype(t)::value;
    parallel_for(0, Np / kBlockN, 1, [&](int64_t nb, int64_t ne) {
      Unpacked v;
      for (int64_t block = nb; block < ne; ++block)
        for (int64_t n = block * kBlockN; n < std::min(N, (block + 1) * kBlockN); ++n)
          for (int64_t g = 0; g < G; ++g) {
            unpack_block(kType, blocks + (n * G + g) * gguf_block_bytes(kType), v);
            write_record<kType>(v, static_cast<int>(n % kBlockN),
                                packed + (block * G + g) * rec);
          }
    });
  });
}

// out (T, K) = rows ids[t] of a packed weight with N rows, dequantized (a tied embedding's
// lookup). Returns 1, writing nothing, if an id is outside [0, N).
int32_t llmserve_kquant_rows(const uint8_t* packed, int32_t type, int64_t N, int64_t K,
                             const int64_t* ids, int64_t T, float* out) {
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= N) return 1;
  const int64_t G = K / kSuper, rec = record_bytes(type);
  with_type(type, [&](auto tt) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = ids[t];
      for (int64_t g = 0; g < G; ++g)
        dequantize_record<decltype(tt)::value>(packed + ((n / kBlockN) * G + g) * rec,
                                               static_cast<int>(n % kBlockN),
                                               out + t * K + g * kSuper);
    }
  });
  return 0;
}

// y (M, N) = W . x (M, K) [+ bias], K a multiple of 256, W the rows of `w`'s segments in
// order (a fused projection whose parts the file stores in different types: Q4_K q and k,
// Q6_K v). `workspace` holds M * K bytes (the rows' int8 values) plus M * K / 256 floats
// (their scales) and M * K / 16 int32 (their sums per 16 k): M * K * 1.27 bytes; the rows
// are quantized once for every segment.
void llmserve_kquant_linear(const float* x, int64_t M, int64_t K, const KQuantWeight* w,
                            const float* bias, float* y, uint8_t* workspace) {
  const int64_t G = K / kSuper, N = w->out_features;
  int8_t* q = reinterpret_cast<int8_t*>(workspace);
  float* xscale = reinterpret_cast<float*>(workspace + M * K);
  int32_t* sums16 = reinterpret_cast<int32_t*>(xscale + M * G);
  parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row_super(x + m * K, K, q + m * K, xscale + m * G, sums16 + m * G * 16);
  });
  std::vector<float> part;  // a segment's outputs where it is not the whole weight
  int64_t n0 = 0;
  for (int64_t i = 0; i < w->num_segments; ++i) {
    const KQuantSegment& seg = w->segments[i];
    const bool whole = w->num_segments == 1;
    if (!whole) part.resize(M * seg.rows);
    float* out = whole ? y : part.data();
    const float* b = bias ? bias + n0 : nullptr;
    with_type(seg.type, [&](auto t) {
      kq_gemm<decltype(t)::value>(q, xscale, sums16, M, K, seg.packed, b, seg.rows, out);
    });
    if (!whole)
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(y + m * N + n0, out + m * seg.rows, seg.rows * sizeof(float));
    n0 += seg.rows;
  }
}

}  // extern "C"
