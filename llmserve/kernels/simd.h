// 16-lane SIMD values for llmserve's kernels, one implementation per instruction-set level.
//
// Why this shape: every kernel works on blocks of 16 output channels (the packed weight
// layouts) or chunks of 16 floats, so the kernels are written once against 16-lane values
// (F16 floats, I16 int32s, B64 bytes) and each level maps a value onto its own registers:
//   avx512   one zmm                    (x86-64-v4: AVX-512 F/BW/DQ/VL; VNNI where present)
//   avx2     two ymm                    (x86-64-v3: AVX2, FMA, F16C; AVX-VNNI where present)
//   neon     four 128-bit q registers   (aarch64: NEON; dotprod where present)
//   generic  plain arrays with loops    (any C++17 compiler; what the compiler vectorises)
// The level is the build's -DLLMSERVE_LEVEL_* define, beside the -march flags that let the
// compiler emit its instructions (both from build.py's BUILDS, the one table of levels; the
// loader picks a build by LLMSERVE_CPU_ISA), not a run-time branch. Lane-wise arithmetic (fused
// multiply-add, IEEE division, rounding to nearest even, power-of-two scaling) is the same at
// every level, and the one horizontal float sum below has a fixed tree, so a kernel built
// only from these gives the same bits at every level (but generic on an x86 CPU without FMA,
// see there); integer dot products are exact everywhere.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(LLMSERVE_LEVEL_GENERIC)
#define LLMSERVE_SIMD_GENERIC 1
#elif defined(LLMSERVE_LEVEL_AVX512)
#define LLMSERVE_SIMD_AVX512 1
#include <immintrin.h>
#elif defined(LLMSERVE_LEVEL_AVX2)
#define LLMSERVE_SIMD_AVX2 1
#include <immintrin.h>
#elif defined(LLMSERVE_LEVEL_NEON)
#define LLMSERVE_SIMD_NEON 1
#include <arm_neon.h>
#else
#error "build with one level's flags from llmserve/kernels/build.py (BUILDS)"
#endif

// int8 dot products of unsigned activations (value + 128) by signed weights in one
// instruction: AVX-512 VNNI or AVX-VNNI. Elsewhere activations stay signed.
#if (defined(LLMSERVE_SIMD_AVX512) && defined(__AVX512VNNI__)) || \
    (defined(LLMSERVE_SIMD_AVX2) && defined(__AVXVNNI__))
#define LLMSERVE_SIMD_U8S8_DOT 1
#endif

namespace simd {

// An IEEE half's bits as a float (exact; subnormals, infinities and NaNs included).
inline float half_bits_to_float(uint16_t h) {
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

// The level's name, as LLMSERVE_CPU_ISA spells it (with its int8 dot-product extension).
#define LLMSERVE_STRINGIFY_(x) #x
#define LLMSERVE_STRINGIFY(x) LLMSERVE_STRINGIFY_(x)
#if !defined(LLMSERVE_BUILD_NAME)
#error "build with a build's flags from llmserve/kernels/build.py (Build.compiler_flags)"
#endif
inline const char* level_name() { return LLMSERVE_STRINGIFY(LLMSERVE_BUILD_NAME); }

// Put before each loop over a tile's arrays of registers (its rows, its blocks of channels):
// the loop unrolled in full, so that the arrays are registers. GCC 12 at -O2 left the loops
// of 3 or more rows as loops, their accumulators in memory, each multiply-add a load and a
// store (an avx2 float32 tile on one core, weights in L2: 4 rows 4.8 -> 1.4 ns per k and
// block of 16, 1 row 0.8; the same bits, the same operations in the same order). Not at
// the generic level, whose 16-lane values are arrays in memory anyway: unrolled there,
// its largest file (gemm_kquant.cpp, -O3) took 84-92 s to compile instead of 48-56.
#if defined(LLMSERVE_SIMD_GENERIC)
#define LLMSERVE_UNROLL
#else
#define LLMSERVE_UNROLL _Pragma("GCC unroll 16")
#endif

// The prefetches below each end with an empty asm statement the compiler must keep: GCC 12
// takes a function that only prefetches for one without effects and drops its calls (a
// loop of prefetches inlined from a helper compiled to nothing; the decode's far prefetch,
// gemm_kquant.cpp, was not in the library until this).
inline void keep_prefetch(const void* p) { asm volatile("" : : "r"(p)); }
// Prefetches one cache line for reading; `kStream`: non-temporal (a single pass).
template <bool kStream>
inline void prefetch(const void* p) {
  __builtin_prefetch(p, 0, kStream ? 0 : 3);
  keep_prefetch(p);
}
// Prefetches one cache line for reading into L2 (not L1).
inline void prefetch_l2(const void* p) {
  __builtin_prefetch(p, 0, 1);
  keep_prefetch(p);
}

#if defined(LLMSERVE_SIMD_AVX512)
// ---- avx512 ---------------------------------------------------------------------------------
struct F16 { __m512 v; };
struct I16 { __m512i v; };
struct M16 { __mmask16 m; };
struct B64 { __m512i v; };

inline F16 zero() { return {_mm512_setzero_ps()}; }
inline F16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline F16 load_first(const float* p, int64_t n) {
  return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p)};
}
inline void store_first(float* p, F16 a, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), a.v);
}
inline F16 operator+(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 operator-(F16 a, F16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F16 operator*(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 operator/(F16 a, F16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 fnmadd(F16 a, F16 b, F16 c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline F16 max(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F16 min(F16 a, F16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline F16 abs(F16 a) { return {_mm512_abs_ps(a.v)}; }
inline F16 round_even(F16 a) {
  return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// a * 2^k for integral k in [-126, 128]
inline F16 scale_pow2(F16 a, F16 k) { return {_mm512_scalef_ps(a.v, k.v)}; }
inline float reduce_max(F16 a) { return _mm512_reduce_max_ps(a.v); }
inline I16 to_int(F16 a) { return {_mm512_cvtps_epi32(a.v)}; }  // nearest even
inline F16 to_float(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline F16 load_half(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline M16 greater(F16 a, F16 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }
inline M16 is_nan(F16 a) { return {_mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q)}; }
inline M16 operator|(M16 a, M16 b) { return {static_cast<__mmask16>(a.m | b.m)}; }
inline bool any(M16 a) { return a.m != 0; }
inline M16 mask_bits(uint32_t bits) { return {static_cast<__mmask16>(bits & 0xFFFF)}; }
inline F16 select(M16 m, F16 a, F16 b) { return {_mm512_mask_blend_ps(m.m, b.v, a.v)}; }
inline I16 select(M16 m, I16 a, I16 b) { return {_mm512_mask_blend_epi32(m.m, b.v, a.v)}; }

inline I16 zero_i() { return {_mm512_setzero_si512()}; }
inline I16 set1_i(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline I16 load_i(const int32_t* p) { return {_mm512_loadu_si512(p)}; }
inline void store_i(int32_t* p, I16 a) { _mm512_storeu_si512(p, a.v); }
inline I16 iota() {
  return {_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)};
}
inline I16 operator+(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I16 operator-(I16 a, I16 b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline I16 operator&(I16 a, I16 b) { return {_mm512_and_si512(a.v, b.v)}; }
template <int N> inline I16 shl(I16 a) { return {_mm512_slli_epi32(a.v, N)}; }
template <int N> inline I16 shr(I16 a) { return {_mm512_srli_epi32(a.v, N)}; }
inline int32_t reduce_add(I16 a) { return _mm512_reduce_add_epi32(a.v); }
inline F16 as_float(I16 a) { return {_mm512_castsi512_ps(a.v)}; }
inline I16 as_int(F16 a) { return {_mm512_castps_si512(a.v)}; }
inline I16 load_u16(const uint16_t* p) {
  return {_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline I16 load_s8(const int8_t* p) {
  return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
// lanes that fit the narrower type (no saturation needed)
inline void store_s8(int8_t* p, I16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v));
}
inline void store_u8(uint8_t* p, I16 a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v));
}
inline void store_u16(uint16_t* p, I16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a.v));
}

inline B64 load_bytes(const void* p) { return {_mm512_loadu_si512(p)}; }
inline B64 operator|(B64 a, B64 b) { return {_mm512_or_si512(a.v, b.v)}; }
template <int S> inline B64 shifted_bits(B64 a, uint8_t mask) {
  __m512i s;
  if constexpr (S >= 0) s = _mm512_slli_epi16(a.v, S); else s = _mm512_srli_epi16(a.v, -S);
  return {_mm512_and_si512(s, _mm512_set1_epi8(static_cast<char>(mask)))};
}
inline I16 mul_lo(I16 a, I16 b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline B64 low_nibbles(B64 a) { return {_mm512_and_si512(a.v, _mm512_set1_epi8(0x0F))}; }
inline B64 high_nibbles(B64 a) {
  return {_mm512_and_si512(_mm512_srli_epi16(a.v, 4), _mm512_set1_epi8(0x0F))};
}
inline B64 lookup16(B64 codes, const int8_t* table) {
  const __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
  return {_mm512_shuffle_epi8(t, codes.v)};
}
// acc[i] += sum_b u[4i + b] * x4[b]: u unsigned bytes <= 127, x4 four signed bytes
inline I16 dot4_u7s8(I16 acc, B64 u, int32_t x4) {
#if defined(__AVX512VNNI__)
  return {_mm512_dpbusd_epi32(acc.v, u.v, _mm512_set1_epi32(x4))};
#else
  const __m512i pairs = _mm512_maddubs_epi16(u.v, _mm512_set1_epi32(x4));
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
#endif
}
#if !defined(__AVX512VNNI__)
#define LLMSERVE_SIMD_PAIR_SUMS 1
struct P32 { __m512i v; };  // see the avx2 branch
inline P32 zero_pairs() { return {_mm512_setzero_si512()}; }
inline P32 dot4_nibbles(P32 acc, B64 u, int32_t x4) {
  return {_mm512_add_epi16(acc.v, _mm512_maddubs_epi16(u.v, _mm512_set1_epi32(x4)))};
}
inline I16 widen_pairs(P32 acc) { return {_mm512_madd_epi16(acc.v, _mm512_set1_epi16(1))}; }
#endif
// acc[i] += sum_b w[4i + b] * x4[b]: signed bytes in [-127, 127] both
inline I16 dot4_s8s8(I16 acc, B64 w, int32_t x4) {
  const __m512i x = _mm512_set1_epi32(x4);
  const __mmask64 negative = _mm512_movepi8_mask(w.v);  // x takes w's sign, |w| is unsigned
  const __m512i xs = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
  const __m512i pairs = _mm512_maddubs_epi16(_mm512_abs_epi8(w.v), xs);
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
#if defined(LLMSERVE_SIMD_U8S8_DOT)
// acc[i] += sum_b x4[b] * w[4i + b]: x4 four unsigned bytes, w signed
inline I16 dot4_u8s8(I16 acc, uint32_t x4, B64 w) {
  return {_mm512_dpbusd_epi32(acc.v, _mm512_set1_epi32(static_cast<int32_t>(x4)), w.v)};
}
// acc[i] += sum_b u[4i + b] * x4[b]: u any unsigned bytes, x4 four signed bytes
inline I16 dot4_u8_lanes(I16 acc, B64 u, int32_t x4) {
  return {_mm512_dpbusd_epi32(acc.v, u.v, _mm512_set1_epi32(x4))};
}
// signed bytes w -> the unsigned bytes w + 128
inline B64 plus128(B64 w) { return {_mm512_xor_si512(w.v, _mm512_set1_epi8(-128))}; }
#endif

// lane i + 8, then + 4, + 2, + 1: the one float sum tree of every level
inline float sum_tree(F16 a) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#elif defined(LLMSERVE_SIMD_AVX2)
// ---- avx2 -----------------------------------------------------------------------------------
struct F16 { __m256 lo, hi; };
struct I16 { __m256i lo, hi; };
struct M16 { __m256 lo, hi; };  // all-ones lanes where true
struct B64 { __m256i lo, hi; };

inline __m256 first_lanes(int64_t n) {  // all-ones in lanes < n of 8
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(
      _mm256_set1_epi32(static_cast<int32_t>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline F16 load_first(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, _mm256_castps_si256(first_lanes(n))),
          _mm256_maskload_ps(p + 8, _mm256_castps_si256(first_lanes(n - 8)))};
}
inline void store_first(float* p, F16 a, int64_t n) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(first_lanes(n)), a.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(first_lanes(n - 8)), a.hi);
}
#define LLMSERVE_F16_OP2(name, expr)                                                       \
  inline F16 name(F16 a, F16 b) {                                                          \
    auto f = [](__m256 x, __m256 y) { return expr; };                                      \
    return {f(a.lo, b.lo), f(a.hi, b.hi)};                                                 \
  }
LLMSERVE_F16_OP2(operator+, _mm256_add_ps(x, y))
LLMSERVE_F16_OP2(operator-, _mm256_sub_ps(x, y))
LLMSERVE_F16_OP2(operator*, _mm256_mul_ps(x, y))
LLMSERVE_F16_OP2(operator/, _mm256_div_ps(x, y))
LLMSERVE_F16_OP2(max, _mm256_max_ps(x, y))
LLMSERVE_F16_OP2(min, _mm256_min_ps(x, y))
#undef LLMSERVE_F16_OP2
inline F16 fmadd(F16 a, F16 b, F16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 fnmadd(F16 a, F16 b, F16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline F16 abs(F16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline F16 round_even(F16 a) {
  constexpr int r = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, r), _mm256_round_ps(a.hi, r)};
}
inline __m256 pow2_half(__m256i k) {  // 2^k for k in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}
// a * 2^k for integral k in [-126, 128], in two exact steps of at most 2^64 (the one rounding
// is the last step's, so the bits equal a single scaling's)
inline F16 scale_pow2(F16 a, F16 k) {
  auto half = [](__m256 x, __m256 kf) {
    const __m256i ki = _mm256_cvtps_epi32(kf);
    const __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    return _mm256_mul_ps(_mm256_mul_ps(x, pow2_half(k1)), pow2_half(k2));
  };
  return {half(a.lo, k.lo), half(a.hi, k.hi)};
}
inline float reduce_max(F16 a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
}
inline I16 to_int(F16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline F16 to_float(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline F16 load_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline M16 greater(F16 a, F16 b) {
  return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)};
}
inline M16 is_nan(F16 a) {
  return {_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q)};
}
inline M16 operator|(M16 a, M16 b) { return {_mm256_or_ps(a.lo, b.lo), _mm256_or_ps(a.hi, b.hi)}; }
inline bool any(M16 a) { return _mm256_movemask_ps(_mm256_or_ps(a.lo, a.hi)) != 0; }
inline M16 mask_bits(uint32_t bits) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  auto half = [&](uint32_t b) {
    const __m256i v = _mm256_and_si256(_mm256_set1_epi32(static_cast<int32_t>(b)), lane);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(v, lane));
  };
  return {half(bits & 0xFF), half((bits >> 8) & 0xFF)};
}
// m ? a : b
inline F16 select(M16 m, F16 a, F16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)};
}
inline I16 select(M16 m, I16 a, I16 b) {
  return {_mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(b.lo),
                                               _mm256_castsi256_ps(a.lo), m.lo)),
          _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(b.hi),
                                               _mm256_castsi256_ps(a.hi), m.hi))};
}

inline I16 zero_i() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 set1_i(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I16 load_i(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline void store_i(int32_t* p, I16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), a.hi);
}
inline I16 iota() {
  return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
          _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
}
inline I16 operator+(I16 a, I16 b) {
  return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
inline I16 operator-(I16 a, I16 b) {
  return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)};
}
inline I16 operator&(I16 a, I16 b) {
  return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)};
}
template <int N> inline I16 shl(I16 a) {
  return {_mm256_slli_epi32(a.lo, N), _mm256_slli_epi32(a.hi, N)};
}
template <int N> inline I16 shr(I16 a) {
  return {_mm256_srli_epi32(a.lo, N), _mm256_srli_epi32(a.hi, N)};
}
inline int32_t reduce_add(I16 a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}
inline F16 as_float(I16 a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
inline I16 as_int(F16 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
inline I16 load_u16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)),
          _mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1))};
}
inline I16 load_s8(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi8_epi32(v), _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))};
}
inline __m256i narrow16(I16 a) {  // 16 int16 lanes in order (values fit)
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);
}
inline void store_s8(int8_t* p, I16 a) {
  const __m256i w = narrow16(a);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
inline void store_u8(uint8_t* p, I16 a) {
  const __m256i w = narrow16(a);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
inline void store_u16(uint16_t* p, I16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_permute4x64_epi64(_mm256_packus_epi32(a.lo, a.hi), 0xD8));
}

inline B64 load_bytes(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline B64 operator|(B64 a, B64 b) {
  return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)};
}
template <int S> inline B64 shifted_bits(B64 a, uint8_t mask) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
  auto half = [&](__m256i v) {
    if constexpr (S >= 0) return _mm256_and_si256(_mm256_slli_epi16(v, S), m);
    else return _mm256_and_si256(_mm256_srli_epi16(v, -S), m);
  };
  return {half(a.lo), half(a.hi)};
}
inline I16 mul_lo(I16 a, I16 b) {
  return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)};
}
inline B64 low_nibbles(B64 a) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
inline B64 high_nibbles(B64 a) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(a.lo, 4), m),
          _mm256_and_si256(_mm256_srli_epi16(a.hi, 4), m)};
}
inline B64 lookup16(B64 codes, const int8_t* table) {
  const __m256i t = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
  return {_mm256_shuffle_epi8(t, codes.lo), _mm256_shuffle_epi8(t, codes.hi)};
}
inline I16 dot4_u7s8(I16 acc, B64 u, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
#if defined(__AVXVNNI__)
  return {_mm256_dpbusd_avx_epi32(acc.lo, u.lo, x), _mm256_dpbusd_avx_epi32(acc.hi, u.hi, x)};
#else
  // u <= 127 and |x| <= 128: a pair's sum fits int16, so vpmaddubsw cannot saturate
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(u.lo, x), one)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(u.hi, x), one))};
#endif
}
#if !defined(__AVXVNNI__)
// Sums of 4-bit codes times int8 kept in int16 pairs (vpmaddubsw + vpaddw: 2 instructions a
// step where int32 sums take 3), widened to int32 once per group (see dot4_nibbles).
#define LLMSERVE_SIMD_PAIR_SUMS 1
struct P32 { __m256i lo, hi; };
inline P32 zero_pairs() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline P32 dot4_nibbles(P32 acc, B64 u, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(u.lo, x)),
          _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(u.hi, x))};
}
inline I16 widen_pairs(P32 acc) {
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(acc.lo, one), _mm256_madd_epi16(acc.hi, one)};
}
#endif
inline I16 dot4_s8s8(I16 acc, B64 w, int32_t x4) {
  // |w| unsigned times x with w's sign: |products| <= 127 * 127, pairs fit int16
  const __m256i x = _mm256_set1_epi32(x4), one = _mm256_set1_epi16(1);
  auto half = [&](__m256i a, __m256i wv) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(x, wv));
    return _mm256_add_epi32(a, _mm256_madd_epi16(p, one));
  };
  return {half(acc.lo, w.lo), half(acc.hi, w.hi)};
}
#if defined(LLMSERVE_SIMD_U8S8_DOT)
inline I16 dot4_u8s8(I16 acc, uint32_t x4, B64 w) {
  const __m256i x = _mm256_set1_epi32(static_cast<int32_t>(x4));
  return {_mm256_dpbusd_avx_epi32(acc.lo, x, w.lo), _mm256_dpbusd_avx_epi32(acc.hi, x, w.hi)};
}
inline I16 dot4_u8_lanes(I16 acc, B64 u, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {_mm256_dpbusd_avx_epi32(acc.lo, u.lo, x), _mm256_dpbusd_avx_epi32(acc.hi, u.hi, x)};
}
inline B64 plus128(B64 w) {
  const __m256i bit = _mm256_set1_epi8(-128);
  return {_mm256_xor_si256(w.lo, bit), _mm256_xor_si256(w.hi, bit)};
}
#endif

inline float sum_tree(F16 a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

#elif defined(LLMSERVE_SIMD_NEON)
// ---- neon -----------------------------------------------------------------------------------
#include "simd_neon.h"

#else
// ---- generic --------------------------------------------------------------------------------
// Plain arrays and loops: what the compiler makes of them at the baseline instruction set
// (SSE2 on x86-64, NEON on aarch64). The same lane arithmetic as the vector levels, but for
// fused multiply-adds on a CPU without them (below).
struct F16 { float v[16]; };
struct I16 { int32_t v[16]; };
struct M16 { bool v[16]; };
struct B64 { uint8_t v[64]; };

#define LLMSERVE_LANES(i) for (int i = 0; i < 16; ++i)
inline F16 zero() { return F16{}; }
inline F16 set1(float x) { F16 r; LLMSERVE_LANES(i) r.v[i] = x; return r; }
inline F16 load(const float* p) { F16 r; std::memcpy(r.v, p, 64); return r; }
inline void store(float* p, F16 a) { std::memcpy(p, a.v, 64); }
inline F16 load_first(const float* p, int64_t n) {
  F16 r{};
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) r.v[i] = p[i];
  return r;
}
inline void store_first(float* p, F16 a, int64_t n) {
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) p[i] = a.v[i];
}
#define LLMSERVE_F16_OP2(name, expr) \
  inline F16 name(F16 a, F16 b) { F16 r; LLMSERVE_LANES(i) { float x = a.v[i], y = b.v[i]; r.v[i] = expr; } return r; }
LLMSERVE_F16_OP2(operator+, x + y)
LLMSERVE_F16_OP2(operator-, x - y)
LLMSERVE_F16_OP2(operator*, x * y)
LLMSERVE_F16_OP2(operator/, x / y)
LLMSERVE_F16_OP2(max, x > y ? x : y)  // x86's semantics: a NaN in either gives y
LLMSERVE_F16_OP2(min, x < y ? x : y)
#undef LLMSERVE_F16_OP2
// Fused where the CPU has the instruction (aarch64 always; x86 from x86-64-v3, which the
// avx2 level is). Without it std::fma is a slow library call (measured: the float32 GEMM
// 20x slower than torch's), so the plain x86-64 build multiplies and adds in two roundings:
// the same results as the other levels up to the last bits, at the speed of SSE2.
#if defined(__FMA__) || defined(__aarch64__)
#define LLMSERVE_FUSED(a, b, c) std::fma(a, b, c)
#else
#define LLMSERVE_FUSED(a, b, c) ((a) * (b) + (c))
#endif
inline F16 fmadd(F16 a, F16 b, F16 c) {
  F16 r; LLMSERVE_LANES(i) r.v[i] = LLMSERVE_FUSED(a.v[i], b.v[i], c.v[i]); return r;
}
inline F16 fnmadd(F16 a, F16 b, F16 c) {
  F16 r; LLMSERVE_LANES(i) r.v[i] = LLMSERVE_FUSED(-a.v[i], b.v[i], c.v[i]); return r;
}
#undef LLMSERVE_FUSED
inline F16 abs(F16 a) { F16 r; LLMSERVE_LANES(i) r.v[i] = std::fabs(a.v[i]); return r; }
inline F16 round_even(F16 a) {
  F16 r; LLMSERVE_LANES(i) r.v[i] = std::nearbyint(a.v[i]); return r;
}
inline float pow2_int(int32_t k) {  // 2^k for k in [-126, 127]
  const uint32_t bits = static_cast<uint32_t>(k + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline F16 scale_pow2(F16 a, F16 k) {
  F16 r;
  LLMSERVE_LANES(i) {
    const int32_t ki = static_cast<int32_t>(k.v[i]), k1 = ki >> 1, k2 = ki - k1;
    r.v[i] = a.v[i] * pow2_int(k1) * pow2_int(k2);
  }
  return r;
}
inline float reduce_max(F16 a) {
  float m = a.v[0];
  for (int i = 1; i < 16; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline I16 to_int(F16 a) {
  I16 r; LLMSERVE_LANES(i) r.v[i] = static_cast<int32_t>(std::nearbyint(a.v[i])); return r;
}
inline F16 to_float(I16 a) {
  F16 r; LLMSERVE_LANES(i) r.v[i] = static_cast<float>(a.v[i]); return r;
}
inline F16 load_half(const uint16_t* p) {
  F16 r; LLMSERVE_LANES(i) r.v[i] = half_bits_to_float(p[i]); return r;
}
inline M16 greater(F16 a, F16 b) { M16 r; LLMSERVE_LANES(i) r.v[i] = a.v[i] > b.v[i]; return r; }
inline M16 is_nan(F16 a) { M16 r; LLMSERVE_LANES(i) r.v[i] = std::isnan(a.v[i]); return r; }
inline M16 operator|(M16 a, M16 b) { M16 r; LLMSERVE_LANES(i) r.v[i] = a.v[i] || b.v[i]; return r; }
inline bool any(M16 a) { bool r = false; LLMSERVE_LANES(i) r = r || a.v[i]; return r; }
inline M16 mask_bits(uint32_t bits) { M16 r; LLMSERVE_LANES(i) r.v[i] = bits >> i & 1u; return r; }
inline F16 select(M16 m, F16 a, F16 b) {
  F16 r; LLMSERVE_LANES(i) r.v[i] = m.v[i] ? a.v[i] : b.v[i]; return r;
}
inline I16 select(M16 m, I16 a, I16 b) {
  I16 r; LLMSERVE_LANES(i) r.v[i] = m.v[i] ? a.v[i] : b.v[i]; return r;
}

inline I16 zero_i() { return I16{}; }
inline I16 set1_i(int32_t x) { I16 r; LLMSERVE_LANES(i) r.v[i] = x; return r; }
inline I16 load_i(const int32_t* p) { I16 r; std::memcpy(r.v, p, 64); return r; }
inline void store_i(int32_t* p, I16 a) { std::memcpy(p, a.v, 64); }
inline I16 iota() { I16 r; LLMSERVE_LANES(i) r.v[i] = i; return r; }
inline I16 operator+(I16 a, I16 b) { I16 r; LLMSERVE_LANES(i) r.v[i] = a.v[i] + b.v[i]; return r; }
inline I16 operator-(I16 a, I16 b) { I16 r; LLMSERVE_LANES(i) r.v[i] = a.v[i] - b.v[i]; return r; }
inline I16 operator&(I16 a, I16 b) { I16 r; LLMSERVE_LANES(i) r.v[i] = a.v[i] & b.v[i]; return r; }
template <int N> inline I16 shl(I16 a) {
  I16 r; LLMSERVE_LANES(i) r.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) << N);
  return r;
}
template <int N> inline I16 shr(I16 a) {
  I16 r; LLMSERVE_LANES(i) r.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) >> N);
  return r;
}
inline int32_t reduce_add(I16 a) { int32_t s = 0; LLMSERVE_LANES(i) s += a.v[i]; return s; }
inline F16 as_float(I16 a) { F16 r; std::memcpy(r.v, a.v, 64); return r; }
inline I16 as_int(F16 a) { I16 r; std::memcpy(r.v, a.v, 64); return r; }
inline I16 load_u16(const uint16_t* p) { I16 r; LLMSERVE_LANES(i) r.v[i] = p[i]; return r; }
inline I16 load_s8(const int8_t* p) { I16 r; LLMSERVE_LANES(i) r.v[i] = p[i]; return r; }
inline void store_s8(int8_t* p, I16 a) { LLMSERVE_LANES(i) p[i] = static_cast<int8_t>(a.v[i]); }
inline void store_u8(uint8_t* p, I16 a) { LLMSERVE_LANES(i) p[i] = static_cast<uint8_t>(a.v[i]); }
inline void store_u16(uint16_t* p, I16 a) {
  LLMSERVE_LANES(i) p[i] = static_cast<uint16_t>(a.v[i]);
}

inline B64 load_bytes(const void* p) { B64 r; std::memcpy(r.v, p, 64); return r; }
inline B64 low_nibbles(B64 a) { for (auto& b : a.v) b &= 0x0F; return a; }
inline B64 high_nibbles(B64 a) { for (auto& b : a.v) b = b >> 4; return a; }
inline B64 lookup16(B64 codes, const int8_t* table) {
  for (auto& b : codes.v) b = static_cast<uint8_t>(table[b & 15]);
  return codes;
}
inline B64 operator|(B64 a, B64 b) { for (int i = 0; i < 64; ++i) a.v[i] |= b.v[i]; return a; }
template <int S> inline B64 shifted_bits(B64 a, uint8_t mask) {
  for (auto& b : a.v) b = static_cast<uint8_t>((S >= 0 ? b << (S & 7) : b >> (-S & 7)) & mask);
  return a;
}
inline I16 mul_lo(I16 a, I16 b) {
  I16 r;
  LLMSERVE_LANES(i) r.v[i] = static_cast<int32_t>(static_cast<uint32_t>(a.v[i]) *
                                                  static_cast<uint32_t>(b.v[i]));
  return r;
}
inline I16 dot4_u7s8(I16 acc, B64 u, int32_t x4) {
  int8_t x[4];
  std::memcpy(x, &x4, 4);
  LLMSERVE_LANES(i) for (int b = 0; b < 4; ++b) acc.v[i] += u.v[4 * i + b] * x[b];
  return acc;
}
inline I16 dot4_s8s8(I16 acc, B64 w, int32_t x4) {
  int8_t x[4];
  std::memcpy(x, &x4, 4);
  LLMSERVE_LANES(i) for (int b = 0; b < 4; ++b) acc.v[i] += static_cast<int8_t>(w.v[4 * i + b]) * x[b];
  return acc;
}

inline float sum_tree(F16 a) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}
#undef LLMSERVE_LANES
#endif

// Every level also has, for the K-quant kernels (gemm_kquant.cpp):
//   a | b                  bytewise or of two B64
//   shifted_bits<S>(a, m)  each byte shifted left by S (right by -S where S < 0), then & m;
//                          m holds only bits that the byte's own bits fill (the x86 levels
//                          shift 16-bit lanes: bits crossing into the next byte are masked)
//   mul_lo(a, b)           int32 lanes multiplied, the low 32 bits kept
//   lookup16(codes, t)     each byte (a code in [0, 15]) replaced by t[code], 16 int8
// Sums of 4-bit codes u in [0, 15] times int8 x, for up to 8 steps between widenings (a
// pair of int16 products then stays below 8 * 2 * 15 * 127 = 30480): acc[i] += sum_b
// u[4i + b] * x4[b]. Levels with a one-instruction int32 dot product keep int32 sums and
// widening is nothing.
#if !defined(LLMSERVE_SIMD_PAIR_SUMS)
using P32 = I16;
inline P32 zero_pairs() { return zero_i(); }
inline P32 dot4_nibbles(P32 acc, B64 u, int32_t x4) { return dot4_u7s8(acc, u, x4); }
inline I16 widen_pairs(P32 acc) { return acc; }
#endif

// exp of 16 lanes: a Cephes-style polynomial after range reduction (~1 ulp); inputs below
// -87 give exp(-87), above ~88.7 infinity. The same bits at every level with fused
// multiply-adds.
inline F16 exp(F16 v) {
  v = min(max(v, set1(-87.0f)), set1(88.8f));  // keeps 2^k within scale_pow2's range
  const F16 k = round_even(v * set1(1.44269504088896341f));
  F16 r = fnmadd(k, set1(0.693359375f), v);
  r = fnmadd(k, set1(-2.12194440e-4f), r);
  F16 p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, r * r, r + set1(1.0f));
  return scale_pow2(p, k);
}

}  // namespace simd
