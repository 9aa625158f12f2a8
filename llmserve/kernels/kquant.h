// The GGUF block formats the K-quant GEMMs read, as packed records: their constants, the
// record layout per type, and the codes of one chunk of a record (gemm_kquant.cpp's tiles
// on simd.h, gemm_kquant_amx.cpp's AMX tiles).
//
// The types: the K-quants (Q4_K, Q5_K, Q6_K, Q3_K, IQ4_XS, as llama.cpp's k-quants write
// them) and the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
//
// A K-quant row is cut into super-blocks of 256 k, each into sub-blocks (8 of 32 k for Q4_K
// and Q5_K, 16 of 16 k for Q6_K) with an integer scale sc and (Q4_K, Q5_K) an integer
// min m per sub-block, and fp16 d and dmin per super-block:
//   Q4_K, Q5_K:  w = d * sc * u - dmin * m       codes u in [0, 15] / [0, 31], sc, m in [0, 63]
//   Q6_K:        w = d * sc * (u - 32)           codes u in [0, 63], sc in [-128, 127]
//   Q3_K:        w = d * sc * (u - 4)            codes u in [0, 7], sc in [-32, 31]
//   IQ4_XS:      w = d * sc * v[u]               codes u in [0, 15], sc in [-32, 31], v
//                                                llama.cpp's 16 non-linear int8 levels
// (Q6_K and Q3_K have 16 sub-blocks of 16 k.) A legacy row is cut into blocks of 32 k,
// each with an fp16 scale d and (Q4_1, Q5_1) an fp16 min m:
//   Q4_0, Q5_0:  w = d * (u - o)                 u in [0, 15] / [0, 31], o = 8 / 16
//   Q4_1, Q5_1:  w = d * u + m
//   Q8_0:        w = d * v                       v the file's int8 value, in [-127, 127]
// Activations are quantized per row and super-block of 256 k to int8 with one scale s
// (llama.cpp's Q8_K): x ~ q * s, with the sums of q over each 16 k. Then per row and
// channel, with exact integer sums:
//   Q4_K, Q5_K, per super-block: A = sum over sub-blocks of sc * (u . q),
//                                B = sum over sub-blocks of m * (sum of q),
//                                y += (d * s) * A  -  (dmin * s) * B
//   Q6_K, Q3_K, IQ4_XS:          A = sum over sub-blocks of sc * (u . q - 32 / 4 * (sum
//                                of q)) (IQ4_XS: sc * (v[u] . q)), y += (d * s) * A
//   legacy, per block of 32:    y += (d * s) * (u . q - o * (sum of q))  [+ m * s * (sum of q)]
//                               (Q8_0: y += (d * s) * (v . q))
// The float epilogue runs over the blocks in order whatever the batch, so a row's result
// does not depend on the other rows (nor on the level: integer sums are exact).
//
// Packed weights: for each block of 16 channels, one record per 256 k, the file's own bits
// re-laid for 16-channel dot products (a decode reads 4.6 / 5.6 / 6.6 bits a weight for
// the K-quants, as many as the file for the legacy types: 4.5 / 5 / 5.5 / 6 / 8.5):
//   codes   32 chunks of 64 bytes: chunk j, lane c, byte b holds the low 4 bits of
//           k = 8j + b (low nibble) and k = 8j + 4 + b (high nibble), as gemm_q4.cpp's;
//           Q8_0: 64 chunks of 64 bytes, chunk j, lane c, byte b holds v of k = 4j + b
//   high    Q5_K, Q5_0, Q5_1: 8 x 64 bytes, vector s (sub-block s = chunks 4s .. 4s + 3):
//           bits 2p and 2p + 1 of byte (c, b) are bit 4 of chunk 4s + p's low and high code;
//           Q6_K: 16 x 64 bytes, vector s (chunks 2s, 2s + 1): bits 0-1, 2-3 are bits 4-5
//           of chunk 2s's low and high code, bits 4-5, 6-7 those of chunk 2s + 1
//           (Q3_K's 3-bit codes fit the nibbles: 4.6 bits a weight read, the file's 3.4)
//   K-quants: scales  one byte per (sub-block, channel): sc (int8)
//             mins    Q4_K, Q5_K: one byte per (sub-block, channel): m
//             d       16 fp16, then dmin: 16 fp16 (Q4_K, Q5_K)
//   legacy:   d       8 x 16 fp16: block s's d per channel, then m likewise (Q4_1, Q5_1)

#pragma once

#include "gemm.h"

#include <type_traits>

namespace llmserve::kquant {

using simd::F16;
using simd::I16;

constexpr int64_t kSuper = 256;
// IQ4_XS's (and IQ4_NL's) 16 levels (llama.cpp's kvalues_iq4nl)
constexpr int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

// Signed weight bytes (Q8_0's values, IQ4_XS's levels) times signed activations. Where one
// instruction multiplies unsigned bytes by signed ones (VNNI), a weight w is taken as the
// unsigned byte w + 128 and 128 * (the sum of q) is taken off per block: one instruction a
// step for the six of the signed product (Q8_0 at batch 32 on the 1B shape, avx512+vnni:
// 276 G int ops/s before, 36 % of the dot-product peak). The integer sums are the same.
#if defined(LLMSERVE_SIMD_U8S8_DOT)
constexpr int kSignedBias = 128;
inline simd::B64 biased(simd::B64 w) { return simd::plus128(w); }
inline I16 dot4_biased(I16 acc, simd::B64 w, int32_t x4) {
  return simd::dot4_u8_lanes(acc, w, x4);
}
#else
constexpr int kSignedBias = 0;
inline simd::B64 biased(simd::B64 w) { return w; }
inline I16 dot4_biased(I16 acc, simd::B64 w, int32_t x4) { return simd::dot4_s8s8(acc, w, x4); }
#endif

struct Table16 {
  int8_t v[16];
};
// IQ4_XS's levels as the weight bytes dot4_biased takes
constexpr Table16 iq4_codes() {
  Table16 t{};
  for (int i = 0; i < 16; ++i)
    t.v[i] = static_cast<int8_t>(static_cast<uint8_t>(kIQ4Levels[i] + kSignedBias));
  return t;
}
alignas(16) constexpr Table16 kIQ4Codes = iq4_codes();

template <int kType>
struct Layout {
  static constexpr bool kLegacy = kType >= kQ4_0 && kType <= kQ8_0;
  static constexpr bool kFive = kType == kQ5K || kType == kQ5_0 || kType == kQ5_1;
  static constexpr bool kLegacyMin = kType == kQ4_1 || kType == kQ5_1;
  // Q6_K and Q3_K: 16-k sub-blocks, signed scales, w = d * sc * (u - offset)
  static constexpr bool kSigned = kType == kQ6K || kType == kQ3K;
  static constexpr int kCodeOffset = kType == kQ6K ? 32 : 4;
  static constexpr int kSubK = kSigned ? 16 : 32;
  static constexpr int kSubs = kSuper / kSubK;
  static constexpr int kCodeBytes = kType == kQ8_0 ? 4096 : 2048;
  static constexpr int kHighBytes = kFive ? 512 : kType == kQ6K ? 1024 : 0;
  // K-quants: sub-block scales, mins, fp16 d (and dmin)
  static constexpr int kScales = kCodeBytes + kHighBytes;
  static constexpr int kMins = kScales + kSubs * 16;
  static constexpr bool kNoMins = kSigned || kType == kIQ4XS;
  static constexpr int kHalves = kMins + (kNoMins ? 0 : kSubs * 16);
  // legacy: fp16 d per block and channel, then m
  static constexpr int kD = kCodeBytes + kHighBytes;
  static constexpr int kM = kD + kSubs * 32;
  static constexpr int kRecord = kLegacy ? kM + (kLegacyMin ? kSubs * 32 : 0)
                                         : kHalves + (kNoMins ? 32 : 64);
  static constexpr int kOffset = kType == kQ4_0 ? 8 : kType == kQ5_0 ? 16 : 0;
#if defined(LLMSERVE_SIMD_PAIR_SUMS)
  // dot4 steps (4 k each) whose int16 pair sums stay below 2^15 before widening:
  // 2 * (2^bits - 1) * 127 per step (maddubs' pairs; Q8_0 sums in int32 at once)
  static constexpr int kStepsPerWiden = kType == kQ6K ? 2 : kType == kQ3K ? 4 : kFive ? 4 : 8;
#else
  static constexpr int kStepsPerWiden = kSubK / 4;  // int32 sums: once a sub-block
#endif
};

// f(std::integral_constant<int, type>{}) for a runtime type id
template <typename F>
inline auto with_type(int32_t type, F&& f) {
  switch (type) {
    case kQ4K: return f(std::integral_constant<int, kQ4K>{});
    case kQ5K: return f(std::integral_constant<int, kQ5K>{});
    case kQ6K: return f(std::integral_constant<int, kQ6K>{});
    case kQ3K: return f(std::integral_constant<int, kQ3K>{});
    case kIQ4XS: return f(std::integral_constant<int, kIQ4XS>{});
    case kQ4_0: return f(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int, kQ5_1>{});
    default: return f(std::integral_constant<int, kQ8_0>{});
  }
}

inline int64_t record_bytes(int32_t type) {
  return with_type(type, [](auto t) -> int64_t { return Layout<decltype(t)::value>::kRecord; });
}

constexpr int64_t kNibbleBytes = 2048;  // the 4-bit codes of a record

// The codes of chunk j (k = 8j .. 8j + 7) of one super-block record of a 4-, 5- or 6-bit
// type: `lo` holds k = 8j + b, `hi` k = 8j + 4 + b, for lane c at bytes 4c + b.
template <int kType>
inline void chunk_codes(const uint8_t* rec, int j, simd::B64& lo, simd::B64& hi) {
  const simd::B64 v = simd::load_bytes(rec + 64 * j);
  lo = simd::low_nibbles(v);
  hi = simd::high_nibbles(v);
  if constexpr (Layout<kType>::kFive) {
    const simd::B64 h = simd::load_bytes(rec + kNibbleBytes + 64 * (j / 4));
    switch (j % 4) {  // bit 2p (low code) and 2p + 1 (high code) -> bit 4
      case 0: lo = lo | simd::shifted_bits<4>(h, 0x10); hi = hi | simd::shifted_bits<3>(h, 0x10); break;
      case 1: lo = lo | simd::shifted_bits<2>(h, 0x10); hi = hi | simd::shifted_bits<1>(h, 0x10); break;
      case 2: lo = lo | simd::shifted_bits<0>(h, 0x10); hi = hi | simd::shifted_bits<-1>(h, 0x10); break;
      default: lo = lo | simd::shifted_bits<-2>(h, 0x10); hi = hi | simd::shifted_bits<-3>(h, 0x10); break;
    }
  } else if constexpr (kType == kQ6K) {
    const simd::B64 h = simd::load_bytes(rec + kNibbleBytes + 64 * (j / 2));
    if (j % 2 == 0) {  // bits 0-1, 2-3 -> bits 4-5
      lo = lo | simd::shifted_bits<4>(h, 0x30);
      hi = hi | simd::shifted_bits<2>(h, 0x30);
    } else {  // bits 4-5, 6-7
      lo = lo | simd::shifted_bits<0>(h, 0x30);
      hi = hi | simd::shifted_bits<-2>(h, 0x30);
    }
  }
}

// Whether rows in tiles of 16 run on AMX (gemm_kquant_amx.cpp): the CPU has it, the kernel
// granted the tile state, and llmserve_set_amx did not turn it off.
bool amx_enabled();

// The first M / 16 * 16 rows of the GEMM on AMX tiles, bit for bit what the VNNI tiles
// give them; returns how many rows it did (0 where AMX is not enabled).
int64_t amx_gemm(int32_t type, const int8_t* q, const float* xscale, const int32_t* sums16,
                 int64_t M, int64_t K, const uint8_t* w, const float* bias, int64_t N,
                 float* y);

}  // namespace llmserve::kquant
