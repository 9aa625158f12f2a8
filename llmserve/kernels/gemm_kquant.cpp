// The K-quant GEMM (GGUF Q4_K, Q5_K, Q6_K blocks, as llama.cpp's k-quants write them) on
// packed weights, written once on simd.h's 16-lane values and built at every level.
//
// A K-quant row is cut into super-blocks of 256 k, each into sub-blocks (8 of 32 k for Q4_K
// and Q5_K, 16 of 16 k for Q6_K) with an integer scale sc and (Q4_K, Q5_K) an integer
// min m per sub-block, and fp16 d and dmin per super-block:
//   Q4_K, Q5_K:  w = d * sc * u - dmin * m       codes u in [0, 15] / [0, 31], sc, m in [0, 63]
//   Q6_K:        w = d * sc * (u - 32)           codes u in [0, 63], sc in [-128, 127]
// (Q6_K is the second form with m = sc and dmin = 32 d.) Activations are quantized per row
// and super-block to int8 with one scale s (llama.cpp's Q8_K): x ~ q * s, with the sums of
// q over each 16 k. Then per row, channel and super-block, with exact integer sums:
//   A = sum over sub-blocks of sc * (u . q),   B = sum over sub-blocks of m * (sum of q)
//   y += (d * s) * A  -  (dmin * s) * B
// The float epilogue runs over the super-blocks in order whatever the batch, so a row's
// result does not depend on the other rows (nor on the level: integer sums are exact).
//
// Packed weights: for each block of 16 channels, one record per super-block, the file's own
// bits re-laid for 16-channel dot products (a decode reads 4.6 / 5.6 / 6.6 bits a weight):
//   codes   32 chunks of 64 bytes: chunk j, lane c, byte b holds the low 4 bits of
//           k = 8j + b (low nibble) and k = 8j + 4 + b (high nibble), as gemm_q4.cpp's
//   high    Q5_K: 8 x 64 bytes, vector s (sub-block s = chunks 4s .. 4s + 3): bits 2p and
//           2p + 1 of byte (c, b) are bit 4 of chunk 4s + p's low and high code;
//           Q6_K: 16 x 64 bytes, vector s (chunks 2s, 2s + 1): bits 0-1, 2-3 are bits 4-5
//           of chunk 2s's low and high code, bits 4-5, 6-7 those of chunk 2s + 1
//   scales  one byte per (sub-block, channel): sc (int8)
//   mins    Q4_K, Q5_K: one byte per (sub-block, channel): m
//   d       16 fp16, then dmin: 16 fp16 (Q4_K, Q5_K)

#include "gemm.h"

#include <vector>

using namespace llmserve;
using namespace llmserve::gemm;

namespace {


constexpr int64_t kSuper = 256;
constexpr int64_t kCodeBytes = 2048;

template <int kType>
struct Layout {
  static constexpr int kSubK = kType == kQ6K ? 16 : 32;
  static constexpr int kSubs = kSuper / kSubK;
  static constexpr int kHighBytes = kType == kQ4K ? 0 : kType == kQ5K ? 512 : 1024;
  static constexpr int kScales = kCodeBytes + kHighBytes;
  static constexpr int kMins = kScales + kSubs * 16;
  static constexpr int kHalves = kMins + (kType == kQ6K ? 0 : kSubs * 16);
  static constexpr int kRecord = kHalves + (kType == kQ6K ? 32 : 64);
  // dot4 steps (4 k each) whose int16 pair sums stay below 2^15 before widening:
  // 2 * (2^bits - 1) * 127 per step (maddubs' pairs)
  static constexpr int kStepsPerWiden = kType == kQ4K ? 8 : kType == kQ5K ? 4 : 2;
};

int64_t record_bytes(int32_t type) {
  switch (type) {
    case kQ4K: return Layout<kQ4K>::kRecord;
    case kQ5K: return Layout<kQ5K>::kRecord;
    default: return Layout<kQ6K>::kRecord;
  }
}

// The codes of chunk j (k = 8j .. 8j + 7) of one super-block record: `lo` holds k = 8j + b,
// `hi` k = 8j + 4 + b, for lane c at bytes 4c + b.
template <int kType>
inline void chunk_codes(const uint8_t* rec, int j, simd::B64& lo, simd::B64& hi) {
  const simd::B64 v = simd::load_bytes(rec + 64 * j);
  lo = simd::low_nibbles(v);
  hi = simd::high_nibbles(v);
  if constexpr (kType == kQ5K) {
    const simd::B64 h = simd::load_bytes(rec + kCodeBytes + 64 * (j / 4));
    switch (j % 4) {  // bit 2p (low code) and 2p + 1 (high code) -> bit 4
      case 0: lo = lo | simd::shifted_bits<4>(h, 0x10); hi = hi | simd::shifted_bits<3>(h, 0x10); break;
      case 1: lo = lo | simd::shifted_bits<2>(h, 0x10); hi = hi | simd::shifted_bits<1>(h, 0x10); break;
      case 2: lo = lo | simd::shifted_bits<0>(h, 0x10); hi = hi | simd::shifted_bits<-1>(h, 0x10); break;
      default: lo = lo | simd::shifted_bits<-2>(h, 0x10); hi = hi | simd::shifted_bits<-3>(h, 0x10); break;
    }
  } else if constexpr (kType == kQ6K) {
    const simd::B64 h = simd::load_bytes(rec + kCodeBytes + 64 * (j / 2));
    if (j % 2 == 0) {  // bits 0-1, 2-3 -> bits 4-5
      lo = lo | simd::shifted_bits<4>(h, 0x30);
      hi = hi | simd::shifted_bits<2>(h, 0x30);
    } else {  // bits 4-5, 6-7
      lo = lo | simd::shifted_bits<0>(h, 0x30);
      hi = hi | simd::shifted_bits<-2>(h, 0x30);
    }
  }
}

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

// MT rows x NB blocks of 16 channels of y = KQ(w) . x [+ bias].
template <int kType, int MT, int NB, bool kStream>
inline void kq_tile(const int8_t* q, const float* xscale, const int32_t* sums16, int64_t m0,
                    int64_t K, const uint8_t* w, int64_t nb0, int64_t N, const float* bias,
                    float* y) {
  using L = Layout<kType>;
  const int64_t G = K / kSuper, block_bytes = G * L::kRecord;
  constexpr int kLines = (L::kRecord + 63) / 64;
  F16 acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int b = 0; b < NB; ++b) acc[m][b] = simd::zero();
  for (int64_t g = 0; g < G; ++g) {
    // the next super-block's record in each block's stream (past a block's end, the next
    // tile's: with one block per tile, a thread's weights are one linear stream)
    const int64_t nb1 = g + 1 < G ? nb0 : nb0 + NB, g1 = g + 1 < G ? g + 1 : 0;
    I16 a_int[MT][NB];
    for (int m = 0; m < MT; ++m)
      for (int b = 0; b < NB; ++b) a_int[m][b] = simd::zero_i();
    for (int s = 0; s < L::kSubs; ++s) {
      for (int b = 0; b < NB; ++b) {
        const char* next = reinterpret_cast<const char*>(w + (nb1 + b) * block_bytes +
                                                         g1 * L::kRecord);
        for (int line = s * kLines / L::kSubs; line < (s + 1) * kLines / L::kSubs; ++line)
          prefetch_weights<kStream>(next + 64 * line);
      }
      I16 sc[NB];
      for (int b = 0; b < NB; ++b)
        sc[b] = simd::load_s8(reinterpret_cast<const int8_t*>(
            w + (nb0 + b) * block_bytes + g * L::kRecord + L::kScales + 16 * s));
      constexpr int kSteps = L::kSubK / 4;  // dot4 steps in a sub-block
      simd::P32 pairs[MT][NB];
      for (int m = 0; m < MT; ++m)
        for (int b = 0; b < NB; ++b) pairs[m][b] = simd::zero_pairs();
      for (int step = 0; step < kSteps; step += 2) {
        const int j = (s * L::kSubK) / 8 + step / 2;  // the chunk: two steps
        simd::B64 ulo[NB], uhi[NB];
        for (int b = 0; b < NB; ++b)
          chunk_codes<kType>(w + (nb0 + b) * block_bytes + g * L::kRecord, j, ulo[b], uhi[b]);
        for (int m = 0; m < MT; ++m) {
          const int8_t* xq = q + (m0 + m) * K + g * kSuper + 8 * j;
          int32_t x0, x1;
          std::memcpy(&x0, xq, 4);
          std::memcpy(&x1, xq + 4, 4);
          for (int b = 0; b < NB; ++b)
            pairs[m][b] = simd::dot4_nibbles(simd::dot4_nibbles(pairs[m][b], ulo[b], x0),
                                             uhi[b], x1);
        }
        if ((step + 2) % L::kStepsPerWiden == 0)
          for (int m = 0; m < MT; ++m)
            for (int b = 0; b < NB; ++b) {
              a_int[m][b] = a_int[m][b] + simd::mul_lo(simd::widen_pairs(pairs[m][b]), sc[b]);
              pairs[m][b] = simd::zero_pairs();
            }
      }
    }
    for (int b = 0; b < NB; ++b) {
      const uint8_t* rec = w + (nb0 + b) * block_bytes + g * L::kRecord;
      const F16 d = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kHalves));
      const F16 dmin =
          kType == kQ6K ? d * simd::set1(32.f)
                        : simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kHalves + 32));
      const int8_t* mins = reinterpret_cast<const int8_t*>(rec + (kType == kQ6K ? L::kScales : L::kMins));
      for (int m = 0; m < MT; ++m) {
        // B = sum of m * (sum of q) over the sub-blocks: |B| < 2^24, exact as a float
        const int32_t* qs = sums16 + ((m0 + m) * G + g) * (kSuper / 16);
        I16 b_int = simd::zero_i();
        for (int s = 0; s < L::kSubs; ++s) {
          const int32_t qsum = L::kSubK == 16 ? qs[s] : qs[2 * s] + qs[2 * s + 1];
          b_int = b_int + simd::mul_lo(simd::load_s8(mins + 16 * s), simd::set1_i(qsum));
        }
        const F16 xs = simd::set1(xscale[(m0 + m) * G + g]);
        acc[m][b] = simd::fmadd(simd::to_float(a_int[m][b]), d * xs, acc[m][b]);
        acc[m][b] = simd::fnmadd(simd::to_float(b_int), dmin * xs, acc[m][b]);
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
    kq_tile<kType, MT, NB, kStream>(q, xscale, sums16, m, K, w, b, N, bias, y);
  }
};

template <int kType>
void kq_gemm(const int8_t* q, const float* xscale, const int32_t* sums16, int64_t M,
             int64_t K, const uint8_t* w, const float* bias, int64_t N, float* y) {
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

// One GGUF block of 256 weights -> codes u, per sub-block sc and m (m: Q4_K, Q5_K only),
// d and dmin as fp16 bits (llama.cpp's ggml-quants.c layouts).
struct Unpacked {
  uint8_t u[kSuper];
  int8_t sc[16];
  uint8_t m[8];
  uint16_t d, dmin;
};

void unpack_block(int32_t type, const uint8_t* blk, Unpacked& out) {
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

int64_t gguf_block_bytes(int32_t type) {
  return type == kQ4K ? 144 : type == kQ5K ? 176 : 210;
}

template <int kType>
void write_record(const Unpacked& v, int c, uint8_t* rec) {
  using L = Layout<kType>;
  for (int j = 0; j < 32; ++j)
    for (int i = 0; i < 4; ++i)
      rec[64 * j + 4 * c + i] =
          static_cast<uint8_t>((v.u[8 * j + i] & 0xF) | (v.u[8 * j + 4 + i] & 0xF) << 4);
  if constexpr (kType == kQ5K) {
    for (int s = 0; s < 8; ++s)
      for (int i = 0; i < 4; ++i) {
        uint8_t bits = 0;
        for (int p = 0; p < 4; ++p) {
          const int j = 4 * s + p;
          bits |= static_cast<uint8_t>(((v.u[8 * j + i] >> 4) & 1) << (2 * p) |
                                       ((v.u[8 * j + 4 + i] >> 4) & 1) << (2 * p + 1));
        }
        rec[kCodeBytes + 64 * s + 4 * c + i] = bits;
      }
  } else if constexpr (kType == kQ6K) {
    for (int s = 0; s < 16; ++s)
      for (int i = 0; i < 4; ++i) {
        const int j0 = 2 * s, j1 = 2 * s + 1;
        rec[kCodeBytes + 64 * s + 4 * c + i] = static_cast<uint8_t>(
            (v.u[8 * j0 + i] >> 4) | (v.u[8 * j0 + 4 + i] >> 4) << 2 |
            (v.u[8 * j1 + i] >> 4) << 4 | (v.u[8 * j1 + 4 + i] >> 4) << 6);
      }
  }
  for (int s = 0; s < L::kSubs; ++s) {
    rec[L::kScales + 16 * s + c] = static_cast<uint8_t>(v.sc[s]);
    if constexpr (kType != kQ6K) rec[L::kMins + 16 * s + c] = v.m[s];
  }
  std::memcpy(rec + L::kHalves + 2 * c, &v.d, 2);
  if constexpr (kType != kQ6K) std::memcpy(rec + L::kHalves + 32 + 2 * c, &v.dmin, 2);
}

// One channel's super-block of a packed record -> 256 floats, as llama.cpp dequantizes:
// (d * sc) * u - (dmin * m), and (d * sc) * (u - 32) for Q6_K.
template <int kType>
void dequantize_record(const uint8_t* rec, int c, float* out) {
  using L = Layout<kType>;
  const float d = simd::half_bits_to_float(read_u16(rec + L::kHalves + 2 * c));
  for (int k = 0; k < kSuper; ++k) {
    const int j = k / 8, b = k % 8;
    const uint8_t byte = rec[64 * j + 4 * c + b % 4];
    int u = b < 4 ? byte & 0xF : byte >> 4;
    if constexpr (kType == kQ5K) {
      const uint8_t h = rec[kCodeBytes + 64 * (j / 4) + 4 * c + b % 4];
      u |= ((h >> (2 * (j % 4) + (b >= 4))) & 1) << 4;
    } else if constexpr (kType == kQ6K) {
      const uint8_t h = rec[kCodeBytes + 64 * (j / 2) + 4 * c + b % 4];
      u |= ((h >> (4 * (j % 2) + 2 * (b >= 4))) & 3) << 4;
    }
    const int s = k / L::kSubK;
    const float sc = static_cast<float>(static_cast<int8_t>(rec[L::kScales + 16 * s + c]));
    if constexpr (kType == kQ6K) {
      out[k] = (d * sc) * static_cast<float>(u - 32);
    } else {
      const float dmin = simd::half_bits_to_float(read_u16(rec + L::kHalves + 32 + 2 * c));
      const float m = static_cast<float>(rec[L::kMins + 16 * s + c]);
      out[k] = (d * sc) * static_cast<float>(u) - dmin * m;
    }
  }
}

}  // namespace

extern "C" {

// Bytes of one record (16 channels x 256 k) of a packed K-quant weight of `type`.
int64_t llmserve_kquant_record_bytes(int32_t type) { return record_bytes(type); }

// Packs a GGUF K-quant tensor (N rows of K / 256 blocks of `type`: 0 Q4_K, 1 Q5_K, 2 Q6_K)
// into the records `kq_tile` reads: (N_pad / 16, K / 256, record) bytes, padding channels
// zero.
void llmserve_pack_kquant(const uint8_t* blocks, int32_t type, int64_t N, int64_t K,
                          uint8_t* packed) {
  const int64_t G = K / kSuper, Np = round_up(N, kBlockN), rec = record_bytes(type);
  std::memset(packed, 0, (Np / kBlockN) * G * rec);
  parallel_for(0, Np / kBlockN, 1, [&](int64_t nb, int64_t ne) {
    Unpacked v;
    for (int64_t block = nb; block < ne; ++block)
      for (int64_t n = block * kBlockN; n < std::min(N, (block + 1) * kBlockN); ++n)
        for (int64_t g = 0; g < G; ++g) {
          unpack_block(type, blocks + (n * G + g) * gguf_block_bytes(type), v);
          uint8_t* r = packed + (block * G + g) * rec;
          const int c = static_cast<int>(n % kBlockN);
          if (type == kQ4K) write_record<kQ4K>(v, c, r);
          else if (type == kQ5K) write_record<kQ5K>(v, c, r);
          else write_record<kQ6K>(v, c, r);
        }
  });
}

// out (T, K) = rows ids[t] of a packed K-quant weight with N rows, dequantized (a tied
// embedding's lookup). Returns 1, writing nothing, if an id is outside [0, N).
int32_t llmserve_kquant_rows(const uint8_t* packed, int32_t type, int64_t N, int64_t K,
                             const int64_t* ids, int64_t T, float* out) {
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= N) return 1;
  const int64_t G = K / kSuper, rec = record_bytes(type);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = ids[t];
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* r = packed + ((n / kBlockN) * G + g) * rec;
      const int c = static_cast<int>(n % kBlockN);
      float* o = out + t * K + g * kSuper;
      if (type == kQ4K) dequantize_record<kQ4K>(r, c, o);
      else if (type == kQ5K) dequantize_record<kQ5K>(r, c, o);
      else dequantize_record<kQ6K>(r, c, o);
    }
  }
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
    if (seg.type == kQ4K) kq_gemm<kQ4K>(q, xscale, sums16, M, K, seg.packed, b, seg.rows, out);
    else if (seg.type == kQ5K) kq_gemm<kQ5K>(q, xscale, sums16, M, K, seg.packed, b, seg.rows, out);
    else kq_gemm<kQ6K>(q, xscale, sums16, M, K, seg.packed, b, seg.rows, out);
    if (!whole)
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(y + m * N + n0, out + m * seg.rows, seg.rows * sizeof(float));
    n0 += seg.rows;
  }
}

}  // extern "C"
