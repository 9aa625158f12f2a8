// The K-quant and legacy GEMMs (gemm_kquant.cpp) on AMX tiles, for rows in tiles of 16.
//
// An AMX tile multiply takes 16 rows x 64 bytes of activations and 16 rows of 64 bytes of
// weights (16 channels x 4 k each: the packed records' very layout, a chunk's low codes one
// tile row, its high codes the next) and adds their exact int32 dot products to a 16 x 16
// tile: 16 x 16 x 64 multiply-adds in about the time VNNI takes for 1,000 (7 T int ops/s a
// core at 64 k on a Xeon VM, against ~0.4 T for VNNI). Two ways to keep a row's result the
// VNNI tiles' bits:
// * the K-quants with integer scales (Q4_K, Q5_K, Q6_K, Q3_K): each sub-block's scale goes
//   into the weight bytes, split into pieces that fit a byte, so a super-block's A (and
//   B) come out of tile multiplies spanning 64 k as the exact integers the VNNI tiles sum
//   (`Split`, below); the float epilogue is the VNNI tiles', per super-block in order;
// * the legacy types and IQ4_XS: one tile multiply a sub-block (its exact u . q), stored,
//   and the VNNI tiles' integer and float epilogue over it (at 128 rows about VNNI's
//   speed for Q4_0, 1.2-1.6x for Q5_0, Q8_0 and IQ4_XS: the epilogue bounds it; four
//   tiles of rows sharing each weight tile measured slower still).
//
// Built where the level has VNNI at 512 bits (every AMX CPU has it) and the compiler knows
// AMX; used where the CPU has AMX-INT8 and the kernel grants this process the tile state
// (arch_prctl), and not turned off (llmserve_set_amx).

#include "kquant.h"

#include <atomic>
#include <cstdlib>
#include <memory>

#if defined(LLMSERVE_SIMD_AVX512) && defined(LLMSERVE_SIMD_U8S8_DOT) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) ||                                     \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define LLMSERVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

using namespace llmserve;
using namespace llmserve::gemm;
using namespace llmserve::kquant;

namespace {

// 1: on, 0: off (llmserve_set_amx), -1: not asked yet (on where granted)
std::atomic<int> g_amx_wanted{-1};

#if defined(LLMSERVE_AMX)
namespace amx {  // apart from gemm_kquant.cpp's names where the sources build as one unit

constexpr int64_t kTileRows = 16;
// Fewer rows go to the VNNI tiles: unpacking a channel block's codes for one or two tiles
// of rows costs about what the tiles save (2 threads, Xeon VM, one weight of the 1B shape,
// ms at 16 / 32 / 128 rows, VNNI -> AMX: Q4_K 0.98 -> 1.10, 1.76 -> 1.29, 7.30 -> 3.72; Q6_K
// 1.24 -> 1.47, 2.52 -> 1.93, 10.07 -> 5.85; Q4_0 at 32 rows 1.72 -> 1.72 and 1.48 -> 1.54,
// at 64 3.20 -> 2.98; Q8_0 at 32 2.11 -> 1.57).
template <int kType>
constexpr int64_t kMinRows = kType == kQ4_0 || kType == kQ4_1 ? 64 : 32;

// Whether the CPU has AMX-INT8 and the kernel grants this process the tile data state.
bool amx_granted() {
  static const bool granted = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && int8 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The sub-block's tiles: tmm0 the int32 sums (16 rows x 16 channels), tmm1 16 rows of
// activations (kSubK bytes each), tmm2 the weights (kSubK / 4 rows of 16 channels x 4 k).
template <int kSubK>
__attribute__((target("amx-tile"))) void configure_tiles() {
  TileConfig cfg;
  cfg.rows[0] = kTileRows, cfg.colsb[0] = 64;
  cfg.rows[1] = kTileRows, cfg.colsb[1] = kSubK;
  cfg.rows[2] = kSubK / 4, cfg.colsb[2] = 64;
  _tile_loadconfig(&cfg);
}

struct Args {
  const int8_t* q;
  const float* xscale;
  const int32_t* sums16;
  int64_t M, K;  // M: a multiple of 16
  const uint8_t* w;
  const float* bias;
  int64_t N;
  float* y;
};

// One channel block's codes over all of K as tile rows: row r holds k = 4r .. 4r + 3 of
// the 16 channels (signed for Q8_0 and IQ4_XS, whose values are the weights' own).
template <int kType>
void unpack_block(const uint8_t* w, int64_t G, int8_t* rows) {
  using L = Layout<kType>;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w + g * L::kRecord;
    int8_t* out = rows + g * kSuper * kBlockN;  // 64 rows of 64 bytes
    if constexpr (kType == kQ8_0) {
      std::memcpy(out, rec, kSuper * kBlockN);
      continue;
    }
    for (int j = 0; j < 32; ++j) {
      simd::B64 lo, hi;
      chunk_codes<kType>(rec, j, lo, hi);
      if constexpr (kType == kIQ4XS) {
        lo = simd::lookup16(lo, kIQ4Levels);
        hi = simd::lookup16(hi, kIQ4Levels);
      }
      _mm512_store_si512(out + 128 * j, lo.v);
      _mm512_store_si512(out + 128 * j + 64, hi.v);
    }
  }
}

// The int32 sums of sub-block s of super-block g for rows m0 .. m0 + 15 into c (16 x 16).
template <int kType>
__attribute__((target("amx-tile,amx-int8"))) inline void sub_block_sums(
    const Args& a, const int8_t* rows, int64_t m0, int64_t g, int s, int32_t* c) {
  constexpr int kSubK = Layout<kType>::kSubK;
  _tile_zero(0);
  _tile_loadd(1, a.q + m0 * a.K + g * kSuper + s * kSubK, a.K);
  _tile_loadd(2, rows + (g * kSuper + s * kSubK) * kBlockN, 64);
  if constexpr (kType == kQ8_0 || kType == kIQ4XS)
    _tile_dpbssd(0, 1, 2);
  else
    _tile_dpbsud(0, 1, 2);  // signed activations, unsigned codes
  _tile_stored(0, c, 64);
}

// Rows m0 .. m0 + 15 x one block of 16 channels, from its unpacked codes `rows`: the legacy
// types and IQ4_XS (the split K-quants: amx_split_tile).
template <int kType>
__attribute__((target("amx-tile,amx-int8"))) void amx_tile(const Args& a, const int8_t* rows,
                                                            int64_t m0, int64_t nb) {
  using L = Layout<kType>;
  const int64_t G = a.K / kSuper, block_bytes = G * L::kRecord;
  alignas(64) int32_t c[kTileRows * 16];
  F16 acc[kTileRows];
  for (auto& v : acc) v = simd::zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = a.w + nb * block_bytes + g * L::kRecord;
    const float* xs0 = a.xscale + m0 * G + g;
    if constexpr (L::kLegacy) {
      const int32_t* qs0 = a.sums16 + (m0 * G + g) * (kSuper / 16);
      for (int s = 0; s < L::kSubs; ++s) {
        sub_block_sums<kType>(a, rows, m0, g, s, c);
        const F16 d = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kD + 32 * s));
        F16 mins = simd::zero();
        if constexpr (L::kLegacyMin)
          mins = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kM + 32 * s));
        for (int r = 0; r < kTileRows; ++r) {
          const int32_t* qs = qs0 + r * G * (kSuper / 16) + 2 * s;
          const int32_t qsum = qs[0] + qs[1];
          const float xs = xs0[r * G];
          I16 dot = simd::load_i(c + 16 * r);
          if constexpr (L::kOffset != 0) dot = dot - simd::set1_i(L::kOffset * qsum);
          acc[r] = simd::fmadd(simd::to_float(dot), d * simd::set1(xs), acc[r]);
          if constexpr (L::kLegacyMin)
            acc[r] = simd::fmadd(mins, simd::set1(static_cast<float>(qsum) * xs), acc[r]);
        }
      }
      continue;
    }
    // IQ4_XS (the other K-quants run with their scales in the bytes, below): A = the sum
    // over sub-blocks of sc * (v[u] . q)
    I16 a_int[kTileRows];
    for (auto& v : a_int) v = simd::zero_i();
    for (int s = 0; s < L::kSubs; ++s) {
      sub_block_sums<kType>(a, rows, m0, g, s, c);
      const I16 sc = simd::load_s8(reinterpret_cast<const int8_t*>(rec + L::kScales + 16 * s));
      for (int r = 0; r < kTileRows; ++r)
        a_int[r] = a_int[r] + simd::mul_lo(simd::load_i(c + 16 * r), sc);
    }
    const F16 d = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kHalves));
    for (int r = 0; r < kTileRows; ++r)
      acc[r] = simd::fmadd(simd::to_float(a_int[r]), d * simd::set1(xs0[r * G]), acc[r]);
  }
  for (int r = 0; r < kTileRows; ++r) {
    const F16 row[1][1] = {{acc[r]}};
    store_tile<1, 1>(row, m0 + r, nb, a.N, a.bias, a.y);
  }
}

// ---- the K-quants with integer scales (Q4_K, Q5_K, Q6_K, Q3_K): the scales in the bytes ----
//
// The tiles above stop after every sub-block (16 or 32 k) to scale its sums, which leaves
// the tile unit mostly idle. Here each sub-block's integer scale goes into the weight
// bytes, so a tile multiply spans 64 k and a super-block's sums stay in the tiles: A (and
// Q4_K's and Q5_K's B) come out of one pass. u * sc does not fit a byte, so it is split
// into pieces that do (codes u and scales sc cut at bit 4 or 3), each piece's products
// summed into one of up to four int32 tiles, and A = the sum of mult x tile, in int32
// arithmetic whose result is the VNNI path's exact A:
//   Q4_K  A = u.(sc & 15) + 16 u.(sc >> 4)                     B = m (each q's sub-block's)
//   Q5_K  A = u.(sc & 7) + 8 u.(sc >> 3)                       B = m
//   Q6_K  A = (u & 15).(sc & 15) + 16 [(u & 15).(sc >> 4) + (u >> 4).(sc & 15)]
//             + 256 (u >> 4).(sc >> 4) - 32 sc                 (sc >> 4 signed)
//   Q3_K  A = u.(sc & 7) + 8 u.(sc >> 3) - 4 sc
// where x.y is the sum over the super-block's k of x y q (x, y those of k's sub-block).

enum Code { kWhole, kLow, kHigh, kOne };                    // u, u & 15, u >> 4, or 1
enum Factor { kScaleLow, kScaleHigh, kMin, kScaleAll };     // sc & (2^b - 1), sc >> b, m, sc
struct Piece {
  Code code;
  Factor factor;
  int tile;  // the int32 tile it adds to
};

template <int kType>
struct Split;
// Q4_K and Q5_K: u x (sc cut at bit b), and the mins
template <int kB>
struct SplitWithMins {
  static constexpr int kBits = kB, kPieces = 3, kTiles = 3, kMinTile = 2;
  static constexpr Piece kPiece[] = {{kWhole, kScaleLow, 0}, {kWhole, kScaleHigh, 1},
                                     {kOne, kMin, 2}};
  static constexpr int kShift[] = {0, kB, 0}, kSign[] = {1, 1, 0};
};
template <>
struct Split<kQ4K> : SplitWithMins<4> {};
template <>
struct Split<kQ5K> : SplitWithMins<3> {};
template <>
struct Split<kQ6K> {
  static constexpr int kBits = 4, kPieces = 5, kTiles = 4, kMinTile = -1;
  static constexpr Piece kPiece[] = {{kLow, kScaleLow, 0}, {kLow, kScaleHigh, 1},
                                     {kHigh, kScaleLow, 1}, {kHigh, kScaleHigh, 2},
                                     {kOne, kScaleAll, 3}};
  static constexpr int kShift[] = {0, 4, 8, 5}, kSign[] = {1, 1, 1, -1};
};
template <>
struct Split<kQ3K> {
  static constexpr int kBits = 3, kPieces = 3, kTiles = 3, kMinTile = -1;
  static constexpr Piece kPiece[] = {{kWhole, kScaleLow, 0}, {kWhole, kScaleHigh, 1},
                                     {kOne, kScaleAll, 2}};
  static constexpr int kShift[] = {0, 3, 2}, kSign[] = {1, 1, -1};
};

template <int kType>
constexpr bool kSplit = kType == kQ4K || kType == kQ5K || kType == kQ6K || kType == kQ3K;

template <int kType>
constexpr bool signed_piece(const Piece& p) {
  return Layout<kType>::kSigned && (p.factor == kScaleHigh || p.factor == kScaleAll);
}

// Per-channel int32 values -> each channel's low byte in its 4 bytes, or in both its int16s.
inline __m512i expand_bytes(__m512i v) {
  return _mm512_mullo_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xFF)),
                            _mm512_set1_epi32(0x01010101));
}
inline __m512i expand_words(__m512i v) {
  return _mm512_mullo_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xFF)),
                            _mm512_set1_epi32(0x00010001));
}

// Codes (bytes) x their channel's factor f (an int16 lane's both bytes share it) -> the
// products' bytes, each of which fits a byte. An unsigned product cannot carry into the
// next byte: one int16 multiply does both bytes; a signed one would borrow, so the high
// byte comes from a second multiply without the low byte.
template <bool kSigned>
inline __m512i mul_bytes(__m512i u, __m512i f) {
  const __m512i both = _mm512_mullo_epi16(u, f);
  if constexpr (!kSigned) return both;
  const __m512i high = _mm512_mullo_epi16(_mm512_and_si512(u, _mm512_set1_epi16(-256)), f);
  return _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, both, high);
}

// One channel block's pieces over all of K: piece p's tile row r (k = 4r .. 4r + 3 of the
// 16 channels) at out + p K 16 + 64 r.
template <int kType>
void unpack_split(const uint8_t* w, int64_t G, int64_t K, int8_t* out) {
  using L = Layout<kType>;
  using S = Split<kType>;
  const int64_t piece_bytes = K * kBlockN;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = w + g * L::kRecord;
    for (int s = 0; s < L::kSubs; ++s) {
      const __m512i sc = _mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L::kScales + 16 * s)));
      __m512i factor[4];  // as int16 lanes (kOne's pieces: as bytes)
      const __m512i low = _mm512_and_si512(sc, _mm512_set1_epi32((1 << S::kBits) - 1));
      factor[kScaleLow] = expand_words(low);
      factor[kScaleHigh] = expand_words(_mm512_srai_epi32(sc, S::kBits));
      factor[kScaleAll] = expand_bytes(sc);
      if constexpr (S::kMinTile >= 0)
        factor[kMin] = expand_bytes(_mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + L::kMins + 16 * s))));
      for (int j = s * L::kSubK / 8; j < (s + 1) * L::kSubK / 8; ++j) {
        simd::B64 halves[2];
        chunk_codes<kType>(rec, j, halves[0], halves[1]);
        for (int h = 0; h < 2; ++h) {
          const __m512i u = halves[h].v;
          const __m512i code[3] = {u, _mm512_and_si512(u, _mm512_set1_epi8(0x0F)),
                                   _mm512_and_si512(_mm512_srli_epi16(u, 4),
                                                    _mm512_set1_epi8(0x0F))};
          const int64_t row = g * (kSuper / 4) + 2 * j + h;
          for (int p = 0; p < S::kPieces; ++p) {
            const Piece piece = S::kPiece[p];
            const __m512i bytes =
                piece.code == kOne ? factor[piece.factor]
                : signed_piece<kType>(piece) ? mul_bytes<true>(code[piece.code], factor[piece.factor])
                                             : mul_bytes<false>(code[piece.code], factor[piece.factor]);
            _mm512_store_si512(out + p * piece_bytes + 64 * row, bytes);
          }
        }
      }
    }
  }
}

// The intrinsics take tile numbers as literals (GCC pastes them into the assembly).
#define LLMSERVE_TILE_DOT(T, B)                                                          \
  if constexpr (kTile == T && kB == B) {                                                 \
    if constexpr (kSigned)                                                               \
      _tile_dpbssd(T, 4, B);                                                             \
    else                                                                                 \
      _tile_dpbsud(T, 4, B); /* signed activations, unsigned weight bytes */             \
  }

// int32 tile kTile += activations (tmm4) . weight bytes (tmm kB)
template <int kTile, int kB, bool kSigned>
__attribute__((target("amx-tile,amx-int8"))) inline void tile_dot() {
  LLMSERVE_TILE_DOT(0, 5) LLMSERVE_TILE_DOT(0, 6) LLMSERVE_TILE_DOT(0, 7)
  LLMSERVE_TILE_DOT(1, 5) LLMSERVE_TILE_DOT(1, 6) LLMSERVE_TILE_DOT(1, 7)
  LLMSERVE_TILE_DOT(2, 5) LLMSERVE_TILE_DOT(2, 6) LLMSERVE_TILE_DOT(2, 7)
  LLMSERVE_TILE_DOT(3, 5) LLMSERVE_TILE_DOT(3, 6) LLMSERVE_TILE_DOT(3, 7)
}
#undef LLMSERVE_TILE_DOT

// Piece P of 64 k: its bytes into tmm5 + P % 3, added to its int32 tile.
template <int kType, int P>
__attribute__((target("amx-tile,amx-int8"))) inline void piece_dot(const int8_t* bytes) {
  using S = Split<kType>;
  if constexpr (P < S::kPieces) {
    constexpr Piece piece = S::kPiece[P];
    constexpr int kB = 5 + P % 3;
    if constexpr (kB == 5) _tile_loadd(5, bytes, 64);
    if constexpr (kB == 6) _tile_loadd(6, bytes, 64);
    if constexpr (kB == 7) _tile_loadd(7, bytes, 64);
    tile_dot<piece.tile, kB, signed_piece<kType>(piece)>();
  }
}

template <int kShift, int kSign>
inline I16 scaled(I16 v) {
  const I16 shifted{_mm512_slli_epi32(v.v, kShift)};
  return kSign < 0 ? simd::zero_i() - shifted : shifted;
}

// Rows m0 .. m0 + 15 x one block of 16 channels, from its pieces.
template <int kType>
__attribute__((target("amx-tile,amx-int8"))) void amx_split_tile(const Args& a,
                                                                  const int8_t* pieces,
                                                                  int64_t m0, int64_t nb) {
  using L = Layout<kType>;
  using S = Split<kType>;
  const int64_t G = a.K / kSuper, block_bytes = G * L::kRecord, piece_bytes = a.K * kBlockN;
  alignas(64) int32_t c[4][kTileRows * 16];
  F16 acc[kTileRows];
  for (auto& v : acc) v = simd::zero();
  for (int64_t g = 0; g < G; ++g) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    if constexpr (S::kTiles > 3) _tile_zero(3);
    for (int64_t k = g * kSuper; k < (g + 1) * kSuper; k += 64) {
      _tile_loadd(4, a.q + m0 * a.K + k, a.K);
      const int8_t* bytes = pieces + k * kBlockN;
      piece_dot<kType, 0>(bytes);
      piece_dot<kType, 1>(bytes + piece_bytes);
      piece_dot<kType, 2>(bytes + 2 * piece_bytes);
      piece_dot<kType, 3>(bytes + 3 * piece_bytes);
      piece_dot<kType, 4>(bytes + 4 * piece_bytes);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    if constexpr (S::kTiles > 3) _tile_stored(3, c[3], 64);
    const uint8_t* rec = a.w + nb * block_bytes + g * L::kRecord;
    const float* xs0 = a.xscale + m0 * G + g;
    const F16 d = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kHalves));
    for (int r = 0; r < kTileRows; ++r) {
      I16 a_int = simd::load_i(c[0] + 16 * r);
      a_int = a_int + scaled<S::kShift[1], S::kSign[1]>(simd::load_i(c[1] + 16 * r));
      if constexpr (S::kMinTile != 2)
        a_int = a_int + scaled<S::kShift[2], S::kSign[2]>(simd::load_i(c[2] + 16 * r));
      if constexpr (S::kTiles > 3)
        a_int = a_int + scaled<S::kShift[3], S::kSign[3]>(simd::load_i(c[3] + 16 * r));
      acc[r] = simd::fmadd(simd::to_float(a_int), d * simd::set1(xs0[r * G]), acc[r]);
    }
    if constexpr (S::kMinTile >= 0) {
      const F16 dmin = simd::load_half(reinterpret_cast<const uint16_t*>(rec + L::kHalves + 32));
      for (int r = 0; r < kTileRows; ++r)
        acc[r] = simd::fnmadd(simd::to_float(simd::load_i(c[S::kMinTile] + 16 * r)),
                              dmin * simd::set1(xs0[r * G]), acc[r]);
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    const F16 row[1][1] = {{acc[r]}};
    store_tile<1, 1>(row, m0 + r, nb, a.N, a.bias, a.y);
  }
}

__attribute__((target("amx-tile"))) inline void configure_split_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = kTileRows, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
}

// This thread's buffer of at least `bytes` (64-byte aligned), kept between calls: a fresh
// one each call was an mmap and a page fault per 4 KiB (it is 128-640 KiB at 1B) for every
// linear of every step.
inline int8_t* unpack_buffer(int64_t bytes) {
  thread_local std::unique_ptr<int8_t, decltype(&std::free)> buffer(nullptr, &std::free);
  thread_local int64_t capacity = 0;
  if (bytes > capacity) {
    buffer.reset(static_cast<int8_t*>(std::aligned_alloc(64, round_up(bytes, 64))));
    capacity = bytes;
  }
  return buffer.get();
}

// Channel blocks [nb, ne) of every row: rows in blocks whose int8 values stay in L2 (1 MiB)
// while each channel block's codes (or pieces) are unpacked once for them.
template <int kType>
__attribute__((target("amx-tile,amx-int8"))) void amx_blocks(const Args& a, int64_t nb,
                                                              int64_t ne) {
  const int64_t G = a.K / kSuper, block_bytes = G * Layout<kType>::kRecord;
  const int64_t row_block =
      std::max<int64_t>(kTileRows, (1024 * 1024 / a.K) / kTileRows * kTileRows);
  constexpr int kPieces = [] {
    if constexpr (kSplit<kType>) return Split<kType>::kPieces;
    return 1;
  }();
  int8_t* rows = unpack_buffer(kPieces * a.K * kBlockN);
  if constexpr (kSplit<kType>)
    configure_split_tiles();
  else
    configure_tiles<Layout<kType>::kSubK>();
  for (int64_t r0 = 0; r0 < a.M; r0 += row_block)
    for (int64_t b = nb; b < ne; ++b) {
      if constexpr (kSplit<kType>)
        unpack_split<kType>(a.w + b * block_bytes, G, a.K, rows);
      else
        unpack_block<kType>(a.w + b * block_bytes, G, rows);
      for (int64_t m0 = r0; m0 < std::min(a.M, r0 + row_block); m0 += kTileRows) {
        if constexpr (kSplit<kType>)
          amx_split_tile<kType>(a, rows, m0, b);
        else
          amx_tile<kType>(a, rows, m0, b);
      }
    }
  _tile_release();
}

}  // namespace amx
#endif  // LLMSERVE_AMX

}  // namespace

namespace llmserve::kquant {

bool amx_enabled() {
#if defined(LLMSERVE_AMX)
  return g_amx_wanted.load(std::memory_order_relaxed) != 0 && amx::amx_granted();
#else
  return false;
#endif
}

int64_t amx_gemm(int32_t type, const int8_t* q, const float* xscale, const int32_t* sums16,
                 int64_t M, int64_t K, const uint8_t* w, const float* bias, int64_t N,
                 float* y) {
#if defined(LLMSERVE_AMX)
  using namespace amx;
  if (!amx_enabled()) return 0;
  const int64_t n_blocks = round_up(N, kBlockN) / kBlockN;
  return with_type(type, [&](auto t) -> int64_t {
    constexpr int kType = decltype(t)::value;
    if (M < kMinRows<kType>) return 0;
    const Args args{q, xscale, sums16, M / kTileRows * kTileRows, K, w, bias, N, y};
    parallel_for(0, n_blocks, 1, [&](int64_t nb, int64_t ne) {
      amx_blocks<kType>(args, nb, ne);
    });
    return args.M;
  });
#else
  (void)type, (void)q, (void)xscale, (void)sums16, (void)M, (void)K, (void)w, (void)bias,
      (void)N, (void)y;
  return 0;
#endif
}

}  // namespace llmserve::kquant

extern "C" {

int32_t llmserve_set_amx(int32_t on) {
  if (on >= 0) g_amx_wanted.store(on != 0);
  return kquant::amx_enabled() ? 1 : 0;
}

}  // extern "C"
