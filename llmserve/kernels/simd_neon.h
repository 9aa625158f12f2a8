// The neon level of simd.h: a 16-lane value is four 128-bit q registers, quarter q holding
// lanes 4q .. 4q + 3 (a B64's quarter q: bytes 16q .. 16q + 15, the bytes of those lanes).
// Included by simd.h inside `namespace simd`, after <arm_neon.h>; every operation gives the
// bits of the generic branch's lane arithmetic (its loops are the reference).
#pragma once

struct F16 { float32x4_t v[4]; };
struct I16 { int32x4_t v[4]; };
struct M16 { uint32x4_t v[4]; };  // all-ones lanes where true
struct B64 { uint8x16_t v[4]; };

#define LLMSERVE_QUARTERS(q) for (int q = 0; q < 4; ++q)

inline F16 zero() { F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vdupq_n_f32(0.f); return r; }
inline F16 set1(float x) { F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vdupq_n_f32(x); return r; }
inline F16 load(const float* p) {
  F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vld1q_f32(p + 4 * q); return r;
}
inline void store(float* p, F16 a) { LLMSERVE_QUARTERS(q) vst1q_f32(p + 4 * q, a.v[q]); }
// through a stack copy: neon has no masked loads, and p[n ..] may be unmapped
inline F16 load_first(const float* p, int64_t n) {
  float tmp[16] = {};
  std::memcpy(tmp, p, std::clamp<int64_t>(n, 0, 16) * sizeof(float));
  return load(tmp);
}
inline void store_first(float* p, F16 a, int64_t n) {
  float tmp[16];
  store(tmp, a);
  std::memcpy(p, tmp, std::clamp<int64_t>(n, 0, 16) * sizeof(float));
}
#define LLMSERVE_F16_OP2(name, expr)                                       \
  inline F16 name(F16 a, F16 b) {                                          \
    F16 r;                                                                 \
    LLMSERVE_QUARTERS(q) {                                                 \
      const float32x4_t x = a.v[q], y = b.v[q];                            \
      r.v[q] = expr;                                                       \
    }                                                                      \
    return r;                                                              \
  }
LLMSERVE_F16_OP2(operator+, vaddq_f32(x, y))
LLMSERVE_F16_OP2(operator-, vsubq_f32(x, y))
LLMSERVE_F16_OP2(operator*, vmulq_f32(x, y))
LLMSERVE_F16_OP2(operator/, vdivq_f32(x, y))
// x > y ? x : y (x86's semantics: a NaN in either gives y); vmaxq_f32 would return the NaN
LLMSERVE_F16_OP2(max, vbslq_f32(vcgtq_f32(x, y), x, y))
LLMSERVE_F16_OP2(min, vbslq_f32(vcltq_f32(x, y), x, y))
#undef LLMSERVE_F16_OP2
// a * b + c, one rounding
inline F16 fmadd(F16 a, F16 b, F16 c) {
  F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vfmaq_f32(c.v[q], a.v[q], b.v[q]); return r;
}
// c - a * b, one rounding: the bits of fma(-a, b, c)
inline F16 fnmadd(F16 a, F16 b, F16 c) {
  F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vfmsq_f32(c.v[q], a.v[q], b.v[q]); return r;
}
inline F16 abs(F16 a) { F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vabsq_f32(a.v[q]); return r; }
inline F16 round_even(F16 a) { F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vrndnq_f32(a.v[q]); return r; }
inline float32x4_t pow2_quarter(int32x4_t k) {  // 2^k for k in [-126, 127]: the exponent field
  return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k, vdupq_n_s32(127)), 23));
}
// a * 2^k for integral k in [-126, 128], in two exact steps as the generic level does (the
// one rounding is the last step's)
inline F16 scale_pow2(F16 a, F16 k) {
  F16 r;
  LLMSERVE_QUARTERS(q) {
    const int32x4_t ki = vcvtq_s32_f32(k.v[q]), k1 = vshrq_n_s32(ki, 1), k2 = vsubq_s32(ki, k1);
    r.v[q] = vmulq_f32(vmulq_f32(a.v[q], pow2_quarter(k1)), pow2_quarter(k2));
  }
  return r;
}
// lane by lane in lane order, as the generic level: with a NaN or signed zeros the result
// depends on the order (a vector tree would pick another NaN or zero); once per row, cheap
inline float reduce_max(F16 a) {
  float x[16];
  store(x, a);
  float m = x[0];
  for (int i = 1; i < 16; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
inline I16 to_int(F16 a) { I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vcvtnq_s32_f32(a.v[q]); return r; }
inline F16 to_float(I16 a) { F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vcvtq_f32_s32(a.v[q]); return r; }
// fp16 -> fp32 is exact (subnormals included)
inline F16 load_half(const uint16_t* p) {
  F16 r;
  LLMSERVE_QUARTERS(q) r.v[q] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * q)));
  return r;
}
inline M16 greater(F16 a, F16 b) {
  M16 r; LLMSERVE_QUARTERS(q) r.v[q] = vcgtq_f32(a.v[q], b.v[q]); return r;
}
// only a NaN is unequal to itself
inline M16 is_nan(F16 a) {
  M16 r; LLMSERVE_QUARTERS(q) r.v[q] = vmvnq_u32(vceqq_f32(a.v[q], a.v[q])); return r;
}
inline M16 operator|(M16 a, M16 b) {
  M16 r; LLMSERVE_QUARTERS(q) r.v[q] = vorrq_u32(a.v[q], b.v[q]); return r;
}
inline bool any(M16 a) {
  return vmaxvq_u32(vorrq_u32(vorrq_u32(a.v[0], a.v[1]), vorrq_u32(a.v[2], a.v[3]))) != 0;
}
// lane i true where bit i of `bits` is set: quarter q tests bits 4q .. 4q + 3
inline M16 mask_bits(uint32_t bits) {
  static const uint32_t lane_bit[4] = {1, 2, 4, 8};
  const uint32x4_t lane = vld1q_u32(lane_bit);
  M16 r;
  LLMSERVE_QUARTERS(q) r.v[q] = vtstq_u32(vdupq_n_u32(bits >> (4 * q)), lane);
  return r;
}
// m ? a : b
inline F16 select(M16 m, F16 a, F16 b) {
  F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vbslq_f32(m.v[q], a.v[q], b.v[q]); return r;
}
inline I16 select(M16 m, I16 a, I16 b) {
  I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vbslq_s32(m.v[q], a.v[q], b.v[q]); return r;
}

inline I16 zero_i() { I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vdupq_n_s32(0); return r; }
inline I16 set1_i(int32_t x) { I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vdupq_n_s32(x); return r; }
inline I16 load_i(const int32_t* p) {
  I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vld1q_s32(p + 4 * q); return r;
}
inline void store_i(int32_t* p, I16 a) { LLMSERVE_QUARTERS(q) vst1q_s32(p + 4 * q, a.v[q]); }
inline I16 iota() {
  static const int32_t lanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return load_i(lanes);
}
inline I16 operator+(I16 a, I16 b) {
  I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vaddq_s32(a.v[q], b.v[q]); return r;
}
inline I16 operator-(I16 a, I16 b) {
  I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vsubq_s32(a.v[q], b.v[q]); return r;
}
inline I16 operator&(I16 a, I16 b) {
  I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vandq_s32(a.v[q], b.v[q]); return r;
}
template <int N> inline I16 shl(I16 a) {
  I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vshlq_n_s32(a.v[q], N); return r;
}
// logical: zeros shifted in, as the generic level's unsigned shift
template <int N> inline I16 shr(I16 a) {
  I16 r;
  LLMSERVE_QUARTERS(q) {
    r.v[q] = vreinterpretq_s32_u32(vshrq_n_u32(vreinterpretq_u32_s32(a.v[q]), N));
  }
  return r;
}
inline int32_t reduce_add(I16 a) {  // integer: any order gives the same sum (mod 2^32)
  return vaddvq_s32(vaddq_s32(vaddq_s32(a.v[0], a.v[1]), vaddq_s32(a.v[2], a.v[3])));
}
inline F16 as_float(I16 a) {
  F16 r; LLMSERVE_QUARTERS(q) r.v[q] = vreinterpretq_f32_s32(a.v[q]); return r;
}
inline I16 as_int(F16 a) {
  I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vreinterpretq_s32_f32(a.v[q]); return r;
}
inline I16 load_u16(const uint16_t* p) {
  const uint16x8_t lo = vld1q_u16(p), hi = vld1q_u16(p + 8);
  return {{vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo))),
           vreinterpretq_s32_u32(vmovl_high_u16(lo)),
           vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi))),
           vreinterpretq_s32_u32(vmovl_high_u16(hi))}};
}
inline I16 load_s8(const int8_t* p) {
  const int8x16_t v = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
  return {{vmovl_s16(vget_low_s16(lo)), vmovl_high_s16(lo), vmovl_s16(vget_low_s16(hi)),
           vmovl_high_s16(hi)}};
}
// the low bits of each lane (truncation, as the generic level's casts)
inline int8x16_t narrow8(I16 a) {
  const int16x8_t lo = vmovn_high_s32(vmovn_s32(a.v[0]), a.v[1]);
  const int16x8_t hi = vmovn_high_s32(vmovn_s32(a.v[2]), a.v[3]);
  return vmovn_high_s16(vmovn_s16(lo), hi);
}
inline void store_s8(int8_t* p, I16 a) { vst1q_s8(p, narrow8(a)); }
inline void store_u8(uint8_t* p, I16 a) { vst1q_u8(p, vreinterpretq_u8_s8(narrow8(a))); }
inline void store_u16(uint16_t* p, I16 a) {
  vst1q_u16(p, vreinterpretq_u16_s16(vmovn_high_s32(vmovn_s32(a.v[0]), a.v[1])));
  vst1q_u16(p + 8, vreinterpretq_u16_s16(vmovn_high_s32(vmovn_s32(a.v[2]), a.v[3])));
}

inline B64 load_bytes(const void* p) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  B64 r; LLMSERVE_QUARTERS(q) r.v[q] = vld1q_u8(b + 16 * q); return r;
}
inline B64 low_nibbles(B64 a) {
  B64 r; LLMSERVE_QUARTERS(q) r.v[q] = vandq_u8(a.v[q], vdupq_n_u8(0x0F)); return r;
}
inline B64 high_nibbles(B64 a) {
  B64 r; LLMSERVE_QUARTERS(q) r.v[q] = vshrq_n_u8(a.v[q], 4); return r;
}
inline B64 lookup16(B64 codes, const int8_t* table) {
  const uint8x16_t t = vld1q_u8(reinterpret_cast<const uint8_t*>(table));
  B64 r; LLMSERVE_QUARTERS(q) r.v[q] = vqtbl1q_u8(t, codes.v[q]); return r;
}
inline B64 operator|(B64 a, B64 b) {
  B64 r; LLMSERVE_QUARTERS(q) r.v[q] = vorrq_u8(a.v[q], b.v[q]); return r;
}
template <int S> inline B64 shifted_bits(B64 a, uint8_t mask) {
  B64 r;
  LLMSERVE_QUARTERS(q) {
    uint8x16_t s;
    if constexpr (S > 0) s = vshlq_n_u8(a.v[q], S);
    else if constexpr (S < 0) s = vshrq_n_u8(a.v[q], -S);
    else s = a.v[q];
    r.v[q] = vandq_u8(s, vdupq_n_u8(mask));
  }
  return r;
}
inline I16 mul_lo(I16 a, I16 b) {
  I16 r; LLMSERVE_QUARTERS(q) r.v[q] = vmulq_s32(a.v[q], b.v[q]); return r;
}
// acc[i] += sum_b w[4i + b] * x[b] for one quarter (lanes 4q .. 4q + 3), w and x signed
// bytes with |w * x| <= 128 * 127: with dotprod one sdot; else the 16 products as int16
// (vmull_s8), adjacent pairs added in int16 (|pair| <= 32512 fits) and the two pairs of
// each lane widened into its int32
inline int32x4_t dot4_quarter(int32x4_t acc, int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, w, x);
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
  const int16x8_t hi = vmull_high_s8(w, x);
  return vpadalq_s16(acc, vpaddq_s16(lo, hi));
#endif
}
// acc[i] += sum_b u[4i + b] * x4[b]: u <= 127, so its bytes read as signed are the same
inline I16 dot4_u7s8(I16 acc, B64 u, int32_t x4) {
  const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
  LLMSERVE_QUARTERS(q) acc.v[q] = dot4_quarter(acc.v[q], vreinterpretq_s8_u8(u.v[q]), x);
  return acc;
}
// acc[i] += sum_b w[4i + b] * x4[b]: signed bytes both
inline I16 dot4_s8s8(I16 acc, B64 w, int32_t x4) {
  const int8x16_t x = vreinterpretq_s8_s32(vdupq_n_s32(x4));
  LLMSERVE_QUARTERS(q) acc.v[q] = dot4_quarter(acc.v[q], vreinterpretq_s8_u8(w.v[q]), x);
  return acc;
}

// lane i + 8, then + 4, + 2, + 1: the one float sum tree of every level (quarters 0 + 2 and
// 1 + 3 are lanes i + 8, their sum lanes i + 4; then lanes 0 + 2, 1 + 3, and those two)
inline float sum_tree(F16 a) {
  const float32x4_t s4 = vaddq_f32(vaddq_f32(a.v[0], a.v[2]), vaddq_f32(a.v[1], a.v[3]));
  const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));
  return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}
#undef LLMSERVE_QUARTERS
